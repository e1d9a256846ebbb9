"""The keep policy: which of a teacher's candidates (captions) or pseudo-labels (classes) the student trains on."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from vitattn.errors import ConfigError

__all__ = ["Keep"]


@dataclass(frozen=True)
class Keep:
    """Which candidates (or pseudo-labels) a pool image keeps, applied when they are read. Captions: those scoring at
    least ``min_score`` and at least the ``percentile``-th percentile of every score, then the image's ``top_k``
    best (BLIP-2 keeps 2). A candidate's score is its filter's, else the plain model's mean token log-probability.
    Classes: an image's one pseudo-label (its teacher's most probable class; ``top_k`` per image never bounds it)
    if its confidence is at least ``min_score``; ``percentile``: the same count for every class, (100 -
    percentile) % of the pool split evenly, each class's most confident (noisy student's balance)."""

    top_k: int | None = 2
    min_score: float | None = None
    percentile: float | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"bootstrap.keep.top_k={self.top_k} must be at least 1 (null: all)")
        if self.percentile is not None and not 0 <= self.percentile < 100:
            raise ConfigError(f"bootstrap.keep.percentile={self.percentile} must be in [0, 100) (null: off)")

    def captions(self, ranked: Sequence[Sequence[tuple[float | None, str]]]) -> list[list[str]]:
        """Each image's kept texts of its ``(score, text)`` candidates, best first; a null score is never kept."""
        scores = [s for image in ranked for s, _ in image if s is not None]
        floor = (
            float(torch.quantile(torch.tensor(scores, dtype=torch.float64), self.percentile / 100))
            if (self.percentile is not None and scores)
            else None
        )
        kept = []
        for image in ranked:
            good = [(s, t) for s, t in image if s is not None and self._above(s) and (floor is None or s >= floor)]
            good.sort(key=lambda st: -st[0])  # stable: ties keep the order drawn
            kept.append([t for _, t in good[: self.top_k]])
        return kept

    def classes(self, labels: Sequence[int], confidences: Sequence[float], num_classes: int) -> list[int]:
        """The kept samples of a pool whose image ``i`` has the pseudo-label ``labels[i]`` with ``confidences[i]``:
        image indices, each class's in name order; with ``percentile`` the same count n of every class, its most
        confident, a class with fewer than n repeating its own, best first (so an index may come twice)."""
        chosen: dict[int, list[int]] = defaultdict(list)
        for i, (label, confidence) in enumerate(zip(labels, confidences)):
            if self._above(confidence):
                chosen[label].append(i)
        per_class = self.per_class(len(labels), num_classes)
        kept = []
        for label in sorted(chosen):
            best = sorted(chosen[label], key=lambda i: -confidences[i])  # stable: ties keep the pool's order
            if per_class is not None:
                best = [best[i % len(best)] for i in range(per_class)]
            kept += sorted(best)
        return kept

    def per_class(self, pool_images: int, num_classes: int) -> int | None:
        """``percentile``'s count of every class: (100 - percentile) % of the pool, split evenly; None without it."""
        if self.percentile is None or not num_classes:
            return None
        return max(1, round((100 - self.percentile) / 100 * pool_images / num_classes))

    def _above(self, score: float) -> bool:
        return self.min_score is None or score >= self.min_score
