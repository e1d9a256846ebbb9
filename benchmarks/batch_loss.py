"""Section ``batch-loss``: how to weigh the loss of batches by patches (``data.batch_patches``), whose images per
batch vary with the batch's sequence length: each batch's mean as it is (every step alike), or that mean times the
batch's images over the epoch's mean images per batch (every image alike, timm's ``--naflex-loss-scale linear``).

    python -m benchmarks batch-loss --seeds 0 1 2 --epochs 10

Each arm trains the shapes classifier (``head=classification data=shapes``, ``data.max_patches=64`` of 8 px,
``data.batch_patches=1024``) from scratch for the same epochs and steps (the schedule is drawn from the seed, the
same in both arms), then scores its validation split; a seed's two arms are paired.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

from benchmarks.report import write_json
from vitattn.training import train
from vitattn.training.config import compose_train
from vitattn.training.systems.base import VisionSystem

ARMS = ("mean", "weighted")
SETTINGS = [
    "head=classification",
    "data=shapes",
    "data.img_size=64",
    "data.num_train=2048",
    "data.num_val=512",
    "data.num_test=8",
    "data.max_patches=64",
    "data.batch_patches=1024",
    "data.num_workers=0",
    "model.patch_size=8",
    "model.embed_dim=64",
    "model.depth=4",
    "model.num_heads=4",
    "test=false",
    "export_bundle=false",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=csv",
]


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The section's options."""
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=None, help="JSON of the numbers")


def _weighted(step: Any) -> Any:
    """``training_step`` with its loss times the batch's images over the epoch's mean images per batch."""

    def weighted(self: VisionSystem, batch: Any, batch_idx: int) -> Any:
        loss = step(self, batch, batch_idx)
        loader = self.trainer.datamodule._train_loader
        mean = loader.sampler.num_samples / len(loader)
        return None if loss is None else loss * (len(batch[1]) / mean)

    return weighted


def _train(arm: str, seed: int, epochs: int, threads: int, folder: Path) -> dict[str, float]:
    step = VisionSystem.training_step
    if arm == "weighted":
        VisionSystem.training_step = _weighted(step)
    try:
        overrides = [*SETTINGS, f"seed={seed}", f"trainer.max_epochs={epochs}", f"num_threads={threads}"]
        result = train(compose_train([*overrides, f"paths.output_dir={folder / f'{arm}-{seed}'}"]))
    finally:
        VisionSystem.training_step = step
    return {
        "val/acc": float(result.metrics["val/acc"]),
        "val/loss": float(result.metrics["val/loss"]),
        "steps": int(result.global_step),
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both arms per seed; prints each and the paired differences, writes ``--out``."""
    found: dict[str, dict[int, dict[str, float]]] = {arm: {} for arm in ARMS}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for arm in ARMS:
                found[arm][seed] = _train(arm, seed, args.epochs, args.threads, Path(tmp))
                print(f"seed {seed} {arm}: {found[arm][seed]}", flush=True)
    differences = [found["weighted"][s]["val/acc"] - found["mean"][s]["val/acc"] for s in args.seeds]
    summary = {
        arm: {k: statistics.mean(found[arm][s][k] for s in args.seeds) for k in ("val/acc", "val/loss")} for arm in ARMS
    }
    print(f"mean over seeds: {summary}; weighted - mean accuracy per seed: {differences}")
    result = {"settings": SETTINGS, "epochs": args.epochs, "runs": found, "summary": summary, "paired": differences}
    if args.out is not None:
        write_json(result, args.out)
    return result
