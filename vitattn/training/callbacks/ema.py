"""An exponential moving average of the weights, validated, tested and exported in their place.

Lightning's ``WeightAveraging`` keeps, swaps in and checkpoints the average; this adds timm's ``ModelEmaV3``
warm-up, so that a short run's average is not dominated by the random initial weights, and its one
``torch._foreach_lerp_`` update, which reads nothing back.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import WeightAveraging
from torch.optim.swa_utils import AveragedModel

__all__ = ["EMA"]


class _WarmupEma(AveragedModel):
    """``AveragedModel`` whose update is averaged <- d * averaged + (1 - d) * current, with
    d = min(decay, (1 + n) / (10 + n)) after n updates; n is counted on the host, ``n_averaged`` follows it.
    """

    def __init__(self, model: torch.nn.Module, decay: float, device: torch.device | None = None) -> None:
        super().__init__(model, device=device, use_buffers=True)
        self.decay = decay
        self.num_averaged = 0

    @torch.no_grad()
    def update_parameters(self, model: torch.nn.Module) -> None:
        averaged = [*self.module.parameters(), *self.module.buffers()]
        current = [t.detach().to(a.device) for a, t in zip(averaged, [*model.parameters(), *model.buffers()])]
        if self.num_averaged == 0:  # the first update copies the weights
            torch._foreach_copy_(averaged, current)
        else:
            n = self.num_averaged
            weight = 1.0 - min(self.decay, (1.0 + n) / (10.0 + n))
            floats = [i for i, a in enumerate(averaged) if a.is_floating_point()]
            torch._foreach_lerp_([averaged[i] for i in floats], [current[i] for i in floats], weight)
            for a, c in zip(averaged, current):
                if not a.is_floating_point():  # a count or an index is copied, not averaged (as timm does)
                    a.copy_(c)
        self.num_averaged += 1
        self.n_averaged.fill_(self.num_averaged)

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        result = super().load_state_dict(state_dict, strict=strict, assign=assign)
        self.num_averaged = int(self.n_averaged)  # a resumed run continues the count
        return result


class EMA(WeightAveraging):
    """EMA of the parameters and buffers, updated after every optimizer step; the final ``decay`` spans about
    ``1 / (1 - decay)`` steps."""

    def __init__(self, decay: float = 0.999) -> None:
        if not 0.0 < decay < 1.0:
            raise ValueError(f"ema.decay={decay} must be between 0 and 1 (e.g. 0.999)")
        super().__init__(use_buffers=True)
        self.decay = decay

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # WeightAveraging's averaged copy, with the update above
            self._average_model = _WarmupEma(pl_module, self.decay, device=self._device or pl_module.device)
