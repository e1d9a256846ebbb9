"""The Python API: ``Captioner`` and ``Classifier``, loaded from any model path, fed images of any common kind
(paths, PIL images, numpy arrays, tensors), each made an upright 8-bit RGB image as ``read_image`` makes a file's,
then the model's ``transform`` (README.md, "Python API").

Dimension letters: B batch, C channels, T' generated tokens, gh x gw patch grid; image sides are written out.

    >>> Captioner.load("runs/coco/bundle").caption("cat.jpg", num_beams=3)
    'a cat sitting on a couch'
    >>> Classifier.load("runs/coca/bundle", labels=["cat", "dog"]).predict("cat.jpg", top_k=1).labels
    ['cat']
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from torch import Tensor

from vitattn.bundle import LoadedModel, load_model
from vitattn.data.images import read_image, upright_rgb
from vitattn.data.preprocess import batch_images
from vitattn.errors import brief
from vitattn.inference.attention_maps import attention_from_tokens, check_figures_runtime, shown_images
from vitattn.inference.candidates import CandidateOptions, candidate_lists
from vitattn.inference.captioning import generate_tokens
from vitattn.inference.embeddings import embed_pixels, embed_texts
from vitattn.inference.zero_shot import check_labels, read_lines, templates_from, zero_shot_model
from vitattn.models.generate import Controls, sequence_log_prob
from vitattn.precision import precision_autocast

__all__ = ["AttentionMaps", "Caption", "Captioner", "Classifier", "ImageLike", "Prediction", "load_model", "to_pixels"]

ImageLike = str | os.PathLike | Image.Image | np.ndarray | torch.Tensor


@dataclass
class Caption:
    """One caption: its words, the generated ids (``<eos>`` kept, padding dropped), its total log-probability as
    the search scored it (``Captioner.score``)."""

    text: str
    tokens: list[int]
    score: float


@dataclass
class AttentionMaps:
    """Where each word of ``caption`` looked, as ``vitattn-caption attention_maps=DIR`` draws it: ``words`` (``<unk>``
    kept, one per map), ``cross`` (len(words), gh, gw), the last decoder layer's cross-attention averaged over
    heads, ``rollout`` (gh, gw), the encoder's, and ``image`` (3, height, width) as the model saw it, in [0, 1]
    (``data.max_patches`` models: the image's own grid, rows x cols, and its own aspect).
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

    def __init__(self, bundle: LoadedModel, where: str = "this") -> None:
        if bundle.task != self.task:
            raise ValueError(f"{where} is a {bundle.task} model; load it with {self.other}.load")
        self.bundle, self.transform = bundle, bundle.transform
        self.model, self.runtime = bundle.model, bundle.runtime  # a PyTorch module on torch, an ONNX folder's on onnx
        self.device, self.precision = bundle.device, bundle.precision  # fp32 or bf16 (torch), fp32 or int8 (onnx)
        self.vocab, self.class_names = bundle.vocab, bundle.class_names

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        precision: str = "auto",
        *,
        merge_tokens: int | Sequence[int] | None = None,
    ) -> Any:
        """The model at ``path``, as ``load_model`` loads it (``precision``: ``auto``, ``fp32`` or ``bf16``;
        ``merge_tokens``: ToMe's tokens merged per encoder layer, None: as the model was trained)."""
        return cls(load_model(path, device, precision, merge_tokens), where=str(path))


class Captioner(_TaskModel):
    """Caption images with a trained model: ``Captioner.load(path).caption(images, num_beams=3)``; decoding
    settings left out are the model's defaults.
    """

    task, other = "caption", "Classifier"

    def pixels(self, images: Sequence[ImageLike]) -> Tensor:
        """(B, C, height, width) model inputs of ``images``, on the model's device."""
        return to_pixels(images, self.transform).to(self.device)

    def caption(
        self,
        images: ImageLike | Sequence[ImageLike],
        *,
        batch_size: int = 32,
        details: bool = False,
        num_return_sequences: int | None = None,
        include_greedy: bool = False,
        seed: int = 0,
        **generate: Any,
    ) -> Any:
        """Caption one image (an ``ImageLike``) or a list of them, ``batch_size`` per ``generate`` call, ``**generate``
        over the model's defaults: a string for one image, a list for a list; ``details``: ``Caption``s instead.
        ``num_return_sequences=K``: a list of each image's candidates instead of its caption (``vitattn-caption``'s:
        K samples with ``do_sample``, seeded by ``seed`` and the image's path or place in the call, or the beam's K
        best; ``include_greedy`` adds the greedy caption first; identical ones once); ``details``: their records,
        ``{"text", "logprob", "length", "count"}``."""
        batches, single = _batches(images, batch_size)
        results: list[Any] = []
        if num_return_sequences is not None:
            options = CandidateOptions(num_return_sequences, include_greedy, seed)
            settings = self.bundle.generate_settings(generate)
            for start, batch in zip(range(0, sum(map(len, batches)), batch_size), batches):
                keys = [str(x) if isinstance(x, (str, os.PathLike)) else str(start + i) for i, x in enumerate(batch)]
                lists = candidate_lists(self.bundle, self.pixels(batch), keys, options, settings)
                results += lists if details else [[c["text"] for c in cs] for cs in lists]
            return results[0] if single else results
        for batch in batches:
            pixels = self.pixels(batch)  # (b, C, height, width)
            texts, tokens = self.caption_pixels(pixels, **generate)  # (b, T')
            if not details:
                results += texts
                continue
            scores = self.score(pixels, tokens, **generate)
            pad = self.vocab.pad_id
            for text, row, score in zip(texts, tokens.tolist(), scores.tolist()):
                results.append(Caption(text, [t for t in row if t != pad], score))
        return results[0] if single else results

    def caption_pixels(self, pixels: Tensor, **generate: Any) -> tuple[list[str], Tensor]:
        """Captions of model inputs already made by ``transform``, (B, C, height, width): ``(texts, tokens)``, the
        tokens (B, T') as ``generate`` returns them (``vitattn-serve`` decodes requests into pixels itself)."""
        settings = self.bundle.generate_settings(generate)
        tokens = generate_tokens(self.model, pixels.to(self.device), self.precision, **settings)  # (B, T')
        return self.vocab.decode_batch(tokens), tokens

    def score(self, pixels: Tensor, tokens: Tensor, **generate: Any) -> Tensor:
        """(B,) total log-probabilities of captions ``tokens`` (B, T') of images ``pixels`` (B, C, height, width), as
        the beam search ranks them under the ``generate`` settings' controls (before its length penalty)."""
        model = self.model
        settings = self.bundle.generate_settings(generate)
        controls = Controls(*(settings.get(k, d) for k, d in Controls._field_defaults.items()))
        with torch.inference_mode(), precision_autocast(self.precision, self.device):
            step = model.decode_step(model.encode(pixels), tokens.shape[1] + 1)
            return sequence_log_prob(step, tokens, model.special_ids, controls)

    def attention_maps(self, image: ImageLike, layer: int = -1, **generate: Any) -> AttentionMaps:
        """Caption one image and say where each word looked (needs the PyTorch runtime: attention
        weights are not outputs of the ONNX graphs)."""
        check_figures_runtime(self.bundle)
        pixels = self.pixels([image])  # (1, C, height, width), or Patches: the image at its own grid
        texts, tokens = self.caption_pixels(pixels, **generate)  # tokens (1, T')
        with torch.inference_mode():  # maps in fp32, as vitattn-caption draws them: from the tokens generated
            cross, rollout = attention_from_tokens(self.model, pixels, tokens, layer)
        words = self.vocab.tokens(tokens[0].tolist())
        shown = shown_images(pixels, self.bundle.preprocess)[0]
        return AttentionMaps(texts[0], words, cross[0][: len(words)].cpu(), rollout[0].cpu(), shown)

    def embed_images(self, images: ImageLike | Sequence[ImageLike], batch_size: int = 32) -> Tensor:
        """(B, E) unit-length embeddings of one image or a list (a ``head=coca`` model's), on the CPU."""
        batches, _ = _batches(images, batch_size)
        return torch.cat([embed_pixels(self.bundle, self.pixels(batch)) for batch in batches])

    def embed_texts(self, texts: str | Sequence[str], batch_size: int = 256) -> Tensor:
        """(N, E) unit-length embeddings of one text or a list, on the CPU; a text longer than the decoder's
        ``max_len`` tokens is cut to it, with a warning that counts them."""
        return embed_texts(self.bundle, [texts] if isinstance(texts, str) else list(texts), batch_size)

    def similarity(self, images: ImageLike | Sequence[ImageLike], texts: str | Sequence[str]) -> Tensor:
        """(B, N) cosine similarities of images and texts, in [-1, 1], rows images."""
        return self.embed_images(images) @ self.embed_texts(texts).T


class Classifier(_TaskModel):
    """Classify images with a trained model: ``Classifier.load(path).predict(images, top_k=5)``; or, with a
    ``head=coca`` model, by class name: ``Classifier.load(path, labels=["cat", "dog"])`` (zero-shot)."""

    task, other = "classification", "Captioner"

    @classmethod
    def load(
        cls,
        path: str | os.PathLike,
        device: str | torch.device = "cpu",
        precision: str = "auto",
        *,
        labels: Sequence[str] | None = None,
        labels_file: str | os.PathLike | None = None,
        templates: str | os.PathLike | Sequence[str] | None = None,
        scorer: str = "auto",
        merge_tokens: int | Sequence[int] | None = None,
    ) -> Classifier:
        """The classifier at ``path``; with ``labels`` (or ``labels_file``, one name a line) a caption model's
        zero-shot classifier of those classes, named through ``templates`` (a list, a file of one a line, or
        ``|``-separated; each with ``{}``; default the ``DEFAULT_TEMPLATES`` its vocabulary spells), scored by
        ``scorer`` (``auto``, ``contrastive``, ``likelihood``, ``both``: ``vitattn.inference.zero_shot``).
        ``merge_tokens``: as ``load_model`` takes it."""
        if labels is not None and labels_file is not None:
            raise ValueError("give labels= or labels_file=, not both")
        if labels_file is not None:
            labels = read_lines(labels_file, "labels_file")
        if labels is None:
            if templates is not None:
                raise ValueError("templates= name classes for zero-shot classification; give labels= with them")
            if scorer != "auto":
                raise ValueError(f"scorer={scorer} scores classes for zero-shot classification; give labels= with it")
            return super().load(path, device, precision, merge_tokens=merge_tokens)
        names = check_labels(labels, "labels_file" if labels_file is not None else "labels")
        prompts = None if templates is None else templates_from(templates)  # refused before the model loads
        bundle = load_model(path, device, precision, merge_tokens)
        if bundle.task == "classification":
            raise ValueError(
                f"{path} is a classification model with its own classes; labels= are for zero-shot classification "
                "with a caption model"
            )
        return cls(zero_shot_model(bundle, names, prompts, scorer, where=str(path)))

    def logits(self, images: ImageLike | Sequence[ImageLike], batch_size: int = 32) -> Tensor:
        """(B, num_classes) logits of one image or a list."""
        batches, _ = _batches(images, batch_size)
        with torch.inference_mode(), precision_autocast(self.precision, self.device):
            rows = [self.model(to_pixels(batch, self.transform).to(self.device)).float().cpu() for batch in batches]
        return torch.cat(rows) if rows else torch.empty(0, len(self.class_names))

    def predict(
        self, images: ImageLike | Sequence[ImageLike], top_k: int = 5, batch_size: int = 32
    ) -> Prediction | list[Prediction]:
        """The ``top_k`` most probable classes of one image (a ``Prediction``) or of each of a list."""
        if top_k < 1:
            raise ValueError(f"top_k={top_k} must be at least 1")
        probs = self.logits(images, batch_size).softmax(-1)  # (B, num_classes)
        values, indices = probs.topk(min(top_k, probs.shape[-1]), dim=-1)
        predictions = [
            Prediction([self.class_names[i] for i in idx], p) for idx, p in zip(indices.tolist(), values.tolist())
        ]
        return predictions if isinstance(images, (list, tuple)) else predictions[0]


def _batches(images: ImageLike | Sequence[ImageLike], batch_size: int) -> tuple[list[list[ImageLike]], bool]:
    """``images`` (a list or tuple of images, anything else one image) cut into lists of ``batch_size``, and
    whether one image was given."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    single = not isinstance(images, (list, tuple))
    items = [images] if single else list(images)
    return [items[i : i + batch_size] for i in range(0, len(items), batch_size)], single


def to_pil(image: Any, where: str = "image") -> Image.Image:
    """One image of any accepted kind as an upright 8-bit RGB PIL image; ``TypeError`` for another kind,
    ``ValueError`` for an array of the wrong shape, dtype or range, ``BadImageError`` for a file it cannot read.
    """
    if isinstance(image, (str, os.PathLike)):
        return read_image(image)
    if isinstance(image, Image.Image):
        return upright_rgb(image)
    if isinstance(image, torch.Tensor):
        return Image.fromarray(_tensor_to_hwc(image, where))
    if isinstance(image, np.ndarray):
        return Image.fromarray(_array_to_hwc(image, where))
    raise TypeError(
        f"{where} is {brief(image)} ({type(image).__name__}); pass a file path, a PIL image, a (height, width, 3) "
        "uint8 numpy array or a (3, height, width) torch tensor (uint8, or float in [0, 1])"
    )


def to_pixels(
    images: Sequence[ImageLike], transform: Callable[[Image.Image], torch.Tensor], where: str = "images"
) -> torch.Tensor:
    """(B, C, height, width) model inputs of ``images`` through ``transform`` (a bundle's ``eval_transform``)."""
    return batch_images([transform(to_pil(x, f"{where}[{i}]")) for i, x in enumerate(images)])


def _array_to_hwc(a: np.ndarray, where: str) -> np.ndarray:
    if a.ndim == 2:
        a = a[..., None]
    if a.ndim != 3 or a.shape[-1] not in (1, 3):
        raise ValueError(
            f"{where} is a numpy array of shape {list(a.shape)}; "
            "pass (height, width, 3) or (height, width) uint8 pixels"
        )
    if a.dtype != np.uint8:
        raise ValueError(f"{where} is a {a.dtype} numpy array; pass uint8 pixels (0-255), e.g. np.asarray(pil_image)")
    return np.repeat(a, 3, axis=-1) if a.shape[-1] == 1 else np.ascontiguousarray(a)


def _tensor_to_hwc(x: torch.Tensor, where: str) -> np.ndarray:
    if x.ndim == 2:
        x = x[None]
    if x.ndim != 3 or x.shape[0] not in (1, 3):
        raise ValueError(
            f"{where} is a tensor of shape {list(x.shape)}; pass (3, height, width) or (height, width) pixels"
        )
    x = x.detach().cpu()
    if x.dtype == torch.uint8:
        pixels = x
    elif x.is_floating_point():
        if x.numel() and not (x.isfinite().all() and x.min() >= 0 and x.max() <= 1):
            raise ValueError(
                f"{where} is a float tensor outside [0, 1]; pass pixels in [0, 1] (as ToTensor gives them), "
                "not normalised ones"
            )
        pixels = (x.float() * 255).round().to(torch.uint8)  # 8 bits, as an image file holds them
    else:
        raise ValueError(f"{where} is a {x.dtype} tensor; pass uint8 pixels or floats in [0, 1]")
    return pixels.expand(3, -1, -1).permute(1, 2, 0).contiguous().numpy()  # (height, width, 3)
