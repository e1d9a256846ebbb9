"""AdamW with warmup + cosine decay, stepped every optimizer step, over a horizon that can move
(``TimeBudgetHorizon`` moves it under ``trainer.max_time``). Each parameter group has its own peak learning
rate (layer-wise decay, a head or decoder rate); one ``WarmupCosine`` factor multiplies them all.
"""

from __future__ import annotations

import math
from typing import Any

from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

__all__ = ["WarmupCosine", "add_param_groups", "build_optimizer", "head_modules", "param_groups", "schedule_all_groups"]

# Parameters without weight decay, wherever they sit (``encoder.pos_embed``, ``decoder.token_embed.weight``);
# norms and biases (one dimension) never get it either.
NO_WEIGHT_DECAY = ("pos_embed", "cls_token", "token_embed")


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """The full names of ``model``'s position embeddings, class tokens and token embeddings."""
    return {name for name, _ in model.named_parameters() if any(part in NO_WEIGHT_DECAY for part in name.split("."))}


AUTO_WARMUP_STEPS = 200  # optim.warmup_steps=auto: 200 steps, or a tenth of a shorter run


class WarmupCosine:
    """Learning-rate factor at an optimizer step: linear warmup from 1/1000, then cosine to ``min_lr_ratio``.

    A plain object (its ``__dict__`` is the scheduler's saved state): a resumed run continues the same curve.

    Args:
        total_steps: the horizon: steps at which the factor reaches ``min_lr_ratio``.
        warmup_steps: steps of linear warmup, at most a tenth of the horizon (``"auto"``: ``AUTO_WARMUP_STEPS``).
        min_lr_ratio: the final factor.
    """

    def __init__(self, total_steps: int, warmup_steps: int | str, min_lr_ratio: float) -> None:
        self.total_steps = max(1, int(total_steps))
        self.requested_warmup = AUTO_WARMUP_STEPS if warmup_steps == "auto" else int(warmup_steps)
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


def head_modules(model: nn.Module) -> list[nn.Module]:
    """What is trained at ``head_lr`` and never frozen: a captioner's decoder, or a classifier's head."""
    decoder = getattr(model, "decoder", None)
    return [decoder] if isinstance(decoder, nn.Module) else [model.head]


def param_groups(
    model: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    layer_decay: float | None = None,
    head_lr: float | None = None,
) -> list[dict[str, Any]]:
    """AdamW parameter groups ``[{"params", "lr", "weight_decay"}, ...]`` of the trainable parameters.

    Norms, biases and embeddings get no weight decay. With ``layer_decay`` (timm's ``param_groups_layer_decay``
    over ``model.group_matcher()``) layer ``i`` of ``L`` (the stem 0, block ``k`` ``k + 1``, the head or decoder
    ``L``) learns at ``lr * layer_decay ** (L - i)``; ``head_lr`` is the rate of ``head_modules(model)``.
    """
    no_decay = no_weight_decay_names(model)
    if layer_decay is None:
        groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_decay)
    else:
        groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=no_decay, layer_decay=layer_decay)
    groups = [{**g, "lr": lr * g.pop("lr_scale", 1.0)} for g in groups]
    if head_lr is None:
        return groups
    head = {id(p) for m in head_modules(model) for p in m.parameters()}
    split = []
    for group in groups:
        for in_head in (False, True):
            params = [p for p in group["params"] if (id(p) in head) == in_head]
            if params:
                split.append({**group, "params": params, "lr": head_lr if in_head else group["lr"]})
    return split


def build_optimizer(
    model: nn.Module,
    total_steps: int,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int | str = "auto",
    min_lr_ratio: float = 0.01,
    layer_decay: float | None = None,
    head_lr: float | None = None,
) -> tuple[AdamW, LambdaLR]:
    """AdamW over ``param_groups(model, lr, weight_decay, layer_decay, head_lr)`` and a ``WarmupCosine`` schedule.

    Args:
        model: the parameters to optimise (the trainable ones: a frozen encoder is added when it thaws).
        total_steps: optimizer steps of the whole run: the schedule's horizon.
        warmup_steps, min_lr_ratio: the schedule's, see ``WarmupCosine``.

    Returns:
        ``(optimizer, scheduler)``, the scheduler stepped once per optimizer step; its ``lr_lambdas[0]`` is the
        ``WarmupCosine`` every group shares.
    """
    groups = param_groups(model, lr, weight_decay, layer_decay, head_lr)
    optimizer = AdamW(groups, lr=lr, betas=tuple(betas))
    schedule = WarmupCosine(total_steps, warmup_steps, min_lr_ratio)
    return optimizer, LambdaLR(optimizer, [schedule] * len(optimizer.param_groups))


def add_param_groups(scheduler: LambdaLR, groups: list[dict[str, Any]]) -> None:
    """Add ``groups`` (peak rates, as ``param_groups`` gives them) to a running schedule's optimizer, at the
    schedule's current factor: parameters that join late (an encoder that thaws) follow the same curve."""
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in groups:
        scheduler.optimizer.add_param_group({**group, "initial_lr": group["lr"], "lr": group["lr"] * factor})
        scheduler.base_lrs.append(group["lr"])
    schedule_all_groups(scheduler)


def schedule_all_groups(scheduler: LambdaLR) -> None:
    """Give the shared schedule to param groups added after the scheduler was built (its saved state has
    one entry per group, so a resumed run needs this before the state is loaded)."""
    missing = len(scheduler.optimizer.param_groups) - len(scheduler.lr_lambdas)
    scheduler.lr_lambdas.extend([scheduler.lr_lambdas[0]] * missing)
