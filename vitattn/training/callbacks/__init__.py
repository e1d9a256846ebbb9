"""Lightning callbacks of a training run."""

from vitattn.training.callbacks.batches import SampleKeys, SkippedImages
from vitattn.training.callbacks.ema import EMA
from vitattn.training.callbacks.freeze import FreezeEncoder
from vitattn.training.callbacks.pictures import ValidationPictures
from vitattn.training.callbacks.preemption import Preemption
from vitattn.training.callbacks.time_budget import TimeBudgetHorizon, schedule_of

__all__ = [
    "EMA",
    "FreezeEncoder",
    "Preemption",
    "SampleKeys",
    "SkippedImages",
    "TimeBudgetHorizon",
    "ValidationPictures",
    "schedule_of",
]
