"""The Python API: ``Captioner`` and ``Classifier``, loaded from a bundle, a run folder, a checkpoint or
an ONNX folder (``vitattn-export format=onnx``), fed images of any common kind.

Dimension letters: B batch, C channels, T' generated tokens, gh x gw patch grid; image sides are written out
(height, width): H is heads elsewhere.

    >>> from vitattn import Captioner
    >>> captioner = Captioner.load("runs/coco/bundle")
    >>> captioner.caption("cat.jpg", num_beams=3)
    'a cat sitting on a couch'

The runtime follows the folder's content: an ONNX folder runs on ONNX Runtime, anything else on
PyTorch; both decode with the same search loops (``vitattn.models.search``).
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vitattn.bundle.runtime import LoadedModel
from vitattn.data.preprocess import denormalize
from vitattn.inference.attention_maps import attention_from_tokens
from vitattn.inference.captioning import generate_tokens
from vitattn.inference.figures import caption_words, check_figures_runtime
from vitattn.inference.file_list import InputImage
from vitattn.inference.image_like import ImageLike, as_image_list, to_pixels
from vitattn.inference.loader import load_model
from vitattn.inference.writers import CaptionSummary, caption_to_file
from vitattn.models.search import sequence_log_prob

__all__ = ["AttentionMaps", "Caption", "Captioner", "Classifier", "Prediction", "load_model"]

log = logging.getLogger(__name__)


@dataclass
class Caption:
    """One caption with what produced it.

    Attributes:
        text: the words, special tokens left out.
        tokens: the generated ids (``<eos>`` included, padding dropped).
        score: the caption's total log-probability under the model.
    """

    text: str
    tokens: list[int]
    score: float


@dataclass
class AttentionMaps:
    """Where each word of a caption looked: what ``vitattn-caption attention_maps=DIR`` draws.

    Attributes:
        caption: the caption.
        words: its words, one per map (``<unk>`` kept so that words line up with positions).
        cross: (len(words), gh, gw) the last decoder layer's cross-attention of each word, averaged over
            heads, each summing to 1 over the patches.
        rollout: (gh, gw) the encoder's attention rollout of the class token.
        image: (3, height, width) the image as the model saw it, in [0, 1] (for drawing the maps over it).
    """

    caption: str
    words: list[str]
    cross: Tensor
    rollout: Tensor
    image: Tensor

    def figure(self) -> Any:
        """The matplotlib ``Figure`` ``vitattn-caption`` saves: the image, one overlay per word, the rollout."""
        from vitattn.inference.attention_maps import attention_figure  # matplotlib: only when a figure is drawn

        return attention_figure(self.image, self.words, self.cross, self.rollout, title=self.caption)


@dataclass
class Prediction:
    """A classifier's ``top_k`` classes of one image, most probable first."""

    labels: list[str]
    probabilities: list[float]


class _TaskModel:
    """What ``Captioner`` and ``Classifier`` share: a ``LoadedModel`` of one task, loaded from any model path."""

    task = ""
    other = ""  # the class that loads the other task

    def __init__(self, bundle: LoadedModel) -> None:
        if bundle.task != self.task:
            raise ValueError(f"this is a {bundle.task} model; load it with {self.other}.load")
        self.bundle = bundle
        self.transform = bundle.transform

    @classmethod
    def load(cls, path: str | os.PathLike, device: str | torch.device = "cpu", precision: str = "auto") -> Any:
        """The model at ``path``: a bundle folder, a training run folder, a ``.ckpt`` or an ONNX folder, run in
        ``precision``: ``auto`` (bf16 on GPUs and on CPUs with bf16 matrix units, else fp32), ``fp32`` or
        ``bf16`` (PyTorch models only: an ONNX folder runs in what it was exported in, fp32 or int8)."""
        bundle = load_model(path, device, precision)
        if bundle.task != cls.task:
            raise ValueError(f"{path} is a {bundle.task} model; load it with {cls.other}.load")
        return cls(bundle)

    @property
    def model(self) -> Any:
        """The network: the PyTorch module, or the ONNX Runtime model of an ONNX folder (``OnnxCaptioner``,
        ``OnnxClassifier``)."""
        return self.bundle.model

    @property
    def runtime(self) -> str:
        """``torch`` or ``onnx``."""
        return self.bundle.runtime

    @property
    def device(self) -> torch.device:
        """Where the model runs."""
        return self.bundle.device

    @property
    def precision(self) -> str:
        """What the model runs in: ``fp32`` or ``bf16`` (``load``'s ``precision`` resolved), or an ONNX folder's
        ``fp32`` or ``int8``."""
        return self.bundle.precision


class Captioner(_TaskModel):
    """Caption images with a trained model.

    Load with ``Captioner.load(path)``; ``caption`` takes one image or a list (file paths, PIL images,
    (height, width, 3) uint8 arrays, (3, height, width) tensors) and batches them; ``generate`` keyword arguments left
    out come from the bundle's defaults.

    Args:
        bundle: a caption model (``load_model``'s output).
    """

    task, other = "caption", "Classifier"

    def __init__(self, bundle: LoadedModel) -> None:
        super().__init__(bundle)
        self.vocab = bundle.vocab

    def generate_settings(self, **generate: Any) -> dict[str, Any]:
        """``generate`` keyword arguments: the bundle's defaults, then those given that are not None;
        bundle defaults that ``generate`` does not accept are dropped with a warning."""
        accepted = inspect.signature(self.model.generate).parameters
        defaults = self.bundle.generate
        settings = {k: v for k, v in defaults.items() if k in accepted}
        if len(settings) < len(defaults):
            log.warning("ignoring the bundle's unknown decoding settings %s", sorted(set(defaults) - set(settings)))
        settings.update({k: v for k, v in generate.items() if v is not None})
        return settings

    def pixels(self, images: Sequence[ImageLike]) -> Tensor:
        """(B, C, height, width) model inputs of ``images``, on the model's device."""
        return to_pixels(images, self.transform).to(self.device)

    def caption(
        self,
        images: ImageLike | Sequence[ImageLike],
        *,
        batch_size: int = 32,
        details: bool = False,
        **generate: Any,
    ) -> str | list[str] | Caption | list[Caption]:
        """Caption one image or a list of them.

        Args:
            images: a file path, PIL image, (height, width, 3) uint8 array or (3, height, width) tensor (uint8, or float
                in [0, 1]); or a list of them.
            batch_size: images per ``generate`` call.
            details: return ``Caption``s (text, tokens, log-probability) instead of strings.
            **generate: ``num_beams``, ``max_new_tokens``, ``length_penalty``, ``do_sample``, ...

        Returns:
            A string (or ``Caption``) for one image, a list for a list.
        """
        items, single = as_image_list(images)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        results: list[str | Caption] = []
        for start in range(0, len(items), batch_size):
            pixels = self.pixels(items[start : start + batch_size])  # (b, C, height, width)
            texts, tokens = self.caption_pixels(pixels, **generate)  # (b, T')
            if not details:
                results += texts
                continue
            scores = self.score(pixels, tokens)
            pad = self.vocab.pad_id
            for text, row, score in zip(texts, tokens.tolist(), scores.tolist()):
                results.append(Caption(text, [t for t in row if t != pad], score))
        return results[0] if single else results

    def caption_pixels(self, pixels: Tensor, **generate: Any) -> tuple[list[str], Tensor]:
        """Captions of model inputs already made by ``transform``, (B, C, height, width): ``(texts, tokens)``, the
        tokens (B, T') as ``generate`` returns them (``vitattn-serve`` decodes requests into pixels itself)."""
        settings = self.generate_settings(**generate)
        tokens = generate_tokens(self.model, pixels.to(self.device), self.precision, **settings)  # (B, T')
        return self.vocab.decode_batch(tokens), tokens

    def score(self, pixels: Tensor, tokens: Tensor) -> Tensor:
        """(B,) total log-probabilities of captions ``tokens`` (B, T') of images ``pixels`` (B, C, height, width)."""
        model = self.model
        with torch.inference_mode(), self.bundle.autocast():
            step = model.decode_step(model.encode(pixels), tokens.shape[1] + 1)
            return sequence_log_prob(step, tokens, model.special_ids)

    def attention_maps(self, image: ImageLike, layer: int = -1, **generate: Any) -> AttentionMaps:
        """Caption one image and say where each word looked (needs the PyTorch runtime: attention
        weights are not outputs of the ONNX graphs)."""
        if self.runtime != "torch":
            raise ValueError(
                "attention maps need the PyTorch runtime; load the bundle or run folder instead of the ONNX folder"
            )
        pixels = self.pixels([image])  # (1, C, height, width)
        tokens = generate_tokens(self.model, pixels, self.precision, **self.generate_settings(**generate))  # (1, T')
        with torch.inference_mode():  # maps in fp32, as vitattn-caption draws them: from the tokens generated
            cross, rollout = attention_from_tokens(self.model, pixels, tokens, layer)
        words = caption_words(tokens[0].tolist(), self.vocab)
        shown = denormalize(pixels[0].float().cpu(), self.bundle.preprocess["mean"], self.bundle.preprocess["std"])
        return AttentionMaps(
            self.vocab.decode(tokens[0]), words, cross[0, : len(words)].cpu(), rollout[0].cpu(), shown.clamp(0, 1)
        )

    def caption_files(self, inputs: Sequence[InputImage], out: str | os.PathLike, **options: Any) -> CaptionSummary:
        """Caption image files into ``out``, resumably: ``vitattn.inference.caption_to_file`` with this model
        (``options``: ``format``, ``batch_size``, ``num_workers``, ``progress``, ``attention_maps`` and
        ``generate`` settings). Returns its ``CaptionSummary``."""
        generate = {k: options.pop(k) for k in list(options) if k not in _FILE_OPTIONS}
        if options.get("attention_maps") is not None:
            check_figures_runtime(self.bundle)
        return caption_to_file(self.bundle, inputs, out, **options, **self.generate_settings(**generate))


_FILE_OPTIONS = ("format", "batch_size", "num_workers", "progress", "attention_maps")


class Classifier(_TaskModel):
    """Classify images with a trained model: ``Classifier.load(path).predict(images, top_k=5)``.

    Args:
        bundle: a classification model (``load_model``'s output).
    """

    task, other = "classification", "Captioner"

    def __init__(self, bundle: LoadedModel) -> None:
        super().__init__(bundle)
        self.class_names = bundle.class_names

    def logits(self, images: ImageLike | Sequence[ImageLike], batch_size: int = 32) -> Tensor:
        """(B, num_classes) logits of one image or a list."""
        items, _ = as_image_list(images)
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        device = self.device
        rows = []
        with torch.inference_mode(), self.bundle.autocast():
            for start in range(0, len(items), batch_size):
                pixels = to_pixels(items[start : start + batch_size], self.transform).to(device)
                rows.append(self.model(pixels).float().cpu())
        return torch.cat(rows) if rows else torch.empty(0, len(self.class_names))

    def predict(
        self, images: ImageLike | Sequence[ImageLike], top_k: int = 5, batch_size: int = 32
    ) -> Prediction | list[Prediction]:
        """The ``top_k`` most probable classes of one image (a ``Prediction``) or of each of a list."""
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be at least 1")
        _, single = as_image_list(images)
        probs = self.logits(images, batch_size).softmax(-1)  # (B, num_classes)
        values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        predictions = [
            Prediction([self.class_names[i] for i in idx], p) for idx, p in zip(indices.tolist(), values.tolist())
        ]
        return predictions[0] if single else predictions
