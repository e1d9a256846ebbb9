"""``vitattn-train`` whose rank 1 alone meets a NaN loss, or a batch of unreadable images, at one step; each rank
reports what it did.

    VITATTN_NAN_STEP=K VITATTN_RANK_REPORT=DIR python tests/helpers/ddp_nonfinite_train.py OVERRIDES...
    VITATTN_EMPTY_STEP=K VITATTN_RANK_REPORT=DIR python tests/helpers/ddp_nonfinite_train.py OVERRIDES...

With ``trainer=ddp`` Lightning starts this file again for rank 1, so both ranks run the patched classifier:
rank 1's images at step K become NaN, and so does its loss; or (``VITATTN_EMPTY_STEP``) its batch at step K
is None, as when ``data.bad_images=skip`` could read none of its images. When training ends each rank writes
``DIR/<rank>.pt``: its count of skipped batches, its optimizer's step counts and its weights. Used by
tests/training/test_nonfinite.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from vitattn.cli.train import main
from vitattn.training.systems import ClassificationSystem

_training_step = ClassificationSystem.training_step


def nan_on_rank_1(self: ClassificationSystem, batch: Any, batch_idx: int) -> Any:
    images, labels = batch
    if self.global_rank == 1 and self.global_step == int(os.environ.get("VITATTN_EMPTY_STEP", -1)):
        return _training_step(self, None, batch_idx)
    if self.global_rank == 1 and self.global_step == int(os.environ.get("VITATTN_NAN_STEP", -1)):
        images = images * float("nan")
    return _training_step(self, (images, labels), batch_idx)


def report(self: ClassificationSystem) -> None:
    optimizer = self.optimizers().optimizer
    torch.save(
        {
            "skipped": self.skipped_batches,
            "optimizer_steps": sorted({int(state["step"]) for state in optimizer.state.values()}),
            "weights": {k: v.detach().clone() for k, v in self.model.state_dict().items()},
        },
        Path(os.environ["VITATTN_RANK_REPORT"]) / f"{self.global_rank}.pt",
    )


if __name__ == "__main__":
    ClassificationSystem.training_step = nan_on_rank_1
    ClassificationSystem.on_train_end = report
    main()
