"""What both systems share: the optimizer, its schedule, and the non-finite loss guard."""

from __future__ import annotations

import math
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from vitattn.errors import NonFiniteLossError
from vitattn.systems.optim import build_optimizer, param_groups

__all__ = ["UNKNOWN_HORIZON", "NonFiniteLossError", "VisionSystem"]

UNKNOWN_HORIZON = 10**9  # steps: a schedule with no step, epoch or time limit stays at its peak


class VisionSystem(pl.LightningModule):
    """Base LightningModule: AdamW + warmup/cosine, and what to do with a non-finite loss.

    Subclasses build ``self.model`` from plain-value hyperparameters (saved with
    ``save_hyperparameters``), so a checkpoint loads with ``torch.load(weights_only=True)``.

    Args:
        optim: keyword arguments of ``build_optimizer`` (lr, weight_decay, warmup_steps, ...).
        nonfinite: ``raise`` stops training naming the step; ``skip`` skips the batch and counts it.
    """

    model: torch.nn.Module

    def __init__(self, optim: dict[str, Any] | None = None, nonfinite: str = "raise") -> None:
        super().__init__()
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; choose 'raise' or 'skip'")
        self.optim = dict(optim or {})
        self.nonfinite = nonfinite
        self.skipped_batches = 0

    @staticmethod
    def example_images(vit: torch.nn.Module) -> Tensor:
        """One blank image of the size ``vit`` takes: the model summary's FLOPs are counted on it."""
        height, width = vit.patch_embed.img_size
        return torch.zeros(1, vit.patch_embed.proj.in_channels, height, width)  # (1, C, height, width)

    def guard(self, loss: Tensor) -> Tensor | None:
        """The loss, or None (batch skipped) / an error when it is not finite."""
        if torch.isfinite(loss):
            return loss
        message = f"non-finite training loss {loss.item()} at step {self.global_step} (epoch {self.current_epoch})"
        if self.nonfinite == "raise":
            raise NonFiniteLossError(
                message + "; the last good checkpoint is kept; set head.nonfinite=skip to skip such batches"
            )
        self.skipped_batches += 1
        rank_zero_warn(message + f"; batch skipped ({self.skipped_batches} so far)")
        self.log("train/skipped_batches", float(self.skipped_batches))
        return None

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's groups for the parameters trainable now (``optim.param_groups``): what a
        thawing encoder adds to the running optimizer."""
        keys = ("lr", "weight_decay", "layer_decay", "head_lr")
        return param_groups(self.model, **{k: v for k, v in self.optim.items() if k in keys})

    def configure_optimizers(self) -> dict[str, Any]:
        # The step or epoch limit, whichever ends training first; under a time budget alone the
        # horizon is unknown here and ``TimeBudgetHorizon`` sets it once the step rate is measured.
        limit = self.trainer.estimated_stepping_batches
        total = int(limit) if math.isfinite(limit) else UNKNOWN_HORIZON
        optimizer, scheduler = build_optimizer(self.model, total_steps=total, **self.optim)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
