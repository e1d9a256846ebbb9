"""AdamW with warmup + cosine decay, stepped every optimizer step."""

from __future__ import annotations

from timm.optim import param_groups_weight_decay
from torch import nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, LRScheduler, SequentialLR

__all__ = ["build_optimizer"]


def build_optimizer(
    model: nn.Module,
    total_steps: int,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int = 100,
    min_lr_ratio: float = 0.01,
) -> tuple[AdamW, LRScheduler]:
    """AdamW (no decay on norms, biases and embeddings) and a warmup-then-cosine schedule.

    Args:
        model: the parameters to optimise.
        total_steps: optimizer steps of the whole run (the schedule ends there).
        lr: peak learning rate.
        weight_decay: decoupled weight decay on matrices.
        betas: AdamW betas.
        warmup_steps: linear warmup from ``lr / 1000``; capped at a tenth of the run.
        min_lr_ratio: final learning rate / peak.

    Returns:
        ``(optimizer, scheduler)``; step the scheduler once per optimizer step.
    """
    groups = param_groups_weight_decay(
        model, weight_decay, no_weight_decay_list=("pos_embed", "cls_token", "token_embed")
    )
    optimizer = AdamW(groups, lr=lr, betas=tuple(betas))
    warmup = max(1, min(warmup_steps, total_steps // 10))
    scheduler = SequentialLR(
        optimizer,
        [
            LinearLR(optimizer, start_factor=1e-3, total_iters=warmup),
            CosineAnnealingLR(optimizer, T_max=max(1, total_steps - warmup), eta_min=lr * min_lr_ratio),
        ],
        milestones=[warmup],
    )
    return optimizer, scheduler
