"""Callbacks that change the learning-rate schedule during a run: ``FreezeEncoder`` trains the head (or the
caption decoder) alone for the first epochs, then adds the encoder's param groups at the schedule's current
factor (Lightning's ``BaseFinetuning`` freezes, thaws and checkpoints them); ``TimeBudgetHorizon`` ends the
schedule at the deadline when ``trainer.max_time`` is what stops training."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning, Callback, Timer
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from vitattn.training.systems.base import WarmupCosine, add_param_groups, head_modules, schedule_all_groups

__all__ = ["FreezeEncoder", "TimeBudgetHorizon"]

log = logging.getLogger(__name__)


class FreezeEncoder(BaseFinetuning):
    """Freeze all but ``head_modules(model)`` until epoch ``unfreeze_at_epoch``; the encoder then joins with the
    groups it would have had from the start (``VisionSystem.param_groups``), not Lightning's one group."""

    def __init__(self, unfreeze_at_epoch: int) -> None:
        super().__init__()
        if unfreeze_at_epoch < 1:
            raise ValueError(f"unfreeze_at_epoch={unfreeze_at_epoch} must be 1 or more")
        self.unfreeze_at_epoch = unfreeze_at_epoch

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a test or validation run after training leaves the model as training left it
            super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.model)
        self.make_trainable(head_modules(pl_module.model))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)  # a resumed run: the saved param groups, thawed ones included
        for scheduler in _lambda_schedulers(trainer):
            schedule_all_groups(scheduler)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed in the middle of an epoch gets no on_train_epoch_start for it: thaw here as well.
        self.on_train_epoch_start(trainer, pl_module)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        model = pl_module.model
        if epoch < self.unfreeze_at_epoch or all(p.requires_grad for p in model.parameters()):
            return
        self.make_trainable(model)
        # A run resumed after the thaw has the encoder's groups already (restored in on_fit_start).
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in present]} for g in pl_module.param_groups()]
        scheduler = next(s for s in _lambda_schedulers(pl_module.trainer) if s.optimizer is optimizer)
        add_param_groups(scheduler, [g for g in groups if g["params"]])


def _lambda_schedulers(trainer: pl.Trainer) -> list[LambdaLR]:
    return [c.scheduler for c in trainer.lr_scheduler_configs if isinstance(c.scheduler, LambdaLR)]


class TimeBudgetHorizon(Callback):
    """Moves the schedule's horizon to the steps that fit in ``trainer.max_time``: ``steps done + time left x
    rate`` (the rate measured after ``skip_steps``, validation included; never past the step or epoch limit),
    every ``every_n_steps``; without ``max_time``, the step or epoch limit, set at the start."""

    def __init__(self, skip_steps: int = 5, every_n_steps: int = 10) -> None:
        self.skip_steps, self.every_n_steps = skip_steps, every_n_steps
        self._first_step = 0
        self._start: tuple[int, float] | None = None  # (step, elapsed seconds) where the measurement starts
        self._timer: Timer | None = None  # found once per fit, not per step
        self._schedule: WarmupCosine | None = None
        self._limit = math.inf
        self.estimates: list[tuple[int, int]] = []  # (step, horizon) each time it was set

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._first_step, self._start = trainer.global_step, None
        timer = next((c for c in trainer.callbacks if isinstance(c, Timer)), None)
        self._timer = timer if timer is not None and timer.time_remaining() is not None else None
        # the step at which max_steps or max_epochs ends training, or inf; it replaces a resumed schedule's horizon
        schedules = (s.lr_lambdas[0] for s in _lambda_schedulers(trainer) if isinstance(s.lr_lambdas[0], WarmupCosine))
        self._schedule, self._limit = next(schedules, None), float(trainer.estimated_stepping_batches)
        if self._schedule is not None and math.isfinite(self._limit):
            self._schedule.total_steps = int(self._limit)

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        timer, schedule = self._timer, self._schedule
        if timer is None or schedule is None:
            return
        step, elapsed = trainer.global_step, timer.time_elapsed("train")
        if self._start is None:
            if step - self._first_step >= self.skip_steps:
                self._start = (step, elapsed)
            return
        done, spent = step - self._start[0], elapsed - self._start[1]
        if done < 1 or spent <= 0 or done % self.every_n_steps:
            return
        left = max(0.0, timer.time_remaining("train"))
        horizon = min(self._limit, step + left * done / spent)
        horizon = int(trainer.strategy.broadcast(max(step + 1, math.floor(horizon))))
        if horizon != schedule.total_steps:
            schedule.total_steps = horizon
            self.estimates.append((step, horizon))
            if len(self.estimates) in (1, 10) or len(self.estimates) % 50 == 0:
                log.info("time budget: %d steps expected by the deadline (at step %d)", horizon, step)
