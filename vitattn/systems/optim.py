"""AdamW with warmup + cosine decay, stepped every optimizer step, over a horizon that can move.

The horizon is the number of optimizer steps the run will take. It is fixed when ``max_steps`` or
``max_epochs`` ends training; under a ``max_time`` budget ``vitattn.callbacks.TimeBudgetHorizon``
re-estimates it from the measured step rate so that the learning rate reaches its floor at the deadline.
"""

from __future__ import annotations

import math

from timm.optim import param_groups_weight_decay
from torch import nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["WarmupCosine", "build_optimizer"]


class WarmupCosine:
    """Learning-rate factor at an optimizer step: linear warmup from 1/1000, then cosine to ``min_lr_ratio``.

    A plain object (its ``__dict__`` is the scheduler's saved state), so a resumed run continues the
    same curve, and ``total_steps`` may be moved while training.

    Args:
        total_steps: the horizon: steps at which the factor reaches ``min_lr_ratio``.
        warmup_steps: steps of linear warmup (capped at a tenth of the horizon).
        min_lr_ratio: the final factor.
    """

    def __init__(self, total_steps: int, warmup_steps: int, min_lr_ratio: float) -> None:
        self.total_steps = max(1, int(total_steps))
        self.requested_warmup = int(warmup_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used: at least 1 step, at most a tenth of the horizon."""
        return max(1, min(self.requested_warmup, self.total_steps // 10))

    def __call__(self, step: int) -> float:
        warmup = self.warmup_steps
        if step < warmup:
            return 1e-3 + (1.0 - 1e-3) * step / warmup
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(
    model: nn.Module,
    total_steps: int,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int = 100,
    min_lr_ratio: float = 0.01,
) -> tuple[AdamW, LambdaLR]:
    """AdamW (no decay on norms, biases and embeddings) and a warmup-then-cosine schedule.

    Args:
        model: the parameters to optimise.
        total_steps: optimizer steps of the whole run (the schedule ends there; ``WarmupCosine`` may move it).
        lr: peak learning rate.
        weight_decay: decoupled weight decay on matrices.
        betas: AdamW betas.
        warmup_steps: linear warmup from ``lr / 1000``; capped at a tenth of the run.
        min_lr_ratio: final learning rate / peak.

    Returns:
        ``(optimizer, scheduler)``; step the scheduler once per optimizer step; ``scheduler.lr_lambdas[0]``
        is the ``WarmupCosine``.
    """
    groups = param_groups_weight_decay(
        model, weight_decay, no_weight_decay_list=("pos_embed", "cls_token", "token_embed")
    )
    optimizer = AdamW(groups, lr=lr, betas=tuple(betas))
    schedule = WarmupCosine(total_steps, warmup_steps, min_lr_ratio)
    return optimizer, LambdaLR(optimizer, [schedule] * len(optimizer.param_groups))
