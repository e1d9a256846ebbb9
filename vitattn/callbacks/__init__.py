"""Lightning callbacks of a training run: a schedule that follows a time budget, EMA weights, an
encoder frozen for the first epochs, and pictures of every validation for TensorBoard and MLflow."""

from vitattn.callbacks.ema import EMA
from vitattn.callbacks.freeze import FreezeEncoder
from vitattn.callbacks.pictures import ValidationPictures
from vitattn.callbacks.time_budget import TimeBudgetHorizon, schedule_of

__all__ = ["EMA", "FreezeEncoder", "TimeBudgetHorizon", "ValidationPictures", "schedule_of"]
