"""What each training step's batches held: the samples trained (``SampleKeys``) and the unreadable images left
out of them (``SkippedImages``, ``data.bad_images=skip``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

__all__ = ["SampleKeys", "SkippedImages"]


class SampleKeys(pl.Callback):
    """Appends ``<global step> <key> <key> ...`` to ``<folder>/keys.rank<R>.txt`` after each training step: the
    DataModule's ``last_keys``, skipped samples included, for auditing a run's data order (docs/scaling.md).
    """

    def __init__(self, folder: str) -> None:
        self.folder = Path(folder)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        keys = getattr(trainer.datamodule, "last_keys", None)
        if not keys:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"keys.rank{trainer.global_rank}.txt", "a") as f:
            f.write(f"{trainer.global_step} {' '.join(keys)}\n")


class SkippedImages(pl.Callback):
    """Logs ``train/``, ``val/`` and ``test/skipped_images`` at the end of each epoch: the images that could not
    be read, summed over the ranks, as the DataModule counted them by stage (``data.bad_images=skip``).
    """

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str, name: str) -> None:
        counts = getattr(trainer.datamodule, "skipped_counts", None)
        if counts is None or trainer.sanity_checking or getattr(trainer.datamodule, "bad_images", "raise") != "skip":
            return
        count = float(counts.pop(stage, 0))
        pl_module.log(f"{name}/skipped_images", count, on_step=False, on_epoch=True, reduce_fx="sum", sync_dist=True)

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, "train", "train")

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, "validate", "val")

    def on_test_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._log(trainer, pl_module, "test", "test")
