"""Validate a caption checkpoint with Lightning and record what each rank logged.

    python tests/helpers/ddp_validate.py CKPT OUT_DIR DEVICES DATA_JSON

With DEVICES > 1 the run is DDP on the CPU (gloo): Lightning starts this file again once per extra
rank, and every rank writes ``OUT_DIR/rank<k>.json`` with its logged metrics and the image ids its
batches held. Used by tests/training/test_ddp_metrics.py, which also calls ``validate`` in-process.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from vitattn.training.datamodules import ShapesDataModule
from vitattn.training.systems import CaptionSystem


class SeenImages(pl.Callback):
    """The image ids of every validation batch this rank ran."""

    def __init__(self) -> None:
        self.ids: list[int] = []

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:  # noqa: ANN001
        self.ids += batch["image_ids"].tolist()


def validate(ckpt: str | Path, data: dict[str, Any], devices: int, out_dir: str | Path) -> dict[str, Any]:
    """``trainer.validate`` of the checkpoint's weights on ``ShapesDataModule(**data)``; this rank's record."""
    checkpoint = torch.load(ckpt, map_location="cpu", weights_only=True)
    system = CaptionSystem(**checkpoint["hyper_parameters"])
    system.load_state_dict(checkpoint["state_dict"])
    seen = SeenImages()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        precision="32-true",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[seen],
        default_root_dir=str(out_dir),
    )
    trainer.validate(system, datamodule=ShapesDataModule(**data), verbose=False)
    return {
        "rank": trainer.global_rank,
        "world_size": trainer.world_size,
        "image_ids": seen.ids,
        "metrics": {k: float(v) for k, v in trainer.callback_metrics.items()},
    }


if __name__ == "__main__":
    ckpt, out_dir, devices, data = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
    record = validate(ckpt, data, devices, out_dir)
    (out_dir / f"rank{record['rank']}.json").write_text(json.dumps(record))
