"""Counting the images left out of their batches because they could not be read (``data.bad_images=skip``)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl

__all__ = ["SkippedImages"]


class SkippedImages(pl.Callback):
    """Logs ``train/skipped_images``, ``val/skipped_images`` and ``test/skipped_images``: the images of the
    epoch's batches that could not be read, summed over the batches and the ranks.

    The DataModule takes each batch's skipped files off it before the batch reaches the model
    (``ImageDataModule.on_before_batch_transfer``, in the main process); this reads its count.
    """

    def _log(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        count = float(getattr(trainer.datamodule, "skipped_in_batch", 0))
        pl_module.log(
            f"{stage}/skipped_images",
            count,
            on_step=False,
            on_epoch=True,
            reduce_fx="sum",
            sync_dist=True,
            batch_size=1,
        )

    def on_train_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        self._log(trainer, pl_module, "train")

    def on_validation_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, pl_module, "val")

    def on_test_batch_start(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._log(trainer, pl_module, "test")
