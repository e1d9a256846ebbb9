"""What each training step's batches held: the samples trained (``SampleKeys``), the unreadable images left
out of them (``SkippedImages``, ``data.bad_images=skip``), the unlabelled images' pseudo-labels (``PseudoLabels``)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

__all__ = ["PseudoLabels", "SampleKeys", "SkippedImages"]


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


class PseudoLabels(pl.Callback):
    """``semi=``: appends each step's pseudo-labels to ``<folder>/pseudo_labels.rank<R>.jsonl`` (``{"step", "key",
    "label", "confidence", "kept"}`` per unlabelled image: a class name or a caption, ``kept``: above the threshold),
    from which a bench computes their accuracy after the run; a resumed run appends, so a step after its checkpoint
    may appear twice (the later line counts). Classes: at each epoch's end logs, over every rank,
    ``semi/labelled/<class>`` (the share of the epoch's unlabelled images kept with that label: the histogram, where
    a collapse shows) and ``semi/kept/<class>`` (the share of the images labelled that class that passed)."""

    def __init__(self, folder: str | Path, class_names: Sequence[str] | None = None) -> None:
        self.folder, self.class_names = Path(folder), list(class_names or [])
        self.counts = torch.zeros(2, len(self.class_names), dtype=torch.float64)  # (labelled, kept) per class

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        pseudo, keys = getattr(pl_module, "last_pseudo", None), getattr(trainer.datamodule, "last_unlabelled_keys", [])
        if not pseudo:
            return
        confidence, kept = pseudo["confidence"].cpu(), pseudo["mask"].cpu()  # one read back
        pl_module.last_pseudo = {}
        if "tokens" in pseudo:  # captions
            names = pl_module.vocab.decode_batch(pseudo["tokens"].cpu())
        else:
            labels = pseudo["labels"].cpu()
            self.counts[0] += torch.bincount(labels, minlength=len(self.class_names)).double()
            self.counts[1] += torch.bincount(labels[kept], minlength=len(self.class_names)).double()
            names = [self.class_names[label] for label in labels.tolist()]
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.folder / f"pseudo_labels.rank{trainer.global_rank}.jsonl", "a", encoding="utf-8") as f:
            for key, label, c, k in zip(keys, names, confidence.tolist(), kept.tolist()):
                record = {"step": trainer.global_step, "key": key, "label": label, "confidence": c}
                f.write(json.dumps({**record, "kept": k}, ensure_ascii=False) + "\n")

    def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if not self.class_names:
            return
        counts = trainer.strategy.reduce(self.counts.to(pl_module.device, torch.float32), reduce_op="sum")
        self.counts.zero_()
        if not counts[0].sum() > 0:
            return
        labelled, kept = counts[0], counts[1]
        for i, name in enumerate(self.class_names):
            pl_module.log(f"semi/labelled/{name}", kept[i] / labelled.sum(), rank_zero_only=True)
            pl_module.log(f"semi/kept/{name}", kept[i] / labelled[i].clamp(min=1), rank_zero_only=True)
