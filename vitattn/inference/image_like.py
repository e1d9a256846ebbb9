"""Images handed to the Python API (paths, PIL images, numpy arrays, torch tensors) as model inputs.

Every kind becomes an upright 8-bit RGB PIL image first (``read_image`` for files, ``upright_rgb``
otherwise), then the bundle's ``eval_transform``: the model sees what it saw in training and what
``vitattn-caption`` gives it for the same picture saved as a file.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitattn.data.images import read_image, upright_rgb
from vitattn.errors import brief

__all__ = ["ImageLike", "as_image_list", "to_pil", "to_pixels"]

ImageLike = str | os.PathLike | Image.Image | np.ndarray | torch.Tensor

_KINDS = (
    "a file path, a PIL image, a (height, width, 3) uint8 numpy array or a (3, height, width) torch tensor "
    "(uint8, or float in [0, 1])"
)


def as_image_list(images: ImageLike | Sequence[ImageLike]) -> tuple[list[ImageLike], bool]:
    """``(images as a list, whether one image was given)``; a list or tuple holds images, anything else is one."""
    if isinstance(images, (list, tuple)):
        return list(images), False
    return [images], True


def to_pil(image: Any, where: str = "image") -> Image.Image:
    """One image of any accepted kind as an upright 8-bit RGB PIL image.

    Raises:
        TypeError: not a kind of image the API takes (the message lists them).
        ValueError: an array or tensor of the wrong shape, dtype or range.
        BadImageError: a file that cannot be read.
    """
    if isinstance(image, (str, os.PathLike)):
        return read_image(image)
    if isinstance(image, Image.Image):
        return upright_rgb(image)
    if isinstance(image, torch.Tensor):
        return Image.fromarray(_tensor_to_hwc(image, where))
    if isinstance(image, np.ndarray):
        return Image.fromarray(_array_to_hwc(image, where))
    raise TypeError(f"{where} is {brief(image)} ({type(image).__name__}); pass {_KINDS}")


def to_pixels(
    images: Sequence[ImageLike], transform: Callable[[Image.Image], torch.Tensor], where: str = "images"
) -> torch.Tensor:
    """(B, C, height, width) model inputs of ``images`` through ``transform`` (a bundle's ``eval_transform``)."""
    return torch.stack([transform(to_pil(x, f"{where}[{i}]")) for i, x in enumerate(images)])


def _array_to_hwc(a: np.ndarray, where: str) -> np.ndarray:
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3):
        raise ValueError(
            f"{where} is a numpy array of shape {list(a.shape)}; "
            "pass (height, width, 3) or (height, width) uint8 pixels"
        )
    if a.dtype != np.uint8:
        raise ValueError(f"{where} is a {a.dtype} numpy array; pass uint8 pixels (0-255), e.g. np.asarray(pil_image)")
    return np.repeat(a, 3, axis=-1) if a.shape[-1] == 1 else np.ascontiguousarray(a)


def _tensor_to_hwc(x: torch.Tensor, where: str) -> np.ndarray:
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or x.shape[0] not in (1, 3):
        raise ValueError(
            f"{where} is a tensor of shape {list(x.shape)}; pass (3, height, width) or (height, width) pixels"
        )
    x = x.detach().cpu()
    if x.dtype == torch.uint8:
        pixels = x
    elif x.is_floating_point():
        if x.numel() and not (x.isfinite().all() and x.min() >= 0 and x.max() <= 1):
            raise ValueError(
                f"{where} is a float tensor outside [0, 1]; pass pixels in [0, 1] (as ToTensor gives them), "
                "not normalised ones"
            )
        pixels = (x.float() * 255).round().to(torch.uint8)  # 8 bits, as an image file holds them
    else:
        raise ValueError(f"{where} is a {x.dtype} tensor; pass uint8 pixels or floats in [0, 1]")
    return pixels.expand(3, -1, -1).permute(1, 2, 0).contiguous().numpy()  # (height, width, 3)
