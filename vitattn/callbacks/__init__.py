"""Lightning callbacks of a training run: a schedule that follows a time budget, and EMA weights."""

from vitattn.callbacks.ema import EMA
from vitattn.callbacks.time_budget import TimeBudgetHorizon, schedule_of

__all__ = ["EMA", "TimeBudgetHorizon", "schedule_of"]
