"""Caption metrics as the COCO caption toolkit computes them, offline and without Java; the toolkit itself
(``vitattn.metrics.toolkit``, METEOR included) when pycocoevalcap and Java are installed; ``CaptionMetrics``, the
same scores as a torchmetrics ``Metric`` (imported when first named: the inference path imports no torchmetrics)."""

from vitattn.metrics.caption import (
    SCORERS,
    CiderD,
    check_corpus,
    cider_d,
    compute_caption_metrics,
    corpus_bleu,
    distinct_share,
    exact_match,
    first_per_image,
    rouge_l,
    score_captions,
)
from vitattn.metrics.tokenize import coco_tokenize

__all__ = [
    "CaptionMetrics",
    "RetrievalMetrics",
    "CiderD",
    "SCORERS",
    "check_corpus",
    "cider_d",
    "coco_tokenize",
    "compute_caption_metrics",
    "corpus_bleu",
    "distinct_share",
    "exact_match",
    "first_per_image",
    "rouge_l",
    "score_captions",
]


def __getattr__(name: str):
    if name in ("CaptionMetrics", "RetrievalMetrics"):
        from vitattn.metrics import metric

        return getattr(metric, name)
    raise AttributeError(f"module 'vitattn.metrics' has no attribute {name!r}")
