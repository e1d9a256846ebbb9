"""An exponential moving average of the weights, validated, tested and exported in their place.

Lightning's ``WeightAveraging`` does the work (the averaged copy, swapping it in for validation,
checkpointing it, and leaving it in the model when training ends, so that the test run and the
exported bundle use it); this adds the warm-up that short runs on small data need: the decay grows
as ``(1 + n) / (10 + n)`` up to ``decay`` (timm's ``ModelEmaV3`` warm-up), so the average is not
dominated by the random initial weights.
"""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import WeightAveraging

__all__ = ["EMA"]


class _EmaWithWarmup:
    """``AveragedModel``'s ``avg_fn``: averaged <- d * averaged + (1 - d) * current, d warming up to ``decay``."""

    def __init__(self, decay: float) -> None:
        self.decay = decay

    def __call__(self, averaged: torch.Tensor, current: torch.Tensor, num_averaged: torch.Tensor | int) -> torch.Tensor:
        n = float(num_averaged)
        d = min(self.decay, (1.0 + n) / (10.0 + n))
        return averaged + (current - averaged) * (1.0 - d)


class EMA(WeightAveraging):
    """EMA of the parameters (and buffers), updated after every optimizer step.

    Args:
        decay: the final decay; the average spans about ``1 / (1 - decay)`` steps.
    """

    def __init__(self, decay: float = 0.999) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema.decay={decay} must be between 0 and 1 (e.g. 0.999)")
        super().__init__(use_buffers=True, avg_fn=_EmaWithWarmup(decay))
        self.decay = decay
