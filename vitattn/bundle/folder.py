"""Model bundles: a folder with everything inference needs, written atomically and loaded without unpickling.

A bundle folder holds ``model.safetensors`` (the weights), ``config.json`` (plain JSON: task, the
model's ``config``, the preprocessing) and, for captioning, the tokenizer its ``vocab_file`` names
(``vocab.json``, a word vocabulary, or ``tokenizer.json``, a subword tokenizer)::

    {"format": "vitattn-bundle", "version": 1, "task": "caption",
     "model": {...}, "preprocess": {"img_size": 224, "crop_pct": 0.9, "mean": [...], "std": [...],
     "interpolation": "bicubic"}, "vocab_file": "vocab.json", "generate": {"num_beams": 3}}

``generate`` (optional) holds the decoding defaults that ``vitattn-caption`` starts from.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import nn

from vitattn.bundle.arguments import build_model, check_arguments
from vitattn.bundle.runtime import LoadedModel
from vitattn.data.preprocess import check_preprocess
from vitattn.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_file_name
from vitattn.errors import brief, first_line
from vitattn.fileio import atomic_folder, read_json
from vitattn.models import TASKS, ImageCaptioner, VisionTransformer
from vitattn.run_dir import VOCAB_FILE

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "CONFIG_FILE",
    "VOCAB_FILE",
    "WEIGHTS_FILE",
    "Bundle",
    "is_bundle_weights",
    "load_bundle_folder",
    "save_bundle",
]

log = logging.getLogger(__name__)


BUNDLE_FORMAT = "vitattn-bundle"


BUNDLE_VERSION = 1


WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


@dataclass
class Bundle(LoadedModel):
    """A PyTorch model with what inference needs around it: the ``torch`` runtime of
    ``vitattn.bundle.runtime.LoadedModel`` (``vitattn.inference.onnx_runtime.OnnxModel`` is the other).

    Attributes:
        model: ``ImageCaptioner`` (caption) or ``VisionTransformer`` (classification), in eval mode.
        config: the whole ``config.json`` content; the other fields as ``LoadedModel``'s.
    """

    model: nn.Module

    @property
    def runtime(self) -> str:
        """``torch``."""
        return "torch"

    @property
    def device(self) -> torch.device:
        """The device of the model's weights."""
        return next(self.model.parameters()).device


def save_bundle(
    directory: str | os.PathLike,
    model: nn.Module,
    *,
    task: str,
    preprocess: Mapping[str, Any],
    vocab: Tokenizer | None = None,
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
        vocab: the caption tokenizer (saved as ``vocab.json`` or ``tokenizer.json``); its size must equal the
            decoder's ``vocab_size``.
        class_names: one per class; default ``"0" .. "num_classes-1"``.
        generate: decoding defaults (``generate`` keyword arguments) stored for ``vitattn-caption``.

    Returns:
        The bundle folder.
    """
    directory = Path(directory)
    config = _bundle_config(model, task, preprocess, vocab, class_names)
    if generate:
        config["generate"] = plain_json(dict(generate), "generate")
    if directory.exists() and not _replaceable(directory):
        raise FileExistsError(f"{directory} exists and is not a vitattn bundle; choose another folder or remove it")
    with atomic_folder(directory) as tmp:
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if vocab is not None:
            vocab.save(tmp / tokenizer_file_name(vocab))
    return directory


def _bundle_config(
    model: nn.Module,
    task: str,
    preprocess: Mapping[str, Any],
    vocab: Tokenizer | None,
    class_names: Sequence[str] | None,
) -> dict[str, Any]:
    config: dict[str, Any] = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION,
        "task": task,
        "model": plain_json(model.config, "model.config"),
        "preprocess": check_preprocess(plain_json(preprocess, "preprocess"), "preprocess"),
    }
    if task == "caption":
        if not isinstance(model, ImageCaptioner):
            raise ValueError(f"task='caption' needs an ImageCaptioner, got {type(model).__name__}")
        if vocab is None:
            raise ValueError("task='caption' needs vocab=Vocabulary(...) or a SubwordTokenizer")
        if len(vocab) != model.decoder.vocab_size:
            raise ValueError(f"vocab has {len(vocab)} tokens but the decoder's vocab_size={model.decoder.vocab_size}")
        config["vocab_file"] = tokenizer_file_name(vocab)
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


def plain_json(value: Any, where: str) -> Any:
    """Plain JSON values (OmegaConf containers and tuples become dicts and lists)."""
    if OmegaConf.is_config(value):
        value = OmegaConf.to_container(value, resolve=True)
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where} must hold plain JSON values: {err}") from None


def is_bundle_weights(path: Path) -> bool:
    """A bundle's ``model.safetensors`` (its folder's config.json says vitattn-bundle)."""
    config = path.parent / CONFIG_FILE
    if path.suffix != ".safetensors" or not config.is_file():
        return False
    try:
        return json.loads(config.read_text(encoding="utf-8")).get("format") == BUNDLE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


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


def load_bundle_folder(directory: Path, device: str | torch.device) -> Bundle:
    """The bundle in ``directory`` (it holds ``config.json``), on ``device``, in eval mode."""
    config_path = directory / CONFIG_FILE
    config = _read_config(config_path)
    task = config["task"]
    preprocess = check_preprocess(config["preprocess"], str(config_path))
    vocab, class_names = _read_labels(directory, config_path, config)
    weights = directory / WEIGHTS_FILE
    model = build_model(task, config["model"], config_path, _weight_shapes(weights, config_path))
    try:
        load_model(model, weights, strict=True, device=str(device))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        raise ValueError(f"{weights} cannot be loaded into the model of {config_path}: {first_line(err)}") from None
    generate = config.get("generate") or {}
    _check_generate(model, task, generate, config_path)
    return finish_bundle(
        Bundle(model, task, preprocess, config, vocab, class_names, dict(generate)), device, config_path
    )


def _read_config(config_path: Path) -> dict[str, Any]:
    """``config.json`` of a bundle of this format and version, with a known task, a model and a preprocess."""
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
    return config


def _read_labels(
    directory: Path, config_path: Path, config: dict[str, Any]
) -> tuple[Tokenizer | None, list[str] | None]:
    """The caption tokenizer (caption task) or the class names (classification task)."""
    if config["task"] == "caption":
        name = config.get("vocab_file", VOCAB_FILE)
        if not isinstance(name, str) or Path(name).name != name or not 0 < len(name.encode(errors="replace")) <= 255:
            raise ValueError(f"{config_path} has vocab_file={brief(name)}; it must be a file name inside the bundle")
        return load_tokenizer(directory / name), None
    class_names = config.get("class_names")
    if not isinstance(class_names, list) or not all(isinstance(name, str) for name in class_names):
        raise ValueError(f"{config_path} has no 'class_names' list of strings")
    if len(set(class_names)) != len(class_names):
        raise ValueError(f"{config_path} repeats class names: {brief(class_names)}")
    return None, class_names


def _weight_shapes(weights: Path, config_path: Path) -> dict[str, list[int]]:
    """Name -> shape of each tensor in the weights file, read from its header (no tensor is loaded)."""
    if not weights.is_file():
        raise FileNotFoundError(f"bundle weights not found: {weights}")
    try:
        with safe_open(weights, "pt") as f:
            return {name: f.get_slice(name).get_shape() for name in f.keys()}
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        raise ValueError(f"{weights} cannot be loaded into the model of {config_path}: {first_line(err)}") from None


def _check_generate(model: nn.Module, task: str, generate: Any, config_path: Path) -> None:
    """The stored decoding defaults are ``generate`` keyword arguments the model accepts."""
    if task == "caption":
        check_arguments(ImageCaptioner.generate, generate, f"{config_path}: generate", unknown_ok=True)
        try:
            checked = inspect.signature(model.check_generate).parameters
            model.check_generate(**{k: v for k, v in generate.items() if k in checked})
        except ValueError as err:
            raise ValueError(f"{config_path}: generate: {err}") from None
    elif not isinstance(generate, dict):
        raise ValueError(f"{config_path}: 'generate' must be a mapping of generate() keyword arguments")


def finish_bundle(bundle: Bundle, device: str | torch.device, where: str | os.PathLike) -> Bundle:
    """``bundle`` with its model on ``device`` in eval mode, once its parts are known to agree (``where`` names
    the file they were read from)."""
    encoder = bundle.model.encoder if isinstance(bundle.model, ImageCaptioner) else bundle.model
    if bundle.preprocess["img_size"] != encoder.config["img_size"]:
        raise ValueError(
            f"{where}: preprocess img_size={bundle.preprocess['img_size']} "
            f"but the model takes {encoder.config['img_size']} px images"
        )
    if bundle.vocab is not None and len(bundle.vocab) != bundle.model.decoder.vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {len(bundle.vocab)} tokens but the decoder's "
            f"vocab_size={bundle.model.decoder.vocab_size}; use the tokenizer the model was trained with "
            f"(its run's {tokenizer_file_name(bundle.vocab)}), or export the model again"
        )
    if bundle.vocab is not None:
        decoder, vocab = bundle.model.decoder, bundle.vocab
        ids = (decoder.pad_id, decoder.bos_id, decoder.eos_id, decoder.unk_id)
        if ids != (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id):
            raise ValueError(
                f"{where}: the decoder's pad, bos, eos and unk ids {ids} "
                f"are not the vocabulary's {(vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id)}"
            )
    if bundle.class_names is not None and len(bundle.class_names) != bundle.model.num_classes:
        raise ValueError(f"{where}: {len(bundle.class_names)} class_names for num_classes={bundle.model.num_classes}")
    bundle.model.to(device).eval()
    return bundle
