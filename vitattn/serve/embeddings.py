"""The routes beside captioning: ``POST /embed`` (an image, or JSON ``text`` / ``texts``) of a ``head=coca`` model,
and ``POST /classify`` (an image, its candidate ``labels``, ``templates`` and ``scorer`` optional) of any caption
model, zero-shot, as ``Classifier.load(labels=...)``. Bad input answers HTTP 400 with one line without failing its
batch (what may be sent: docs/serving.md).

Dimension letters: B images, N texts, K labels, E embedding width.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from vitattn.errors import brief
from vitattn.inference.embeddings import embed_pixels, embed_texts, embedding_model
from vitattn.inference.zero_shot import SCORERS, check_labels, templates_from, zero_shot_classifier
from vitattn.precision import precision_autocast
from vitattn.serve.api import BundleAPI, ImageRequest

__all__ = ["EMBEDDING_ROUTES", "ClassifyAPI", "ClassifyRequest", "EmbedAPI", "TextRequest"]

EMBEDDING_ROUTES = ("/embed", "/classify")

NO_INPUT = (
    "the request has no 'image', 'text' or 'texts'; send an image file, JSON {\"image\": \"<base64>\"}, "
    '{"text": "..."} or {"texts": ["...", ...]}'
)


@dataclass
class TextRequest:
    """One decoded ``/embed`` request of texts: ``single`` for ``text`` (one embedding back), else ``texts``."""

    texts: list[str]
    single: bool


@dataclass
class ClassifyRequest:
    """One decoded ``/classify`` request: its image (or the reason it has none), labels, templates (None: the
    spellable defaults) and scorer."""

    image: ImageRequest
    labels: list[str]
    templates: list[str] | None
    scorer: str


class _EmbeddingAPI(BundleAPI):
    """A ``BundleAPI`` of a model with embeddings (a ``head=coca`` bundle or run folder)."""

    def setup(self, device: str) -> None:
        super().setup(device)
        embedding_model(self.bundle, f"POST {self.api_path}", f"model={self.model_path}")

    def _embed_images(self, requests: list[ImageRequest]) -> list[Tensor]:
        """Each good image's (E,) embedding, one batch for all of them; None for a bad one."""
        good = [r.image for r in requests if r.image is not None]
        rows = iter(embed_pixels(self.bundle, torch.stack(good)) if good else [])  # (B, E)
        return [next(rows) if r.image is not None else None for r in requests]


class EmbedAPI(_EmbeddingAPI):
    """``POST /embed``: an image -> ``{"embedding": [E floats]}``; ``{"text": "..."}`` -> ``{"embedding"}``;
    ``{"texts": [...]}`` -> ``{"embeddings": [[E floats], ...]}``; each unit-length, in the one space of both."""

    def __init__(self, model: str, **settings: Any) -> None:
        super().__init__(model, **{"api_path": "/embed", **settings})

    def decode_request(self, request) -> ImageRequest | TextRequest:
        fields = request if hasattr(request, "keys") else {}
        text, texts = fields.get("text"), fields.get("texts")
        has_image = "image" in fields or any(hasattr(v, "file") for v in fields.values())
        if text is not None and texts is not None:
            return ImageRequest(error="the request has both 'text' and 'texts'; send one of them")
        if (text is not None or texts is not None) and has_image:
            return ImageRequest(error="the request has an image and text; embed one of them a request")
        if text is not None:
            if not isinstance(text, str):
                return ImageRequest(error=f"'text' must be a string, got {brief(text)}")
            return TextRequest([text], single=True)
        if texts is not None:
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                return ImageRequest(error=f"'texts' must be a non-empty list of strings, got {brief(texts)}")
            return TextRequest(texts, single=False)
        if not has_image:
            return ImageRequest(error=NO_INPUT)
        return super().decode_request(request)

    def predict(self, x: list | ImageRequest | TextRequest) -> list[dict[str, Any]] | dict[str, Any]:
        """Embed the batch's images together and its texts together; bad requests keep their reason."""
        requests = x if isinstance(x, list) else [x]
        images = [r if isinstance(r, ImageRequest) else ImageRequest() for r in requests]
        outputs: list[dict[str, Any]] = [{"error": r.error} for r in images]
        for i, row in enumerate(self._embed_images(images)):
            if row is not None:
                outputs[i] = {"embedding": row.tolist()}
        asked = [(i, r) for i, r in enumerate(requests) if isinstance(r, TextRequest)]
        if asked:
            rows = iter(embed_texts(self.bundle, [t for _, r in asked for t in r.texts]))  # (N, E)
            for i, r in asked:
                found = [next(rows).tolist() for _ in r.texts]
                outputs[i] = {"embedding": found[0]} if r.single else {"embeddings": found}
        return outputs if isinstance(x, list) else outputs[0]


class ClassifyAPI(BundleAPI):
    """``POST /classify``: an image and ``labels`` (a JSON list, or one form field of comma-separated names),
    ``templates`` optional (a JSON list or ``|``-separated; each with ``{}``; default ``DEFAULT_TEMPLATES`` the
    vocabulary spells), ``scorer`` optional (``SCORERS``; default ``auto``) -> ``{"labels", "probabilities"}``,
    every label, most probable first, as ``Classifier.load(labels=...)``; any caption model."""

    def __init__(self, model: str, **settings: Any) -> None:
        super().__init__(model, **{"api_path": "/classify", **settings})

    def decode_request(self, request) -> ClassifyRequest | ImageRequest:
        fields = request if hasattr(request, "keys") else {}
        try:
            labels = check_labels(_names(fields.get("labels"), ",", "labels"))
            templates = fields.get("templates")
            templates = None if templates is None else templates_from(_names(templates, "|", "templates"))
            scorer = fields.get("scorer", "auto")
            if scorer not in SCORERS:
                raise ValueError(f"'scorer' is {brief(scorer)}; choose one of {list(SCORERS)}")
        except ValueError as err:
            return ImageRequest(error=str(err))
        image = super().decode_request(request)
        return image if image.error is not None else ClassifyRequest(image, labels, templates, scorer)

    def predict(self, x: list | ClassifyRequest | ImageRequest) -> list[dict[str, Any]] | dict[str, Any]:
        """Score each good image against its own labels; a request the model cannot classify keeps its reason."""
        requests = x if isinstance(x, list) else [x]
        outputs: list[dict[str, Any]] = [{"error": getattr(r, "error", None)} for r in requests]
        for i, r in enumerate(requests):
            if isinstance(r, ClassifyRequest):
                try:
                    logits = self._logits(r)  # (K,)
                except ValueError as err:  # classes that encode alike, a scorer this model lacks
                    outputs[i] = {"error": str(err)}
                    continue
                probabilities, order = logits.softmax(-1).sort(descending=True)
                outputs[i] = {"labels": [r.labels[k] for k in order.tolist()], "probabilities": probabilities.tolist()}
        return outputs if isinstance(x, list) else outputs[0]

    def _logits(self, r: ClassifyRequest) -> Tensor:
        bundle = self.bundle
        with torch.inference_mode(), precision_autocast(bundle.precision, bundle.device):
            classify = zero_shot_classifier(bundle.model, bundle.vocab, r.labels, r.templates, r.scorer, bundle.device)
            return classify(r.image.image[None].to(bundle.device)).float().cpu()[0]  # (K,)


def _names(value: Any, sep: str, what: str) -> list[Any]:
    """A request's list of names, or one string of them separated by ``sep`` (a form field); never a file path,
    as the command line's ``templates`` may be."""
    if value is None:
        raise ValueError(f"the request has no '{what}'; send them as a JSON list or one field separated by {sep!r}")
    if isinstance(value, str):
        return [part.strip() for part in value.split(sep) if part.strip()]
    if not isinstance(value, list):
        raise ValueError(f"'{what}' must be a list of strings or one string, got {brief(value)}")
    return value
