from collections import Counter

import pytest
import timm
import torch
from timm.layers import resample_abs_pos_embed
from torch.utils.checkpoint import checkpoint

from tests.helpers.bundles import teacher_forced_log_prob
from vitattn.layers import DecoderLayer, EncoderLayer, Memory, record_attention
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer, vit_preset
from vitattn.models.generate import beam_search
from vitattn.models.generate import sample_token as _sample
from vitattn.models.timm_weights import load_timm_weights
from vitattn.models.vit import trunc_normal_

TINY = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)


@pytest.mark.parametrize("norm_first,activation", [(False, "relu"), (True, "gelu")])
@pytest.mark.parametrize("global_pool", ["cls", "mean"])
def test_vit_shapes_and_gradients(norm_first, activation, global_pool):
    model = VisionTransformer(
        **TINY, num_classes=5, norm_first=norm_first, activation=activation, global_pool=global_pool
    )
    x = torch.randn(3, 3, 32, 32)
    feats = model.forward_features(x)
    assert feats.shape == (3, 1 + 16, 32)
    logits = model(x)
    assert logits.shape == (3, 5) and torch.isfinite(logits).all()
    logits.logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_vit_fused_equals_explicit_and_records_maps():
    model = VisionTransformer(**TINY, num_classes=5).eval()
    x = torch.randn(2, 3, 32, 32)
    fused = model(x)
    with record_attention(model) as maps:
        explicit = model(x)
    torch.testing.assert_close(fused, explicit, atol=1e-5, rtol=1e-5)
    assert len(maps) == 2 and maps["blocks.0.mha"][0].shape == (2, 2, 17, 17)


@pytest.mark.parametrize(
    "name,kwargs,timm_name",
    [
        ("tiny", dict(num_classes=10), "vit_tiny_patch16_224"),
        ("cpu", dict(num_classes=7), None),
    ],
)
def test_vit_matches_timm_with_its_weights(name, kwargs, timm_name):
    if timm_name is None:  # same config built explicitly in timm
        cfg = dict(vit_preset(name).config)
        ref = timm.models.vision_transformer.VisionTransformer(
            img_size=cfg["img_size"],
            patch_size=cfg["patch_size"],
            embed_dim=cfg["embed_dim"],
            depth=cfg["depth"],
            num_heads=cfg["num_heads"],
            mlp_ratio=cfg["mlp_ratio"],
            num_classes=kwargs["num_classes"],
        )
    else:
        ref = timm.create_model(timm_name, pretrained=False, **kwargs)
    ref.eval()
    ours = vit_preset(name, **kwargs).eval()
    load_timm_weights(ours, ref)
    x = torch.randn(2, 3, ours.config["img_size"], ours.config["img_size"])
    torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


def test_load_timm_weights_from_local_files(tmp_path):
    from safetensors.torch import save_file

    ref = timm.models.vision_transformer.VisionTransformer(
        img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3
    ).eval()
    save_file(ref.state_dict(), tmp_path / "vit.safetensors")
    torch.save({"state_dict": ref.state_dict()}, tmp_path / "vit.pth")
    x = torch.randn(2, 3, 32, 32)
    for path in ("vit.safetensors", "vit.pth"):
        ours = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=3).eval()
        load_timm_weights(ours, tmp_path / path)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)
    with pytest.raises(FileNotFoundError, match=r"timm weights file not found: .*missing\.pth"):
        load_timm_weights(ours, tmp_path / "missing.pth")


def test_load_timm_weights_skips_a_head_of_another_size():
    ref = timm.create_model("vit_tiny_patch16_224", pretrained=False, num_classes=1000)
    ours = vit_preset("tiny", num_classes=4)
    head_before = ours.head.weight.clone()
    load_timm_weights(ours, ref)
    torch.testing.assert_close(ours.blocks[0].mha.wq.weight, ref.blocks[0].attn.qkv.weight[:192])
    torch.testing.assert_close(ours.head.weight, head_before)


def test_vit_sincos_position_init_is_timms_2d_sincos_and_still_learned():
    from timm.layers import build_sincos2d_pos_embed

    model = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, pos_embed_init="sincos")
    assert torch.equal(model.pos_embed[0, 1:], build_sincos2d_pos_embed([4, 4], 32))
    assert torch.equal(model.pos_embed[0, 0], torch.zeros(32)) and model.pos_embed.requires_grad
    default = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    assert default.pos_embed.std() < 0.03  # timm's truncated normal of 0.02
    with pytest.raises(ValueError, match="embed_dim divisible by 4, not 30"):
        VisionTransformer(img_size=32, patch_size=8, embed_dim=30, depth=1, num_heads=2, pos_embed_init="sincos")
    with pytest.raises(ValueError, match="pos_embed_init='rope' is unknown"):
        VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, pos_embed_init="rope")


def test_vit_pos_embed_resampled_on_load():
    src = VisionTransformer(**{**TINY, "img_size": 32})
    dst = VisionTransformer(**{**TINY, "img_size": 48})
    dst.load_state_dict(src.state_dict())
    assert dst.pos_embed.shape == (1, 1 + 36, 32)
    torch.testing.assert_close(dst.pos_embed[:, 0], src.pos_embed[:, 0])  # class token position kept
    grid = dst.pos_embed[0, 1:].reshape(6, 6, 32)
    assert torch.isfinite(grid).all() and not torch.allclose(grid[0, 0], grid[5, 5])
    assert dst(torch.randn(1, 3, 48, 48)).shape == (1, 32)


@pytest.mark.parametrize("src_size,dst_size", [(32, 48), (48, 32), (32, 64)])
def test_vit_pos_embed_resampling_equals_timm_resample_abs_pos_embed(src_size, dst_size):
    src = VisionTransformer(**{**TINY, "img_size": src_size})
    dst = VisionTransformer(**{**TINY, "img_size": dst_size})
    dst.load_state_dict(src.state_dict())
    grid = dst_size // TINY["patch_size"]
    expected = resample_abs_pos_embed(src.pos_embed.detach(), new_size=[grid, grid], num_prefix_tokens=1)
    torch.testing.assert_close(dst.pos_embed.detach(), expected, rtol=0, atol=0)


def _timm_vit(img_size: int) -> timm.models.vision_transformer.VisionTransformer:
    """A randomly initialised timm ViT of the TINY shape with 3 classes; its position grid made large, so
    that a wrongly resampled grid shows in the features."""
    model = timm.models.vision_transformer.VisionTransformer(
        img_size=img_size, **{k: v for k, v in TINY.items() if k != "img_size"}, num_classes=3
    )
    with torch.no_grad():
        model.pos_embed.normal_()
    return model.eval()


@pytest.mark.parametrize("src_size,dst_size", [(32, 48), (48, 32)])
def test_timm_weights_of_another_size_give_the_features_of_timm_built_at_the_new_size(src_size, dst_size):
    from timm.models.vision_transformer import checkpoint_filter_fn

    src = _timm_vit(src_size)
    ref = _timm_vit(dst_size)  # timm's own way to load weights of another size: its checkpoint filter
    ref.load_state_dict(checkpoint_filter_fn(src.state_dict(), ref))
    ours = VisionTransformer(**{**TINY, "img_size": dst_size}, num_classes=3).eval()
    load_timm_weights(ours, src)
    x = torch.randn(2, 3, dst_size, dst_size)
    with torch.no_grad():
        torch.testing.assert_close(ours.forward_features(x), ref.forward_features(x), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name,width,depth,heads", [("tiny", 192, 12, 3), ("small", 384, 12, 6), ("base", 768, 12, 12)])
def test_vit_presets(name, width, depth, heads):
    model = vit_preset(name)
    assert (model.embed_dim, len(model.blocks), model.blocks[0].mha.num_heads) == (width, depth, heads)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(num_heads=5), "num_heads=5 must divide embed_dim=32"),
        (dict(img_size=30), "img_size=30 must be divisible by patch_size=8"),
        (dict(global_pool="max"), "global_pool='max' is unknown"),
        (dict(activation="tanh"), "activation='tanh' is unknown"),
    ],
)
def test_vit_rejects_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        VisionTransformer(**{**TINY, **kwargs})


def _captioner(norm_first: bool = True, vocab: int = 13) -> ImageCaptioner:
    encoder = VisionTransformer(**TINY)
    decoder = CaptionDecoder(
        vocab,
        embed_dim=24,
        depth=2,
        num_heads=2,
        max_len=16,
        memory_dim=32,
        norm_first=norm_first,
        activation="gelu" if norm_first else "relu",
    )
    model = ImageCaptioner(encoder, decoder).eval()
    with torch.no_grad():  # far from the init: sharp, context-dependent outputs, so decoders differ
        for p in decoder.parameters():
            p.normal_(0.0, 0.5)
    return model


def test_models_built_on_the_meta_device_skip_their_init_and_keep_the_shapes(monkeypatch):
    """A copy without values (``bundle.folder.build_model`` builds one, checks it against the weights, then fills
    it) runs none of the initialisers, which are slow on meta tensors; built for real, they run."""
    real_vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    real_decoder = CaptionDecoder(vocab_size=20, embed_dim=32, depth=1, num_heads=2, max_len=8)
    called = []
    monkeypatch.setattr("vitattn.models.vit.trunc_normal_", lambda *a, **k: called.append("vit"))
    monkeypatch.setattr("vitattn.models.caption.trunc_normal_", lambda *a, **k: called.append("decoder"))
    with torch.device("meta"):
        vit = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
        decoder = CaptionDecoder(vocab_size=20, embed_dim=32, depth=1, num_heads=2, max_len=8)
    assert called == []
    for meta, real in ((vit, real_vit), (decoder, real_decoder)):
        shapes = {name: t.shape for name, t in real.state_dict().items()}
        assert {name: t.shape for name, t in meta.state_dict().items()} == shapes
        assert all(t.is_meta for t in meta.state_dict().values())
    VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2)
    CaptionDecoder(vocab_size=20, embed_dim=32, depth=1, num_heads=2, max_len=8)
    assert "vit" in called and "decoder" in called
    assert real_vit.pos_embed.abs().sum() > 0 and real_decoder.pos_embed.abs().sum() > 0


def test_caption_decoder_output_tied_to_embedding():
    model = _captioner()
    assert model.decoder.head.weight is model.decoder.token_embed.weight
    logits = model(torch.randn(2, 3, 32, 32), torch.randint(3, 13, (2, 6)))
    assert logits.shape == (2, 6, 13)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("num_beams", [1, 3])
def test_generate_cached_equals_recompute(norm_first, num_beams):
    model = _captioner(norm_first)
    images = torch.randn(4, 3, 32, 32)
    cached = model.generate(images, max_new_tokens=10, num_beams=num_beams)
    full = model.generate(images, max_new_tokens=10, num_beams=num_beams, use_cache=False)
    torch.testing.assert_close(cached, full, rtol=0, atol=0)


def test_beam_search_with_one_beam_equals_greedy():
    model = _captioner()
    images = torch.randn(4, 3, 32, 32)
    greedy = model.generate(images, max_new_tokens=10)
    memory = model.encode(images)
    with torch.no_grad():
        beam1 = beam_search(model.decode_step(memory, 10), 4, 10, 1, model.special_ids)
    torch.testing.assert_close(beam1, greedy, rtol=0, atol=0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_beam_search_at_least_as_likely_as_greedy(seed):
    torch.manual_seed(seed)
    model = _captioner()
    images = torch.randn(6, 3, 32, 32)
    greedy = model.generate(images, max_new_tokens=8)
    beam = model.generate(images, max_new_tokens=8, num_beams=4, length_penalty=0.0)
    with torch.no_grad():
        lp_greedy, lp_beam = (
            teacher_forced_log_prob(model, images, greedy),
            teacher_forced_log_prob(model, images, beam),
        )
    assert torch.all(lp_beam >= lp_greedy - 1e-4), (lp_beam, lp_greedy)
    assert torch.any(lp_beam > lp_greedy + 1e-4)  # the sharpened model leaves room to improve


def test_generate_pads_after_eos_and_lengths_vary():
    model = _captioner()
    eos, pad = model.decoder.eos_id, model.decoder.pad_id
    head = torch.nn.Linear(24, 13)  # untied head with an <eos> bias: captions end at different steps
    with torch.no_grad():
        head.weight.copy_(model.decoder.token_embed.weight)
        head.bias.zero_()
        head.bias[eos] = 4.0
    model.decoder.head = head
    images = torch.randn(16, 3, 32, 32)
    for beams in (1, 3):
        out = model.generate(images, max_new_tokens=12, num_beams=beams)
        torch.testing.assert_close(out, model.generate(images, max_new_tokens=12, num_beams=beams, use_cache=False))
        lengths = set()
        for row in out.tolist():
            n = row.index(eos) + 1 if eos in row else len(row)
            assert all(t == pad for t in row[n:]) and pad not in row[:n]
            lengths.add(n)
        assert len(lengths) > 1, f"all captions have one length with num_beams={beams}"


def test_generate_beam_lengths_match_log_prob_of_returned_tokens():
    model = _captioner()
    images = torch.randn(3, 3, 32, 32)
    out = model.generate(images, max_new_tokens=6, num_beams=3, length_penalty=0.0)
    assert out.shape[1] <= 6 and torch.isfinite(teacher_forced_log_prob(model, images, out)).all()


def test_sampling_filters():
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0, -1.0]]).repeat(2000, 1)
    g = torch.Generator().manual_seed(0)
    top_k = _sample(logits, temperature=1.0, top_k=2, top_p=1.0, generator=g)
    assert set(top_k.tolist()) == {0, 1}
    # probs ≈ .64 .24 .09 .03 .004: the smallest set reaching 0.8 is {0, 1}
    top_p = _sample(logits, temperature=1.0, top_k=0, top_p=0.8, generator=g)
    assert set(top_p.tolist()) == {0, 1}
    cold = _sample(logits, temperature=0.05, top_k=0, top_p=1.0, generator=g)
    assert set(cold.tolist()) == {0}
    hot = _sample(logits, temperature=5.0, top_k=0, top_p=1.0, generator=g)
    assert set(hot.tolist()) == {0, 1, 2, 3, 4}


def test_generate_sampling_is_reproducible_with_a_generator():
    model = _captioner()
    images = torch.randn(4, 3, 32, 32)
    a = model.generate(images, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(3))
    b = model.generate(images, do_sample=True, temperature=1.5, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_generate_rejects_bad_arguments():
    model = _captioner()
    images = torch.randn(1, 3, 32, 32)
    with pytest.raises(ValueError, match="max_new_tokens=40 exceeds"):
        model.generate(images, max_new_tokens=40)
    with pytest.raises(ValueError, match="do_sample=True needs num_beams=1"):
        model.generate(images, do_sample=True, num_beams=2)


@pytest.mark.parametrize(
    "encoder",
    [
        dict(global_pool="cls"),
        dict(global_pool="mean"),
        dict(global_pool="avg"),
        dict(global_pool="avg", fc_norm=True, norm_pre=True),  # timm's *_gap_* ViTs
        dict(global_pool="cls", norm_first=False, activation="relu"),  # the document's post-norm layers
    ],
)
def test_a_caption_step_reads_normalised_tokens_and_trains_every_parameter(encoder):
    vit = VisionTransformer(**TINY, **encoder)
    model = ImageCaptioner(vit, CaptionDecoder(11, embed_dim=32, depth=1, num_heads=2, max_len=6, memory_dim=32))
    images, tokens = torch.randn(3, 3, 32, 32) * 5 + 2, torch.randint(4, 11, (3, 5))
    memory = model.encode(images).tokens
    if encoder.get("norm_first", True):  # a LayerNorm's output: every token of mean 0 and variance 1
        torch.testing.assert_close(memory.mean(-1), torch.zeros(3, 17), atol=1e-4, rtol=0)
        torch.testing.assert_close(memory.var(-1, unbiased=False), torch.ones(3, 17), atol=1e-2, rtol=0)
    model(images, tokens).logsumexp(-1).mean().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_captioner_config_round_trip():
    model = _captioner()
    clone = ImageCaptioner.from_config(model.config).eval()
    clone.load_state_dict(model.state_dict())
    images = torch.randn(2, 3, 32, 32)
    torch.testing.assert_close(clone.generate(images), model.generate(images), rtol=0, atol=0)


def test_caption_decoder_init_switch():
    """``init="timm"``: linear weights from a truncated normal of std 0.02; ``init="torch"``: PyTorch's
    default ``nn.Linear`` init, uniform within 1/sqrt(fan_in) (std 1/sqrt(3 fan_in)); the embeddings alike."""
    torch.manual_seed(0)
    timm_init = CaptionDecoder(50, embed_dim=256, depth=1, num_heads=4, max_len=8, tie_embeddings=False)
    torch_init = CaptionDecoder(50, embed_dim=256, depth=1, num_heads=4, max_len=8, tie_embeddings=False, init="torch")
    assert timm_init.head.weight.std().item() == pytest.approx(0.02, rel=0.1)
    bound = 1 / 256**0.5
    assert torch_init.head.weight.abs().max().item() <= bound
    assert torch_init.head.weight.std().item() == pytest.approx(bound / 3**0.5, rel=0.1)
    assert torch_init.token_embed.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert torch_init.config["init"] == "torch" and "init" in timm_init.config
    with pytest.raises(ValueError, match="init='xavier' is unknown"):
        CaptionDecoder(50, embed_dim=32, depth=1, num_heads=2, init="xavier")


def _checkpointing_pair(head: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """One tiny model with dropout everywhere (so the recomputed pass must replay its masks), twice: as built
    and with gradient checkpointing, same weights, both in training mode."""
    drops = dict(drop_rate=0.1, attn_drop_rate=0.1)
    if head == "classification":
        plain = VisionTransformer(**TINY, num_classes=5, pos_drop_rate=0.1, drop_path_rate=0.1, **drops)
        checkpointed = VisionTransformer(**plain.config)
    else:
        encoder = VisionTransformer(**TINY, drop_path_rate=0.1, **drops)
        plain = ImageCaptioner(encoder, CaptionDecoder(13, embed_dim=24, depth=2, num_heads=2, memory_dim=32, **drops))
        checkpointed = ImageCaptioner.from_config(plain.config)
    checkpointed.load_state_dict(plain.state_dict())
    checkpointed.set_grad_checkpointing()
    return plain.train(), checkpointed.train()


def _batches(head: str, steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(images, labels) or (images, tokens) batches from their own generator."""
    g = torch.Generator().manual_seed(1)
    high = 5 if head == "classification" else 13
    shape = (4,) if head == "classification" else (4, 7)
    return [(torch.randn(4, 3, 32, 32, generator=g), torch.randint(0, high, shape, generator=g)) for _ in range(steps)]


def _loss(model: torch.nn.Module, images: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    if targets.dim() == 1:
        return torch.nn.functional.cross_entropy(model(images), targets)
    logits = model(images, targets[:, :-1])  # (B, T-1, V)
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets[:, 1:].flatten())


def _train(model: torch.nn.Module, batches: list) -> list[float]:
    torch.manual_seed(2)  # the same dropout masks for both models
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for images, targets in batches:
        optimizer.zero_grad()
        loss = _loss(model, images, targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("head", ["classification", "caption"])
def test_grad_checkpointing_trains_as_without(head):
    """Ten AdamW steps with dropout and stochastic depth: the same losses, since the recomputed pass replays
    the forward pass's random masks."""
    plain, checkpointed = _checkpointing_pair(head)
    batches = _batches(head, 10)
    expected = _train(plain, batches)
    assert len(set(expected)) == 10  # the model learns: ten different losses to compare
    torch.testing.assert_close(_train(checkpointed, batches), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("head", ["classification", "caption"])
def test_grad_checkpointing_gives_the_same_gradient_on_every_parameter(head):
    plain, checkpointed = _checkpointing_pair(head)
    [(images, targets)] = _batches(head, 1)
    for model in (plain, checkpointed):
        torch.manual_seed(2)
        _loss(model, images, targets).backward()
    grads = dict(checkpointed.named_parameters())
    for name, p in plain.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name
        torch.testing.assert_close(grads[name].grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _count_layer_runs(model: torch.nn.Module) -> Counter:
    """Runs of each encoder and decoder layer, counted by a forward pre-hook (the backward's recomputation too)."""
    runs: Counter = Counter()
    for name, module in model.named_modules():
        if isinstance(module, EncoderLayer | DecoderLayer):
            module.register_forward_pre_hook(lambda *_, name=name: runs.update([name]))
    return runs


def _count_checkpoints(monkeypatch) -> list:
    """The functions given to ``torch.utils.checkpoint.checkpoint`` by the encoder and the decoder."""
    checkpointed = []

    def counted(function, *args, **kwargs):
        checkpointed.append(function)
        return checkpoint(function, *args, **kwargs)

    monkeypatch.setattr("vitattn.models.vit.checkpoint", counted)
    monkeypatch.setattr("vitattn.models.caption.checkpoint", counted)
    return checkpointed


def test_grad_checkpointing_runs_each_layer_again_in_the_backward_pass_and_only_while_training(monkeypatch):
    _, model = _checkpointing_pair("caption")
    runs, checkpointed = _count_layer_runs(model), _count_checkpoints(monkeypatch)
    layers = ["encoder.blocks.0", "encoder.blocks.1", "decoder.layers.0", "decoder.layers.1"]
    [(images, tokens)] = _batches("caption", 1)

    def runs_of_one_step() -> dict[str, int]:
        runs.clear()
        checkpointed.clear()
        loss = _loss(model, images, tokens)
        if loss.requires_grad:
            loss.backward()
        return dict(runs)

    assert runs_of_one_step() == dict.fromkeys(layers, 2)  # forward, and again in the backward pass
    with torch.no_grad():
        assert runs_of_one_step() == dict.fromkeys(layers, 1) and checkpointed == []
    model.eval()
    assert runs_of_one_step() == dict.fromkeys(layers, 1)  # evaluation keeps its activations
    model.train()
    model.set_grad_checkpointing(False)
    assert runs_of_one_step() == dict.fromkeys(layers, 1)
    assert model.config["encoder"]["grad_checkpointing"] is False and not model.decoder.config["grad_checkpointing"]


def test_grad_checkpointing_never_checkpoints_the_cached_decoding(monkeypatch):
    """The key/value cache path, even in training mode with gradients on, is not checkpointed (a recomputation
    in the backward pass would append its keys and values again) and gives the full pass's logits."""
    checkpointed = _count_checkpoints(monkeypatch)
    decoder = CaptionDecoder(13, embed_dim=24, depth=2, num_heads=2, max_len=16, drop_rate=0.0, grad_checkpointing=True)
    memory, tokens = Memory(torch.randn(3, 5, 24)), torch.randint(3, 13, (3, 6))
    cache = decoder.train().new_cache()
    cached = torch.cat([decoder(tokens[:, i : i + 1], memory, cache, start=i) for i in range(6)], dim=1)  # (B, 6, V)
    assert checkpointed == [] and [c.length for c in cache] == [6, 6]
    full = decoder(tokens, memory)
    assert checkpointed == list(decoder.layers)  # without a cache, each layer is
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def test_grad_checkpointing_leaves_generated_captions_unchanged():
    model = _captioner()
    images = torch.randn(4, 3, 32, 32)
    expected = model.generate(images, max_new_tokens=10, num_beams=3)
    model.set_grad_checkpointing()
    assert model.encoder.grad_checkpointing and model.decoder.grad_checkpointing
    torch.testing.assert_close(model.generate(images, max_new_tokens=10, num_beams=3), expected, rtol=0, atol=0)


@pytest.mark.parametrize("std", [0.02, 1.0])
def test_trunc_normal_draws_what_timms_draws(std):
    """Written here so that captioning imports no timm; a seed still gives the model it gave with timm's."""
    ours, theirs = torch.empty(300, 70), torch.empty(300, 70)
    torch.manual_seed(0)
    trunc_normal_(ours, std=std)
    torch.manual_seed(0)
    timm.layers.trunc_normal_(theirs, std=std)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
