"""Learning-rate schedules that end at the deadline when ``trainer.max_time`` is what stops training."""

from __future__ import annotations

import logging
import math
from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback, Timer

from vitattn.training.systems.base import WarmupCosine

__all__ = ["TimeBudgetHorizon", "schedule_of"]

log = logging.getLogger(__name__)


def schedule_of(trainer: pl.Trainer) -> WarmupCosine | None:
    """The ``WarmupCosine`` of the trainer's first scheduler, if it has one."""
    for config in trainer.lr_scheduler_configs:
        lambdas = getattr(config.scheduler, "lr_lambdas", [])
        if lambdas and isinstance(lambdas[0], WarmupCosine):
            return lambdas[0]
    return None


class TimeBudgetHorizon(Callback):
    """Moves the schedule's horizon to the number of steps that fit in ``trainer.max_time``.

    The step rate is measured over the run so far (validation included, the first ``skip_steps`` left out) and
    the horizon, ``steps done + time left x rate`` (never past the step or epoch limit), re-estimated every
    ``every_n_steps``. Without ``max_time`` it sets the horizon to the step or epoch limit at the start.
    """

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
        self._schedule, self._limit = schedule_of(trainer), float(trainer.estimated_stepping_batches)
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
