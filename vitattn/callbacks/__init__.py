"""Lightning callbacks of a training run: a schedule that follows a time budget, EMA weights, an
encoder frozen for the first epochs, and a checkpoint when the run is preempted."""

from vitattn.callbacks.ema import EMA
from vitattn.callbacks.freeze import FreezeEncoder
from vitattn.callbacks.preemption import Preemption
from vitattn.callbacks.time_budget import TimeBudgetHorizon, schedule_of

__all__ = ["EMA", "FreezeEncoder", "Preemption", "TimeBudgetHorizon", "schedule_of"]
