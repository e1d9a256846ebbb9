"""``train(cfg)``: the whole training run, callable without the command line.

Data flows one way: config -> plan (resolved, checked once, frozen: ``training.plan``) -> DataModule, system and
Trainer, each built once from it (``training.build``) -> fit, test, export -> run directory (the plan's config,
checkpoints, logs, tokenizer, bundle).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitattn.bundle import bundle_from_system
from vitattn.data.bad_images import gather_skipped
from vitattn.errors import Preempted
from vitattn.fileio import atomic_open
from vitattn.run_dir import RunDir
from vitattn.training.build import build
from vitattn.training.callbacks import Preemption
from vitattn.training.plan import Config, resolve
from vitattn.training.systems import VisionSystem
from vitattn.training.systems.sharding import is_sharded, unsharded_copy

__all__ = ["AtomicCheckpointIO", "TrainResult", "load_best_weights", "train"]

log = logging.getLogger(__name__)


@dataclass
class TrainResult:
    """What a run produced."""

    run_dir: Path
    metrics: dict[str, float] = field(default_factory=dict)
    samples: list[tuple[str, list[str]]] = field(default_factory=list)
    bundle_dir: Path | None = None
    global_step: int = 0
    system: VisionSystem | None = None
    weights: str = "last"  # which weights were tested and exported: "last", or "best (val/cider_d 1.2 at step 800)"
    steps_per_second: float = 0.0  # optimizer steps of this run / seconds of trainer.fit (validation included)
    skipped_images: dict[str, str] = field(default_factory=dict)  # unreadable files left out (data.bad_images=skip)
    already_complete: bool = False  # resume found the run complete: nothing trained, tested or written


def train(cfg: Config, overrides: Sequence[str] = ()) -> TrainResult:
    """Train, test and export as ``cfg`` (the composed ``conf/train.yaml``) says, into ``cfg.paths.output_dir``;
    a run ``resume`` finds complete returns its saved result, with ``already_complete``. ``overrides``: the
    command line's (``vitattn-train`` passes its own), which ``resolve`` reads: called with the same, ``train``
    refuses what ``vitattn-train`` refuses.

    Raises:
        Preempted: SIGTERM or SIGUSR1 stopped training after a whole step (``resume`` continues from
            ``checkpoints/last.ckpt``), or SIGTERM stopped the test after training (it runs again on resume).
    """
    complete = _saved_result(cfg)
    if complete is not None:
        return complete
    pl.seed_everything(cfg.seed, workers=True)
    plan = resolve(cfg, overrides)
    cfg = plan.cfg
    datamodule, system, trainer = build(plan, plugins=[AtomicCheckpointIO()])
    started = time.monotonic()
    try:
        trainer.fit(system, datamodule=datamodule, ckpt_path=plan.resume.ckpt_path)
    except SIGTERMException:  # Lightning's stop after a signal: a SystemExit with status 0
        raise _preempted(trainer) from None
    seconds = time.monotonic() - started
    if is_sharded(system.model):  # trainer=fsdp: the best weights, the test and the bundle take whole weights
        system.model = unsharded_copy(system.model)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    fast_dev_run = plan.trainer.fast_dev_run
    # test and export the best model, not the last
    best = not fast_dev_run and plan.weights == "best"
    source = load_best_weights(trainer, system, cfg.head.monitor if best else None)
    if cfg.test and not fast_dev_run:
        metrics.update(_test(trainer, system, datamodule))
    result = TrainResult(
        plan.run_dir,
        metrics,
        getattr(system, "last_samples", []),
        global_step=trainer.global_step,
        system=system,
        weights=source,
        steps_per_second=(trainer.global_step - plan.resume.first_step) / seconds if seconds > 0 else 0.0,
        skipped_images=gather_skipped(datamodule.skipped_images) if cfg.data.get("bad_images") == "skip" else {},
    )
    if cfg.export_bundle and trainer.is_global_zero:
        result.bundle_dir = bundle_from_system(system, RunDir(plan.run_dir).bundle)
    if trainer.is_global_zero:  # last: a run stopped before this point is not complete, and resumes
        RunDir(plan.run_dir).save_result(result.global_step, source, metrics, result.bundle_dir is not None)
    _finish_wandb_run()
    return result


def _saved_result(cfg: Config) -> TrainResult | None:
    """The saved result when the run ``cfg`` resumes is complete (``RunDir.completion``); None otherwise."""
    run_dir = Path(cfg.paths.output_dir)
    run = RunDir(run_dir)
    length = {key: cfg.trainer.get(key) for key in ("max_steps", "max_epochs")}
    line = run.completion(cfg.resume, cfg.ckpt_path, length)
    if line is None:
        return None
    saved = run.load_result()
    log.info(line)
    return TrainResult(
        run_dir,
        saved["metrics"],
        global_step=saved["global_step"],
        weights=saved["weights"],
        bundle_dir=run.bundle if saved["bundle"] else None,
        already_complete=True,
    )


def _test(trainer: pl.Trainer, system: VisionSystem, datamodule: pl.LightningDataModule) -> dict[str, float]:
    """The test split's metrics for the weights ``system`` holds now."""
    try:
        rows = trainer.test(system, datamodule=datamodule, verbose=False)
    except SIGTERMException:  # not a finished run: it must not exit with status 0
        raise _preempted(trainer) from None
    return {k: float(v) for row in rows for k, v in row.items()}


def _preempted(trainer: pl.Trainer) -> Preempted:
    """The stop's ``Preempted``: the ``Preemption`` callback's, or one without a checkpoint (``callbacks=none``)."""
    callback = next((c for c in trainer.callbacks if isinstance(c, Preemption)), None)
    return callback.preempted() if callback else Preempted("SIGTERM", trainer.global_step, None)


def _finish_wandb_run() -> None:
    """End the W&B run Lightning leaves open, which a sweep's next trial in this process would log into."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def load_best_weights(trainer: pl.Trainer, system: VisionSystem, monitor: str | None) -> str:
    """Load into ``system`` the best checkpoint by ``monitor`` (``head.monitor`` under ``weights=best``; None: the
    last weights) when there is one; returns what the tested and exported weights are."""
    monitoring = [c for c in trainer.checkpoint_callbacks if monitor and getattr(c, "monitor", None) == monitor]
    best = next((c for c in monitoring if c.best_model_path), None)
    if best is None or not Path(best.best_model_path).is_file():
        return f"last (step {trainer.global_step})"
    checkpoint = torch.load(best.best_model_path, map_location="cpu", weights_only=True)
    system.load_state_dict(checkpoint["state_dict"])
    score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    return f"best ({monitor} {score:.4f} at step {checkpoint['global_step']})"


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint beside itself, then renames it: a kill leaves the old file whole (why Lightning's
    own save does not: docs/reliability.md)."""

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: fsspec's way
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)
