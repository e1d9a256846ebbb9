"""Model bundles: a folder with everything inference needs, loaded without unpickling.

A bundle folder holds ``model.safetensors`` (the weights), ``config.json`` (plain JSON: task, the
model's ``config``, the preprocessing) and, for captioning, ``vocab.json``::

    {"format": "vitattn-bundle", "version": 1, "task": "caption",
     "model": {...}, "preprocess": {"img_size": 224, "crop_pct": 0.9, "mean": [...], "std": [...],
     "interpolation": "bicubic"}, "vocab_file": "vocab.json", "generate": {"num_beams": 3}}

``generate`` (optional) holds the decoding defaults that ``vitattn-caption`` starts from.

``load_bundle`` also reads a training run folder (its ``bundle/``, else ``checkpoints/last.ckpt``)
and a Lightning ``.ckpt`` whose ``hyper_parameters`` hold the same plain values. A checkpoint is
read with ``torch.load(..., weights_only=True)``: one that needs real unpickling is refused.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
import tempfile
import zipfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from PIL import Image
from torch import nn

from vitattn.data.vocab import Vocabulary
from vitattn.fileio import read_json
from vitattn.models import ImageCaptioner, VisionTransformer

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "Bundle",
    "bundle_from_system",
    "default_preprocess",
    "eval_transform",
    "load_bundle",
    "save_bundle",
]

BUNDLE_FORMAT = "vitattn-bundle"
BUNDLE_VERSION = 1
TASKS = ("caption", "classification")
PREPROCESS_KEYS = ("img_size", "crop_pct", "mean", "std", "interpolation")
CROP_MODES = ("center", "squash", "border")  # timm's eval crop modes; optional ``crop_mode`` key
WEIGHTS_FILE, CONFIG_FILE, VOCAB_FILE = "model.safetensors", "config.json", "vocab.json"

log = logging.getLogger(__name__)


@dataclass
class Bundle:
    """A loaded model with what inference needs around it.

    Attributes:
        model: ``ImageCaptioner`` (caption) or ``VisionTransformer`` (classification), in eval mode.
        task: ``caption`` or ``classification``.
        preprocess: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation`` (and maybe
            ``crop_mode``); ``eval_transform(preprocess)`` turns a PIL image into the model's input.
        config: the whole ``config.json`` content (plain JSON values).
        vocab: the caption vocabulary (caption task), else None.
        class_names: one name per class (classification task), else None.
        generate: default ``ImageCaptioner.generate`` keyword arguments (may be empty).
    """

    model: nn.Module
    task: str
    preprocess: dict[str, Any]
    config: dict[str, Any]
    vocab: Vocabulary | None = None
    class_names: list[str] | None = None
    generate: dict[str, Any] = field(default_factory=dict)

    @property
    def transform(self) -> Callable[[Image.Image], torch.Tensor]:
        """PIL image -> (3, img_size, img_size) normalised tensor."""
        return eval_transform(self.preprocess)


def default_preprocess(img_size: int) -> dict[str, Any]:
    """The whole image squashed to ``img_size`` (bicubic), ImageNet mean/std: the built-in data's
    evaluation transform."""
    from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

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

    p = _check_preprocess(preprocess, "preprocess")
    return create_transform(
        input_size=p["img_size"],
        is_training=False,
        crop_pct=p["crop_pct"],
        crop_mode=p.get("crop_mode"),
        mean=tuple(p["mean"]),
        std=tuple(p["std"]),
        interpolation=p["interpolation"],
    )


def save_bundle(
    directory: str | os.PathLike,
    model: nn.Module,
    *,
    task: str,
    preprocess: Mapping[str, Any],
    vocab: Vocabulary | None = None,
    class_names: Sequence[str] | None = None,
    generate: Mapping[str, Any] | None = None,
) -> Path:
    """Write ``model`` as a bundle folder, atomically: a temporary folder beside it is filled, then
    renamed into place (an existing bundle there is replaced).

    Args:
        directory: the bundle folder to create.
        model: an ``ImageCaptioner`` (task ``caption``) or a ``VisionTransformer`` with
            ``num_classes > 0`` (task ``classification``).
        task: ``caption`` or ``classification``.
        preprocess: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation`` (see ``eval_transform``).
        vocab: the caption vocabulary; its size must equal the decoder's ``vocab_size``.
        class_names: one per class; default ``"0" .. "num_classes-1"``.
        generate: decoding defaults (``generate`` keyword arguments) stored for ``vitattn-caption``.

    Returns:
        The bundle folder.
    """
    from safetensors.torch import save_model

    directory = Path(directory)
    config = _bundle_config(model, task, preprocess, vocab, class_names)
    if generate:
        config["generate"] = _plain(dict(generate), "generate")
    if directory.exists() and not _replaceable(directory):
        raise FileExistsError(f"{directory} exists and is not a vitattn bundle; choose another folder or remove it")
    directory.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
    try:
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if vocab is not None:
            vocab.save(tmp / VOCAB_FILE)
        for name in os.listdir(tmp):
            _fsync(tmp / name)
        old = None
        if directory.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{directory.name}.old-", dir=directory.parent))
            os.replace(directory, old / "bundle")
        os.replace(tmp, directory)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return directory


def bundle_from_system(system: Any, directory: str | os.PathLike) -> Path:
    """Write the bundle of a trained ``CaptionSystem`` or ``ClassificationSystem``.

    Uses ``system.model``, ``system.task`` and the system's hyperparameters (``preprocess``,
    ``class_names``), its ``vocab`` and its validation decoding settings (``generate_kwargs``).
    """
    hparams = dict(getattr(system, "hparams", {}) or {})
    model = system.model
    preprocess = hparams.get("preprocess") or default_preprocess(_img_size(model))
    return save_bundle(
        directory,
        model,
        task=system.task,
        preprocess=preprocess,
        vocab=getattr(system, "vocab", None),
        class_names=hparams.get("class_names"),
        generate=getattr(system, "generate_kwargs", None),
    )


def _img_size(model: nn.Module) -> int:
    encoder = model.encoder if isinstance(model, ImageCaptioner) else model
    return int(encoder.config["img_size"])


def load_bundle(path: str | os.PathLike, device: str | torch.device = "cpu") -> Bundle:
    """Load a model for inference from a bundle, a training run folder, or a Lightning checkpoint.

    Args:
        path: a bundle folder (has ``config.json``); a training run folder (uses ``RUN/bundle`` if
            present, else ``RUN/checkpoints/last.ckpt``); or a ``.ckpt`` file whose
            ``hyper_parameters`` hold ``task``, ``model_config``, ``preprocess`` and ``vocab`` (words
            in id order) or ``class_names``, and whose ``state_dict`` keys start with ``model.``.
        device: where to put the model.

    Returns:
        A ``Bundle`` with the model in eval mode.

    Raises:
        FileNotFoundError: nothing loadable at ``path``.
        ValueError: a file is corrupt or incomplete, or a checkpoint holds pickled objects
            (it is never unpickled).
    """
    path = Path(path)
    if path.is_dir():
        if (path / CONFIG_FILE).is_file():
            return _load_bundle_dir(path, device)
        if (path / "bundle" / CONFIG_FILE).is_file():
            return _load_bundle_dir(path / "bundle", device)
        if (path / "checkpoints" / "last.ckpt").is_file():
            return _load_checkpoint(path / "checkpoints" / "last.ckpt", device)
        raise FileNotFoundError(
            f"{path} is neither a bundle (no {CONFIG_FILE}) nor a training run (no bundle/{CONFIG_FILE} "
            "or checkpoints/last.ckpt)"
        )
    if path.is_file():
        if path.name == CONFIG_FILE:
            return _load_bundle_dir(path.parent, device)
        return _load_checkpoint(path, device)
    raise FileNotFoundError(
        f"model not found: {path} (expected a bundle folder, a training run folder or a .ckpt file)"
    )


# ---------------------------------------------------------------------------------------------- save


def _bundle_config(
    model: nn.Module,
    task: str,
    preprocess: Mapping[str, Any],
    vocab: Vocabulary | None,
    class_names: Sequence[str] | None,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "task": task,
        "model": _plain(model.config, "model.config"),
        "preprocess": _check_preprocess(_plain(preprocess, "preprocess"), "preprocess"),
    }
    if task == "caption":
        if not isinstance(model, ImageCaptioner):
            raise ValueError(f"task='caption' needs an ImageCaptioner, got {type(model).__name__}")
        if vocab is None:
            raise ValueError("task='caption' needs vocab=Vocabulary(...)")
        if len(vocab) != model.decoder.vocab_size:
            raise ValueError(f"vocab has {len(vocab)} tokens but the decoder's vocab_size={model.decoder.vocab_size}")
        config["vocab_file"] = VOCAB_FILE
    elif task == "classification":
        if not isinstance(model, VisionTransformer) or model.num_classes <= 0:
            raise ValueError("task='classification' needs a VisionTransformer with num_classes > 0")
        names = [str(i) for i in range(model.num_classes)] if class_names is None else [str(n) for n in class_names]
        if len(names) != model.num_classes:
            raise ValueError(f"class_names has {len(names)} names but the model has num_classes={model.num_classes}")
        config["class_names"] = names
    else:
        raise ValueError(f"task={task!r} is unknown; choose one of {list(TASKS)}")
    return config


def _plain(value: Any, where: str) -> Any:
    """Plain JSON values (OmegaConf containers and tuples become dicts and lists)."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            value = OmegaConf.to_container(value, resolve=True)
    except ImportError:  # pragma: no cover - hydra is a dependency
        pass
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} must hold plain JSON values: {err}") from None


def _check_preprocess(preprocess: Any, where: str) -> dict[str, Any]:
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


def _replaceable(directory: Path) -> bool:
    """An empty folder or an earlier bundle may be replaced; anything else is kept."""
    if not directory.is_dir():
        return False
    if not any(directory.iterdir()):
        return True
    try:
        return json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get("format") == BUNDLE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _fsync(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


# ---------------------------------------------------------------------------------------------- load


def _one_line(err: BaseException) -> str:
    text = " ".join(str(err).split())
    return (text[:300] + "...") if len(text) > 300 else (text or type(err).__name__)


def _build_model(task: str, model_config: Any, where: Path) -> nn.Module:
    if not isinstance(model_config, Mapping):
        raise ValueError(f"{where}: the model config must be a mapping, got {type(model_config).__name__}")
    try:
        if task == "caption":
            return ImageCaptioner.from_config(dict(model_config))
        return VisionTransformer(**model_config)
    except (TypeError, ValueError, KeyError) as err:
        raise ValueError(f"{where}: cannot build the {task} model from its config: {_one_line(err)}") from None


def _load_bundle_dir(directory: Path, device: str | torch.device) -> Bundle:
    from safetensors.torch import load_model

    config_path = directory / CONFIG_FILE
    config = read_json(config_path, "bundle config")
    if not isinstance(config, dict) or config.get("format") != BUNDLE_FORMAT:
        raise ValueError(f"{config_path} is not a vitattn bundle config (format must be {BUNDLE_FORMAT!r})")
    if config.get("version") != BUNDLE_VERSION:
        raise ValueError(
            f"{config_path} has version={config.get('version')!r}; this vitattn reads version {BUNDLE_VERSION}"
        )
    task = config.get("task")
    if task not in TASKS:
        raise ValueError(f"{config_path} has task={task!r}; expected one of {list(TASKS)}")
    for key in ("model", "preprocess"):
        if key not in config:
            raise ValueError(f"{config_path} has no {key!r}")
    preprocess = _check_preprocess(config["preprocess"], str(config_path))
    vocab, class_names = None, None
    if task == "caption":
        name = config.get("vocab_file", VOCAB_FILE)
        if not isinstance(name, str) or Path(name).name != name:
            raise ValueError(f"{config_path} has vocab_file={name!r}; it must be a file name inside the bundle")
        vocab = Vocabulary.load(directory / name)
    else:
        class_names = config.get("class_names")
        if not isinstance(class_names, list):
            raise ValueError(f"{config_path} has no 'class_names' list")
    model = _build_model(task, config["model"], config_path)
    weights = directory / WEIGHTS_FILE
    if not weights.is_file():
        raise FileNotFoundError(f"bundle weights not found: {weights}")
    try:
        load_model(model, weights, strict=True, device=str(device))
    except Exception as err:  # safetensors raises its own error types for corrupt files
        raise ValueError(f"{weights} cannot be loaded into the model of {config_path}: {_one_line(err)}") from None
    generate = config.get("generate") or {}
    if not isinstance(generate, dict):
        raise ValueError(f"{config_path}: 'generate' must be a mapping of generate() keyword arguments")
    return _finish(Bundle(model, task, preprocess, config, vocab, class_names, dict(generate)), device)


def _read_checkpoint(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as err:
        with open(path, "rb") as f:
            head = f.read(2)
        if zipfile.is_zipfile(path) or head[:1] == b"\x80":  # a torch zip archive or a raw pickle
            lines = [ln.strip() for ln in str(err).splitlines()]
            detail = next((ln for ln in lines if ln.startswith(("Trying to load", "Unsupported"))), "")
            raise ValueError(
                f"{path} contains pickled objects, which are never unpickled here"
                + (f" ({detail})" if detail else "")
                + "; save the checkpoint with plain tensors and values only"
            ) from None
        raise ValueError(f"{path} is not a PyTorch checkpoint") from None
    except Exception as err:  # torch raises RuntimeError, EOFError, struct.error, ... for damaged files
        reason = "the file is empty" if path.stat().st_size == 0 else _one_line(err)
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {reason}") from None


def _load_checkpoint(path: Path, device: str | torch.device) -> Bundle:
    checkpoint = _read_checkpoint(path)
    if not isinstance(checkpoint, Mapping):
        raise ValueError(f"{path} holds a {type(checkpoint).__name__}, not a Lightning checkpoint dict")
    hparams, state = checkpoint.get("hyper_parameters"), checkpoint.get("state_dict")
    if not isinstance(hparams, Mapping) or not isinstance(state, Mapping):
        raise ValueError(f"{path} needs 'hyper_parameters' and 'state_dict' (a Lightning checkpoint)")
    if "model_config" not in hparams:
        raise ValueError(f"{path}: hyper_parameters has no 'model_config'")
    # The systems save their constructor arguments; the task follows from vocab / class_names.
    task = hparams.get("task") or (
        "caption" if "vocab" in hparams else "classification" if "class_names" in hparams else None
    )
    if task not in TASKS:
        raise ValueError(
            f"{path}: hyper_parameters task={task!r}; expected one of {list(TASKS)} (or a 'vocab' or 'class_names')"
        )
    model = _build_model(task, hparams["model_config"], path)
    if hparams.get("preprocess"):
        preprocess = _check_preprocess(hparams["preprocess"], f"{path}: hyper_parameters preprocess")
    else:
        preprocess = default_preprocess(_img_size(model))
        log.warning(
            "%s has no preprocess in hyper_parameters; using a %d px squash resize", path, preprocess["img_size"]
        )
    vocab, class_names = None, None
    if task == "caption":
        words = hparams.get("vocab")
        if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) for w in words):
            raise ValueError(f"{path}: hyper_parameters needs 'vocab', the list of words in id order")
        from vitattn.data.vocab import SPECIALS

        vocab = Vocabulary(list(words[len(SPECIALS) :]) if tuple(words[: len(SPECIALS)]) == SPECIALS else list(words))
    else:
        class_names = hparams.get("class_names")
        if not isinstance(class_names, (list, tuple)):
            raise ValueError(f"{path}: hyper_parameters needs 'class_names'")
        class_names = [str(n) for n in class_names]
    weights = {k[len("model.") :]: v for k, v in state.items() if k.startswith("model.")}
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path}: its 'model.*' weights do not fit the model: {_one_line(err)}") from None
    config = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "task": task,
        "model": _plain(hparams["model_config"], "model_config"),
        "preprocess": preprocess,
        **({"vocab_file": VOCAB_FILE} if task == "caption" else {"class_names": class_names}),
    }
    generate = hparams.get("generate") or {}
    if not isinstance(generate, Mapping):
        raise ValueError(f"{path}: hyper_parameters 'generate' must be a mapping")
    generate = _plain(dict(generate), "generate")
    if generate:
        config["generate"] = generate
    return _finish(Bundle(model, task, preprocess, config, vocab, class_names, generate), device)


def _finish(bundle: Bundle, device: str | torch.device) -> Bundle:
    bundle.model.to(device).eval()
    if bundle.vocab is not None and len(bundle.vocab) != bundle.model.decoder.vocab_size:
        raise ValueError(
            f"the vocabulary has {len(bundle.vocab)} tokens but the decoder's vocab_size={bundle.model.decoder.vocab_size}"
        )
    if bundle.class_names is not None and len(bundle.class_names) != bundle.model.num_classes:
        raise ValueError(f"{len(bundle.class_names)} class_names for num_classes={bundle.model.num_classes}")
    return bundle
