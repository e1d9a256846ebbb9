"""Online pseudo-labels (FixMatch, FreeMatch): images without labels learned in the same step as the labelled batch.

Each step takes ``ratio`` x B unlabelled images, each as a weak view (the training transform) and a strong view (the
weak one with RandAugment and Cutout). The teacher (the model itself with dropout and drop-path off, or an EMA copy
of it) labels the weak view without gradient; where its confidence passes the threshold, the model learns that
label on the strong view: loss = λ · mean over all unlabelled images of mask · CE(strong logits, label)
(Sohn et al. 2020; USB's ``fixmatch.py``). FreeMatch (Wang et al. 2023) swaps the fixed threshold for a
self-adaptive one. docs/bootstrap.md#online-pseudo-labels.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import Dataset

from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.stream import image_member
from vitattn.inference import list_inputs
from vitattn.losses import soft_target_cross_entropy
from vitattn.training.bootstrap import BootstrapSettings, Pool

__all__ = [
    "METHODS",
    "FixedThreshold",
    "FreeMatchThreshold",
    "SemiSettings",
    "TeacherEma",
    "WeakStrong",
    "caption_token_probs",
    "labelling",
    "read_unlabelled",
    "unlabelled_caption_loss",
    "unlabelled_loss",
]

METHODS = ("none", "fixmatch", "freematch")


@dataclass(frozen=True)
class SemiSettings:
    """The ``semi`` config group: ``method`` labels ``images`` (a folder, a file list or shards) online; ``ratio``
    (μ) unlabelled images per labelled one in a step; ``threshold`` (τ; FreeMatch: its own, adaptive); ``weight``
    (λ); ``ema_decay`` (0: the model labels, as FixMatch; > 0: an EMA copy of it); ``start_step`` (labelled-only
    steps first); ``strong`` (timm's RandAugment of the strong view); ``soft`` (the teacher's probabilities as
    targets, not its argmax); ``momentum`` (FreeMatch's EMA of the confidences). Refusals name the key bare
    (``ratio=0 ...``); ``build`` names it in full."""

    method: str = "none"
    images: str | None = None
    ratio: int = 7
    threshold: float = 0.95
    weight: float = 1.0
    ema_decay: float = 0.0
    start_step: int = 0
    strong: str = "rand-m10-n2-mstd101-inc1"
    soft: bool = False
    momentum: float = 0.999

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is unknown; choose semi=none, semi=fixmatch or semi=freematch")
        if self.method == "none" and self.images is not None:
            raise ValueError(f"images={self.images} needs a method to label them: add semi=fixmatch (or freematch)")
        if self.method != "none" and self.images is None:
            raise ValueError(f"semi={self.method} labels images without labels: give images=POOL (a folder or list)")
        if not isinstance(self.ratio, int) or isinstance(self.ratio, bool) or self.ratio < 1:
            raise ValueError(f"ratio={self.ratio} must be a whole number of unlabelled images per labelled one, >= 1")
        if not 0.0 <= self.threshold <= 1.0:
            raise ValueError(f"threshold={self.threshold} must be a probability in [0, 1] (FixMatch: 0.95)")
        if self.weight < 0:
            raise ValueError(f"weight={self.weight} must be 0 or more (FixMatch: 1.0)")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay={self.ema_decay} must be in [0, 1): 0 labels with the model itself")
        if not isinstance(self.start_step, int) or self.start_step < 0:
            raise ValueError(f"start_step={self.start_step} must be a whole number of steps, 0 or more")
        if not str(self.strong).startswith("rand"):
            raise ValueError(f"strong={self.strong!r} must be a timm RandAugment string (rand-m10-n2-mstd101-inc1)")
        if not 0.0 < self.momentum < 1.0:
            raise ValueError(f"momentum={self.momentum} must be in (0, 1) (FreeMatch: 0.999)")

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> SemiSettings | None:
        """The settings of the ``semi`` node (plain values), or None for ``semi=none`` (after its checks)."""
        known = {f.name for f in fields(cls)}
        settings = cls(**{k: v for k, v in dict(node or {}).items() if k in known})
        return None if settings.method == "none" else settings

    @property
    def teacher_is_ema(self) -> bool:
        return self.ema_decay > 0


def read_unlabelled(images: str) -> Pool:
    """The images without labels of ``semi.images``, by the pool readers of ``bootstrap.images``: a folder or a file
    list (``list_inputs``), or WebDataset shards (each sample's image bytes, held in memory, named by its key)."""
    if not BootstrapSettings(images=images).shards:
        return Pool(list(list_inputs(images).paths))
    sources = []
    for url in expand_shards(str(images), "semi.images"):
        for sample in read_shard(url):
            name = image_member(sample)
            if name is not None:
                sources.append((sample["__key__"], sample[name]))
    return Pool(sources)


class WeakStrong(Dataset):
    """Each image of ``pool`` as ``{"weak", "strong"}``: two (3, height, width) uint8 views, drawn independently."""

    def __init__(self, pool: Pool, weak: Callable[[Any], Tensor], strong: Callable[[Any], Tensor]) -> None:
        self.pool, self.weak, self.strong = pool, weak, strong

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        image = self.pool.read(index)  # a PIL image, as captioning reads it
        return {"weak": self.weak(image), "strong": self.strong(image)}


@contextmanager
def labelling(model: nn.Module) -> Iterator[None]:
    """The labelling pass: ``model`` in eval mode (dropout and drop-path off), no gradient; its mode restored."""
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        model.train(was_training)


class TeacherEma:
    """An EMA copy of a model that labels the weak views (``semi.ema_decay`` > 0): after each optimizer step,
    teacher <- d * teacher + (1 - d) * model over the floating parameters and buffers. Not an ``nn.Module``: kept out
    of the system's state dict (so out of the ``ema`` callback's average and of the export), saved beside it."""

    def __init__(self, model: nn.Module, decay: float) -> None:
        self.module = copy.deepcopy(model).eval().requires_grad_(False)
        self.decay = decay

    @torch.no_grad()
    def update(self, model: nn.Module) -> None:
        ours = [*self.module.parameters(), *self.module.buffers()]
        theirs = [t.detach() for t in (*model.parameters(), *model.buffers())]
        floats = [i for i, t in enumerate(ours) if t.is_floating_point()]
        torch._foreach_lerp_([ours[i] for i in floats], [theirs[i] for i in floats], 1.0 - self.decay)

    def to(self, device: torch.device) -> TeacherEma:
        self.module.to(device)
        return self


class FixedThreshold(nn.Module):
    """FixMatch's mask: an image's pseudo-label counts where its largest probability is at least ``threshold``."""

    def __init__(self, threshold: float) -> None:
        super().__init__()
        self.threshold = threshold

    def forward(self, probs: Tensor, everyone: Tensor | None = None) -> Tensor:
        """(B,) bool mask of ``probs`` (B, K; a caption's confidence: (B, 1)); ``everyone``: unused here."""
        return probs.max(dim=-1).values >= self.threshold


class FreeMatchThreshold(nn.Module):
    """FreeMatch's self-adaptive threshold (USB's ``FreeMatchThresholingHook``): a global level ``time_p``, the EMA
    of the mean largest probability, scaled per class by ``p_model / max(p_model)``, the EMA of the mean probability
    of each class; both start at 1/K and move with ``momentum`` over every rank's batch before each mask. Buffers:
    in the checkpoint, so a resumed run continues them."""

    def __init__(self, num_classes: int, momentum: float = 0.999) -> None:
        super().__init__()
        self.momentum = momentum
        self.register_buffer("time_p", torch.tensor(1.0 / num_classes))
        self.register_buffer("p_model", torch.full((num_classes,), 1.0 / num_classes))

    @torch.no_grad()
    def update(self, probs: Tensor) -> None:
        """Move the levels towards ``probs`` (N, K), every rank's batch."""
        m = self.momentum
        self.time_p.mul_(m).add_((1 - m) * probs.max(dim=-1).values.mean())
        self.p_model.mul_(m).add_((1 - m) * probs.mean(dim=0))

    def thresholds(self) -> Tensor:
        """(K,) each class's threshold now."""
        return self.time_p * self.p_model / self.p_model.max()

    def forward(self, probs: Tensor, everyone: Tensor | None = None) -> Tensor:
        """(B,) bool mask of ``probs`` (B, K), after the update with ``everyone`` (N, K; None: ``probs``)."""
        self.update(probs if everyone is None else everyone)
        confidence, labels = probs.max(dim=-1)
        return confidence >= self.thresholds()[labels]


def unlabelled_loss(strong_logits: Tensor, probs: Tensor, mask: Tensor, soft: bool = False) -> Tensor:
    """The mean over all B unlabelled images of mask * CE(strong logits (B, K), target): the hard target argmax of
    the teacher's ``probs`` (B, K), or ``soft``: ``probs`` themselves. Masked images count in the mean as zeros."""
    logits = strong_logits.float()
    if soft:
        losses = soft_target_cross_entropy(logits, probs)  # (B,)
    else:
        losses = F.cross_entropy(logits, probs.argmax(dim=-1), reduction="none")  # (B,)
    return (losses * mask.float()).mean()


def caption_token_probs(logits: Tensor, generated: Tensor, ids: Any) -> Tensor:
    """(U, T') probability of each generated token (``<eos>`` included; 0 at padding) under the teacher-forced
    ``logits`` (U, T', V) over ``<bos>`` + ``generated`` (U, T'), the search's banned tokens masked (``ids``: the
    model's ``SpecialIds``) as greedy decoding masks them: the probabilities the greedy search drew them with."""
    banned = torch.tensor(ids.banned, device=logits.device)
    probs = logits.float().index_fill(-1, banned, float("-inf")).softmax(dim=-1)  # (U, T', V)
    chosen = probs.gather(-1, generated.unsqueeze(-1)).squeeze(-1)  # (U, T')
    return chosen.masked_fill(generated == ids.pad_id, 0.0)


def unlabelled_caption_loss(strong_logits: Tensor, generated: Tensor, mask: Tensor, pad_id: int) -> Tensor:
    """The mean over all U unlabelled images of mask * each pseudo-caption's mean token cross-entropy, teacher-forced
    on the strong view: ``strong_logits`` (U, T', V) over ``<bos>`` + ``generated`` (U, T', padded after ``<eos>``)."""
    losses = F.cross_entropy(strong_logits.float().transpose(1, 2), generated, reduction="none")  # (U, T')
    real = (generated != pad_id).float()
    per_caption = (losses * real).sum(dim=1) / real.sum(dim=1).clamp(min=1)  # (U,)
    return (per_caption * mask.float()).mean()
