"""Lightning callbacks of a training run."""

from vitattn.training.callbacks.batches import PseudoLabels, SampleKeys, SkippedImages
from vitattn.training.callbacks.ema import EMA
from vitattn.training.callbacks.pictures import ValidationPictures
from vitattn.training.callbacks.preemption import Preemption
from vitattn.training.callbacks.schedule import FreezeEncoder, TimeBudgetHorizon

__all__ = [
    "EMA",
    "FreezeEncoder",
    "Preemption",
    "PseudoLabels",
    "SampleKeys",
    "SkippedImages",
    "TimeBudgetHorizon",
    "ValidationPictures",
]
