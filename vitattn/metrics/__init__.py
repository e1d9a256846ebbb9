"""Caption metrics as the COCO caption toolkit computes them, offline and without Java."""

from vitattn.metrics.caption import compute_caption_metrics, cider_d, corpus_bleu, rouge_l
from vitattn.metrics.tokenize import coco_tokenize

__all__ = ["cider_d", "coco_tokenize", "compute_caption_metrics", "corpus_bleu", "rouge_l"]
