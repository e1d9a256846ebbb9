"""Evaluate a trained model on a split: caption metrics; top-1 / top-5 accuracy and a confusion matrix (a trained
head or zero-shot by class name); image-text retrieval recall."""

from vitattn.evaluation.captions import evaluate_captions, evaluate_retrieval, read_predictions
from vitattn.evaluation.classification import evaluate_classification, evaluate_zero_shot
from vitattn.evaluation.report import EvalReport, format_report, save_confusion_matrix, write_report

__all__ = [
    "EvalReport",
    "evaluate_captions",
    "evaluate_classification",
    "evaluate_retrieval",
    "evaluate_zero_shot",
    "format_report",
    "read_predictions",
    "save_confusion_matrix",
    "write_report",
]
