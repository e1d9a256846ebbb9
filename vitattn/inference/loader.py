"""The one loader of every entry point: any model path -> a ``LoadedModel`` of the runtime its folder holds.

The API (``Captioner.load``, ``Classifier.load``), ``vitattn-caption`` on files and on shards (one process or
many), ``vitattn-eval`` and ``vitattn-serve`` all load here.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vitattn.bundle import load_bundle
from vitattn.bundle.onnx_folder import is_onnx_folder
from vitattn.bundle.runtime import LoadedModel
from vitattn.inference.onnx_runtime import load_onnx_folder
from vitattn.precision import check_precision, resolve_precision

__all__ = ["load_model", "runtime_of"]


def runtime_of(path: str | os.PathLike) -> str:
    """The runtime that runs the model at ``path``, known before loading it: ``onnx`` for an ONNX folder,
    else ``torch``."""
    return "onnx" if is_onnx_folder(Path(path)) else "torch"


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu", precision: str = "auto") -> LoadedModel:
    """The model at ``path``, ready for inference on ``device`` in ``precision``.

    Args:
        path: a bundle folder, a training run folder, a ``.ckpt`` (PyTorch), or an ONNX folder (ONNX Runtime,
            on the CPU).
        device: where the model runs.
        precision: ``auto``, ``fp32`` or ``bf16`` (``vitattn.precision``). An ONNX folder runs in what it was
            exported in (fp32 or int8): ``precision`` must then be ``auto`` or that, else it is refused in one line.

    Returns:
        A ``Bundle`` or an ``OnnxModel``, both ``LoadedModel``s; ``precision`` resolved (fp32 or bf16 for
        PyTorch, the folder's for ONNX).
    """
    check_precision(precision)
    if runtime_of(path) == "onnx":
        model = load_onnx_folder(Path(path), device)
        if precision not in ("auto", model.precision):
            raise ValueError(
                f"precision={precision} but {path} is an ONNX folder, which runs in the {model.precision} it was "
                f"exported in; use precision=auto, or load the bundle or run folder for {precision}"
            )
        return model
    model = load_bundle(path, device)
    model.precision = resolve_precision(precision, model.device)
    return model
