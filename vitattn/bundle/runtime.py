"""What every entry point needs of a loaded model, whichever runtime runs it: the ``LoadedModel`` protocol.

Two runtimes implement it: ``vitattn.bundle.Bundle`` (PyTorch: an ``ImageCaptioner`` or a ``VisionTransformer``)
and ``vitattn.inference.onnx_runtime.OnnxModel`` (ONNX Runtime, on the CPU). ``vitattn.inference.load_model``
returns one or the other from any model path; the API, ``vitattn-caption`` (files and shards, one process or
many), ``vitattn-eval`` and ``vitattn-serve`` load with it and use nothing else. Neither runtime poses as the
other: what only PyTorch can do (attention maps, moving to a GPU) is asked of ``runtime`` and refused in one
line elsewhere.

Dimension letters: B images, T' generated tokens, K classes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import torch
from PIL import Image
from torch import Tensor

from vitattn.data.tokenizer import Tokenizer
from vitattn.models.search import DecodeStep, SpecialIds

__all__ = ["RUNTIMES", "CaptionNetwork", "ClassifierNetwork", "LoadedModel"]

RUNTIMES = ("torch", "onnx")


@runtime_checkable
class CaptionNetwork(Protocol):
    """A captioner as the search drives it (``ImageCaptioner``, ``OnnxCaptioner``)."""

    special_ids: SpecialIds

    def generate(self, images: Tensor, **generate: Any) -> Tensor:
        """(B, C, height, width) -> (B, T') token ids (``ImageCaptioner.generate``'s arguments)."""
        ...

    def encode(self, images: Tensor) -> Any:
        """What the decoder steps attend to, once per image."""
        ...

    def decode_step(self, memory: Any, max_new_tokens: int) -> DecodeStep:
        """The step that turns a caption so far into its next token's logits."""
        ...

    def check_generate(
        self,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        do_sample: bool = False,
        temperature: float = 1.0,
        early_stopping: bool | str = False,
    ) -> int:
        """Refuse settings the model cannot decode with; returns the ``max_new_tokens`` it will use."""
        ...


@runtime_checkable
class ClassifierNetwork(Protocol):
    """A classifier (``VisionTransformer``, ``OnnxClassifier``): images -> logits."""

    def __call__(self, images: Tensor) -> Tensor:
        """(B, C, height, width) -> (B, K) logits."""
        ...


@runtime_checkable
class LoadedModel(Protocol):
    """A model ready for inference, with everything around it that inference needs.

    Attributes:
        model: the network, a ``CaptionNetwork`` (task ``caption``) or a ``ClassifierNetwork``.
        task: ``caption`` or ``classification``.
        preprocess: ``img_size``, ``crop_pct``, ``mean``, ``std``, ``interpolation``: what ``transform`` does.
        config: the folder's whole description (plain JSON values).
        vocab: the caption tokenizer (caption task; ``vitattn.data.tokenizer``), else None.
        class_names: one name per class (classification task), else None.
        generate: the decoding defaults (``generate`` keyword arguments; may be empty).
    """

    model: Any
    task: str
    preprocess: dict[str, Any]
    config: dict[str, Any]
    vocab: Tokenizer | None
    class_names: list[str] | None
    generate: dict[str, Any]

    @property
    def runtime(self) -> str:
        """``torch`` or ``onnx``."""
        ...

    @property
    def device(self) -> torch.device:
        """Where the model's inputs go."""
        ...

    @property
    def transform(self) -> Callable[[Image.Image], Tensor]:
        """PIL image -> (3, img_size, img_size) model input."""
        ...

    def to(self, device: str | torch.device) -> LoadedModel:
        """The model on ``device`` (a one-line ``ValueError`` where its runtime cannot run there)."""
        ...
