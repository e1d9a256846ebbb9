"""Image-text retrieval recall from a similarity matrix: ranks of the first match, recall@k, median ranks."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RECALL", "retrieval_metrics", "retrieval_ranks"]

RECALL = (1, 5, 10)  # retrieval's recall@k


def retrieval_ranks(similarity: Tensor, text_image: Tensor) -> tuple[Tensor, Tensor]:
    """1-based ranks of the first match: (B,) of each image's best-placed own caption among all N texts, and (N,)
    of each text's image among all B images, from ``similarity`` (B, N) and ``text_image`` (N,), the image of each
    text. A tie with the match counts in the match's favour."""
    B, N = similarity.shape
    own = text_image[None, :] == torch.arange(B, device=similarity.device)[:, None]  # (B, N)
    best = similarity.masked_fill(~own, float("-inf")).amax(dim=1)  # (B,): an image's nearest own caption
    image_ranks = 1 + (similarity > best[:, None]).sum(dim=1)  # (B,)
    matched = similarity[text_image, torch.arange(N, device=similarity.device)]  # (N,)
    text_ranks = 1 + (similarity > matched[None, :]).sum(dim=0)  # (N,)
    return image_ranks, text_ranks


def retrieval_metrics(similarity: Tensor, text_image: Tensor) -> dict[str, float]:
    """``i2t_r1``, ``i2t_r5``, ``i2t_r10`` (the share of images with an own caption in the top k texts),
    ``t2i_r1`` ... (of texts with their image in the top k images), ``i2t_median_rank``, ``t2i_median_rank``
    (the median of ``retrieval_ranks``; the mean of the middle two for an even count)."""
    if (torch.bincount(text_image, minlength=len(similarity)) == 0).any():
        raise ValueError("every image needs at least one caption to be retrieved by")
    metrics: dict[str, float] = {}
    for way, ranks in zip(("i2t", "t2i"), retrieval_ranks(similarity, text_image)):
        for k in RECALL:
            metrics[f"{way}_r{k}"] = float((ranks <= k).float().mean())
        metrics[f"{way}_median_rank"] = float(ranks.double().quantile(0.5))
    return metrics
