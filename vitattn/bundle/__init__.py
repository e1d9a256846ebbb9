"""Models as inference loads them: ``load_model`` turns any model path (or ``hf-hub:`` name) into a
``LoadedModel`` of the runtime its folder holds (``Bundle``: PyTorch; ``OnnxModel``: ONNX Runtime).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch

from vitattn.bundle.checkpoint import bundle_from_system, load_checkpoint
from vitattn.bundle.folder import (
    BUNDLE_FORMAT,
    BUNDLE_VERSION,
    CONFIG_FILE,
    Bundle,
    LoadedModel,
    encoder_of,
    load_bundle_folder,
    merge_setting,
    recorded_merge_tokens,
    save_bundle,
)
from vitattn.bundle.hub import resolve_model_path
from vitattn.bundle.onnx_folder import is_onnx_folder, load_onnx_folder
from vitattn.precision import check_precision, resolve_precision
from vitattn.run_dir import RunDir

__all__ = [
    "BUNDLE_FORMAT",
    "BUNDLE_VERSION",
    "Bundle",
    "LoadedModel",
    "bundle_from_system",
    "load_bundle",
    "load_checkpoint",
    "load_model",
    "runtime_of",
    "save_bundle",
]

log = logging.getLogger(__name__)


def load_bundle(path: str | os.PathLike, device: str | torch.device = "cpu") -> Bundle:
    """The PyTorch model at ``path``, in eval mode on ``device``: a bundle folder (``config.json``), a training run
    folder (its ``bundle/``, else ``checkpoints/last.ckpt``), a Lightning ``.ckpt`` (never unpickled) or a
    ``hf-hub:ORG/NAME[@REVISION]`` bundle."""
    path = resolve_model_path(path)
    if path.is_dir():
        run = RunDir(path)
        if (path / CONFIG_FILE).is_file():
            return load_bundle_folder(path, device)
        if (run.bundle / CONFIG_FILE).is_file():
            return load_bundle_folder(run.bundle, device)
        if run.last_checkpoint.is_file():
            return load_checkpoint(run.last_checkpoint, device)
        raise FileNotFoundError(
            f"{path} is neither a bundle (no {CONFIG_FILE}) nor a training run (no "
            f"{(run.bundle / CONFIG_FILE).relative_to(path)} or {run.last_checkpoint.relative_to(path)})"
        )
    if path.is_file():
        if path.name == CONFIG_FILE:
            return load_bundle_folder(path.parent, device)
        return load_checkpoint(path, device)
    raise FileNotFoundError(
        f"model not found: {path} (expected a bundle folder, a training run folder or a .ckpt file)"
    )


def runtime_of(path: str | os.PathLike) -> str:
    """``onnx`` for an ONNX folder, else ``torch``: the runtime of the model at ``path`` (or ``hf-hub:`` name),
    known before loading it."""
    return "onnx" if is_onnx_folder(resolve_model_path(path)) else "torch"


def load_model(
    path: str | os.PathLike,
    device: str | torch.device = "cpu",
    precision: str = "auto",
    merge_tokens: int | Sequence[int] | None = None,
) -> LoadedModel:
    """The model at ``path`` (a bundle folder, run folder or ``.ckpt`` on PyTorch; an ONNX folder on ONNX Runtime,
    on the CPU; either as ``hf-hub:ORG/NAME[@REVISION]``), ready on ``device``: the one loader of the API and every
    entry point. ``precision`` (``auto``, ``fp32``, ``bf16``) is resolved for ``device``; an ONNX folder runs in the
    one it was exported in. ``merge_tokens`` (ToMe: an int, or one count per encoder layer; 0: off) runs the encoder
    with that merge whatever it was trained with (None: the one its config records, which stays as it is); an ONNX
    folder runs the one it was exported with."""
    check_precision(precision)
    path = resolve_model_path(path)
    if runtime_of(path) == "onnx":
        model = load_onnx_folder(path, device)
        if precision not in ("auto", model.precision):
            raise ValueError(
                f"precision={precision} but {path} is an ONNX folder, which runs in the {model.precision} it was "
                f"exported in; use precision=auto, or load the bundle or run folder for {precision}"
            )
        wanted, exported = merge_setting(merge_tokens), merge_setting(model.merge_tokens)
        if merge_tokens is not None and wanted != exported:
            raise ValueError(
                f"merge_tokens={wanted} but {path} is an ONNX folder, whose graphs merge the merge_tokens={exported} "
                f"they were exported with; export it again with vitattn-export model=RUN format=onnx "
                f"merge_tokens={wanted}, or load the bundle or run folder"
            )
        return model
    model = load_bundle(path, device)
    model.precision = resolve_precision(precision, model.device)
    if merge_tokens is not None:
        encoder_of(model.model).set_merge_tokens(merge_tokens)
        trained = merge_setting(recorded_merge_tokens(model.config))
        log.info("%s: running with merge_tokens=%s (trained with %s)", path, merge_setting(merge_tokens), trained)
    return model
