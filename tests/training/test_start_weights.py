"""``finetune.init``, where a run starts. Kind ``encoder``: every source, built from a randomly initialised timm
model saved to a file, gives the encoder timm's features; the timm ViT families load with the switches their
weights show. Kind ``model``: a whole vitattn model of the run's task (the rest: test_self_critical.py)."""

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import timm
import torch
from safetensors.torch import save_file

from tests.helpers.bundles import make_caption_bundle, put_in_hub_cache
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.bundle import load_bundle, save_bundle
from vitattn.data.preprocess import default_preprocess
from vitattn.errors import ConfigError
from vitattn.models import VisionTransformer
from vitattn.models.coca import CONTRASTIVE_PARTS
from vitattn.models.vit import preset_config
from vitattn.training import build_system, train
from vitattn.training.build import build_datamodule, load_start
from vitattn.training.plan import resolve
from vitattn.training.start_weights import read_start

SHAPE = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
# The timm ViT families, each at the tiny shape: what their weights show, and what a file cannot show.
FAMILIES = {
    "augreg": ("vit_base_patch16_224", {}),
    "deit": ("deit_base_patch16_224", {}),
    "clip_laion": ("vit_base_patch16_clip_224", {}),  # LayerNorm before the blocks, eps 1e-5, no patch bias
    "clip_openai": ("vit_base_patch32_clip_quickgelu_224", {"activation": "quick_gelu"}),
    "avg_fc_norm": ("eva_large_patch14_196", {}),  # global_pool=avg: fc_norm after pooling, no final norm
}
TIMM_TINY = "vit_tiny_patch16_224.augreg_in21k_ft_in1k"  # the smallest timm ViT name with weights (5.7 M)


def _timm(name: str = "vit_base_patch16_224", **kwargs) -> torch.nn.Module:
    """A randomly initialised timm model of family ``name`` at the tiny shape, its positions made large so that
    a wrongly resampled grid shows in the features."""
    model = timm.create_model(name, pretrained=False, **{**SHAPE, "num_classes": 3, **kwargs})
    with torch.no_grad():
        model.pos_embed.normal_()
    return model.eval()


def _config(**overrides) -> dict:
    """Model keyword arguments as ``model=cpu`` composes them (today's defaults), at the tiny shape."""
    return {**preset_config("cpu"), **SHAPE, "num_classes": 0, **overrides}


def _encoder(source, **overrides) -> VisionTransformer:
    """What a run does with ``finetune.init=source`` of kind encoder: read, fit the config, build, load."""
    weights = read_start(str(source), "encoder")
    config = _config(**overrides)
    weights.fit(config)
    model = VisionTransformer(**config)
    load_start(model, weights)
    return model.eval()


def _assert_same_features(ours: VisionTransformer, ref: torch.nn.Module, img_size: int = 32) -> None:
    x = torch.randn(2, 3, img_size, img_size)
    with torch.no_grad():
        feats, ref_feats = ours.forward_tokens(x), ref.forward_features(x)
        torch.testing.assert_close(feats.tokens, ref_feats, atol=1e-5, rtol=1e-5)
        pooled = ours.forward_head(feats, pre_logits=True)
        torch.testing.assert_close(pooled, ref.forward_head(ref_feats, pre_logits=True), atol=1e-5, rtol=1e-5)


def _save_npz(model: torch.nn.Module, path: Path) -> Path:
    """``model`` in the original JAX ViT layout that timm's ``_load_weights`` reads (the inverse of its ``_n2p``)."""
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    D, H = model.embed_dim, model.blocks[0].attn.num_heads
    w = {
        "embedding/kernel": sd["patch_embed.proj.weight"].transpose(2, 3, 1, 0),  # (P, P, C, D)
        "embedding/bias": sd["patch_embed.proj.bias"],
        "cls": sd["cls_token"],
        "Transformer/posembed_input/pos_embedding": sd["pos_embed"],
        "Transformer/encoder_norm/scale": sd["norm.weight"],
        "Transformer/encoder_norm/bias": sd["norm.bias"],
        "head/kernel": sd["head.weight"].T,
        "head/bias": sd["head.bias"],
    }
    for i in range(len(model.blocks)):
        b, t = f"blocks.{i}.", f"Transformer/encoderblock_{i}/"
        for n, ln in (("norm1", "LayerNorm_0"), ("norm2", "LayerNorm_2")):
            w[f"{t}{ln}/scale"], w[f"{t}{ln}/bias"] = sd[f"{b}{n}.weight"], sd[f"{b}{n}.bias"]
        qkv_w, qkv_b = np.split(sd[f"{b}attn.qkv.weight"], 3), np.split(sd[f"{b}attn.qkv.bias"], 3)
        for name, weight, bias in zip(("query", "key", "value"), qkv_w, qkv_b):
            w[f"{t}MultiHeadDotProductAttention_1/{name}/kernel"] = weight.T.reshape(D, H, D // H)
            w[f"{t}MultiHeadDotProductAttention_1/{name}/bias"] = bias.reshape(H, D // H)
        proj = sd[f"{b}attn.proj.weight"]
        w[f"{t}MultiHeadDotProductAttention_1/out/kernel"] = proj.reshape(D, H, D // H).transpose(1, 2, 0)
        w[f"{t}MultiHeadDotProductAttention_1/out/bias"] = sd[f"{b}attn.proj.bias"]
        for r in range(2):
            w[f"{t}MlpBlock_3/Dense_{r}/kernel"] = sd[f"{b}mlp.fc{r + 1}.weight"].T
            w[f"{t}MlpBlock_3/Dense_{r}/bias"] = sd[f"{b}mlp.fc{r + 1}.bias"]
    np.savez(path, **w)
    return path


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_timm_family_gives_timm_features_with_the_switches_its_weights_show(family, tmp_path):
    name, not_in_the_weights = FAMILIES[family]
    ref = _timm(name)
    save_file(ref.state_dict(), tmp_path / "vit.safetensors")
    ours = _encoder(tmp_path / "vit.safetensors", **not_in_the_weights)  # config: today's defaults
    _assert_same_features(ours, ref)
    config = ours.config
    assert config["norm_pre"] == family.startswith("clip")
    assert config["layer_norm_eps"] == (1e-5 if family.startswith("clip") else 1e-6)
    assert (config["global_pool"], config["fc_norm"]) == (("avg", None) if family == "avg_fc_norm" else ("cls", None))


@pytest.mark.parametrize("suffix", [".safetensors", ".pth", ".bin", ".npz"])
def test_a_local_timm_file_gives_timm_features(suffix, tmp_path):
    ref = _timm(num_classes=5)
    path = tmp_path / f"vit{suffix}"
    if suffix == ".safetensors":
        save_file(ref.state_dict(), path)
    elif suffix == ".pth":
        torch.save({"state_dict": ref.state_dict(), "epoch": 3}, path)  # a timm training checkpoint
    elif suffix == ".bin":
        torch.save(ref.state_dict(), path)
    else:
        _save_npz(ref, path)
    ours = _encoder(path, num_classes=5)
    _assert_same_features(ours, ref)
    with torch.no_grad():
        x = torch.randn(1, 3, 32, 32)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)  # a head of the same size is loaded


def test_a_timm_name_with_a_local_file_loads_through_timm(tmp_path, no_network):
    file = tmp_path / "model.safetensors"
    save_file(timm.create_model(TIMM_TINY, pretrained=False).state_dict(), file)
    ours = _encoder(f"{TIMM_TINY}@{file}", embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0)
    assert ours.config["patch_size"] == 16  # set from the weights
    ref = timm.create_model(TIMM_TINY, pretrained=True, pretrained_cfg_overlay=dict(file=str(file)), img_size=32)
    _assert_same_features(ours, ref.eval())
    assert not no_network


def test_a_timm_name_loads_from_timms_cache_without_the_network(tmp_path, hub_cache, no_network):
    save_file(timm.create_model(TIMM_TINY, pretrained=False).state_dict(), tmp_path / "model.safetensors")
    file = put_in_hub_cache(hub_cache, f"timm/{TIMM_TINY}", [tmp_path / "model.safetensors"]) / "model.safetensors"
    ours = _encoder(TIMM_TINY, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0)
    assert not no_network
    ref = timm.create_model(TIMM_TINY, pretrained=True, pretrained_cfg_overlay=dict(file=str(file)), img_size=32)
    _assert_same_features(ours, ref.eval())


def test_a_timm_name_offline_and_uncached_is_one_line_naming_the_local_file_fix(hub_cache, no_network):
    with pytest.raises(
        ConfigError, match=rf"{TIMM_TINY}: its weights are not in timm's cache and vitattn does not"
    ) as err:
        read_start(TIMM_TINY, "encoder")
    assert not no_network
    message = str(err.value)
    assert "\n" not in message
    assert "pretrained_cfg_overlay=dict(file=" in message and f"finetune.init={TIMM_TINY}@/path/to/" in message


def _vitattn_classifier(ref: torch.nn.Module, tmp_path: Path) -> VisionTransformer:
    """A vitattn classifier started from ``ref``'s weights: the kind of model a run here trains first."""
    source = tmp_path / "timm.safetensors"
    save_file(ref.state_dict(), source)
    return _encoder(source, num_classes=3)


@pytest.mark.parametrize("kind", ["run", "bundle", "bundle-weights", "ckpt"])
def test_a_vitattn_run_bundle_or_checkpoint_gives_its_encoder(kind, tmp_path):
    ref = _timm("vit_base_patch16_clip_224")  # its switches travel through the vitattn model's config
    classifier = _vitattn_classifier(ref, tmp_path)
    run = tmp_path / "run"
    save_bundle(run / "bundle", classifier, task="classification", preprocess=default_preprocess(32))
    if kind == "ckpt":
        hparams = dict(model_config=classifier.config, class_names=["a", "b", "c"], preprocess=default_preprocess(32))
        state = {f"model.{k}": v for k, v in classifier.state_dict().items()}
        torch.save({"hyper_parameters": hparams, "state_dict": state}, tmp_path / "last.ckpt")
    source = {
        "run": run,
        "bundle": run / "bundle",
        "bundle-weights": run / "bundle" / "model.safetensors",
        "ckpt": tmp_path / "last.ckpt",
    }[kind]
    ours = _encoder(source, num_classes=7)  # another head size: dropped
    assert ours.config["norm_pre"] and ours.config["layer_norm_eps"] == 1e-5
    _assert_same_features(ours, ref)


def test_switches_are_set_from_the_weights_and_logged_in_one_line(tmp_path, caplog):
    ref = _timm("vit_base_patch16_clip_224", patch_size=16, img_size=64, num_classes=1000)
    save_file(ref.state_dict(), tmp_path / "clip_b16.safetensors")
    with caplog.at_level(logging.INFO):
        ours = _encoder(tmp_path / "clip_b16.safetensors", patch_size=8, num_classes=4)
    assert (ours.config["patch_size"], ours.config["norm_pre"]) == (16, True)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("pretrained encoder:")]
    assert len(lines) == 1
    for part in (
        "model.patch_size 8 -> 16",
        "model.norm_pre false -> true",
        "model.layer_norm_eps 1e-06 -> 1e-05",
        "resampled pos_embed 4x4 -> 2x2",
        "skipped head (1000 classes; the model has 4)",
        "model.activation=quick_gelu",
    ):
        assert part in lines[0], (part, lines[0])


@pytest.mark.parametrize(
    "overrides,message",
    [
        (
            dict(embed_dim=64),
            r"the weights have in_chans=3 embed_dim=32 depth=2 mlp_ratio=2.0; set model\.embed_dim=32$",
        ),
        (dict(depth=3, mlp_ratio=4.0), r"set model\.depth=2 model\.mlp_ratio=2\.0$"),
        (dict(img_size=36, patch_size=4), r"its patch_size=8 does not divide data\.img_size=36"),
    ],
)
def test_a_config_that_contradicts_the_weights_is_refused_in_one_line(overrides, message, tmp_path):
    save_file(_timm().state_dict(), tmp_path / "vit.safetensors")
    with pytest.raises(ConfigError, match=rf"^finetune\.init=.*vit\.safetensors: .*{message}"):
        _encoder(tmp_path / "vit.safetensors", **overrides)


def test_a_timm_name_refuses_a_head_count_that_contradicts_it(tmp_path, no_network):
    file = tmp_path / "model.safetensors"
    save_file(timm.create_model(TIMM_TINY, pretrained=False).state_dict(), file)
    with pytest.raises(ConfigError, match=r"num_heads=3 mlp_ratio=4\.0; set model\.num_heads=3 \(or model=tiny\)$"):
        _encoder(f"{TIMM_TINY}@{file}", embed_dim=192, depth=12, num_heads=4, mlp_ratio=4.0)
    assert not no_network


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (
            dict(init_values=1e-5),
            r"blocks\.0\.ls1\.gamma.* have no place in vitattn.s encoder",
        ),  # layer scale (DeiT III, EVA-02)
        (dict(reg_tokens=4, no_embed_class=True), r"not a square grid plus the class token"),
        (dict(class_token=False, global_pool="avg"), r"the weights have no cls_token"),
    ],
)
def test_timm_vits_that_the_encoder_cannot_copy_are_refused(kwargs, message, tmp_path):
    save_file(_timm(**kwargs).state_dict(), tmp_path / "vit.safetensors")
    with pytest.raises(ConfigError, match=message):
        _encoder(tmp_path / "vit.safetensors")


@pytest.mark.parametrize(
    "value,message",
    [
        ("no/such/file.safetensors", r"is neither an existing file or folder nor a timm model name"),
        ("vit_tiny_patch16_224.nope", r"has no pretrained weights in timm; its pretrained tags: vit_tiny_patch16_224"),
        (f"{TIMM_TINY}@/no/such.safetensors", r"/no/such\.safetensors does not exist"),
    ],
)
def test_a_start_encoder_that_is_not_there_is_refused_before_any_step(value, message, tmp_path):
    cfg = compose_train([*TINY, *TINY_SHAPES, f"finetune.init={value}", "finetune.init_kind=encoder"], tmp_path)
    with pytest.raises(ConfigError, match=rf"^finetune\.init={value}.*{message}") as err:
        train(cfg)
    assert "\n" not in str(err.value) and not (tmp_path / "config.yaml").exists()


def test_defaults_keep_todays_encoder_and_old_configs_load():
    model = VisionTransformer(**_config())
    assert not any(k.startswith(("norm_pre.", "fc_norm.")) for k in model.state_dict())
    assert "patch_embed.proj.bias" in model.state_dict() and "norm.weight" in model.state_dict()
    old = {k: v for k, v in model.config.items() if k not in ("norm_pre", "fc_norm")}  # a bundle written before
    VisionTransformer(**old).load_state_dict(model.state_dict())
    assert "pretrained" not in preset_config("base")


def test_train_from_timm_weights_then_caption_from_that_run(tmp_path):
    ref = _timm("vit_base_patch16_clip_224", num_classes=1000)
    save_file(ref.state_dict(), tmp_path / "clip.safetensors")
    fast = [*TINY, *TINY_SHAPES, "trainer.fast_dev_run=true", "model.mlp_ratio=2.0"]
    first = train(
        compose_train(
            [
                *fast,
                "head=classification",
                f"finetune.init={tmp_path / 'clip.safetensors'}",
                "finetune.init_kind=encoder",
            ],
            tmp_path / "a",
        )
    )
    saved = json.loads((first.bundle_dir / "config.json").read_text())["model"]
    assert saved["norm_pre"] and "pretrained" not in saved
    overrides = [*fast, "head.decoder.depth=1", f"finetune.init={first.run_dir}", "finetune.init_kind=encoder"]
    plan = resolve(compose_train(overrides, tmp_path / "b"))
    assert plan.cfg.model.norm_pre  # set from the weights in the config itself: the one the run builds and saves
    datamodule = build_datamodule(plan)
    datamodule.setup("fit")
    system = build_system(plan, datamodule)
    encoder = system.model.encoder
    assert encoder.config["norm_pre"] and "pretrained" not in system.hparams["model_config"]["encoder"]
    classifier = load_bundle(first.bundle_dir).model
    for key, value in classifier.state_dict().items():
        if not key.startswith("head."):
            torch.testing.assert_close(encoder.state_dict()[key], value, rtol=0, atol=0)


def test_init_leaves_grad_checkpointing_to_the_run(tmp_path):
    """Whether the model was trained with gradient checkpointing is the new run's choice, on the command line too."""
    bundle = make_caption_bundle(tmp_path / "bundle")
    config = json.loads((bundle / "config.json").read_text())
    config["model"]["encoder"]["grad_checkpointing"] = config["model"]["decoder"]["grad_checkpointing"] = True
    (bundle / "config.json").write_text(json.dumps(config))
    init = read_start(str(bundle))
    assert init.bundle.model.encoder.grad_checkpointing  # read from the bundle
    cfg = compose_train([*TINY, f"finetune.init={bundle}"], tmp_path / "run")
    cfg = resolve(cfg, ["model.grad_checkpointing=false"]).cfg
    assert cfg.model.grad_checkpointing is False and cfg.head.decoder.grad_checkpointing is False
    assert cfg.data.max_caption_len == 8  # the model's sizes still come from it (24 composed)


def test_a_hub_bundle_starts_a_run_by_its_name_offline(tmp_path, hub_cache, hub_offline, no_network):
    """finetune.init=hf-hub:ORG/NAME reads the cached bundle: its weights, and the sizes they fix in the config."""
    bundle = make_caption_bundle(tmp_path / "bundle")
    put_in_hub_cache(hub_cache, "org/tiny", bundle)
    init = read_start("hf-hub:org/tiny")
    local = load_bundle(bundle).model.state_dict()
    for key, value in init.bundle.model.state_dict().items():
        torch.testing.assert_close(value, local[key], rtol=0, atol=0)
    cfg = compose_train([*TINY, "finetune.init=hf-hub:org/tiny"], tmp_path / "run")
    cfg = resolve(cfg).cfg
    assert cfg.data.max_caption_len == 8 and not no_network  # the bundle's sizes (24 composed); no connection


def test_init_refuses_a_classifier_for_a_captioner(small_classifier_run, tmp_path):
    with pytest.raises(ConfigError, match=r"is a classification model, not a caption model \(head=caption\)"):
        train(compose_train([*TINY, f"finetune.init={small_classifier_run}"], tmp_path / "run"))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [f"finetune.init={TIMM_TINY}"],
            rf"^finetune\.init={TIMM_TINY} does not exist; .*finetune\.init_kind=encoder$",
        ),
        (["finetune.init={file}"], r"is a timm weights file, an encoder: add finetune\.init_kind=encoder$"),
        (["finetune.init={file}", "finetune.init_kind=head"], r"^finetune\.init_kind='head' is unknown"),
    ],
)
def test_a_start_of_the_wrong_kind_is_one_line_before_any_step(overrides, message, tmp_path):
    save_file(_timm().state_dict(), tmp_path / "vit.safetensors")
    given = [o.format(file=tmp_path / "vit.safetensors") for o in overrides]
    with pytest.raises(ConfigError, match=message) as err:
        train(compose_train([*TINY, *TINY_SHAPES, *given], tmp_path / "run"))
    assert "\n" not in str(err.value) and not (tmp_path / "run" / "config.yaml").exists()


def _start_system(bundle: Path, head: str, tmp_path: Path):
    plan = resolve(compose_train([f"head={head}", *TINY, f"finetune.init={bundle}"], tmp_path / head))
    datamodule = build_datamodule(plan)
    datamodule.setup("fit")
    return build_system(plan, datamodule), plan.start


def test_init_crosses_caption_and_coca_loading_the_captioner_in_one_line(tmp_path, caplog):
    """head=coca from a head=caption model: the captioner's weights, the contrastive parts fresh; and back: the
    contrastive parts dropped. Each said in one line."""
    caption = make_caption_bundle(tmp_path / "caption")
    theirs = load_bundle(caption).model.state_dict()
    with caplog.at_level(logging.INFO):
        coca, _ = _start_system(caption, "coca", tmp_path)
    ours = coca.model.state_dict()
    new = {k.split(".")[0] for k in set(ours) - set(theirs)}
    assert set(theirs) < set(ours) and new == set(CONTRASTIVE_PARTS) - {"logit_bias"}  # clip has no bias
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0)
    (line,) = [r.getMessage() for r in caplog.records if "new (the model has none)" in r.getMessage()]
    assert "image_proj, logit_scale, text, text_proj" in line and "\n" not in line
    save_bundle(
        tmp_path / "coca",
        coca.model,
        task="caption",
        preprocess=load_bundle(caption).preprocess,
        vocab=load_bundle(caption).vocab,
    )
    caplog.clear()
    with caplog.at_level(logging.INFO):
        back, _ = _start_system(tmp_path / "coca", "caption", tmp_path)
    assert set(back.model.state_dict()) == set(theirs)
    for key, value in back.model.state_dict().items():
        torch.testing.assert_close(value, ours[key], rtol=0, atol=0)
    (line,) = [r.getMessage() for r in caplog.records if "dropped (the run has none)" in r.getMessage()]
    assert "image_proj, logit_scale, text, text_proj" in line


def test_init_refuses_any_other_mismatch_in_one_line(tmp_path, monkeypatch):
    caption = make_caption_bundle(tmp_path / "caption")
    state = load_bundle(caption).model.state_dict()
    plan = resolve(compose_train(["head=coca", *TINY, f"finetune.init={caption}"], tmp_path / "run"))
    monkeypatch.setattr(plan.start.bundle.model, "state_dict", lambda: {**state, "extra.weight": torch.zeros(1)})
    datamodule = build_datamodule(plan)
    datamodule.setup("fit")
    with pytest.raises(ConfigError, match=r"^finetune\.init=.*: its model and the run.s differ in extra; only") as err:
        build_system(plan, datamodule)
    assert "\n" not in str(err.value)


def test_resolve_refuses_the_sizes_its_overrides_give_and_reads_no_hydra_global(tmp_path):
    """The keys ``finetune.init``'s model contradicts are refused when the command line's overrides, passed to
    ``resolve`` (and ``train``), give them, as ``vitattn-train`` does; a Hydra run's global overrides are not read."""
    from hydra import compose, initialize_config_module
    from hydra.core.hydra_config import HydraConfig

    bundle = make_caption_bundle(tmp_path / "bundle")  # embed_dim 32
    given = ["model.embed_dim=64", "data.img_size=64"]
    cfg = compose_train([*TINY, *TINY_SHAPES, f"finetune.init={bundle}", *given], tmp_path / "run")
    with initialize_config_module("vitattn.conf", version_base="1.3"):
        hydra_cfg = compose("train", overrides=given, return_hydra_config=True)
    assert list(hydra_cfg.hydra.overrides.task) == given  # what command_line_keys() used to read
    HydraConfig.instance().set_config(hydra_cfg)
    try:
        plan = resolve(cfg)  # a Python caller that passes none: the model's sizes, the global left unread
    finally:
        HydraConfig.instance().cfg = None
    assert (plan.cfg.model.embed_dim, plan.cfg.data.img_size) == (32, 32)
    message = "its model has data.img_size=32 model.embed_dim=32, not data.img_size=64 model.embed_dim=64 as given"
    with pytest.raises(ConfigError, match=message):
        resolve(cfg, given)
    with pytest.raises(ConfigError, match=message):
        train(cfg, overrides=["+" + given[0], given[1]])  # keys as Hydra spells them
    assert not (tmp_path / "run").exists()
