"""Model bundles: what inference needs of a model (``LoadedModel``), and bundle folders, written atomically and
loaded without unpickling, their model config checked against the weights before any memory is taken.

A bundle folder holds ``model.safetensors``, ``config.json`` and, for captioning, the tokenizer its
``vocab_file`` names (``vocab.json`` or ``tokenizer.json``)::

    {"format": "vitattn-bundle", "version": 1, "task": "caption",
     "model": {...}, "preprocess": {"img_size": 224, "crop_pct": 0.9, "mean": [...], "std": [...],
     "interpolation": "bicubic"}, "vocab_file": "vocab.json", "generate": {"num_beams": 3}}

``generate`` (optional) holds the decoding defaults every entry point starts from.
"""

from __future__ import annotations

import collections.abc
import inspect
import json
import logging
import math
import os
import typing
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from omegaconf import OmegaConf
from PIL import Image
from safetensors import safe_open
from safetensors.torch import load_model, save_model
from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from vitattn.data.preprocess import check_preprocess, eval_transform
from vitattn.data.tokenizer import Tokenizer, load_tokenizer, tokenizer_file_name
from vitattn.errors import brief, first_line
from vitattn.fileio import atomic_folder, read_json
from vitattn.models import TASKS, CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.models.search import SEARCH_KEYS
from vitattn.run_dir import VOCAB_FILE

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "CONFIG_FILE",
    "VOCAB_FILE",
    "WEIGHTS_FILE",
    "Bundle",
    "LoadedModel",
    "build_model",
    "check_arguments",
    "is_bundle_weights",
    "load_bundle_folder",
    "save_bundle",
]

log = logging.getLogger(__name__)

BUNDLE_FORMAT = "vitattn-bundle"
BUNDLE_VERSION = 1
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


@dataclass
class LoadedModel(ABC):
    """A model ready for inference, whichever runtime runs it (``Bundle``: PyTorch; ``OnnxModel``: ONNX Runtime).

    ``model`` is a ``CaptionSearch`` (task ``caption``) or a classifier ((B, C, height, width) -> (B, K) logits);
    ``preprocess`` is what ``transform`` does; ``config`` the folder's description; ``vocab`` (captions) or
    ``class_names``; ``generate`` the stored decoding defaults; ``precision`` ``fp32`` or ``bf16`` (PyTorch, as
    ``load_model`` resolves ``auto``) or an ONNX folder's ``fp32`` or ``int8``.
    """

    model: Any
    task: str
    preprocess: dict[str, Any]
    config: dict[str, Any]
    vocab: Tokenizer | None = None
    class_names: list[str] | None = None
    generate: dict[str, Any] = field(default_factory=dict)
    precision: str = "fp32"

    @property
    @abstractmethod
    def runtime(self) -> str:
        """``torch`` or ``onnx``."""

    @property
    @abstractmethod
    def device(self) -> torch.device:
        """Where the model's inputs go."""

    @property
    def transform(self) -> Callable[[Image.Image], Tensor]:
        """PIL image -> (3, img_size, img_size) normalised model input."""
        return eval_transform(self.preprocess)

    def generate_settings(self, given: Mapping[str, Any] | None = None, written_out: bool = False) -> dict[str, Any]:
        """The ``generate`` keyword arguments to decode with, resolved here for every entry point: the stored
        defaults that ``generate`` takes (others dropped with a warning), then the ``given`` ones (any mapping,
        a command line's included) that ``generate`` takes and that are not None. ``written_out`` adds the
        search settings' own defaults, ``max_new_tokens`` as the decoder's limit, as a report shows them."""
        parameters = inspect.signature(self.model.generate).parameters
        accepted = {k: p for k, p in parameters.items() if p.default is not inspect.Parameter.empty}
        settings = {k: v for k, v in self.generate.items() if k in accepted}
        if len(settings) < len(self.generate):
            log.warning("ignoring the model's unknown decoding settings %s", sorted(set(self.generate) - set(settings)))
        settings.update({k: v for k, v in (given or {}).items() if k in accepted and v is not None})
        if written_out:
            for key in SEARCH_KEYS:
                settings.setdefault(key, accepted[key].default)
            if settings["max_new_tokens"] is None:
                settings["max_new_tokens"] = self.model.check_generate(None)  # the decoder's max_len - 1
        return settings


@dataclass
class Bundle(LoadedModel):
    """A PyTorch model (``ImageCaptioner`` or ``VisionTransformer``, in eval mode): ``LoadedModel``'s ``torch``
    runtime; ``config`` is its ``config.json``."""

    model: nn.Module

    @property
    def runtime(self) -> str:
        """``torch``."""
        return "torch"

    @property
    def device(self) -> torch.device:
        """The device of the model's weights."""
        return next(self.model.parameters()).device


class _TooManyTensors(Exception):
    pass


@contextmanager
def _at_most_tensors(limit: int) -> Iterator[None]:
    """Raise ``_TooManyTensors`` in the module constructor that registers parameter number ``limit + 1``."""
    count = 0

    def count_parameter(module: nn.Module, name: str, parameter: Any) -> None:
        nonlocal count
        count += 1
        if count > limit:
            raise _TooManyTensors

    handle = register_module_parameter_registration_hook(count_parameter)
    try:
        yield
    finally:
        handle.remove()


def check_arguments(function: Callable, arguments: Any, where: str, unknown_ok: bool = False) -> None:
    """``arguments`` (a config's mapping) are keyword arguments of ``function`` of the types it declares,
    floats finite: a file's ``"1e-6"`` or ``NaN`` is refused here rather than failing in a forward pass."""
    name = function.__qualname__.removesuffix(".__init__")
    if not isinstance(arguments, Mapping):
        raise ValueError(f"{where} must be a mapping of {name} arguments, got {brief(arguments)}")
    hints = typing.get_type_hints(function)
    for key, value in arguments.items():
        if key not in hints and unknown_ok:
            continue
        if key not in hints:
            raise ValueError(f"{where} has {brief(key)}, which is not a {name} argument")
        if typing.get_origin(hints[key]) is collections.abc.Sequence:  # of ints: a JSON list of token ids
            if not isinstance(value, list) or not all(type(v) is int and v >= 0 for v in value):
                raise ValueError(f"{where} has {key}={brief(value)}; it must be a list of non-negative integers")
            continue
        allowed = typing.get_args(hints[key]) or (hints[key],)
        ok = (
            (value is None and type(None) in allowed)
            or (isinstance(value, bool) and bool in allowed)
            or (isinstance(value, int) and not isinstance(value, bool) and (int in allowed or float in allowed))
            or (isinstance(value, float) and float in allowed and math.isfinite(value))
            or (isinstance(value, str) and str in allowed)
        )
        if not ok:
            names = " or ".join("null" if t is type(None) else t.__name__ for t in allowed)
            raise ValueError(f"{where} has {key}={brief(value)}; it must be {names}")


def _check_config(task: str, model_config: Mapping[str, Any], where: Path) -> None:
    if task == "caption":
        for part, cls in (("encoder", VisionTransformer), ("decoder", CaptionDecoder)):
            check_arguments(cls.__init__, model_config.get(part), f"{where}: model.{part}")
    else:
        check_arguments(VisionTransformer.__init__, model_config, f"{where}: model")


def _construct(task: str, model_config: Mapping[str, Any]) -> nn.Module:
    if task == "caption":
        return ImageCaptioner.from_config(dict(model_config))
    return VisionTransformer(**model_config)


def _integers(value: Any, key: str = "") -> Iterator[tuple[str, int]]:
    if isinstance(value, Mapping):
        for k, v in value.items():
            yield from _integers(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, int) and not isinstance(value, bool):
        yield key, value


def _misfit(model: nn.Module, shapes: Mapping[str, tuple[int, ...]]) -> str:
    """What keeps weights of these ``shapes`` from loading into ``model`` (strictly), or ``""``."""
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
    aliases: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        aliases.setdefault(id(parameter), []).append(name)
    saved_once = {name for names in aliases.values() if any(n in shapes for n in names) for name in names}
    for name in expected:
        if name not in shapes and name not in saved_once:
            return f"{name} is missing from the weights"
        if name in shapes and shapes[name] != expected[name]:
            return f"{name} is {list(shapes[name])} in the weights but {list(expected[name])} in the model"
    unexpected = sorted(set(shapes) - set(expected))
    return f"{unexpected[0]} is not in the model" if unexpected else ""


def build_model(task: str, model_config: Any, where: Path, shapes: Mapping[str, Sequence[int]]) -> nn.Module:
    """The ``task`` model of ``model_config``, built once a copy on the meta device (no memory) has shown that its
    tensors have the ``shapes`` of the weights: a config that does not fit is refused before any memory is
    taken, however large the sizes it names (no size exceeds the number of weights; the copy stops at the first
    tensor more than the weights hold).
    """
    if not isinstance(model_config, Mapping):
        raise ValueError(f"{where}: the model config must be a mapping, got {type(model_config).__name__}")
    _check_config(task, model_config, where)
    num_weights = sum(math.prod(shape) for shape in shapes.values())
    too_large = [(k, v) for k, v in _integers(model_config) if v > num_weights]
    if too_large:
        key, value = too_large[0]
        raise ValueError(f"{where}: model {key}={value} does not fit weights of {num_weights} numbers")
    try:  # tied weights are registered (and counted) twice, but saved once
        with torch.device("meta"), _at_most_tensors(2 * len(shapes) + 8):
            skeleton = _construct(task, model_config)
    except _TooManyTensors:
        raise ValueError(
            f"{where}: the model config has far more tensors than the {len(shapes)} of its weights"
        ) from None
    except Exception as err:  # noqa: BLE001 - a config can make a constructor fail in any way
        raise ValueError(f"{where}: cannot build the {task} model from its config: {first_line(err)}") from None
    problem = _misfit(skeleton, {name: tuple(shape) for name, shape in shapes.items()})
    if problem:
        raise ValueError(f"{where}: the weights do not fit the model config: {problem}")
    return _construct(task, model_config)


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
    """Write ``model`` (an ``ImageCaptioner``, or a ``VisionTransformer`` with classes) as a bundle folder,
    atomically (an earlier bundle there is replaced), with its ``preprocess`` (``eval_transform``'s), its
    tokenizer (``vocab``, as large as the decoder's vocabulary) or ``class_names`` (default ``"0"``, ``"1"``, ...),
    and the decoding defaults ``generate``. Returns the folder.
    """
    directory = Path(directory)
    config = _bundle_config(model, task, preprocess, vocab, class_names)
    if generate:
        config["generate"] = plain_json(dict(generate), "generate")
    if directory.exists() and not (directory.is_dir() and (not any(directory.iterdir()) or _is_bundle(directory))):
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
    return path.suffix == ".safetensors" and _is_bundle(path.parent)


def _is_bundle(directory: Path) -> bool:
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
        ids = (decoder.pad_id, decoder.bos_id, decoder.eos_id, decoder.unk_id, decoder.other_special_ids)
        expected = (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id, vocab.other_special_ids)
        if ids != expected:
            raise ValueError(
                f"{where}: the decoder's pad, bos, eos, unk and other special ids {ids} "
                f"are not the vocabulary's {expected}"
            )
    if bundle.class_names is not None and len(bundle.class_names) != bundle.model.num_classes:
        raise ValueError(f"{where}: {len(bundle.class_names)} class_names for num_classes={bundle.model.num_classes}")
    bundle.model.to(device).eval()
    return bundle
