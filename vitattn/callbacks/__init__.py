"""Lightning callbacks of a training run: a schedule that follows a time budget, EMA weights, and an
encoder frozen for the first epochs."""

from vitattn.callbacks.ema import EMA
from vitattn.callbacks.freeze import FreezeEncoder
from vitattn.callbacks.time_budget import TimeBudgetHorizon, schedule_of

__all__ = ["EMA", "FreezeEncoder", "TimeBudgetHorizon", "schedule_of"]
