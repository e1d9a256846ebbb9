"""A record of which samples each training step trained: one line a step, per rank, for every DataModule."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl

__all__ = ["SampleKeys"]


class SampleKeys(pl.Callback):
    """Appends ``<global step> <key> <key> ...`` to ``<folder>/keys.rank<R>.txt`` after each training step: the
    keys of the step's samples (the DataModule's ``last_keys``: image file names, image paths, scene numbers or
    shard keys; skipped samples included). For auditing a run's data order, e.g. that a resumed epoch trains
    each sample once:

        vitattn-train data=coco ... +callbacks.sample_keys._target_=vitattn.training.callbacks.SampleKeys
        +callbacks.sample_keys.folder=DIR
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
