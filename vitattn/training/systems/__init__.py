"""LightningModules: loss, metrics, optimizer and logging around the plain models."""

from vitattn.training.systems.base import VisionSystem
from vitattn.training.systems.caption import CaptionSystem
from vitattn.training.systems.classification import ClassificationSystem
from vitattn.training.systems.coca import CocaSystem

__all__ = [
    "CaptionSystem",
    "ClassificationSystem",
    "CocaSystem",
    "VisionSystem",
]
