"""Image-text retrieval recall from a similarity matrix: ranks of the first match, recall@k, median ranks.

A tie is no hit: tied candidates are taken in a random order, and a query's rank and recall@k are their expected
values under that order, so all-equal similarities score chance and distinct ones score as a plain sort.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RECALL", "retrieval_metrics", "retrieval_ranks"]

RECALL = (1, 5, 10)  # retrieval's recall@k


def _rank_spans(similarity: Tensor, text_image: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
    """For each way (image->text, text->image) and query: (above, tied, own), the candidates scoring strictly
    higher than the query's best match, those scoring equal to it (own matches included), and the own matches
    among those tied (an image's captions; a text's one image)."""
    B, N = similarity.shape
    own = text_image[None, :] == torch.arange(B, device=similarity.device)[:, None]  # (B, N)
    best = similarity.masked_fill(~own, float("-inf")).amax(dim=1, keepdim=True)  # (B, 1): nearest own caption
    image_spans = (
        (similarity > best).sum(dim=1),  # (B,)
        (similarity == best).sum(dim=1),  # (B,)
        (own & (similarity == best)).sum(dim=1),  # (B,)
    )
    matched = similarity[text_image, torch.arange(N, device=similarity.device)][None, :]  # (1, N)
    tied = (similarity == matched).sum(dim=0)  # (N,)
    text_spans = ((similarity > matched).sum(dim=0), tied, torch.ones_like(tied))
    return image_spans, text_spans


def retrieval_ranks(similarity: Tensor, text_image: Tensor) -> tuple[Tensor, Tensor]:
    """Expected 1-based ranks of the first match: (B,) of each image's best-placed own caption among all N texts,
    and (N,) of each text's image among all B images, from ``similarity`` (B, N) and ``text_image`` (N,), the image
    of each text. Tied candidates are ordered at random: a query with ``above`` candidates scoring higher and
    ``tied`` scoring equal to its best match, ``own`` of them its matches, ranks ``above + (tied + 1) / (own + 1)``
    on average (the first of ``own`` marked among ``tied`` shuffled), and exactly ``above + 1`` without a tie."""
    return tuple(_expected_rank(*spans) for spans in _rank_spans(similarity, text_image))


def _expected_rank(above: Tensor, tied: Tensor, own: Tensor) -> Tensor:
    return above + (tied + 1).double() / (own + 1)  # (Q,) float64


def _recall(above: Tensor, tied: Tensor, own: Tensor, k: int) -> Tensor:
    """(Q,) the probability that a match is in the top ``k`` when the ``tied`` candidates are shuffled: one minus
    the chance that the ``j = k - above`` (clipped to [0, tied]) places left hold none of the ``own`` matches,
    C(tied - j, own) / C(tied, own) as a product of ``own`` ratios, exact (1 or 0) without a tie."""
    j = (k - above).clamp(min=0).minimum(tied).double()  # (Q,)
    missed = torch.ones_like(j)
    for t in range(int(own.max())):
        ratio = ((tied - j - t).clamp(min=0) / (tied - t).clamp(min=1)).double()
        missed = torch.where(t < own, missed * ratio, missed)
    return 1 - missed


def retrieval_metrics(similarity: Tensor, text_image: Tensor) -> dict[str, float]:
    """``i2t_r1``, ``i2t_r5``, ``i2t_r10`` (the expected share of images with an own caption in the top k texts),
    ``t2i_r1`` ... (of texts with their image in the top k images), ``i2t_median_rank``, ``t2i_median_rank``
    (the median of ``retrieval_ranks``; the mean of the middle two for an even count). Ties are shuffled
    (``retrieval_ranks``): with all similarities equal, i2t R@k is an image's chance that one of its captions is
    among k texts drawn at random, t2i R@k is k / B."""
    if (torch.bincount(text_image, minlength=len(similarity)) == 0).any():
        raise ValueError("every image needs at least one caption to be retrieved by")
    metrics: dict[str, float] = {}
    for way, spans in zip(("i2t", "t2i"), _rank_spans(similarity, text_image)):
        for k in RECALL:
            metrics[f"{way}_r{k}"] = float(_recall(*spans, k).mean())
        metrics[f"{way}_median_rank"] = float(_expected_rank(*spans).quantile(0.5))
    return metrics
