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
from typing import Any, ClassVar

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
from vitattn.models import (
    TASKS,
    CaptionDecoder,
    CocaCaptioner,
    ImageCaptioner,
    VisionTransformer,
    captioner_from_config,
)
from vitattn.models.generate import SEARCH_KEYS, CaptionSearch, beams_of
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
    "bundle_config",
    "check_arguments",
    "check_decoding",
    "check_tokenizer",
    "encoder_of",
    "img_size",
    "is_bundle_folder",
    "is_bundle_weights",
    "load_bundle_folder",
    "merge_setting",
    "read_config",
    "read_labels",
    "recorded_merge_tokens",
    "save_bundle",
]

log = logging.getLogger(__name__)

BUNDLE_FORMAT = "vitattn-bundle"
BUNDLE_VERSION = 1
# 2: images at their own aspect ratio (``preprocess`` holds ``max_patches``): an older vitattn, which would run them
# as squares, refuses the folder; square bundles stay version 1, which every vitattn reads.
PATCHES_VERSION = 2
WEIGHTS_FILE, CONFIG_FILE = "model.safetensors", "config.json"


@dataclass
class LoadedModel(ABC):
    """A model ready for inference, whichever ``runtime`` runs it (``Bundle``: ``torch``; ``OnnxModel``: ``onnx``).

    ``model`` is a ``CaptionSearch`` (task ``caption``) or a classifier ((B, C, height, width) -> (B, K) logits);
    ``config`` is the folder's description (what the model was trained, or exported, with); ``generate`` the stored
    decoding defaults; ``precision`` ``fp32`` or ``bf16`` (PyTorch, as ``load_model`` resolves ``auto``) or an ONNX
    folder's ``fp32`` or ``int8``.
    """

    runtime: ClassVar[str]
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
    def device(self) -> torch.device:
        """Where the model's inputs go."""

    @property
    def merge_tokens(self) -> int | list[int]:
        """The tokens each encoder layer merges (ToMe) as the model runs: what ``config`` records (an ONNX folder's
        graphs merge what they were exported with)."""
        return recorded_merge_tokens(self.config)

    @property
    def transform(self) -> Callable[[Image.Image], Tensor]:
        """PIL image -> (3, img_size, img_size) normalised model input."""
        return eval_transform(self.preprocess)

    def generate_settings(self, given: Mapping[str, Any] | None = None, written_out: bool = False) -> dict[str, Any]:
        """The ``generate`` keyword arguments of every entry point: the stored defaults (unknown ones dropped with a
        warning), then the ``given`` ones that ``generate`` takes and that are not None (a given ``rerank=N``
        without ``num_beams`` takes N beams, not a smaller stored count). ``written_out`` adds the
        search settings' own defaults (``max_new_tokens`` as the decoder's limit), as a report shows them."""
        parameters = inspect.signature(self.model.generate).parameters
        accepted = {k: p for k, p in parameters.items() if p.default is not inspect.Parameter.empty}
        settings = {k: v for k, v in self.generate.items() if k in accepted}
        if len(settings) < len(self.generate):
            log.warning("ignoring the model's unknown decoding settings %s", sorted(set(self.generate) - set(settings)))
        given = {k: v for k, v in (given or {}).items() if k in accepted and v is not None}
        if given.get("num_beams") is None and (settings.get("num_beams") or 1) < given.get("rerank", 1):
            settings.pop("num_beams", None)  # a stored default gives way: a given rerank=N alone takes N beams
        settings.update(given)
        if written_out:
            for key in SEARCH_KEYS:
                settings.setdefault(key, accepted[key].default)
            settings["num_beams"] = beams_of(
                settings["num_beams"], settings["rerank"], settings.get("do_sample", False)
            )
            if settings["max_new_tokens"] is None:
                settings["max_new_tokens"] = self.model.check_generate(None)  # the decoder's max_len - 1
        return settings


@dataclass
class Bundle(LoadedModel):
    """A PyTorch model (``ImageCaptioner`` or ``VisionTransformer``, in eval mode); ``config``: its ``config.json``."""

    runtime: ClassVar[str] = "torch"
    model: nn.Module

    @property
    def device(self) -> torch.device:
        """The device of the model's weights."""
        return next(self.model.parameters()).device

    @property
    def merge_tokens(self) -> int | list[int]:
        """The tokens each encoder layer merges (ToMe) as the model runs: the encoder's own setting, which
        ``load_model``'s ``merge_tokens`` may have changed from the one ``config`` records."""
        return encoder_of(self.model).config["merge_tokens"]


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
    """``arguments`` (a config's mapping) are keyword arguments of ``function`` of the types it declares, floats
    finite: a file's ``"1e-6"`` or ``NaN`` is refused here, not in a forward pass."""
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
            or (isinstance(value, list) and list[int] in allowed and all(type(v) is int for v in value))
        )
        if not ok:
            names = " or ".join(
                "null" if t is type(None) else "a list of int" if t == list[int] else t.__name__ for t in allowed
            )
            raise ValueError(f"{where} has {key}={brief(value)}; it must be {names}")


def _check_config(task: str, model_config: Mapping[str, Any], where: Path) -> None:
    if task == "caption":
        for part, cls in (("encoder", VisionTransformer), ("decoder", CaptionDecoder)):
            check_arguments(cls.__init__, model_config.get(part), f"{where}: model.{part}")
        if "contrastive" in model_config:  # head=coca
            check_arguments(CocaCaptioner.__init__, model_config["contrastive"], f"{where}: model.contrastive")
    else:
        check_arguments(VisionTransformer.__init__, model_config, f"{where}: model")


def _construct(task: str, model_config: Mapping[str, Any]) -> nn.Module:
    if task == "caption":
        return captioner_from_config(dict(model_config))
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
    """The ``task`` model of ``model_config`` on the CPU, its tensors not yet filled: load the weights of these
    ``shapes`` into it. It is built once, on the meta device, and takes memory only once its tensors have been
    shown to have the ``shapes`` of the weights: a config that does not fit is refused first."""
    if not isinstance(model_config, Mapping):
        raise ValueError(f"{where}: the model config must be a mapping, got {type(model_config).__name__}")
    _check_config(task, model_config, where)
    num_weights = sum(math.prod(shape) for shape in shapes.values())
    for key, value in _integers(model_config):  # a constructor may size a CPU list by one (depth), even on meta
        if value > num_weights:
            raise ValueError(f"{where}: model {key}={value} does not fit weights of {num_weights} numbers")
    try:  # tied weights are registered (and counted) twice, but saved once
        with torch.device("meta"), _at_most_tensors(2 * len(shapes) + 8):
            model = _construct(task, model_config)
    except _TooManyTensors:
        raise ValueError(
            f"{where}: the model config has far more tensors than the {len(shapes)} of its weights"
        ) from None
    except Exception as err:  # noqa: BLE001 - a config can make a constructor fail in any way
        raise ValueError(f"{where}: cannot build the {task} model from its config: {first_line(err)}") from None
    problem = _misfit(model, {name: tuple(shape) for name, shape in shapes.items()})
    if problem:
        raise ValueError(f"{where}: the weights do not fit the model config: {problem}")
    return _materialise(model)


def _materialise(model: nn.Module) -> nn.Module:
    """``model`` (on the meta device, every tensor in its state dict) on the CPU, uninitialised, ties kept."""
    tied: dict[int, list[str]] = {}
    for name, parameter in model.named_parameters(remove_duplicate=False):
        tied.setdefault(id(parameter), []).append(name)
    model.to_empty(device="cpu")  # gives each module a parameter of its own: tie them again
    for first, *others in tied.values():
        for name in others:
            owner, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(owner), attribute, model.get_parameter(first))
    return model


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
    """Write ``model`` (an ``ImageCaptioner``, or a ``VisionTransformer`` with classes) as a bundle folder, atomically
    (an earlier bundle there replaced), with ``eval_transform``'s ``preprocess``, its tokenizer ``vocab`` or
    ``class_names`` (default ``"0"``, ``"1"``, ...) and the decoding defaults ``generate``. Returns the folder."""
    directory = Path(directory)
    class_names = _labels(model, task, vocab, class_names)
    config = bundle_config(task, model.config, preprocess, vocab, class_names, generate)
    if directory.exists() and not (
        directory.is_dir() and (not any(directory.iterdir()) or is_bundle_folder(directory))
    ):
        raise FileExistsError(f"{directory} exists and is not a vitattn bundle; choose another folder or remove it")
    with atomic_folder(directory) as tmp:
        save_model(model, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
        if vocab is not None:
            vocab.save(tmp / tokenizer_file_name(vocab))
    return directory


def _labels(
    model: nn.Module, task: str, vocab: Tokenizer | None, class_names: Sequence[str] | None
) -> list[str] | None:
    """The class names to save with ``model`` (None for a captioner), once its ``vocab`` or ``class_names`` fit."""
    if task == "caption":
        if not isinstance(model, ImageCaptioner):
            raise ValueError(f"task='caption' needs an ImageCaptioner, got {type(model).__name__}")
        if vocab is None:
            raise ValueError("task='caption' needs vocab=Vocabulary(...) or a SubwordTokenizer")
        if len(vocab) != model.decoder.vocab_size:
            raise ValueError(f"vocab has {len(vocab)} tokens but the decoder's vocab_size={model.decoder.vocab_size}")
        return None
    if task != "classification":
        raise ValueError(f"task={task!r} is unknown; choose one of {list(TASKS)}")
    if not isinstance(model, VisionTransformer) or model.num_classes <= 0:
        raise ValueError("task='classification' needs a VisionTransformer with num_classes > 0")
    names = [str(i) for i in range(model.num_classes)] if class_names is None else [str(n) for n in class_names]
    if len(names) != model.num_classes:
        raise ValueError(f"class_names has {len(names)} names but the model has num_classes={model.num_classes}")
    return names


def bundle_config(
    task: str,
    model_config: Mapping[str, Any],
    preprocess: Mapping[str, Any],
    vocab: Tokenizer | None,
    class_names: Sequence[str] | None,
    generate: Mapping[str, Any] | None,
) -> dict[str, Any]:
    """A bundle's ``config.json``: the model's config, ``preprocess``, the tokenizer's file name (task ``caption``)
    or the ``class_names``, and the decoding defaults ``generate`` when there are any."""
    labels = {"vocab_file": tokenizer_file_name(vocab)} if task == "caption" else {"class_names": list(class_names)}
    config = {
        "format": BUNDLE_FORMAT,
        "version": BUNDLE_VERSION if preprocess.get("max_patches") is None else PATCHES_VERSION,
        "task": task,
        "model": plain_json(model_config, "model config"),
        "preprocess": check_preprocess(plain_json(preprocess, "preprocess"), "preprocess"),
        **labels,
    }
    if generate:
        config["generate"] = plain_json(dict(generate), "generate")
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
    return path.suffix == ".safetensors" and is_bundle_folder(path.parent)


def is_bundle_folder(directory: Path) -> bool:
    """Whether ``directory`` holds a bundle: its config.json says vitattn-bundle."""
    try:
        return json.loads((directory / CONFIG_FILE).read_text(encoding="utf-8")).get("format") == BUNDLE_FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def load_bundle_folder(directory: Path, device: str | torch.device) -> Bundle:
    """The bundle in ``directory`` (it holds ``config.json``), on ``device``, in eval mode."""
    config_path = directory / CONFIG_FILE
    config = read_config(config_path, "vitattn bundle config", BUNDLE_FORMAT, (BUNDLE_VERSION, PATCHES_VERSION))
    for key in ("model", "preprocess"):
        if key not in config:
            raise ValueError(f"{config_path} has no {key!r}")
    task = config["task"]
    preprocess = check_preprocess(config["preprocess"], str(config_path))
    vocab, class_names = read_labels(directory, config, config_path)
    weights = directory / WEIGHTS_FILE
    model = build_model(task, config["model"], config_path, _weight_shapes(weights, config_path))
    try:
        load_model(model, weights, strict=True, device=str(device))
    except Exception as err:  # noqa: BLE001 - safetensors raises its own error types for corrupt files
        raise ValueError(f"{weights} cannot be loaded into the model of {config_path}: {first_line(err)}") from None
    generate = config.get("generate") or {}
    check_decoding(model, task, generate, config_path)
    return finish_bundle(
        Bundle(model, task, preprocess, config, vocab, class_names, dict(generate)), device, config_path
    )


def read_config(
    path: Path, what: str, format: str, version: int | tuple[int, ...], fix: str = "", newer: str = ""
) -> dict[str, Any]:
    """The JSON ``what`` at ``path``, of ``format`` and ``version`` (or one of several) and with a known task;
    ``fix`` (``"; ..."``) ends the errors of another format or version; ``newer``, when given, in its place for a
    version above every one this vitattn reads (a newer vitattn wrote it: the fix is an upgrade)."""
    config = read_json(path, what)
    if not isinstance(config, dict) or config.get("format") != format:
        raise ValueError(f"{path} is not a {what} (format must be {format!r}){fix}")
    versions = version if isinstance(version, tuple) else (version,)
    if config.get("version") not in versions:
        written = f" (written by vitattn {brief(config['vitattn_version'])})" if "vitattn_version" in config else ""
        readable = " or ".join(map(str, versions))
        found = config.get("version")
        later = isinstance(found, int) and not isinstance(found, bool) and found > max(versions)
        ending = newer if later and newer else fix
        raise ValueError(f"{path} has version={brief(found)}{written}; this vitattn reads version {readable}{ending}")
    if config.get("task") not in TASKS:
        raise ValueError(f"{path} has task={brief(config.get('task'))}; expected one of {list(TASKS)}")
    return config


def read_labels(directory: Path, config: Mapping[str, Any], where: Path) -> tuple[Tokenizer | None, list[str] | None]:
    """The tokenizer that ``config``'s ``vocab_file`` names in ``directory`` (task ``caption``), or its
    ``class_names``."""
    if config["task"] == "caption":
        name = config.get("vocab_file", VOCAB_FILE)
        if not isinstance(name, str) or Path(name).name != name or not 0 < len(name.encode(errors="replace")) <= 255:
            raise ValueError(f"{where} has vocab_file={brief(name)}; it must be a file name inside the folder")
        return load_tokenizer(directory / name), None
    class_names = config.get("class_names")
    if not isinstance(class_names, list) or not class_names or not all(isinstance(n, str) for n in class_names):
        raise ValueError(f"{where} has no 'class_names' list of strings")
    if len(set(class_names)) != len(class_names):
        raise ValueError(f"{where} repeats class names: {brief(class_names)}")
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


def check_decoding(model: Any, task: str, generate: Any, where: Path) -> None:
    """The stored decoding defaults ``generate`` are keyword arguments that ``model.generate`` accepts."""
    if task != "caption":
        if not isinstance(generate, Mapping):
            raise ValueError(f"{where}: 'generate' must be a mapping of generate() keyword arguments")
        return
    check_arguments(CaptionSearch.generate, generate, f"{where}: generate", unknown_ok=True)
    checked = inspect.signature(model.check_generate).parameters
    try:
        model.check_generate(**{k: v for k, v in generate.items() if k in checked})
    except (TypeError, ValueError) as err:
        raise ValueError(f"{where}: generate: {first_line(err)}") from None


def check_tokenizer(vocab: Tokenizer, vocab_size: int, ids: tuple[int | None, ...], where: str | os.PathLike) -> None:
    """``vocab`` has the decoder's ``vocab_size`` and its pad, bos, eos and unk ``ids``."""
    if len(vocab) != vocab_size:
        raise ValueError(
            f"{where}: the tokenizer has {len(vocab)} tokens but the decoder's vocab_size={vocab_size}; use the "
            f"tokenizer the model was trained with (its run's {tokenizer_file_name(vocab)}), or export the model again"
        )
    theirs = (vocab.pad_id, vocab.bos_id, vocab.eos_id, vocab.unk_id)
    if tuple(ids) != theirs:
        raise ValueError(f"{where}: the decoder's pad, bos, eos and unk ids {ids} are not the vocabulary's {theirs}")


def img_size(model: nn.Module) -> int:
    """The image side that ``model`` (an ``ImageCaptioner`` or a ``VisionTransformer``) takes."""
    return int(encoder_of(model).config["img_size"])


def encoder_of(model: nn.Module) -> VisionTransformer:
    """The ``VisionTransformer`` that encodes ``model``'s images: ``model`` itself (a classifier), else the first
    in it (a captioner's encoder, also inside a zero-shot classifier)."""
    return next(m for m in model.modules() if isinstance(m, VisionTransformer))


def recorded_merge_tokens(config: Mapping[str, Any]) -> int | list[int]:
    """The ``merge_tokens`` (ToMe) that a bundle's ``config.json`` or an ONNX folder's ``onnx.json`` records for its
    encoder: what it was trained (or exported) with; 0 for a folder that records none."""
    model = config.get("model", {})
    return model.get("encoder", model).get("merge_tokens", 0)


def merge_setting(merge_tokens: int | Sequence[int] | None) -> str:
    """``merge_tokens`` as a command line writes it (``8``, ``[8,8,4,4]``): one spelling of each setting."""
    plain = merge_tokens if merge_tokens is None or isinstance(merge_tokens, int) else [int(r) for r in merge_tokens]
    return json.dumps(plain, separators=(",", ":"))


def finish_bundle(bundle: Bundle, device: str | torch.device, where: str | os.PathLike) -> Bundle:
    """``bundle`` with its model on ``device`` in eval mode, once its parts (read from ``where``) agree."""
    model, size = bundle.model, bundle.preprocess["img_size"]
    if size != img_size(model):
        raise ValueError(f"{where}: preprocess img_size={size} but the model takes {img_size(model)} px images")
    patch, own = bundle.preprocess.get("patch_size"), encoder_of(model).config["patch_size"]
    if patch is not None and patch != own:
        raise ValueError(f"{where}: preprocess patch_size={patch} but the model cuts {own} px patches")
    if bundle.vocab is not None:
        dec = model.decoder
        check_tokenizer(bundle.vocab, dec.vocab_size, (dec.pad_id, dec.bos_id, dec.eos_id, dec.unk_id), where)
        if dec.other_special_ids != bundle.vocab.other_special_ids:
            raise ValueError(
                f"{where}: the decoder's other special ids {list(dec.other_special_ids)} are not the tokenizer's "
                f"{list(bundle.vocab.other_special_ids)}"
            )
    if bundle.class_names is not None and len(bundle.class_names) != model.num_classes:
        raise ValueError(f"{where}: {len(bundle.class_names)} class_names for num_classes={model.num_classes}")
    model.to(device).eval()
    return bundle
