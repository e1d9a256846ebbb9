"""Normalisation of image tensors: in the loaders of the built-in data, and on the device for every DataModule.

The DataModules' loaders yield uint8 images (a quarter of float32's bytes cross to the device) and
``Normalize`` finishes them where they land, as timm's prefetcher does (``ImageDataModule.on_after_batch_transfer``);
augmentation: ``vitattn.data.augment``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD


class Normalize:
    """``(image - mean) / std`` per channel, on (..., 3, height, width) tensors: float in [0, 1], or uint8, which is
    first scaled as ``ToTensor`` scales it (``.float().div(255)``), so that a uint8 image normalised here is bit for
    bit what ``ToTensor`` then ``Normalize`` make of it, on whichever device it is.

    ``torchvision.transforms.Normalize`` rebuilds its mean and std tensors on every call, a large part
    of the per-image cost of the shapes pipeline at small sizes (``docs/benchmarks.md``, "The built-in
    shapes data"); this keeps them, one copy per device.
    """

    def __init__(self, mean: Sequence[float], std: Sequence[float]) -> None:
        self.mean = torch.tensor(mean, dtype=torch.float32).view(3, 1, 1)
        self.std = torch.tensor(std, dtype=torch.float32).view(3, 1, 1)
        # 255 as a tensor, not a Python number: CUDA divides by a host scalar as a multiplication by its
        # reciprocal (one bit off in places); by a device tensor it divides exactly, as ToTensor does on the CPU.
        self.scale = torch.tensor(255.0)
        self._on_device: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        scale, mean, std = self._constants(image.device)
        if image.dtype == torch.uint8:
            image = image.float().div(scale)  # ToTensor's scaling, in its order: divide, then normalise
        return (image - mean) / std

    def _constants(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device.type == "cpu":
            return self.scale, self.mean, self.std
        if device not in self._on_device:  # copied once: no host-to-device copy each batch
            self._on_device[device] = tuple(t.to(device) for t in (self.scale, self.mean, self.std))
        return self._on_device[device]

    def __getstate__(self) -> dict:  # loader workers get the CPU statistics only
        return {**self.__dict__, "_on_device": {}}

    def __repr__(self) -> str:
        return f"Normalize(mean={self.mean.flatten().tolist()}, std={self.std.flatten().tolist()})"


def normalize() -> Normalize:
    """ImageNet mean/std normalisation of a (3, height, width) float tensor in [0, 1] (or uint8)."""
    return Normalize(IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD)
