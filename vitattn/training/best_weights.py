"""``weights=best``: the weights a run tests and exports are those of its best checkpoint by ``head.monitor``."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import torch
from omegaconf import DictConfig

from vitattn.training.systems import VisionSystem

__all__ = ["load_best_weights"]


def load_best_weights(cfg: DictConfig, trainer: pl.Trainer, system: VisionSystem) -> str:
    """Load the best checkpoint by ``head.monitor`` into ``system`` when ``weights=best`` and there is one;
    returns what the tested and exported weights are."""
    if cfg.get("weights", "best") != "best" or cfg.trainer.get("fast_dev_run"):
        return f"last (step {trainer.global_step})"
    best = next(
        (
            c
            for c in trainer.checkpoint_callbacks
            if getattr(c, "monitor", None) == cfg.head.monitor and c.best_model_path
        ),
        None,
    )
    if best is None or not Path(best.best_model_path).is_file():
        return f"last (step {trainer.global_step})"
    checkpoint = torch.load(best.best_model_path, map_location="cpu", weights_only=True)
    system.load_state_dict(checkpoint["state_dict"])
    score = float(best.best_model_score) if best.best_model_score is not None else float("nan")
    return f"best ({cfg.head.monitor} {score:.4f} at step {checkpoint['global_step']})"
