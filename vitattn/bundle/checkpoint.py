"""Lightning checkpoints as bundles: a trained system's bundle, and a ``.ckpt`` read back with
``torch.load(..., weights_only=True)`` (one that needs real unpickling is refused)."""

from __future__ import annotations

import logging
import os
import pickle
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vitattn.bundle.folder import Bundle, build_model, bundle_config, finish_bundle, img_size, save_bundle
from vitattn.data.preprocess import check_preprocess, default_preprocess
from vitattn.data.tokenizer import Tokenizer, tokenizer_from_labels
from vitattn.errors import first_line
from vitattn.models import TASKS

__all__ = ["bundle_from_system", "load_checkpoint"]

log = logging.getLogger(__name__)


def bundle_from_system(system: Any, directory: str | os.PathLike) -> Path:
    """Write the bundle of a trained ``CaptionSystem`` or ``ClassificationSystem``: its ``model``, ``task``, ``vocab``,
    hyperparameters (``preprocess``, ``class_names``) and validation decoding settings (``generate_kwargs``).
    """
    hparams = dict(getattr(system, "hparams", {}) or {})
    model = system.model
    preprocess = hparams.get("preprocess") or default_preprocess(img_size(model))
    return save_bundle(
        directory,
        model,
        task=system.task,
        preprocess=preprocess,
        vocab=getattr(system, "vocab", None),
        class_names=hparams.get("class_names"),
        generate=getattr(system, "generate_kwargs", None),
    )


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
    except Exception as err:  # noqa: BLE001 - torch raises RuntimeError, EOFError, struct.error, ... here
        reason = "the file is empty" if path.stat().st_size == 0 else first_line(err)
        raise ValueError(f"{path} is not a readable PyTorch checkpoint: {reason}") from None


def load_checkpoint(path: Path, device: str | torch.device) -> Bundle:
    """The model of a Lightning checkpoint written by a vitattn system, on ``device``, in eval mode."""
    hparams, state, task = _read_parts(path)
    weights = {k[len("model.") :]: v for k, v in state.items() if isinstance(k, str) and k.startswith("model.")}
    if not all(isinstance(v, torch.Tensor) for v in weights.values()):
        raise ValueError(f"{path}: its 'model.*' weights must all be tensors")
    model = build_model(task, hparams["model_config"], path, {k: v.shape for k, v in weights.items()})
    if hparams.get("preprocess"):
        preprocess = check_preprocess(hparams["preprocess"], f"{path}: hyper_parameters preprocess")
    else:
        preprocess = default_preprocess(img_size(model))
        log.warning(
            "%s has no preprocess in hyper_parameters; using a %d px squash resize", path, preprocess["img_size"]
        )
    vocab, class_names = _read_labels(path, hparams, task)
    try:
        model.load_state_dict(weights, strict=True)
    except RuntimeError as err:
        raise ValueError(f"{path}: its 'model.*' weights do not fit the model: {first_line(err)}") from None
    generate = hparams.get("generate") or {}
    if not isinstance(generate, Mapping):
        raise ValueError(f"{path}: hyper_parameters 'generate' must be a mapping")
    config = bundle_config(task, hparams["model_config"], preprocess, vocab, class_names, generate)
    bundle = Bundle(model, task, preprocess, config, vocab, class_names, config.get("generate", {}))
    return finish_bundle(bundle, device, path)


def _read_parts(path: Path) -> tuple[Mapping[str, Any], Mapping[str, Any], str]:
    """The checkpoint's ``hyper_parameters`` (with a ``model_config``), its ``state_dict`` and its task."""
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
    return hparams, state, task


def _read_labels(path: Path, hparams: Mapping[str, Any], task: str) -> tuple[Tokenizer | None, list[str] | None]:
    """The caption tokenizer (caption task) or the class names (classification task) of ``hyper_parameters``."""
    if task == "caption":
        labels = hparams.get("vocab")
        if not isinstance(labels, (list, tuple, str)) or not all(isinstance(w, str) for w in labels):
            raise ValueError(
                f"{path}: hyper_parameters needs 'vocab', the list of words in id order or a tokenizer.json text"
            )
        return tokenizer_from_labels(labels, f"{path}: hyper_parameters 'vocab'"), None
    class_names = hparams.get("class_names")
    if not isinstance(class_names, (list, tuple)):
        raise ValueError(f"{path}: hyper_parameters needs 'class_names'")
    return None, [str(n) for n in class_names]
