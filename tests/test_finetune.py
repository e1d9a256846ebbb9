"""Fine-tuning controls: layer-wise lr decay, a head / decoder rate."""

import pytest
from timm.optim import param_groups_weight_decay

from tests.helpers import TINY, TINY_SHAPES, compose_train
from vitattn.config import ConfigError, check_config
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.systems.optim import NO_WEIGHT_DECAY, add_param_groups, build_optimizer, head_modules, param_groups

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
    timms = param_groups_weight_decay(model, 0.05, no_weight_decay_list=NO_WEIGHT_DECAY)
    assert [[id(p) for p in g["params"]] for g in ours] == [[id(p) for p in g["params"]] for g in timms]
    assert {g["lr"] for g in ours} == {2e-3}


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
    ],
)
def test_bad_fine_tuning_values_are_one_config_error(override, message, tmp_path):
    cfg = compose_train([*TINY, *TINY_SHAPES, *override.split()], tmp_path)
    with pytest.raises(ConfigError, match=message):
        check_config(cfg)
