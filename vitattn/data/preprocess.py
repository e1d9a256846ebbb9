"""The one description of how an image file becomes the model's input at evaluation and inference.

A ``preprocess`` mapping (stored in checkpoints and bundles) holds timm's ``create_transform``
arguments: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation`` and an optional
``crop_mode`` (``center``, ``squash``, ``border``). The DataModules' evaluation transforms and the
bundles' transforms are both ``eval_transform(preprocess)`` (the DataModules' stop before the normalisation, which
runs on the device: ``vitattn.data.transforms.Normalize``); ``denormalize`` undoes its last step.

Pretrained weights bring their own (``WEIGHTS_KEYS``: all but the image size, which the run's data sets):
``from_timm`` reads them from timm's data config (``resolve_model_data_config``), a vitattn model's are its
``preprocess``; ``describe`` is how the run log names a choice.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from PIL import Image
from timm.data import (
    IMAGENET_DEFAULT_MEAN,
    IMAGENET_DEFAULT_STD,
    IMAGENET_INCEPTION_MEAN,
    IMAGENET_INCEPTION_STD,
    OPENAI_CLIP_MEAN,
    OPENAI_CLIP_STD,
    create_transform,
)
from timm.data.transforms import str_to_interp_mode

from vitattn.errors import brief

__all__ = [
    "CROP_MODES",
    "PREPROCESS_KEYS",
    "WEIGHTS_KEYS",
    "check_preprocess",
    "default_preprocess",
    "denormalize",
    "describe",
    "eval_transform",
    "from_timm",
    "weights_preprocess",
]

PREPROCESS_KEYS = ("img_size", "crop_pct", "mean", "std", "interpolation")
CROP_MODES = ("center", "squash", "border")  # timm's eval crop modes; optional ``crop_mode`` key
# What pretrained weights fix and the data may set (``data.mean=`` ...): all but the image size.
WEIGHTS_KEYS = ("mean", "std", "interpolation", "crop_pct", "crop_mode")
_STATISTICS = {  # the (mean, std) pairs timm names, as the run log names them
    (IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD): "ImageNet",
    (IMAGENET_INCEPTION_MEAN, IMAGENET_INCEPTION_STD): "Inception 0.5",
    (OPENAI_CLIP_MEAN, OPENAI_CLIP_STD): "OpenAI CLIP",
}


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


def from_timm(data_config: Mapping[str, Any]) -> dict[str, Any]:
    """A ``preprocess`` from timm's data config (``timm.data.resolve_model_data_config(model)``): the same transform
    as ``timm.data.create_transform(**data_config)``.

    Raises:
        ValueError: a non-square input size (vitattn's images are square).
    """
    _, height, width = data_config["input_size"]
    if height != width:
        raise ValueError(f"timm's input_size={tuple(data_config['input_size'])} is not square")
    return check_preprocess(
        {
            "img_size": int(height),
            "crop_pct": data_config["crop_pct"],
            "crop_mode": data_config.get("crop_mode") or "center",
            "interpolation": data_config["interpolation"],
            "mean": list(data_config["mean"]),
            "std": list(data_config["std"]),
        },
        "timm's data config",
    )


def weights_preprocess(preprocess: Mapping[str, Any]) -> dict[str, Any]:
    """The ``WEIGHTS_KEYS`` of a model's ``preprocess``: what a run that starts from that model takes (a missing
    ``crop_mode`` is ``center``, as timm's transform reads it)."""
    return {"crop_mode": "center", **{k: preprocess[k] for k in WEIGHTS_KEYS if preprocess.get(k) is not None}}


def describe(preprocess: Mapping[str, Any]) -> str:
    """How the run log names a preprocessing, in the ``data.*`` keys that set it:
    ``mean (0.5, 0.5, 0.5) std (0.5, 0.5, 0.5) [Inception 0.5], bicubic, crop_mode center crop_pct 0.9, 224 px``."""
    mean, std = tuple(preprocess["mean"]), tuple(preprocess["std"])
    name = next((f" [{n}]" for (m, s), n in _STATISTICS.items() if _close(m, mean) and _close(s, std)), "")
    return (
        f"mean {_numbers(mean)} std {_numbers(std)}{name}, {preprocess['interpolation']}, "
        f"crop_mode {preprocess.get('crop_mode') or 'center'} crop_pct {float(preprocess['crop_pct']):g}, "
        f"{preprocess['img_size']} px"
    )


def _numbers(values: Sequence[float]) -> str:
    return "(" + ", ".join(f"{x:g}" for x in values) + ")"


def _close(a: Sequence[float], b: Sequence[float]) -> bool:
    return all(abs(x - y) < 1e-6 for x, y in zip(a, b))


def eval_transform(preprocess: Mapping[str, Any], normalize: bool = True) -> Callable[[Image.Image], torch.Tensor]:
    """timm's evaluation transform (resize, crop, to tensor, normalise) for a bundle's ``preprocess``.

    Args:
        preprocess: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation``; an optional
            ``crop_mode`` (``center``, ``squash``, ``border``) is passed on to timm.
        normalize: False: stop at the (3, img_size, img_size) uint8 tensor (timm's prefetcher form), what the
            DataModules' loaders yield; ``Normalize(mean, std)`` of it is then bit for bit the normalised image.
    """
    p = check_preprocess(preprocess, "preprocess")
    return create_transform(
        input_size=p["img_size"],
        is_training=False,
        use_prefetcher=not normalize,
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
