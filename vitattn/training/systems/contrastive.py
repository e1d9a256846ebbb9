"""Contrastive losses between image and text embeddings, with every rank's embeddings as negatives and every
reference of an image, and every equal text, as its positives.

Each rank gathers the ranks' embeddings it uses with gradients (open_clip's ``ClipLoss(local_loss=True,
gather_with_grad=True)``; SigLIP's: the texts), batches of any sizes (``gather_rows``), and takes its share of the
loss one process would take over all ranks' rows, so that DDP's and FSDP's mean over ranks is that loss whatever
each rank's batch size (``loss_over_ranks``: what is logged). The loss runs in fp32 at least with autocast off;
``logit_scale`` is not capped here (the system clamps it after each step). Design: docs/captioning.md#coca.

Dimension letters: B this rank's images, N this rank's texts, I and N_all every rank's, W ranks, E embedding width,
T token positions.
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
    "loss_over_ranks",
    "positives",
    "rank_rows",
    "siglip_loss",
]

LOSSES = ("clip", "siglip")
MAX_LOGIT_SCALE = math.log(100)  # CLIP's cap on the learned log temperature, clamped in after each step
INIT_LOGIT_SCALE = {"clip": math.log(1 / 0.07), "siglip": math.log(10)}
RETRIEVAL_MONITORS = ("val/i2t_r1", "val/t2i_r1")  # what validation logs from ``RetrievalMetrics``
ZERO_SHOT_MONITOR = "val/zero_shot_top1"  # what validation logs with ``head.zero_shot.data_root``


def check_contrastive(loss: str, contrastive_weight: float, caption_weight: float, ramp_steps: int = 0) -> None:
    """Raise a one-line ``ValueError`` for an unknown loss, weights that are negative or both 0, or a ramp that is
    not a whole number of steps."""
    if loss not in LOSSES:
        raise ValueError(f"head.contrastive.loss={loss!r} is unknown; choose clip or siglip")
    for key, weight in (("contrastive_weight", contrastive_weight), ("caption_weight", caption_weight)):
        if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
            raise ValueError(f"head.{key}={weight!r} must be a number of 0 or more")
    if contrastive_weight == caption_weight == 0:
        raise ValueError("head.contrastive_weight=0 and head.caption_weight=0 train nothing; set one above 0")
    if isinstance(ramp_steps, bool) or not isinstance(ramp_steps, int) or ramp_steps < 0:
        raise ValueError(f"head.contrastive_ramp_steps={ramp_steps!r} must be a whole number of steps, 0 or more")


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


def rank_rows(x: Tensor) -> list[int]:
    """Every rank's number of rows of ``x`` (R, ...), in rank order; ``[R]`` without a process group."""
    if _world_size() == 1:
        return [len(x)]
    rows = [torch.zeros(1, dtype=torch.long, device=x.device) for _ in range(_world_size())]
    dist.all_gather(rows, torch.tensor([len(x)], device=x.device))
    return torch.cat(rows).tolist()


def gather_rows(x: Tensor, rows: list[int] | None = None) -> tuple[Tensor, int]:
    """Every rank's rows of ``x`` (R, ...), R this rank's own and the rest of the shape the same on every rank, in
    rank order, and the index of this rank's first row; without a process group, ``x`` and 0. The ranks may hold
    different numbers of rows (``rows``, ``rank_rows``' if known): each pads its own to the largest, all are
    gathered, and each part is cut back to its rows. A float ``x`` that needs a gradient is gathered with one, each
    row's gradients summed back to the rank that made it."""
    rows = rank_rows(x) if rows is None else rows  # (W,) every rank's R
    if len(rows) == 1:
        return x, 0
    padded = torch.cat([x, x.new_zeros(max(rows) - len(x), *x.shape[1:])])  # (max R, ...)
    if x.requires_grad:
        with warnings.catch_warnings():  # torch 2.14 deprecates it for a private module's; it works on every backend
            warnings.simplefilter("ignore", FutureWarning)
            parts = dist_nn.all_gather(padded)
    else:
        parts = [torch.empty_like(padded) for _ in rows]
        dist.all_gather(parts, padded)
    return torch.cat([part[:n] for part, n in zip(parts, rows)]), sum(rows[: dist.get_rank()])


def positives(text_image: Tensor, text_ids: Tensor | None, images: int) -> Tensor:
    """(I, N) True where text n is a positive of image i: one of i's own texts (``text_image`` (N,) the image of
    each), or a text of the same token ids (``text_ids`` (N, T), rows compared whole; None: every text distinct)."""
    if text_ids is None:
        group = torch.arange(len(text_image), device=text_image.device)  # (N,)
    else:
        group = torch.unique(text_ids, dim=0, return_inverse=True)[1]  # (N,): one id per distinct text
    has = torch.zeros(images, len(group), dtype=torch.bool, device=group.device)  # (I, groups)
    has[text_image, group] = True
    return has[:, group]  # (I, N)


def _pairs(
    image: Tensor, text: Tensor, text_image: Tensor | None, text_ids: Tensor | None
) -> tuple[list[int], Tensor, Tensor, int, int]:
    """Every rank's number of images, every rank's texts, the (I, N) positives over them all, and this rank's
    first image and text; the images themselves are gathered only by the loss that uses them (``clip_loss``)."""
    image_rows = rank_rows(image)
    first_image = sum(image_rows[: dist.get_rank()]) if len(image_rows) > 1 else 0
    own = torch.arange(len(image), device=image.device) if text_image is None else text_image
    all_text, first_text = gather_rows(text)
    all_text_image, _ = gather_rows(own + first_image)  # (N,): each text's image among all ranks'
    all_ids = None if text_ids is None else gather_rows(text_ids)[0]
    return image_rows, all_text, positives(all_text_image, all_ids, sum(image_rows)), first_image, first_text


def clip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    text_image: Tensor | None = None,
    text_ids: Tensor | None = None,
) -> Tensor:
    """CLIP's InfoNCE with every positive, over this rank's (B, E) images and (N, E) texts (``text_image`` (N,)
    the image of each, default text n of image n; ``text_ids`` (N, T) their tokens, equal rows positives of each
    other's images): the mean of the image->text cross-entropy, its target spread evenly over the image's positive
    texts, and the text->image one, over each text's positive images; this rank's share, as the module says."""
    image_rows, all_text, positive, first_image, first_text = _pairs(image, text, text_image, text_ids)
    all_image, _ = gather_rows(image, image_rows)
    scale = logit_scale.exp()
    mine = positive[first_image : first_image + len(image)]  # (B, N_all)
    per_image = _soft_cross_entropy(scale * image @ all_text.T, mine)  # (B, N_all) logits
    theirs = positive[:, first_text : first_text + len(text)].T  # (N, B_all)
    per_text = _soft_cross_entropy(scale * text @ all_image.T, theirs)
    world = _world_size()
    return world * (per_image / len(all_image) + per_text / len(all_text)) / 2


def _soft_cross_entropy(logits: Tensor, positive: Tensor) -> Tensor:
    """The summed cross-entropies of (R, C) ``logits`` against targets spread evenly over each row's positives."""
    target = positive / positive.sum(dim=1, keepdim=True)  # (R, C): every row has one positive at least
    return -(target * logits.log_softmax(dim=1)).sum()


def siglip_loss(
    image: Tensor,
    text: Tensor,
    logit_scale: Tensor,
    logit_bias: Tensor,
    text_image: Tensor | None = None,
    text_ids: Tensor | None = None,
) -> Tensor:
    """SigLIP's sigmoid loss: each of this rank's (B, E) images against every rank's texts, label +1 for each of
    its positive texts (as ``clip_loss``) and -1 for the rest, summed over the texts and averaged over all ranks'
    images; this rank's share, as the module says."""
    _, all_text, positive, first_image, _ = _pairs(image, text, text_image, text_ids)
    logits = logit_scale.exp() * image @ all_text.T + logit_bias  # (B, N_all)
    labels = 2 * positive[first_image : first_image + len(image)].to(logits.dtype) - 1  # (B, N_all): +1 or -1
    return -F.logsigmoid(labels * logits).sum() * _world_size() / len(positive)


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def loss_over_ranks(share: Tensor) -> Tensor:
    """The loss one process takes over every rank's rows, from this rank's ``share`` (detached): the mean of the
    ranks' shares, as DDP's gradient is; ``share`` itself without a process group. What to log."""
    share = share.detach()
    if _world_size() == 1:
        return share
    total = share.clone()
    dist.all_reduce(total)
    return total / _world_size()


def contrastive_loss(
    loss: str, image: Tensor, text: Tensor, model: Any, text_image: Tensor | None = None, text_ids: Tensor | None = None
) -> Tensor:
    """The ``loss`` (``clip`` or ``siglip``) of (B, E) image and (N, E) text embeddings (``text_image``,
    ``text_ids`` as ``clip_loss``'s), with ``model``'s scale and bias, in fp32 at least with autocast off: under
    autocast a cast up is undone by the next matmul, and bf16 logits would reach the softmax."""
    dtype = torch.promote_types(image.dtype, torch.float32)
    with torch.autocast(image.device.type, enabled=False):
        image, text, scale = image.to(dtype), text.to(dtype), model.logit_scale.to(dtype)
        if text_ids is not None:  # one width on every rank, padded as the batch is, so equal texts have equal rows
            text_ids = F.pad(text_ids, (0, model.max_len - text_ids.shape[1]), value=model.decoder.pad_id)
        if loss == "siglip":
            return siglip_loss(image, text, scale, model.logit_bias.to(dtype), text_image, text_ids)
        return clip_loss(image, text, scale, text_image, text_ids)
