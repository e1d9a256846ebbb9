"""``train(cfg)``: the whole training run, callable without the command line.

Data flows one way: config -> resolved config (start weights, precision, preprocessing) -> checked ->
DataModule + system, each built once -> Trainer -> run directory (that config, checkpoints, logs, tokenizer,
exported bundle).
"""

from __future__ import annotations

import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from omegaconf import DictConfig

from vitattn.bundle import bundle_from_system
from vitattn.data.bad_images import gather_skipped
from vitattn.data.tokenizer import tokenizer_file_name
from vitattn.fileio import atomic_open
from vitattn.run_dir import RunDir
from vitattn.training.advice import check_fit
from vitattn.training.build import (
    build_datamodule,
    build_system,
    on_gpu,
    plan_cores,
    prepare_reward,
    resolve_train_precision,
    run_tokenizer,
    set_matmul_precision,
    setup_data,
)
from vitattn.training.callbacks import Preemption
from vitattn.training.config import check_accelerator, check_config, check_targets, fully_sharded, instantiate_group
from vitattn.training.loggers import build_loggers
from vitattn.training.start import command_line_keys, log_preprocess, read_start, resolve_preprocess
from vitattn.training.systems import VisionSystem
from vitattn.training.systems.sharding import is_sharded, unsharded_copy

__all__ = ["AtomicCheckpointIO", "TrainResult", "load_best_weights", "should_compile", "train"]

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


def train(cfg: DictConfig) -> TrainResult:
    """Train, test and export as ``cfg`` (the composed ``conf/train.yaml``) says, into ``cfg.paths.output_dir``;
    a run ``resume`` finds complete returns its saved result, with ``already_complete``.

    Raises:
        Preempted: SIGTERM or SIGUSR1 stopped training after a whole step (``resume`` continues from
            ``checkpoints/last.ckpt``), or SIGTERM stopped the test after training (it runs again on resume).
    """
    check_targets(cfg)  # a run folder's config is input: nothing it names is imported before this
    run_dir = Path(cfg.paths.output_dir)
    complete = _complete_run(cfg, run_dir)
    if complete is not None:
        return complete
    pl.seed_everything(cfg.seed, workers=True)
    # resolved in place first, so that the config checked next is the one that runs and is saved
    start = read_start(cfg.finetune.init, cfg.finetune.get("init_kind", "model")) if cfg.finetune.get("init") else None
    if start is not None:
        start.resolve(cfg, command_line_keys())
    resolve_train_precision(cfg)
    preprocess_from = resolve_preprocess(cfg, start)
    check_config(cfg)  # every user error surfaces here, before data is read
    check_accelerator(cfg.trainer)
    set_matmul_precision(cfg)
    ckpt_path = _resume_checkpoint(cfg)
    vocab = start.vocab if start is not None else run_tokenizer(cfg, run_dir, ckpt_path is not None)
    datamodule = build_datamodule(cfg, vocab)
    log_preprocess(datamodule, preprocess_from)
    first_step = _checkpoint_step(ckpt_path) if ckpt_path else 0
    setup_data(cfg, datamodule, ckpt_path)  # empty data, wrong vocabulary: one line, no step run
    plan_cores(cfg, datamodule)
    if rank_zero_only.rank == 0:
        check_fit(cfg, datamodule)  # a coarse patch grid, a vocabulary of <unk>, a schedule with no end
    system = build_system(cfg, datamodule, start)
    if cfg.finetune.get("scst") is not None:
        system.use_reward(prepare_reward(datamodule, run_dir, ckpt_path is not None))
    if should_compile(cfg):
        system.model.compile()  # in place: parameter names (checkpoints, bundles) stay as they are
    # A resumed run, or a resume=auto start, continues the logs of the folder's run from its first step.
    log_from = first_step if ckpt_path or cfg.resume == "auto" else None

    trainer: pl.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        callbacks=instantiate_group(cfg.get("callbacks")),
        logger=build_loggers(cfg.get("logger"), run_dir, log_from) or False,
        default_root_dir=str(run_dir),
        plugins=[AtomicCheckpointIO()],
    )
    _save_run_files(cfg, datamodule, run_dir)
    started = time.monotonic()
    try:
        trainer.fit(system, datamodule=datamodule, ckpt_path=ckpt_path)
    except SIGTERMException:  # Lightning's stop after a signal: a SystemExit with status 0
        raise _preempted(trainer) from None
    seconds = time.monotonic() - started
    if is_sharded(system.model):  # trainer=fsdp: the best weights, the test and the bundle take whole weights
        system.model = unsharded_copy(system.model)

    metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
    source = load_best_weights(cfg, trainer, system)  # test and export the best model, not the last
    if cfg.test and not cfg.trainer.get("fast_dev_run"):
        metrics.update(_test(trainer, system, datamodule))
    result = TrainResult(
        run_dir,
        metrics,
        getattr(system, "last_samples", []),
        global_step=trainer.global_step,
        system=system,
        weights=source,
        steps_per_second=(trainer.global_step - first_step) / seconds if seconds > 0 else 0.0,
        skipped_images=gather_skipped(datamodule.skipped_images) if cfg.data.get("bad_images") == "skip" else {},
    )
    if cfg.export_bundle and trainer.is_global_zero:
        result.bundle_dir = bundle_from_system(system, RunDir(run_dir).bundle)
    if trainer.is_global_zero:  # last: a run stopped before this point is not complete, and resumes
        RunDir(run_dir).save_result(result.global_step, source, metrics, result.bundle_dir is not None)
    _finish_wandb_run()
    return result


def _complete_run(cfg: DictConfig, run_dir: Path) -> TrainResult | None:
    """The saved result when ``cfg`` resumes the run in ``run_dir`` and that run is complete; None otherwise."""
    resumes_here = cfg.resume == "auto" or (cfg.resume and Path(cfg.resume).resolve() == run_dir.resolve())
    run = RunDir(run_dir)
    length = {key: cfg.trainer.get(key) for key in ("max_steps", "max_epochs")}
    line = run.completion(length) if resumes_here and not cfg.ckpt_path else None
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


def _checkpoint_step(ckpt_path: str) -> int:
    # read before the run starts: it rewrites last.ckpt
    return int(torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def _test(trainer: pl.Trainer, system: VisionSystem, datamodule: pl.LightningDataModule) -> dict[str, float]:
    """The test split's metrics for the weights ``system`` holds now."""
    try:
        rows = trainer.test(system, datamodule=datamodule, verbose=False)
    except SIGTERMException:  # not a finished run: it must not exit with status 0
        raise _preempted(trainer) from None
    return {k: float(v) for row in rows for k, v in row.items()}


def _preempted(trainer: pl.Trainer) -> Exception:
    return next(c for c in trainer.callbacks if isinstance(c, Preemption)).preempted()


def _resume_checkpoint(cfg: DictConfig) -> str | None:
    if cfg.ckpt_path:
        return str(cfg.ckpt_path)
    if cfg.resume == "auto":  # the run folder's own checkpoint when it has one: a fresh start otherwise
        last = RunDir(cfg.paths.output_dir).last_checkpoint
        found = f"continuing from {last} (step {_checkpoint_step(str(last))})" if last.is_file() else None
        log.info("resume=auto: %s", found or f"no {last}, starting afresh")
        return str(last) if last.is_file() else None
    if cfg.resume:
        return str(RunDir(cfg.resume).last_checkpoint)
    return None


@rank_zero_only
def _save_run_files(cfg: DictConfig, datamodule: pl.LightningDataModule, run_dir: Path) -> None:
    run = RunDir(run_dir)
    # A complete run trained further is no longer complete: the ranks Lightning starts during fit would
    # otherwise read its old result.json beside the new config (the new length) and stop at once.
    run.result.unlink(missing_ok=True)
    run.save_config(cfg)
    if getattr(datamodule, "vocab", None) is not None:
        datamodule.vocab.save(run.path / tokenizer_file_name(datamodule.vocab))


def _finish_wandb_run() -> None:
    """End the W&B run Lightning leaves open, which a sweep's next trial in this process would log into."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and getattr(wandb, "run", None) is not None:
        wandb.finish()


def should_compile(cfg: DictConfig) -> bool:
    """``compile=auto`` compiles on GPUs only: on CPUs eager is as fast (see docs/benchmarks.md); and not under
    ``trainer=fsdp``, whose sharded layers have not been tested compiled (``compile=true`` asks for it)."""
    if str(cfg.compile).lower() == "auto":
        return on_gpu(cfg) and not fully_sharded(cfg.trainer)
    return bool(cfg.compile)


def load_best_weights(cfg: DictConfig, trainer: pl.Trainer, system: VisionSystem) -> str:
    """Load the best checkpoint by ``head.monitor`` into ``system`` when ``weights=best`` and there is one;
    returns what the tested and exported weights are."""
    if cfg.get("weights", "best") != "best" or cfg.trainer.get("fast_dev_run"):
        return f"last (step {trainer.global_step})"
    monitoring = [c for c in trainer.checkpoint_callbacks if getattr(c, "monitor", None) == cfg.head.monitor]
    best = next((c for c in monitoring if c.best_model_path), None)
    if best is None or not Path(best.best_model_path).is_file():
        return f"last (step {trainer.global_step})"
    checkpoint = torch.load(best.best_model_path, map_location="cpu", weights_only=True)
    system.load_state_dict(checkpoint["state_dict"])
    score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    return f"best ({cfg.head.monitor} {score:.4f} at step {checkpoint['global_step']})"


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
