"""Counting the images left out of their batches because they could not be read (``data.bad_images=skip``)."""

from __future__ import annotations

import lightning.pytorch as pl

__all__ = ["SkippedImages"]


class SkippedImages(pl.Callback):
    """Logs ``train/skipped_images``, ``val/skipped_images`` and ``test/skipped_images`` at the end of each epoch:
    the images of the epoch's batches that could not be read, summed over the ranks. Idle unless the
    DataModule skips such images (``data.bad_images=skip``).

    The DataModule takes each batch's skipped files off it before the batch reaches the model
    (``ImageDataModule.on_before_batch_transfer``, in the main process) and counts them by stage; a
    batch with no readable image never reaches the batch hooks, so the count is read at the epoch's end.
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
