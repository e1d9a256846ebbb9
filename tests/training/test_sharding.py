"""``trainer=fsdp``: FSDP2 over two CPU processes (gloo) against DDP, the oracle; its checkpoints as bundles."""

import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.bundle import load_bundle, load_checkpoint
from vitattn.errors import ConfigError
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.training.build import should_compile
from vitattn.training.config import check_config
from vitattn.training.plan import resolve
from vitattn.training.systems.sharding import gather_for_evaluation, shard_again, shard_layers, unsharded_copy

# Two CPU processes, the tiny model on the shapes; a constant learning rate (a resumed run with another
# max_steps keeps the schedule) and a clip that acts at every step (the gradient norm is far above it).
TWO_CPUS = [
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.benchmark=false",
    "trainer.log_every_n_steps=1",
    "trainer.gradient_clip_val=0.05",
    "optim.warmup_steps=0",
    "optim.min_lr_ratio=1.0",
    *TINY,
    *TINY_SHAPES,
]


def _train(launch: str, overrides: list[str], cwd: Path, **env: str) -> None:
    script = (
        [sys.executable, str(Path(__file__).parents[1] / "helpers" / "fsdp_train.py")]
        if launch == "probe"
        else [
            sys.executable,
            "-m",
            "vitattn.cli.train",
        ]
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", **env}
    proc = subprocess.run(
        [*script, *TWO_CPUS, *overrides], capture_output=True, text=True, timeout=300, env=env, cwd=cwd
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


def _losses(run: Path) -> dict[int, float]:
    with open(run / "csv" / "metrics.csv") as f:
        return {int(row["step"]): float(row["train/loss"]) for row in csv.DictReader(f) if row.get("train/loss")}


def _logged(run: Path, prefix: str) -> dict[str, float]:
    with open(run / "csv" / "metrics.csv") as f:
        return {k: float(v) for row in csv.DictReader(f) for k, v in row.items() if k.startswith(prefix) and v}


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]


@pytest.mark.slow
@pytest.mark.parametrize("head", ["caption", "classification"])
def test_an_fsdp_run_trains_as_ddp_and_its_checkpoint_is_the_bundle(head, tmp_path):
    """Two processes, FSDP against DDP: the same losses step by step (FSDP stopped after 2 of 4 steps and resumed
    with resume=auto; the caption model recomputes its layers, model.grad_checkpointing=true), validation and test
    metrics and final weights; each rank holds a half of the weights, in units of one encoder or decoder layer;
    the bundle holds the checkpoint's weights and predicts as the checkpoint loaded in one process."""
    common = [f"head={head}", "trainer.max_steps=4"]
    _train("ddp", ["trainer=ddp", *common, "export_bundle=false", f"hydra.run.dir={tmp_path / 'ddp'}"], tmp_path)
    shards, run = tmp_path / "shards.jsonl", tmp_path / "fsdp"
    fsdp = ["trainer=fsdp", *common, "resume=auto", f"hydra.run.dir={run}"]
    if head == "caption":
        fsdp.append("model.grad_checkpointing=true")
        _train("probe", [*fsdp, "trainer.max_steps=2"], tmp_path, VITATTN_SHARD_LOG=str(shards))
    _train("probe", fsdp, tmp_path, VITATTN_SHARD_LOG=str(shards))

    records = [json.loads(line) for line in shards.read_text().splitlines()]
    layers = ["EncoderLayer"] * 2 + (["DecoderLayer"] * 2 if head == "caption" else [])
    root = "ImageCaptioner" if head == "caption" else "VisionTransformer"
    assert len(records) == (4 if head == "caption" else 2)
    for first, second in zip(records[::2], records[1::2]):  # the two ranks of one run
        assert {first["rank"], second["rank"]} == {0, 1}
        assert first["units"] == second["units"] == [root, *layers]
        assert first["held"] + second["held"] == first["total"]  # every weight on one rank, none on both
        assert max(first["held"], second["held"]) < 0.6 * first["total"]

    ddp = tmp_path / "ddp"
    expected = _losses(ddp)
    assert sorted(expected) == [0, 1, 2, 3]
    torch.testing.assert_close(_losses(run), expected, rtol=0, atol=1e-5)
    for stage in ("val/", "test/"):  # validation on gathered weights; the test on an unsharded copy
        logged = _logged(run, stage)
        assert logged and logged.keys() == _logged(ddp, stage).keys()
        torch.testing.assert_close(logged, _logged(ddp, stage), rtol=0, atol=1e-5)
    weights = _weights(run)
    assert torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 4
    torch.testing.assert_close(weights, _weights(ddp), rtol=0, atol=1e-5)

    bundle = load_bundle(run / "bundle")
    assert bundle.model.state_dict().keys() == {k.removeprefix("model.") for k in weights}
    for key, value in bundle.model.state_dict().items():
        assert torch.equal(value, weights[f"model.{key}"]), key
    single = load_checkpoint(run / "checkpoints" / "last.ckpt", "cpu")  # one process, no sharding
    images = torch.randn(4, 3, 32, 32)
    with torch.no_grad():
        if head == "caption":
            assert torch.equal(bundle.model.generate(images), single.model.generate(images))
        else:
            assert torch.equal(bundle.model(images), single.model(images))


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of one process (this one) and its mesh, destroyed after the test."""
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _captioner() -> ImageCaptioner:
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    return ImageCaptioner(encoder, CaptionDecoder(12, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0, max_len=8))


def test_shard_layers_makes_each_encoder_and_decoder_layer_a_unit(one_process_group):
    model = _captioner().eval()
    images, tokens = torch.randn(2, 3, 32, 32), torch.randint(4, 12, (2, 6))
    with torch.no_grad():
        expected = model(images, tokens)
    shard_layers(model, one_process_group)
    units = [name for name, m in model.named_modules() if isinstance(m, FSDPModule)]
    assert units == ["", "encoder.blocks.0", "encoder.blocks.1", "decoder.layers.0", "decoder.layers.1"]
    gather_for_evaluation(model)
    with torch.no_grad():
        torch.testing.assert_close(model(images, tokens), expected)
    shard_again(model)
    copy = unsharded_copy(model)
    assert not any(isinstance(m, FSDPModule) for m in copy.modules()) and not copy.training
    with torch.no_grad():
        torch.testing.assert_close(copy(images, tokens), expected)


@pytest.mark.parametrize(("precision", "gathered"), [("bf16-mixed", torch.bfloat16), ("32-true", torch.float32)])
def test_under_bf16_mixed_weights_are_gathered_in_bf16_and_gradients_reduced_in_fp32(
    precision, gathered, one_process_group
):
    model = _captioner()
    seen = []
    layer = model.encoder.blocks[0]
    layer.register_forward_pre_hook(lambda module, args: seen.append(module.ffn[0].weight.dtype))
    shard_layers(model, one_process_group, precision)
    model(torch.randn(2, 3, 32, 32), torch.randint(4, 12, (2, 6))).float().logsumexp(-1).mean().backward()
    assert seen == [gathered]  # the weights the layer computed with
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # the sharded weights the optimizer steps
    assert {p.grad.dtype for p in model.parameters() if p.grad is not None} == {torch.float32}


def test_trainer_fsdp_refuses_self_critical_training_in_one_line(tmp_path):
    cpu = ["trainer.accelerator=cpu", "trainer.precision=32-true"]  # so that no GPU check answers first
    cfg = compose_train(["trainer=fsdp", *cpu, "finetune=scst", f"finetune.init={tmp_path}"], tmp_path)
    with pytest.raises(ConfigError, match="finetune=scst does not work with trainer=fsdp") as error:
        check_config(cfg)
    assert "\n" not in str(error.value) and "trainer=ddp" in str(error.value)


def test_trainer_fsdp_refuses_the_ema_in_one_line_and_compiles_only_when_asked(tmp_path):
    cfg = compose_train(["trainer=fsdp", "ema.decay=0.99"], tmp_path)
    with pytest.raises(ConfigError, match="ema.decay=0.99 does not work with trainer=fsdp") as error:
        check_config(cfg)
    assert "\n" not in str(error.value)
    assert not should_compile(
        resolve(compose_train(["trainer=fsdp"], tmp_path))
    )  # a GPU trainer: auto compiles elsewhere
    assert should_compile(resolve(compose_train(["trainer=fsdp", "compile=true"], tmp_path)))
