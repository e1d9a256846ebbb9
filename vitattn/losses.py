"""The training losses, as open_clip's ``loss.py``: the cross-entropies of captions (``CaptionLoss``), of classes
(``classification_loss``) and of soft targets (``soft_target_cross_entropy``: mixup, a teacher's probabilities), SCST's
policy gradient (``scst_loss``), and the contrastive losses of image and text embeddings (``ClipLoss``,
``SigLipLoss``): every rank's embeddings as negatives, every reference of an image and every equal text positives.

Each rank gathers with gradients the ranks' embeddings it uses (SigLIP's: the texts), batches of any sizes
(``gather_rows``), and takes its share of the loss one process would take over all ranks' rows, so that DDP's and
FSDP's mean over ranks is that loss (``loss_over_ranks``: what is logged). The loss runs in fp32 at least with
autocast off; ``logit_scale`` is clamped to ``MAX_LOGIT_SCALE`` by training and inference. Design: docs/captioning.md.
Dimension letters: B this rank's images, N this rank's texts, I and N_all every rank's, W ranks, E embedding width,
T token positions, V vocabulary, K classes, S sampled captions.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.distributed.nn.functional as dist_nn
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "CONTRASTIVE_LOSSES",
    "INIT_LOGIT_SCALE",
    "MAX_LOGIT_SCALE",
    "CaptionLoss",
    "ClipLoss",
    "SigLipLoss",
    "classification_loss",
    "gather_rows",
    "loss_over_ranks",
    "positives",
    "rank_rows",
    "scst_loss",
    "soft_target_cross_entropy",
]

MAX_LOGIT_SCALE = math.log(100)  # CLIP's cap on the learned log temperature
INIT_LOGIT_SCALE = {"clip": math.log(1 / 0.07), "siglip": math.log(10)}


class CaptionLoss(nn.Module):
    """The teacher-forced cross-entropy of next-token logits, the padding (``pad_id``) ignored."""

    def __init__(self, pad_id: int) -> None:
        super().__init__()
        self.pad_id = pad_id

    def forward(self, logits: Tensor, tokens: Tensor, label_smoothing: float = 0.0) -> Tensor:
        """The mean cross-entropy of (N, T-1, V) ``logits`` in fp32 against the next tokens ``tokens[:, 1:]``
        ((N, T): bos ... eos pad)."""
        return F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(),  # (N·(T-1), V)
            tokens[:, 1:].reshape(-1),
            ignore_index=self.pad_id,
            label_smoothing=label_smoothing,
        )


def classification_loss(logits: Tensor, labels: Tensor, label_smoothing: float = 0.0) -> Tensor:
    """The mean cross-entropy in fp32 of (B, K) ``logits`` against ``labels``: class indices (B,), or class
    probabilities (B, K) (``bootstrap.soft``: a teacher's), smoothed by ``label_smoothing`` over all K classes."""
    return F.cross_entropy(logits.float(), labels, label_smoothing=label_smoothing)


def soft_target_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """(B,) cross-entropies ``-sum_k targets_k log softmax(logits)_k`` in fp32 of (B, K) ``logits`` against the
    distributions ``targets`` (B, K) taken as they are (timm's ``SoftTargetCrossEntropy``, not reduced): mixup's
    mixed, already smoothed labels, and a teacher's soft pseudo-labels."""
    return torch.sum(-targets * F.log_softmax(logits.float(), dim=-1), dim=-1)


def scst_loss(log_probs: Tensor, mask: Tensor, advantage: Tensor) -> Tensor:
    """``-sum(advantage * log p(token) * mask) / sum(mask)``, the reference ``RewardCriterion`` (Rennie et al. 2017),
    of (S, T) ``log_probs`` and ``mask`` (1 for generated tokens, ``<eos>`` included) and (S,) ``advantage`` (no
    gradient)."""
    mask = mask.to(log_probs.dtype)
    return -(advantage.detach()[:, None] * log_probs * mask).sum() / mask.sum().clamp(min=1)


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
    first image and text; the images themselves are gathered only by the loss that uses them (``ClipLoss``)."""
    image_rows = rank_rows(image)
    first_image = sum(image_rows[: dist.get_rank()]) if len(image_rows) > 1 else 0
    own = torch.arange(len(image), device=image.device) if text_image is None else text_image
    all_text, first_text = gather_rows(text)
    all_text_image, _ = gather_rows(own + first_image)  # (N,): each text's image among all ranks'
    all_ids = None if text_ids is None else gather_rows(text_ids)[0]
    return image_rows, all_text, positives(all_text_image, all_ids, sum(image_rows)), first_image, first_text


class _ContrastiveLoss(nn.Module):
    def forward(
        self,
        image: Tensor,
        text: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None = None,
        text_image: Tensor | None = None,
        text_ids: Tensor | None = None,
    ) -> Tensor:
        """This rank's share of the loss of its (B, E) images and (N, E) texts (``text_image`` (N,) the image of
        each, default text n of image n; ``text_ids`` (N, T) their tokens, one width on every rank: equal rows are
        positives of each other's images), ``logit_scale`` the log temperature, in fp32 at least with autocast off:
        under autocast a cast up is undone by the next matmul, and bf16 logits would reach the softmax."""
        dtype = torch.promote_types(image.dtype, torch.float32)
        with torch.autocast(image.device.type, enabled=False):
            image, text, scale = image.to(dtype), text.to(dtype), logit_scale.to(dtype)
            bias = None if logit_bias is None else logit_bias.to(dtype)
            return self._loss(image, text, scale, bias, text_image, text_ids)


class ClipLoss(_ContrastiveLoss):
    """CLIP's InfoNCE with every positive: the mean of the image->text cross-entropy, its target spread evenly over
    the image's positive texts, and the text->image one, over each text's positive images (``logit_bias``, when
    given, added to the logits as open_clip does)."""

    def _loss(
        self,
        image: Tensor,
        text: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None,
        text_image: Tensor | None,
        text_ids: Tensor | None,
    ) -> Tensor:
        image_rows, all_text, positive, first_image, first_text = _pairs(image, text, text_image, text_ids)
        all_image, _ = gather_rows(image, image_rows)
        scale, bias = logit_scale.exp(), 0 if logit_bias is None else logit_bias
        mine = positive[first_image : first_image + len(image)]  # (B, N_all)
        per_image = _soft_cross_entropy(scale * image @ all_text.T + bias, mine)  # (B, N_all) logits
        theirs = positive[:, first_text : first_text + len(text)].T  # (N, B_all)
        per_text = _soft_cross_entropy(scale * text @ all_image.T + bias, theirs)
        world = _world_size()
        return world * (per_image / len(all_image) + per_text / len(all_text)) / 2


def _soft_cross_entropy(logits: Tensor, positive: Tensor) -> Tensor:
    """The summed cross-entropies of (R, C) ``logits`` against targets spread evenly over each row's positives."""
    target = positive / positive.sum(dim=1, keepdim=True)  # (R, C): every row has one positive at least
    return -(target * logits.log_softmax(dim=1)).sum()


class SigLipLoss(_ContrastiveLoss):
    """SigLIP's sigmoid loss: each of this rank's images against every rank's texts, label +1 for each of its
    positive texts (as ``ClipLoss``) and -1 for the rest, summed over the texts and averaged over all ranks'
    images."""

    def _loss(
        self,
        image: Tensor,
        text: Tensor,
        logit_scale: Tensor,
        logit_bias: Tensor | None,
        text_image: Tensor | None,
        text_ids: Tensor | None,
    ) -> Tensor:
        _, all_text, positive, first_image, _ = _pairs(image, text, text_image, text_ids)
        logits = logit_scale.exp() * image @ all_text.T  # (B, N_all)
        logits = logits if logit_bias is None else logits + logit_bias
        labels = 2 * positive[first_image : first_image + len(image)].to(logits.dtype) - 1  # (B, N_all): +1 or -1
        return -F.logsigmoid(labels * logits).sum() * _world_size() / len(positive)


CONTRASTIVE_LOSSES = {"clip": ClipLoss, "siglip": SigLipLoss}  # head.contrastive.loss's choices


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
