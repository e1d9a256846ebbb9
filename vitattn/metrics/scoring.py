"""Scoring a split's captions: each image once, the whole metric set, in one call (training and evaluation alike)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from vitattn.metrics.caption import compute_caption_metrics, distinct_share, exact_match

__all__ = ["SCORERS", "first_per_image", "score_captions"]

# vitattn-eval's scorer=: the built-in metrics alone, or the COCO caption toolkit's beside them (toolkit.py).
SCORERS = ("builtin", "coco")

Item = tuple[Any, str, list[str]]  # (image id, caption, references)


def first_per_image(items: Iterable[Item]) -> list[Item]:
    """The first ``(image_id, caption, references)`` of each image id, sorted by id (ints before strings)."""
    first: dict[Any, Item] = {}
    for item in items:
        first.setdefault(item[0], item)
    return [first[k] for k in sorted(first, key=lambda k: (str(type(k)), k))]


def score_captions(items: Iterable[Item], synthetic: bool = True) -> dict[str, float]:
    """BLEU-1..4, ROUGE-L, CIDEr-D, ``distinct`` and ``num_images`` of ``items``, each image once.

    Args:
        items: ``(image_id, caption, references)``; a repeated image id counts once (its first item).
        synthetic: the references list every correct caption, so ``exact_match`` is added.
    """
    items = first_per_image(items)
    captions = [caption for _, caption, _ in items]
    references = [refs for _, _, refs in items]
    metrics = compute_caption_metrics(captions, references)
    if synthetic:  # one right answer up to the reading direction: exact match is meaningful
        metrics["exact_match"] = exact_match(captions, references)
    metrics["distinct"] = distinct_share(captions)  # collapse alarm: near 0 = one caption for all
    metrics["num_images"] = len(items)
    return metrics
