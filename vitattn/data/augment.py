"""Training augmentation of image files, sized to the image and safe for what captions say.

Classification: a random-resized crop whose smallest scale suits the image size (small images get
mild crops: cutting 92 % of a 32 px image rarely leaves the object), a horizontal flip, optional
colour jitter, and optional RandAugment (timm), TrivialAugment or AugMix (timm); mixup / cutmix are
batch-level and live in the classification system (``head.mixup``, ``head.cutmix``). Every step runs on the PIL
image; the transforms end in a uint8 tensor, normalised with the batch on the device
(``ImageDataModule.on_after_batch_transfer``), so the mixing still sees normalised images.

Captions: nothing that changes what a caption states. The crop is milder (none up to 64 px, where half
the image is often what the caption names; at least half the image from 224 px), an image is flipped only
when none of its captions says ``left`` or ``right``, and colour-jittered only when none names a
colour (``CaptionAugment``); both are off by default and switched on with ``augment.hflip`` and
``augment.color_jitter``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import torch
from PIL import Image
from timm.data.auto_augment import augment_and_mix_transform, rand_augment_transform
from torchvision import transforms as T

__all__ = ["CAPTION_CROP_SCALE", "Augment", "CaptionAugment", "auto_min_scale", "classification_train_transform"]

# Captions: BLIP's recipe crops at least half of a 224-384 px photo; a small image is not cropped at all:
# half of a 32 px emoji loses the skin tone, the flag's emblem or the hair that its name is about.
CAPTION_CROP_SCALE = "auto_caption"
CROPS = ("resized", "pad")
LEFT_RIGHT = frozenset({"left", "right", "leftmost", "rightmost"})
COLOURS = frozenset(
    "red orange yellow green blue purple violet pink brown black white gray grey silver gold golden beige "
    "tan maroon navy teal turquoise cyan magenta blond blonde".split()
)
_WORD = re.compile(r"[a-z]+")


def auto_min_scale(img_size: int, captions: bool = False) -> float:
    """The smallest random-resized-crop scale for ``img_size``. Classification: 0.5 up to 64 px, timm's ImageNet
    0.08 from 224 px. Captions: 1 (no crop) up to 64 px, BLIP's 0.5 from 224 px. Linear in between."""
    small, large = (1.0, 0.5) if captions else (0.5, 0.08)
    if img_size <= 64:
        return small
    if img_size >= 224:
        return large
    return small + (large - small) * (img_size - 64) / (224 - 64)


@dataclass
class Augment:
    """What training augmentation does (``data.augment.*`` in the configs).

    Attributes:
        enabled: off: training images get the evaluation transform.
        scale: random-resized-crop area range ``[min, max]``; ``auto``: ``[auto_min_scale(img_size), 1]``;
            ``auto_caption``: the captions' milder rule (the default of the caption data).
        ratio: crop aspect-ratio range.
        crop: ``resized`` (a random-resized crop of ``scale`` and ``ratio``) or ``pad`` (pad each side by an
            eighth of the image, mirrored, and cut a random image-sized window: a shift without resampling,
            the CIFAR recipe; ``scale`` and ``ratio`` are not used).
        hflip: probability of a horizontal flip.
        color_jitter: brightness / contrast / saturation jitter strength (0 = off).
        auto_augment: ``rand-m9-mstd0.5-inc1`` (timm RandAugment), ``trivialaugment`` (torchvision),
            ``augmix-m5-w3`` (timm AugMix), or None.
    """

    enabled: bool = True
    scale: Any = "auto"
    ratio: Sequence[float] = (3 / 4, 4 / 3)
    crop: str = "resized"
    hflip: float = 0.5
    color_jitter: float = 0.0
    auto_augment: str | None = None

    def __post_init__(self) -> None:
        if self.crop not in CROPS:
            raise ValueError(f"data.augment.crop={self.crop!r} is unknown; use one of {list(CROPS)}")

    @classmethod
    def from_config(cls, value: Any, **defaults: Any) -> Augment:
        """From ``True`` / ``False`` or a mapping of the attributes (unknown keys are refused)."""
        if isinstance(value, bool) or value is None:
            return cls(enabled=bool(value), **defaults)
        if not isinstance(value, Mapping):
            raise ValueError(
                f"data.augment={value!r} must be true, false or a mapping of {[f.name for f in fields(cls)]}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"data.augment has unknown keys {unknown}; known: {sorted(known)}")
        return cls(**{**defaults, **dict(value)})

    def crop_scale(self, img_size: int) -> tuple[float, float]:
        """The crop scale range for ``img_size``."""
        if self.scale in ("auto", "auto_caption") or self.scale is None:
            return (auto_min_scale(img_size, captions=self.scale == "auto_caption"), 1.0)
        low, high = (float(x) for x in self.scale)
        if not 0.0 < low <= high <= 1.0:
            raise ValueError(f"data.augment.scale={list(self.scale)} must satisfy 0 < min <= max <= 1")
        return (low, high)


def _auto_augment(name: str, img_size: int, mean: Sequence[float]) -> Callable[[Image.Image], Image.Image]:
    hparams = {"translate_const": int(img_size * 0.45), "img_mean": tuple(round(255 * x) for x in mean)}
    if name.startswith("rand"):
        return rand_augment_transform(name, hparams)
    if name.startswith("augmix"):
        return augment_and_mix_transform(name, hparams)
    if name in ("trivialaugment", "trivial"):
        return T.TrivialAugmentWide()
    raise ValueError(
        f"data.augment.auto_augment={name!r} is unknown; use rand-m9-mstd0.5-inc1, trivialaugment or augmix-m5-w3"
    )


def _geometry(img_size: int, augment: Augment, interpolation: str) -> list[Callable]:
    if augment.crop == "pad":
        return [T.RandomCrop(img_size, padding=max(1, img_size // 8), padding_mode="reflect")]
    mode = T.InterpolationMode(interpolation)
    ratio = tuple(float(x) for x in augment.ratio)
    return [T.RandomResizedCrop(img_size, scale=augment.crop_scale(img_size), ratio=ratio, interpolation=mode)]


def _to_tensor() -> list[Callable]:  # uint8: the loaders' images are normalised on the device (``Normalize``)
    return [T.PILToTensor()]


def classification_train_transform(
    img_size: int, augment: Augment, preprocess: Mapping[str, Any]
) -> Callable[[Image.Image], torch.Tensor]:
    """PIL image -> (3, img_size, img_size) uint8 tensor: crop, flip, jitter, auto-augment (``preprocess``'s
    interpolation; its mean and std normalise the batch on the device, ``vitattn.data.transforms.Normalize``)."""
    steps = _geometry(img_size, augment, preprocess["interpolation"])
    if augment.hflip > 0:
        steps.append(T.RandomHorizontalFlip(augment.hflip))
    if augment.color_jitter > 0:
        steps.append(T.ColorJitter(*(3 * [augment.color_jitter])))
    if augment.auto_augment:
        steps.append(_auto_augment(augment.auto_augment, img_size, preprocess["mean"]))
    return T.Compose(steps + _to_tensor())


class CaptionAugment:
    """Caption-safe training transform, called as ``transform(image, captions)``: a (3, height, width) uint8 tensor.

    A flip is drawn only when no caption of the image says left or right, colour jitter only when
    none names a colour; the crop always applies.
    """

    reads_captions = True

    def __init__(self, img_size: int, augment: Augment, preprocess: Mapping[str, Any]) -> None:
        self.augment = augment
        self.crop = T.Compose(_geometry(img_size, augment, preprocess["interpolation"]))
        self.flip = T.RandomHorizontalFlip(1.0) if augment.hflip > 0 else None
        self.jitter = T.ColorJitter(*(3 * [augment.color_jitter])) if augment.color_jitter > 0 else None
        self.finish = T.Compose(_to_tensor())

    def __call__(self, image: Image.Image, captions: Sequence[str]) -> torch.Tensor:
        words = {w for caption in captions for w in _WORD.findall(caption.lower())}
        image = self.crop(image)
        if self.flip is not None and not words & LEFT_RIGHT and torch.rand(()) < self.augment.hflip:
            image = self.flip(image)
        if self.jitter is not None and not words & COLOURS:
            image = self.jitter(image)
        return self.finish(image)
