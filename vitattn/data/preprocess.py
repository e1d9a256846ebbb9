"""The one description of how an image file becomes the model's input at evaluation and inference.

A ``preprocess`` mapping (stored in checkpoints and bundles) holds timm's ``create_transform``
arguments: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation`` and an optional
``crop_mode`` (``center``, ``squash``, ``border``). The DataModules' evaluation transforms and the
bundles' transforms are both ``eval_transform(preprocess)``; ``denormalize`` undoes its last step.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD, create_transform
from timm.data.transforms import str_to_interp_mode

from vitattn.errors import brief

__all__ = ["CROP_MODES", "PREPROCESS_KEYS", "check_preprocess", "default_preprocess", "denormalize", "eval_transform"]

PREPROCESS_KEYS = ("img_size", "crop_pct", "mean", "std", "interpolation")
CROP_MODES = ("center", "squash", "border")  # timm's eval crop modes; optional ``crop_mode`` key


def default_preprocess(img_size: int) -> dict[str, Any]:
    """The whole image squashed to ``img_size`` (bicubic), ImageNet mean/std: the built-in data's
    evaluation transform."""
    return {
        "img_size": int(img_size),
        "crop_pct": 1.0,
        "crop_mode": "squash",
        "interpolation": "bicubic",
        "mean": list(IMAGENET_DEFAULT_MEAN),
        "std": list(IMAGENET_DEFAULT_STD),
    }


def eval_transform(preprocess: Mapping[str, Any]) -> Callable[[Image.Image], torch.Tensor]:
    """timm's evaluation transform (resize, crop, to tensor, normalise) for a bundle's ``preprocess``.

    Args:
        preprocess: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation``; an optional
            ``crop_mode`` (``center``, ``squash``, ``border``) is passed on to timm.
    """
    p = check_preprocess(preprocess, "preprocess")
    return create_transform(
        input_size=p["img_size"],
        is_training=False,
        crop_pct=p["crop_pct"],
        crop_mode=p.get("crop_mode"),
        mean=tuple(p["mean"]),
        std=tuple(p["std"]),
        interpolation=p["interpolation"],
    )


def check_preprocess(preprocess: Any, where: str = "preprocess") -> dict[str, Any]:
    """``preprocess`` checked and normalised to plain values; a one-line ``ValueError`` names what is wrong."""
    if not isinstance(preprocess, Mapping):
        raise ValueError(f"{where} must be a mapping with keys {list(PREPROCESS_KEYS)}, got {brief(preprocess)}")
    missing = [k for k in PREPROCESS_KEYS if k not in preprocess]
    if missing:
        raise ValueError(f"{where} has no {missing}; it needs {list(PREPROCESS_KEYS)}")
    p = {k: preprocess[k] for k in PREPROCESS_KEYS}
    p["mean"], p["std"] = _three_floats(p["mean"], f"{where}: mean"), _three_floats(p["std"], f"{where}: std")
    if min(p["std"]) <= 0:
        raise ValueError(f"{where}: std={p['std']} must be positive")
    size, crop = p["img_size"], p["crop_pct"]
    if isinstance(size, bool) or not isinstance(size, numbers.Integral) or size < 1:
        raise ValueError(f"{where}: img_size={brief(size)} must be a positive integer")
    if isinstance(crop, bool) or not isinstance(crop, numbers.Real) or not 0.1 <= crop <= 1:
        raise ValueError(
            f"{where}: crop_pct={brief(crop)} must be a number from 0.1 to 1 (the crop's share of the resized side)"
        )
    p["img_size"], p["crop_pct"] = int(size), float(crop)
    try:
        str_to_interp_mode(p["interpolation"])
    except (KeyError, TypeError):
        raise ValueError(f"{where}: interpolation={brief(p['interpolation'])} is unknown; try bicubic") from None
    if preprocess.get("crop_mode") is not None:
        if preprocess["crop_mode"] not in CROP_MODES:
            raise ValueError(
                f"{where}: crop_mode={brief(preprocess['crop_mode'])} is unknown; choose one of {list(CROP_MODES)}"
            )
        p["crop_mode"] = preprocess["crop_mode"]
    return p


def _three_floats(values: Any, where: str) -> list[float]:
    ok = isinstance(values, Sequence) and not isinstance(values, str) and len(values) == 3
    if not ok or not all(isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) for x in values):
        raise ValueError(f"{where}={brief(values)} must be 3 finite numbers")
    return [float(x) for x in values]


def denormalize(
    images: torch.Tensor, mean: Sequence[float] = IMAGENET_DEFAULT_MEAN, std: Sequence[float] = IMAGENET_DEFAULT_STD
) -> torch.Tensor:
    """Undo the normalisation of (..., 3, height, width) images (a ``preprocess``'s ``mean`` and ``std``), back
    to [0, 1]."""
    mean_ = images.new_tensor(list(mean)).view(3, 1, 1)
    std_ = images.new_tensor(list(std)).view(3, 1, 1)
    return images * std_ + mean_
