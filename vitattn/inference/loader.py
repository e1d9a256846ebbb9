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

__all__ = ["load_model", "runtime_of"]


def runtime_of(path: str | os.PathLike) -> str:
    """The runtime that runs the model at ``path``, known before loading it: ``onnx`` for an ONNX folder,
    else ``torch``."""
    return "onnx" if is_onnx_folder(Path(path)) else "torch"


def load_model(path: str | os.PathLike, device: str | torch.device = "cpu") -> LoadedModel:
    """The model at ``path``, ready for inference on ``device``.

    Args:
        path: a bundle folder, a training run folder, a ``.ckpt`` (PyTorch), or an ONNX folder (ONNX Runtime,
            on the CPU).
        device: where the model runs.

    Returns:
        A ``Bundle`` or an ``OnnxModel``, both ``LoadedModel``s.
    """
    if runtime_of(path) == "onnx":
        return load_onnx_folder(Path(path), device)
    return load_bundle(path, device)
