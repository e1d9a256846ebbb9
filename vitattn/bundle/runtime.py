"""What every entry point needs of a loaded model, whichever runtime runs it: ``LoadedModel``.

Two runtimes subclass it: ``vitattn.bundle.Bundle`` (PyTorch: an ``ImageCaptioner`` or a ``VisionTransformer``)
and ``vitattn.inference.onnx_runtime.OnnxModel`` (ONNX Runtime, on the CPU). Their caption networks share the
search (``vitattn.models.search.CaptionSearch``); a classifier network maps images to logits.
``vitattn.inference.load_model`` returns one or the other from any model path; the API, ``vitattn-caption``
(files and shards, one process or many), ``vitattn-eval`` and ``vitattn-serve`` load with it and use nothing
else. Neither runtime poses as the other: what only PyTorch can do (attention maps) is asked of ``runtime`` and
refused in one line elsewhere.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from PIL import Image
from torch import Tensor

from vitattn.data.preprocess import eval_transform
from vitattn.data.tokenizer import Tokenizer
from vitattn.precision import precision_autocast

__all__ = ["LoadedModel"]


@dataclass
class LoadedModel(ABC):
    """A model ready for inference, with everything around it that inference needs.

    Attributes:
        model: the network: a ``CaptionSearch`` (task ``caption``: ``generate``, ``encode``, ``decode_step``,
            ``check_generate``, ``special_ids``) or a classifier (images (B, C, height, width) -> (B, K) logits).
        task: ``caption`` or ``classification``.
        preprocess: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation``: what ``transform`` does.
        config: the folder's whole description (plain JSON values).
        vocab: the caption tokenizer (caption task; ``vitattn.data.tokenizer``), else None.
        class_names: one name per class (classification task), else None.
        generate: the decoding defaults (``generate`` keyword arguments; may be empty).
        precision: what inference runs in: ``fp32`` or ``bf16`` (autocast) for PyTorch, as ``load_model`` resolves
            ``precision=auto``; ``fp32`` or ``int8`` for an ONNX folder, as it was exported.
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

    def autocast(self) -> contextlib.AbstractContextManager:
        """What the model's calls run under: bf16 ``torch.autocast`` on its device when ``precision`` is bf16,
        else nothing."""
        return precision_autocast(self.precision, self.device)

    @property
    def transform(self) -> Callable[[Image.Image], Tensor]:
        """PIL image -> (3, img_size, img_size) normalised model input."""
        return eval_transform(self.preprocess)
