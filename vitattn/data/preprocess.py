"""The one description of how an image file becomes the model's input at evaluation and inference.

A ``preprocess`` mapping (stored in checkpoints and bundles) holds timm's ``create_transform``
arguments: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation`` and an optional
``crop_mode`` (``center``, ``squash``, ``border``). The DataModules' evaluation transforms and the
bundles' transforms are both ``eval_transform(preprocess)``; ``denormalize`` undoes its last step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

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
    from timm.data import create_transform

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
        raise ValueError(f"{where} must be a mapping with keys {list(PREPROCESS_KEYS)}, got {preprocess!r:.80}")
    missing = [k for k in PREPROCESS_KEYS if k not in preprocess]
    if missing:
        raise ValueError(f"{where} has no {missing}; it needs {list(PREPROCESS_KEYS)}")
    p = {k: preprocess[k] for k in PREPROCESS_KEYS}
    p["mean"], p["std"] = [float(x) for x in p["mean"]], [float(x) for x in p["std"]]
    if len(p["mean"]) != 3 or len(p["std"]) != 3:
        raise ValueError(f"{where}: mean={p['mean']} and std={p['std']} need 3 values each")
    p["img_size"], p["crop_pct"] = int(p["img_size"]), float(p["crop_pct"])
    if preprocess.get("crop_mode") is not None:
        if preprocess["crop_mode"] not in CROP_MODES:
            raise ValueError(
                f"{where}: crop_mode={preprocess['crop_mode']!r} is unknown; choose one of {list(CROP_MODES)}"
            )
        p["crop_mode"] = preprocess["crop_mode"]
    return p


def denormalize(
    images: torch.Tensor, mean: Sequence[float] = IMAGENET_DEFAULT_MEAN, std: Sequence[float] = IMAGENET_DEFAULT_STD
) -> torch.Tensor:
    """Undo the normalisation of (..., 3, H, W) images (a ``preprocess``'s ``mean`` and ``std``), back to [0, 1]."""
    mean_ = images.new_tensor(list(mean)).view(3, 1, 1)
    std_ = images.new_tensor(list(std)).view(3, 1, 1)
    return images * std_ + mean_
