"""Image transforms shared by the DataModules; all normalise with the ImageNet statistics."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from torchvision import transforms as T

# BLIP's captioning recipe crops at least half the image; no flips: captions say left and right.
CAPTION_CROP_SCALE = (0.5, 1.0)


class Normalize:
    """``(image - mean) / std`` per channel, on (..., 3, H, W) float tensors in [0, 1].

    ``torchvision.transforms.Normalize`` rebuilds its mean and std tensors on every call, which is
    half the per-image cost of the shapes pipeline at 64 px; this keeps them.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


def normalize() -> Normalize:
    """ImageNet mean/std normalisation of a (3, H, W) float tensor in [0, 1]."""
    return Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)


def classification_transform(
    img_size: int, training: bool, augment: bool = True
) -> Callable[[Image.Image], torch.Tensor]:
    """timm's ImageNet transform: random-resized crop, flip and colour jitter when training with
    ``augment``, else resize and centre crop."""
    return create_transform(
        img_size,
        is_training=training and augment,
        mean=IMAGENET_DEFAULT_MEAN,
        std=IMAGENET_DEFAULT_STD,
    )


def caption_transform(img_size: int, training: bool) -> Callable[[Image.Image], torch.Tensor]:
    """Captioning transform: a mild random-resized crop when training, else the whole image
    squashed to ``img_size`` (a centre crop could cut off what the captions mention)."""
    resize = (
        T.RandomResizedCrop(img_size, scale=CAPTION_CROP_SCALE, interpolation=T.InterpolationMode.BICUBIC)
        if training
        else T.Resize((img_size, img_size), interpolation=T.InterpolationMode.BICUBIC)
    )
    return T.Compose([resize, T.ToTensor(), normalize()])
