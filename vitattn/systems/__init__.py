"""LightningModules: loss, metrics, optimizer and logging around the plain models."""

from vitattn.systems.base import NonFiniteLossError, VisionSystem
from vitattn.systems.captioning import CaptionSystem, gather_predictions
from vitattn.systems.classification import ClassificationSystem

__all__ = ["CaptionSystem", "ClassificationSystem", "NonFiniteLossError", "VisionSystem", "gather_predictions"]
