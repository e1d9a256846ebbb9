"""Evaluate a trained model on a split: caption metrics, or top-1 / top-5 accuracy and a confusion matrix."""

from vitattn.training.evaluation.captions import evaluate_captions, read_predictions
from vitattn.training.evaluation.classification import evaluate_classification
from vitattn.training.evaluation.report import EvalReport, format_report, save_confusion_matrix, write_report

__all__ = [
    "EvalReport",
    "evaluate_captions",
    "evaluate_classification",
    "format_report",
    "read_predictions",
    "save_confusion_matrix",
    "write_report",
]
