"""Fine-tuning controls: layer-wise lr decay, a head / decoder rate, an encoder frozen for the first epochs."""

import pytest
import torch
from lightning.pytorch import Callback
from timm.optim import param_groups_weight_decay

import vitattn.run_dir as targets
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.cli.train import _resume_argv
from vitattn.errors import ConfigError
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.run_dir import RunDir
from vitattn.training import train
from vitattn.training.plan import resolve
from vitattn.training.systems.base import (
    add_param_groups,
    build_optimizer,
    head_modules,
    no_weight_decay_names,
    param_groups,
)

DEPTH = 2
SIZES = dict(img_size=32, patch_size=8, embed_dim=32, depth=DEPTH, num_heads=2)


def _classifier() -> VisionTransformer:
    return VisionTransformer(**SIZES, num_classes=3)


def _captioner() -> ImageCaptioner:
    return ImageCaptioner(VisionTransformer(**SIZES), CaptionDecoder(20, embed_dim=32, depth=1, num_heads=2))


def _lr_of(groups: list[dict]) -> dict[int, float]:
    return {id(p): g["lr"] for g in groups for p in g["params"]}


def _beit_layer(name: str) -> int:
    """BEiT's layer id: embeddings 0, block i i + 1, the final norm with the last block, the rest DEPTH + 1."""
    name = name.removeprefix("encoder.")
    if name.startswith(("cls_token", "pos_embed", "patch_embed")):
        return 0
    if name.startswith("blocks."):
        return int(name.split(".")[1]) + 1
    return DEPTH if name.startswith("norm.") else DEPTH + 1


@pytest.mark.parametrize("build", [_classifier, _captioner], ids=["classifier", "captioner"])
def test_layer_decay_gives_timms_per_layer_rates(build):
    model, lr, decay = build(), 1e-3, 0.75
    groups = param_groups(model, lr=lr, weight_decay=0.05, layer_decay=decay)
    rates = _lr_of(groups)
    num_layers = DEPTH + 1
    for name, p in model.named_parameters():
        expected = lr * decay ** (num_layers - _beit_layer(name))  # timm: scale = layer_decay ** (L - layer_id)
        assert rates[id(p)] == pytest.approx(expected), name
    assert len(rates) == len(list(model.parameters()))  # every parameter in exactly one group
    assert {g["weight_decay"] for g in groups if all(p.ndim <= 1 for p in g["params"])} == {0.0}
    assert min(rates.values()) == pytest.approx(lr * decay**num_layers)  # the stem learns slowest


@pytest.mark.parametrize("build", [_classifier, _captioner], ids=["classifier", "captioner"])
@pytest.mark.parametrize("layer_decay", [None, 0.5])
def test_head_lr_applies_to_the_head_or_the_decoder_only(build, layer_decay):
    model = build()
    plain = _lr_of(param_groups(model, lr=1e-3, layer_decay=layer_decay))
    rates = _lr_of(param_groups(model, lr=1e-3, layer_decay=layer_decay, head_lr=5e-2))
    head = {id(p) for m in head_modules(model) for p in m.parameters()}
    assert head and all(rates[i] == 5e-2 for i in head)
    assert all(rates[i] == plain[i] for i in rates if i not in head)  # the encoder keeps its rates
    assert head_modules(model)[0] is (model.decoder if isinstance(model, ImageCaptioner) else model.head)


def test_without_fine_tuning_options_the_groups_are_timms_weight_decay_groups():
    model = _captioner()
    ours = param_groups(model, lr=2e-3, weight_decay=0.05)
    timms = param_groups_weight_decay(model, 0.05, no_weight_decay_list=no_weight_decay_names(model))
    assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in timms]
    assert {g["lr"] for g in ours} == {2e-3}
    names = {id(p): n for n, p in model.named_parameters()}
    undecayed = {names[id(p)] for g in ours if g["weight_decay"] == 0 for p in g["params"]}
    # the embeddings of the nested encoder and decoder too, not only top-level names
    assert {"encoder.pos_embed", "encoder.cls_token", "decoder.pos_embed", "decoder.token_embed.weight"} <= undecayed


def test_one_schedule_scales_every_groups_own_rate():
    optimizer, scheduler = build_optimizer(_classifier(), total_steps=50, lr=1e-3, layer_decay=0.5, head_lr=1e-2)
    peaks = [g["lr"] for g in param_groups(_classifier(), lr=1e-3, layer_decay=0.5, head_lr=1e-2)]
    schedule = scheduler.lr_lambdas[0]
    assert all(f is schedule for f in scheduler.lr_lambdas)  # one WarmupCosine, moved by TimeBudgetHorizon
    for step in range(1, 13):
        optimizer.step()
        scheduler.step()
        assert [g["lr"] for g in optimizer.param_groups] == pytest.approx([p * schedule(step) for p in peaks])


def test_groups_added_while_running_follow_the_schedule():
    model = _classifier()
    for name, p in model.named_parameters():
        p.requires_grad_(name.startswith("head."))
    optimizer, scheduler = build_optimizer(model, total_steps=50, lr=1e-3, layer_decay=0.5)
    for _ in range(7):
        optimizer.step()
        scheduler.step()
    model.requires_grad_(True)
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    new = [
        {**g, "params": [p for p in g["params"] if id(p) not in known]} for g in param_groups(model, 1e-3, 0.05, 0.5)
    ]
    new = [g for g in new if g["params"]]
    add_param_groups(scheduler, new)
    schedule, peaks = scheduler.lr_lambdas[0], [g["lr"] for g in new]
    assert [g["lr"] for g in optimizer.param_groups[-len(new) :]] == pytest.approx([p * schedule(7) for p in peaks])
    optimizer.step()
    scheduler.step()
    assert [g["lr"] for g in optimizer.param_groups[-len(new) :]] == pytest.approx([p * schedule(8) for p in peaks])


@pytest.mark.parametrize(
    "override,message",
    [
        ("optim.layer_decay=0", r"^optim\.layer_decay=0 must be in \(0, 1\]"),
        ("optim.layer_decay=1.5", r"^optim\.layer_decay=1\.5 must be in \(0, 1\]"),
        ("optim.head_lr=-0.1", r"^optim\.head_lr=-0\.1 must be positive"),
        ("finetune.freeze_encoder_epochs=-1", r"^finetune\.freeze_encoder_epochs=-1 must be a whole number of epochs"),
        (
            "finetune.freeze_encoder_epochs=1 trainer=ddp",
            r"^finetune\.freeze_encoder_epochs=1 does not work with several processes \(trainer\.strategy=ddp, ",
        ),
    ],
)
def test_bad_fine_tuning_values_are_one_config_error(override, message, tmp_path):
    cfg = compose_train([*TINY, *TINY_SHAPES, *override.split()], tmp_path)
    with pytest.raises(ConfigError, match=message):
        resolve(cfg)  # the plan refuses what needs the trainer's processes


def test_resume_replays_the_saved_overrides_before_the_command_lines(tmp_path):
    run = RunDir(tmp_path / "old")
    run.overrides.parent.mkdir(parents=True)
    run.overrides.write_text("- finetune.freeze_encoder_epochs=1\n- optim.lr=0.1\n")
    argv = _resume_argv([f"resume={run.path}", "optim.lr=0.2"])
    assert argv == [
        "finetune.freeze_encoder_epochs=1",
        f"resume={run.path}",
        "optim.lr=0.2",
        f"hydra.run.dir={run.path}",
    ]


class _Snapshots(Callback):
    """The model's weights by global step, when training starts and at each epoch end; what every instance
    takes goes to the class (the runs build their own, from the callbacks group)."""

    at: dict[int, dict[str, torch.Tensor]] = {}

    def _take(self, trainer, pl_module) -> None:
        self.at[trainer.global_step] = {k: v.detach().clone() for k, v in pl_module.model.state_dict().items()}

    on_train_start = on_train_epoch_end = _take

    @classmethod
    def encoder(cls, step: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in cls.at[step].items() if not k.startswith(("head.", "decoder."))}

    @classmethod
    def head(cls, step: int) -> dict[str, torch.Tensor]:
        return {k: v for k, v in cls.at[step].items() if k.startswith(("head.", "decoder."))}


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> set[str]:
    return {k for k in before if not torch.equal(before[k], after[k])}


@pytest.fixture
def snapshots(monkeypatch):
    """``_Snapshots``, added to the runs as a user adds a callback (``+callbacks.snapshots._target_=...``)."""
    monkeypatch.setattr(targets, "ALLOWED_TARGET_PREFIXES", (*targets.ALLOWED_TARGET_PREFIXES, "tests."))
    monkeypatch.setattr(_Snapshots, "at", {})
    return _Snapshots


# 64 training images in batches of 8: 8 steps an epoch; the encoder thaws at epoch 1 (step 8).
FROZEN = [
    "head=classification",
    *TINY,
    *TINY_SHAPES,
    "finetune.freeze_encoder_epochs=1",
    "optim.layer_decay=0.75",
    "optim.head_lr=5e-3",
    "optim.warmup_steps=2",
    "trainer.max_epochs=-1",
    "trainer.check_val_every_n_epoch=1000",
    "trainer.log_every_n_steps=1",  # the learning-rate monitor logs every group, before and after the thaw
    "callbacks.step_checkpoint.every_n_train_steps=4",
    f"+callbacks.snapshots._target_={__name__}._Snapshots",
    "test=false",
    "export_bundle=false",
]


def _assert_groups_follow_the_schedule(system) -> None:
    scheduler = system.trainer.lr_scheduler_configs[0].scheduler
    optimizer, schedule = scheduler.optimizer, scheduler.lr_lambdas[0]
    in_optimizer = {id(p) for g in optimizer.param_groups for p in g["params"]}
    assert in_optimizer == {id(p) for p in system.model.parameters()}  # the thawed encoder joined
    peaks = _lr_of(system.param_groups())  # the groups it would have had from the start
    for group, base in zip(optimizer.param_groups, scheduler.base_lrs, strict=True):
        assert all(peaks[id(p)] == pytest.approx(base) for p in group["params"])
        assert group["lr"] == pytest.approx(base * schedule(scheduler.last_epoch))


def test_frozen_encoder_trains_only_after_the_frozen_epochs(snapshots, tmp_path):
    result = train(compose_train([*FROZEN, "trainer.max_steps=16"], tmp_path))
    assert result.global_step == 16
    start, frozen, thawed = (snapshots.encoder(step) for step in (0, 8, 16))
    assert _changed(start, frozen) == set()  # epoch 0: not one encoder weight moved
    assert _changed(snapshots.head(0), snapshots.head(8)) == {"head.weight", "head.bias"}  # the head trained
    assert _changed(frozen, thawed) == set(frozen)  # epoch 1: every encoder weight moved
    _assert_groups_follow_the_schedule(result.system)


def test_frozen_captioner_trains_the_decoder_first(snapshots, tmp_path):
    overrides = [o for o in FROZEN if not o.startswith(("head=", "optim."))]
    train(compose_train(["head=caption", *overrides, "trainer.max_steps=10"], tmp_path))
    assert _changed(snapshots.encoder(0), snapshots.encoder(8)) == set()
    assert _changed(snapshots.head(0), snapshots.head(8)) == set(snapshots.head(0))  # the whole decoder trained
    assert _changed(snapshots.encoder(8), snapshots.encoder(10)) == set(snapshots.encoder(8))


def _adam_steps(ckpt_path) -> dict[str, int]:
    """Adam's step count of each parameter in a checkpoint, by name (saved state is by group position)."""
    checkpoint = torch.load(ckpt_path, weights_only=True)
    meta = checkpoint["callbacks"]["FreezeEncoder"]["internal_optimizer_metadata"][0]  # Lightning's record, by name
    state = checkpoint["optimizer_states"][0]
    order = [n for g in meta for n in g["params"]]
    indices = [i for g in state["param_groups"] for i in g["params"]]
    return {name.removeprefix("model."): int(state["state"][i]["step"]) for name, i in zip(order, indices, strict=True)}


@pytest.mark.parametrize("saved_at", [4, 8, 12], ids=["frozen", "frozen-epoch-end", "thawed"])
def test_resume_keeps_the_frozen_and_thawed_optimizer(saved_at, snapshots, tmp_path):
    first = tmp_path / "first"
    train(compose_train([*FROZEN, f"trainer.max_steps={saved_at}"], first))
    second = tmp_path / "second"
    result = train(compose_train([*FROZEN, "trainer.max_steps=20", f"resume={first}"], second))
    assert result.global_step == 20
    resumed = snapshots.encoder(saved_at)
    if saved_at == 4:  # frozen until epoch 1 starts (step 8), then trained
        assert _changed(resumed, snapshots.encoder(8)) == set()
        assert _changed(snapshots.encoder(8), snapshots.encoder(16)) == set(resumed)
    else:  # at the thaw, or after it in the middle of epoch 1: trains at once
        assert _changed(resumed, snapshots.encoder(16)) == set(resumed)
    steps = _adam_steps(second / "checkpoints" / "last.ckpt")
    assert {s for n, s in steps.items() if n.startswith("head.")} == {20}
    assert {s for n, s in steps.items() if not n.startswith("head.")} == {12}  # from step 8, when it thawed
    _assert_groups_follow_the_schedule(result.system)
