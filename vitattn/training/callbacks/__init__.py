"""Lightning callbacks of a training run: a schedule that follows a time budget, EMA weights, an
encoder frozen for the first epochs, the count of unreadable images skipped, pictures of every
validation for TensorBoard and MLflow, a checkpoint when the run is preempted, and a record of the samples
each step trained."""

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
