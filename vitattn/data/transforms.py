"""Normalisation of image tensors, kept fast for the built-in data (augmentation: ``vitattn.data.augment``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD


class Normalize:
    """``(image - mean) / std`` per channel, on (..., 3, height, width) float tensors in [0, 1].

    ``torchvision.transforms.Normalize`` rebuilds its mean and std tensors on every call, a large part
    of the per-image cost of the shapes pipeline at small sizes (``docs/benchmarks.md``, "The built-in
    shapes data"); this keeps them.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return (image - self.mean) / self.std

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


def normalize() -> Normalize:
    """ImageNet mean/std normalisation of a (3, height, width) float tensor in [0, 1]."""
    return Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
