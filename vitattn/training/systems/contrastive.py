"""Contrastive losses between image and text embeddings, with every rank's embeddings as negatives.

Each rank's loss is over its own rows against all ranks' embeddings, gathered with gradients (open_clip's
``ClipLoss(local_loss=True, gather_with_grad=True)``), and is a mean over its own rows: the mean of the ranks'
losses, and the mean of their gradients that DDP and FSDP take, are then one process's loss and gradients over all
the ranks' rows together (docs/captioning.md#coca).

Dimension letters: B this rank's pairs, W ranks, E embedding width.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import Tensor

__all__ = [
    "LOSSES",
    "MAX_LOGIT_SCALE",
    "RETRIEVAL_MONITORS",
    "ZERO_SHOT_MONITOR",
    "check_contrastive",
    "clip_loss",
    "contrastive_loss",
    "contrastive_model_config",
    "gather_rows",
    "siglip_loss",
]

LOSSES = ("clip", "siglip")
MAX_LOGIT_SCALE = math.log(100)  # CLIP's cap on the learned log temperature
INIT_LOGIT_SCALE = {"clip": math.log(1 / 0.07), "siglip": math.log(10)}
RETRIEVAL_MONITORS = ("val/i2t_r1", "val/t2i_r1")  # what validation logs from ``RetrievalMetrics``
ZERO_SHOT_MONITOR = "val/zero_shot_top1"  # what validation logs with ``head.zero_shot.data_root``


def check_contrastive(loss: str, contrastive_weight: float, caption_weight: float) -> None:
    """Raise a one-line ``ValueError`` for an unknown loss or weights that are negative or both 0."""
    if loss not in LOSSES:
        raise ValueError(f"head.contrastive.loss={loss!r} is unknown; choose clip or siglip")
    for key, weight in (("contrastive_weight", contrastive_weight), ("caption_weight", caption_weight)):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"head.{key}={weight!r} must be a number of 0 or more")
    if contrastive_weight == caption_weight == 0:
        raise ValueError("head.contrastive_weight=0 and head.caption_weight=0 train nothing; set one above 0")


def contrastive_model_config(contrastive: dict[str, Any], pairs: int) -> dict[str, Any]:
    """``CocaCaptioner``'s keyword arguments from ``head.contrastive``: its sizes, and the logit scale and bias its
    loss starts from. SigLIP's bias ``auto``: -log(pairs - 1), ``pairs`` the images of a step on all ranks, where
    random embeddings (cosine 0) are at the loss's minimum (open_clip issue #650; open_clip's -10 suits 22,000)."""
    loss = contrastive["loss"]
    sizes = {k: contrastive[k] for k in ("embed_dim", "text_depth", "text_num_heads", "text_mlp_ratio")}
    bias = contrastive.get("init_logit_bias", "auto")
    if loss != "siglip":
        bias = None
    elif bias == "auto":
        bias = -math.log(max(pairs - 1, 1))
    return {**sizes, "init_logit_scale": INIT_LOGIT_SCALE[loss], "init_logit_bias": bias}


def gather_rows(x: Tensor) -> tuple[Tensor, int]:
    """(W·B, E) every rank's rows of (B, E) ``x`` in rank order, their gradients summed back to the rank that made
    them, and the index of this rank's first row; without a process group, ``x`` and 0."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return x, 0
    with warnings.catch_warnings():  # torch 2.14 deprecates it for a private module's; it still works on every backend
        warnings.simplefilter("ignore", FutureWarning)
        parts = dist_nn.all_gather(x.contiguous())
    return torch.cat(parts), dist.get_rank() * x.shape[0]


def clip_loss(image: Tensor, text: Tensor, logit_scale: Tensor) -> Tensor:
    """CLIP's InfoNCE over this rank's (B, E) pairs: the mean of the image->text and text->image cross-entropies."""
    all_image, first = gather_rows(image)
    all_text, _ = gather_rows(text)
    scale = logit_scale.clamp(max=MAX_LOGIT_SCALE).exp()
    labels = torch.arange(first, first + len(image), device=image.device)  # (B,): each pair's column
    per_image = scale * image @ all_text.T  # (B, W·B)
    per_text = scale * text @ all_image.T  # (B, W·B)
    return (F.cross_entropy(per_image, labels) + F.cross_entropy(per_text, labels)) / 2


def siglip_loss(image: Tensor, text: Tensor, logit_scale: Tensor, logit_bias: Tensor) -> Tensor:
    """SigLIP's sigmoid loss: each of this rank's B images against every text, a binary label each, summed over
    the texts and averaged over the images."""
    all_text, first = gather_rows(text)
    logits = logit_scale.clamp(max=MAX_LOGIT_SCALE).exp() * image @ all_text.T + logit_bias  # (B, W·B)
    positive = torch.arange(first, first + len(image), device=image.device)
    labels = 2 * F.one_hot(positive, logits.shape[1]).to(logits.dtype) - 1  # (B, W·B): +1 its own text, -1 others
    return -F.logsigmoid(labels * logits).sum() / len(image)


def contrastive_loss(loss: str, image: Tensor, text: Tensor, model: Any) -> Tensor:
    """The ``loss`` (``clip`` or ``siglip``) of (B, E) embeddings in fp32 at least, with ``model``'s scale and bias."""
    dtype = torch.promote_types(image.dtype, torch.float32)  # bf16 embeddings under autocast: fp32
    image, text = image.to(dtype), text.to(dtype)
    if loss == "siglip":
        return siglip_loss(image, text, model.logit_scale, model.logit_bias)
    return clip_loss(image, text, model.logit_scale)
