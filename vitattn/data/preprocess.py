"""How an image becomes the model's input: evaluation (``eval_transform``, timm's, written without timm),
normalisation on the device (``Normalize``) and training augmentation (``Augment``; docs/data.md). A
``preprocess`` mapping (checkpoints, bundles) holds timm's ``create_transform`` arguments (``PREPROCESS_KEYS``).
Images at their own aspect ratio (``data.max_patches``, docs/training.md): ``resize_to_patches``, ``patchify``,
``pad_patches``; ``patch_limit``, a batch's sequence length (``data.batch_patches``)."""

from __future__ import annotations

import importlib
import math
import numbers
import random
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, fields
from fractions import Fraction
from functools import partial
from typing import Any, NamedTuple

import numpy as np
import torch
from PIL import Image
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from vitattn.errors import brief
from vitattn.models.vit import Patches

__all__ = [
    "Augment",
    "auto_min_scale",
    "batch_images",
    "Budget",
    "CAPTION_CROP_SCALE",
    "CAPTION_SAFE_OPS",
    "CaptionAugment",
    "check_max_patches",
    "caption_weak_transform",
    "check_preprocess",
    "classification_train_transform",
    "CROP_MODES",
    "Cutout",
    "default_preprocess",
    "denormalize",
    "describe",
    "eval_transform",
    "from_timm",
    "ImagePatches",
    "Normalize",
    "normalize",
    "pad_patches",
    "patch_grid",
    "patch_limit",
    "patchify",
    "PREPROCESS_KEYS",
    "preprocess_taken",
    "RandomResizedCropToPatches",
    "resize_to_patches",
    "seeded_generators",
    "strong_view",
    "unpatchify",
    "WEIGHTS_KEYS",
    "weights_preprocess",
]

# timm's statistics (``timm.data``), written here: the caption path imports no timm (the first-caption bench)
IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)
IMAGENET_INCEPTION_MEAN = IMAGENET_INCEPTION_STD = (0.5, 0.5, 0.5)
OPENAI_CLIP_MEAN, OPENAI_CLIP_STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
INTERPOLATIONS = ("nearest", "bilinear", "bicubic", "box", "hamming", "lanczos")  # timm's names
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
    """A ``preprocess`` from timm's data config: the transform of ``timm.data.create_transform(**data_config)``.

    Raises:
        ValueError: a non-square input size.
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


def preprocess_taken(data: Mapping[str, Any], preprocess: Mapping[str, Any] | None) -> dict[str, Any]:
    """What of a model's ``preprocess`` a data config takes: the ``weights_keys`` of the DataModule its
    ``_target_`` names that ``data`` leaves null (a ``data.*`` key the config sets wins over the weights')."""
    if preprocess is None:
        return {}
    theirs = weights_preprocess(preprocess)
    module, _, name = str(data["_target_"]).rpartition(".")
    keys = getattr(getattr(importlib.import_module(module), name), "weights_keys", ())
    return {k: theirs[k] for k in keys if k in theirs and data.get(k) is None}


def describe(preprocess: Mapping[str, Any]) -> str:
    """How the run log names a preprocessing, in the ``data.*`` keys that set it:
    ``mean (0.5, 0.5, 0.5) std (0.5, 0.5, 0.5) [Inception 0.5], bicubic, crop_mode center crop_pct 0.9, 224 px``;
    with ``max_patches``, that budget in place of the crop."""
    mean, std = tuple(preprocess["mean"]), tuple(preprocess["std"])
    name = next((f" [{n}]" for pair, n in _STATISTICS.items() if np.allclose(pair, (mean, std), rtol=0, atol=1e-6)), "")
    if preprocess.get("max_patches") is not None:  # no crop: the image's own aspect, resized to its grid
        return (
            f"mean {_numbers(mean)} std {_numbers(std)}{name}, {preprocess['interpolation']}, each image at its own "
            f"aspect ratio, max_patches {preprocess['max_patches']} of {preprocess['patch_size']} px "
            f"(positions of {preprocess['img_size']} px)"
        )
    return (
        f"mean {_numbers(mean)} std {_numbers(std)}{name}, {preprocess['interpolation']}, "
        f"crop_mode {preprocess.get('crop_mode') or 'center'} crop_pct {float(preprocess['crop_pct']):g}, "
        f"{preprocess['img_size']} px"
    )


def _numbers(values: Sequence[float]) -> str:
    return "(" + ", ".join(f"{x:g}" for x in values) + ")"


def eval_transform(preprocess: Mapping[str, Any], normalize: bool = True) -> Callable[[Image.Image], torch.Tensor]:
    """timm's evaluation transform of ``preprocess``, PIL image -> (3, img_size, img_size): resize, crop, to
    tensor, normalise; ``normalize=False`` stops at uint8, which ``Normalize`` then finishes bit for bit. With
    ``max_patches`` (and ``patch_size``): the image at its own aspect ratio as ``ImagePatches`` (``batch_images``)."""
    p = check_preprocess(preprocess, "preprocess")
    size, mode = p["img_size"], T.InterpolationMode(p["interpolation"])
    scale = math.floor(size / p["crop_pct"])
    if p.get("max_patches") is not None:  # the image's own aspect: resized to its grid, then ``ImagePatches``
        patch = p["patch_size"]
        steps = [partial(resize_to_patches, patch_size=patch, max_patches=p["max_patches"], interpolation=mode.value)]
        cut = partial(patchify, patch_size=patch)
        if not normalize:
            return T.Compose([*steps, partial(_to_tensor, scale=False), cut])
        mean, std = torch.tensor(p["mean"]), torch.tensor(p["std"])
        return T.Compose([*steps, partial(_to_tensor, scale=True), T.Normalize(mean, std), cut])
    if p.get("crop_mode") == "squash":
        steps = [T.Resize((scale, scale), interpolation=mode), T.CenterCrop(size)]
    elif p.get("crop_mode") == "border":
        fill = [round(255 * v) for v in p["mean"]]
        steps = [partial(_resize_longest, size=scale, interpolation=mode), partial(_crop_or_pad, size=size, fill=fill)]
    else:
        steps = [T.Resize(scale, interpolation=mode), T.CenterCrop(size)]
    if not normalize:
        return T.Compose([*steps, partial(_to_tensor, scale=False)])
    mean, std = torch.tensor(p["mean"]), torch.tensor(p["std"])
    return T.Compose([*steps, partial(_to_tensor, scale=True), T.Normalize(mean, std)])


def _resize_longest(image: Image.Image, size: int, interpolation: T.InterpolationMode) -> Image.Image:
    """timm's ``ResizeKeepRatio(longest=1)``: the longer side to ``size``, the aspect ratio kept."""
    _, height, width = TF.get_dimensions(image)
    ratio = max(height / size, width / size)
    return TF.resize(image, [round(height / ratio), round(width / ratio)], interpolation)


def _crop_or_pad(image: Image.Image, size: int, fill: list[int]) -> Image.Image:
    """timm's ``CenterCropOrPad``: pad a side shorter than ``size`` with ``fill``, then crop the centre."""
    _, height, width = TF.get_dimensions(image)
    dw, dh = max(size - width, 0), max(size - height, 0)
    if dw or dh:
        image = TF.pad(image, [dw // 2, dh // 2, (dw + 1) // 2, (dh + 1) // 2], fill=fill)
    return TF.center_crop(image, [size, size])


def _to_tensor(image: Any, scale: bool) -> torch.Tensor:
    """timm's ``MaybeToTensor`` (``scale``: float in [0, 1]) or ``MaybePILToTensor`` (uint8); a tensor as it is."""
    if isinstance(image, torch.Tensor):
        return image
    return TF.to_tensor(image) if scale else TF.pil_to_tensor(image)


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
    if not isinstance(p["interpolation"], str) or p["interpolation"] not in INTERPOLATIONS:
        raise ValueError(f"{where}: interpolation={brief(p['interpolation'])} is unknown; try bicubic") from None
    if preprocess.get("crop_mode") is not None:
        if preprocess["crop_mode"] not in CROP_MODES:
            raise ValueError(
                f"{where}: crop_mode={brief(preprocess['crop_mode'])} is unknown; choose one of {list(CROP_MODES)}"
            )
        p["crop_mode"] = preprocess["crop_mode"]
    if preprocess.get("max_patches") is not None:  # images at their own aspect ratio (data.max_patches)
        patch = preprocess.get("patch_size")
        if isinstance(patch, bool) or not isinstance(patch, numbers.Integral) or patch < 1:
            raise ValueError(f"{where}: patch_size={brief(patch)} must be a positive integer with max_patches")
        p["max_patches"] = check_max_patches(preprocess["max_patches"], p["img_size"], int(patch))
        p["patch_size"] = int(patch)
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


class Normalize:
    """``(image - mean) / std`` of (..., 3, height, width) float or uint8 (scaled as ``ToTensor`` does) images,
    with its constants kept once per device (torchvision's rebuilds them each call, docs/benchmarks.md)."""

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


# Captions: BLIP's recipe crops at least half of a 224-384 px photo; a small one is not cropped (docs/data.md).
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
    return float(np.interp(img_size, (64, 224), (small, large)))


@dataclass
class Augment:
    """Training augmentation, ``data.augment.*`` (docs/training.md); off: the evaluation transform. ``scale`` is
    the crop's area range, ``auto`` ``auto_min_scale(img_size)`` to 1; ``hflip`` a probability."""

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
        if self.scale not in ("auto", "auto_caption", None):
            low, high = (float(x) for x in self.scale)
            if not 0.0 < low <= high <= 1.0:
                raise ValueError(f"data.augment.scale={list(self.scale)} must satisfy 0 < min <= max <= 1")

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
        low, high = (float(x) for x in self.scale)  # checked when made
        return (low, high)


def _auto_augment(
    name: str, img_size: int, mean: Sequence[float], ops: Sequence[str] | None = None
) -> Callable[[Image.Image], Image.Image]:
    from timm.data.auto_augment import augment_and_mix_transform, rand_augment_transform  # training only

    hparams = {"translate_const": int(img_size * 0.45), "img_mean": tuple(round(255 * x) for x in mean)}
    if name.startswith("rand"):
        return rand_augment_transform(name, hparams, transforms=list(ops) if ops else None)
    if name.startswith("augmix"):
        return augment_and_mix_transform(name, hparams)
    if name in ("trivialaugment", "trivial"):
        return T.TrivialAugmentWide()
    raise ValueError(
        f"data.augment.auto_augment={name!r} is unknown; use rand-m9-mstd0.5-inc1, trivialaugment or augmix-m5-w3"
    )


@dataclass(frozen=True)
class Budget:
    """Images at their own aspect ratio (``data.max_patches``): at most ``max_patches`` patches of ``patch_size``."""

    max_patches: int
    patch_size: int


def _geometry(img_size: int, augment: Augment, interpolation: str, budget: Budget | None = None) -> list[Callable]:
    if budget is not None:
        if augment.crop != "resized":
            raise ValueError(
                f"data.augment.crop={augment.crop} keeps no aspect ratio: use crop=resized with data.max_patches"
            )
        scale, ratio = augment.crop_scale(img_size), tuple(float(x) for x in augment.ratio)
        return [RandomResizedCropToPatches(budget.patch_size, budget.max_patches, scale, ratio, interpolation)]
    if augment.crop == "pad":
        return [T.RandomCrop(img_size, padding=max(1, img_size // 8), padding_mode="reflect")]
    mode = T.InterpolationMode(interpolation)
    ratio = tuple(float(x) for x in augment.ratio)
    return [T.RandomResizedCrop(img_size, scale=augment.crop_scale(img_size), ratio=ratio, interpolation=mode)]


def _finish(budget: Budget | None) -> Callable[[Image.Image], Any]:
    """PIL image -> (3, height, width) uint8, or with a ``budget`` its ``ImagePatches`` (``patchify``)."""
    if budget is None:
        return T.PILToTensor()
    return T.Compose([T.PILToTensor(), partial(patchify, patch_size=budget.patch_size)])


class RandomResizedCropToPatches:
    """timm's ``RandomResizedCropToSequence``: a crop of a random share ``scale`` of the image's area, its aspect the
    image's times a log-uniform factor from ``ratio`` (a centre crop after 10 misses), resized to the largest size
    whose grid holds at most ``max_patches`` (``patch_grid``: timm's bisection solved exactly). The image's own
    aspect is what the crop varies around, so a wide image stays wide. Draws from Python's ``random``, as timm (in
    training seeded per sample: ``vitattn.training.datamodules.base.SeededDraws``)."""

    def __init__(
        self,
        patch_size: int,
        max_patches: int,
        scale: tuple[float, float] = (0.08, 1.0),
        ratio: tuple[float, float] = (0.8, 1.25),
        interpolation: str = "bicubic",
    ) -> None:
        self.patch_size, self.max_patches = patch_size, max_patches
        self.scale, self.ratio, self.interpolation = scale, ratio, T.InterpolationMode(interpolation)

    def get_params(self, height: int, width: int) -> tuple[int, int, int, int]:
        """The crop's (top, left, height, width), drawn as timm's ``get_params`` draws it."""
        aspect, log_ratio = width / height, (math.log(self.ratio[0]), math.log(self.ratio[1]))
        for _ in range(10):
            area = height * width * random.uniform(*self.scale)
            crop_aspect = aspect * math.exp(random.uniform(*log_ratio))
            crop_h, crop_w = round(math.sqrt(area / crop_aspect)), round(math.sqrt(area * crop_aspect))
            if 0 < crop_w <= width and 0 < crop_h <= height:
                return random.randint(0, height - crop_h), random.randint(0, width - crop_w), crop_h, crop_w
        # timm's fallback: the largest centre crop whose aspect lies in the range
        crop_h, crop_w = height, width
        if self.ratio[0] > 1:
            crop_h = min(round(width / (aspect * self.ratio[0])), height)
        elif self.ratio[1] < 1:
            crop_w = min(round(height * aspect * self.ratio[1]), width)
        crop_h, crop_w = max(1, crop_h), max(1, crop_w)
        return (height - crop_h) // 2, (width - crop_w) // 2, crop_h, crop_w

    def __call__(self, image: Image.Image) -> Image.Image:
        _, height, width = TF.get_dimensions(image)
        top, left, crop_h, crop_w = self.get_params(height, width)
        rows, cols = patch_grid(crop_h, crop_w, _limited(self.max_patches))
        size = [rows * self.patch_size, cols * self.patch_size]
        return TF.resized_crop(image, top, left, crop_h, crop_w, size, self.interpolation, antialias=True)

    def __repr__(self) -> str:
        return f"RandomResizedCropToPatches(patch_size={self.patch_size}, max_patches={self.max_patches}, ...)"


def classification_train_transform(
    img_size: int, augment: Augment, preprocess: Mapping[str, Any], budget: Budget | None = None
) -> Callable[[Image.Image], Any]:
    """PIL image -> (3, img_size, img_size) uint8 tensor: crop, flip, jitter, auto-augment (``preprocess``'s
    interpolation; its mean and std normalise the batch on the device, ``vitattn.data.preprocess.Normalize``).
    With a ``budget``: the crop keeps the image's aspect (``RandomResizedCropToPatches``), and the image comes out as
    ``ImagePatches``."""
    steps = _geometry(img_size, augment, preprocess["interpolation"], budget)
    if augment.hflip > 0:
        steps.append(T.RandomHorizontalFlip(augment.hflip))
    if augment.color_jitter > 0:
        steps.append(T.ColorJitter(*(3 * [augment.color_jitter])))
    if augment.auto_augment:
        steps.append(_auto_augment(augment.auto_augment, img_size, preprocess["mean"]))
    return T.Compose([*steps, _finish(budget)])  # uint8: batches are normalised on the device


class Cutout:
    """FixMatch's Cutout of a (3, height, width) uint8 image: a square of side up to ``max_share`` of the image's,
    centred anywhere (clipped at the edges), filled with ``fill`` (the mean colour, 0-255)."""

    def __init__(self, fill: Sequence[int], max_share: float = 0.5) -> None:
        self.fill, self.max_share = torch.tensor(list(fill), dtype=torch.uint8), max_share

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        _, height, width = image.shape
        side = float(torch.rand(())) * self.max_share * min(height, width)
        y, x = float(torch.rand(())) * height, float(torch.rand(())) * width
        top, left = max(0, round(y - side / 2)), max(0, round(x - side / 2))
        bottom, right = min(height, round(y + side / 2)), min(width, round(x + side / 2))
        image = image.clone()
        image[:, top:bottom, left:right] = self.fill[:, None, None]
        return image


# RandAugment's operations that keep an unknown caption true (the rules ``CaptionAugment`` applies): geometry that
# keeps left left (rotation and shear up to 30 degrees, translation) and sharpness; no colour operation, no flip.
CAPTION_SAFE_OPS = ("Rotate", "ShearX", "ShearY", "TranslateXRel", "TranslateYRel", "Sharpness")


def strong_view(
    weak: T.Compose, randaugment: str, img_size: int, mean: Sequence[float], captions: bool = False
) -> Callable[[Image.Image], torch.Tensor]:
    """FixMatch's strong view: the weak view's transform ``weak`` (PIL -> uint8, its last step the conversion to a
    tensor) with timm's RandAugment ``randaugment`` after its crop, then ``Cutout``. ``captions``: RandAugment of
    ``CAPTION_SAFE_OPS`` only and no Cutout (which can erase what the caption names)."""
    augment = _auto_augment(randaugment, img_size, mean, CAPTION_SAFE_OPS if captions else None)
    if captions:
        return T.Compose([*weak.transforms[:-1], augment, weak.transforms[-1]])
    fill = [round(255 * x) for x in mean]
    return T.Compose([*weak.transforms[:-1], augment, weak.transforms[-1], Cutout(fill)])


def caption_weak_transform(
    img_size: int, augment: Augment, preprocess: Mapping[str, Any]
) -> Callable[[Image.Image], torch.Tensor]:
    """The weak view of an image without a caption: ``CaptionAugment``'s crop alone (a flip or a colour change could
    contradict the caption it will get), PIL -> (3, img_size, img_size) uint8."""
    return T.Compose([*_geometry(img_size, augment, preprocess["interpolation"]), T.PILToTensor()])


class CaptionAugment:
    """``transform(image, captions)`` -> (3, height, width) uint8: the crop, a flip only when no caption says
    left or right, colour jitter and the ``auto_augment`` (whose operations change colours) only when none names a
    colour. With a ``budget``, as ``classification_train_transform``'s: the crop keeps the aspect, patches come out."""

    reads_captions = True

    def __init__(
        self, img_size: int, augment: Augment, preprocess: Mapping[str, Any], budget: Budget | None = None
    ) -> None:
        self.augment = augment
        self.crop = T.Compose(_geometry(img_size, augment, preprocess["interpolation"], budget))
        self.flip = T.RandomHorizontalFlip(1.0) if augment.hflip > 0 else None
        self.jitter = T.ColorJitter(*(3 * [augment.color_jitter])) if augment.color_jitter > 0 else None
        auto = augment.auto_augment
        self.auto = _auto_augment(auto, img_size, preprocess["mean"]) if auto else None
        self.finish = _finish(budget)

    def __call__(self, image: Image.Image, captions: Sequence[str]) -> Any:
        words = {w for caption in captions for w in _WORD.findall(caption.lower())}
        image = self.crop(image)
        if self.flip is not None and not words & LEFT_RIGHT and torch.rand(()) < self.augment.hflip:
            image = self.flip(image)
        if self.jitter is not None and not words & COLOURS:
            image = self.jitter(image)
        if self.auto is not None and not words & COLOURS:
            image = self.auto(image)
        return self.finish(image)


@contextmanager
def seeded_generators(key: str) -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators seeded by ``key`` inside, the process's own put back after: a
    random augmentation made inside is a function of ``key`` (a shard sample's epoch and position)."""
    seed = random.Random(key).getrandbits(63)
    saved = random.getstate(), np.random.get_state(), torch.get_rng_state()
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.random.default_generator.manual_seed(seed)  # the CPU's alone: CUDA's stream is the model's
    try:
        yield
    finally:
        random.setstate(saved[0])
        np.random.set_state(saved[1])
        torch.set_rng_state(saved[2])


def check_max_patches(max_patches: Any, img_size: int, patch_size: int) -> int:
    """``max_patches`` as an int, refused in one line when not a whole number or below one row of the square
    grid (``img_size // patch_size`` patches), where an image would keep too few patches to see anything."""
    row = img_size // patch_size
    if isinstance(max_patches, bool) or not isinstance(max_patches, numbers.Integral) or max_patches < row:
        raise ValueError(
            f"data.max_patches={brief(max_patches)} is below one row of patches: at least {row} "
            f"(data.img_size={img_size} / patch_size={patch_size}), or leave it unset for square images"
        )
    return int(max_patches)


def patch_grid(height: int, width: int, max_patches: int) -> tuple[int, int]:
    """The (rows, columns) grid of the largest scale of a ``height`` x ``width`` image whose grid, each side
    rounded up to whole patches and at least one, holds at most ``max_patches`` (timm's ``get_image_size_for_seq``,
    solved exactly where timm bisects). The grid's largest aspect is ``max_patches``:1, one patch on the short side.

    The grid changes only at scales where a side fills a whole number k of patches: each such scale is a candidate,
    k patches on that side and the other rounded up; the largest scale whose grid fits wins."""
    best, best_scale = (1, 1), Fraction(0)
    for side, other, first in ((height, width, True), (width, height, False)):
        for k in range(1, max_patches + 1):
            rest = max(1, -(-other * k // side))  # the other side at scale k / side, rounded up
            if k * rest > max_patches:  # larger k only grows both sides
                break
            if Fraction(k, side) > best_scale:
                best_scale, best = Fraction(k, side), ((k, rest) if first else (rest, k))
    return best


_PATCH_LIMIT: ContextVar[int | None] = ContextVar("patch_limit", default=None)


@contextmanager
def patch_limit(max_patches: int) -> Iterator[None]:
    """Within it, every resize to patches (``resize_to_patches``, ``RandomResizedCropToPatches``) holds at most
    ``max_patches`` as well as its own budget: the sequence length of a batch by patches (``data.batch_patches``),
    set around one item as timm builds a transform per sequence length, whatever transform the dataset holds."""
    token = _PATCH_LIMIT.set(max_patches)
    try:
        yield
    finally:
        _PATCH_LIMIT.reset(token)


def _limited(max_patches: int) -> int:
    limit = _PATCH_LIMIT.get()
    return max_patches if limit is None else min(max_patches, limit)


def resize_to_patches(
    image: Image.Image, patch_size: int, max_patches: int, interpolation: str = "bicubic"
) -> Image.Image:
    """A PIL image (``read_image``'s: EXIF orientation applied) resized, its aspect ratio kept, to the largest
    size whose ``patch_size`` grid holds at most ``max_patches`` patches (``patch_grid``), each side a whole
    number of patches (fewer within ``patch_limit``); a (C, height, width) tensor (generated images) likewise."""
    _, height, width = TF.get_dimensions(image)
    rows, cols = patch_grid(height, width, _limited(max_patches))
    return TF.resize(image, [rows * patch_size, cols * patch_size], T.InterpolationMode(interpolation))


class ImagePatches(NamedTuple):
    """One image as ``patchify`` cuts it: ``patches`` (N, P*P*C), ``coord`` (N, 2) (row, column)."""

    patches: torch.Tensor
    coord: torch.Tensor


def batch_images(images: Sequence[torch.Tensor | ImagePatches]) -> torch.Tensor | Patches:
    """The model inputs of B images (``eval_transform``'s) as one batch: square images stacked (B, C, height,
    width), ``ImagePatches`` padded to the longest (``pad_patches``)."""
    return pad_patches(images) if isinstance(images[0], ImagePatches) else torch.stack(list(images))


def patchify(image: torch.Tensor, patch_size: int) -> ImagePatches:
    """(C, height, width), each side a multiple of ``patch_size`` (P) -> its (N, P*P*C) patches, row by row, each
    in (row, column, channel) order as timm's ``patchify_image``, and their (N, 2) (row, column) coordinates."""
    C, height, width = image.shape
    rows, cols = height // patch_size, width // patch_size
    assert rows * patch_size == height and cols * patch_size == width, (height, width, patch_size)
    patches = image.reshape(C, rows, patch_size, cols, patch_size).permute(1, 3, 2, 4, 0)  # (rows, cols, P, P, C)
    coord = torch.stack(torch.meshgrid(torch.arange(rows), torch.arange(cols), indexing="ij"), dim=-1)
    return ImagePatches(patches.reshape(rows * cols, -1), coord.reshape(-1, 2))  # (N, P*P*C), (N, 2)


def unpatchify(patches: torch.Tensor, grid: tuple[int, int], patch_size: int) -> torch.Tensor:
    """``patchify`` undone: an image's patches (N >= rows*cols, P*P*C), its ``grid``'s first, row by row (padding
    after them is left out) -> (C, rows*P, cols*P)."""
    rows, cols = grid
    P = patch_size
    image = patches[: rows * cols].reshape(rows, cols, P, P, -1)  # (rows, cols, P, P, C)
    return image.permute(4, 0, 2, 1, 3).reshape(-1, rows * P, cols * P)  # (C, height, width)


def pad_patches(images: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Patches:
    """``patchify``'s (patches, coordinates) of B images -> one ``Patches``, each padded to the longest with zero
    patches at coordinate (0, 0), ``valid`` False there."""
    longest = max(len(patches) for patches, _ in images)
    first = images[0][0]
    patches = first.new_zeros(len(images), longest, first.shape[-1])  # (B, N, P*P*C)
    coord = torch.zeros(len(images), longest, 2, dtype=torch.long)  # (B, N, 2)
    valid = torch.zeros(len(images), longest, dtype=torch.bool)  # (B, N)
    for row, (image_patches, image_coord) in enumerate(images):
        patches[row, : len(image_patches)] = image_patches
        coord[row, : len(image_coord)] = image_coord
        valid[row, : len(image_patches)] = True
    return Patches(patches, coord, valid)
