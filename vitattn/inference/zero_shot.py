"""Zero-shot classification by class name with a ``head=coca`` model: each class's embedding is the mean of its
prompts' text embeddings ("a photo of a {}." with the name in place of ``{}``), renormalised, as open_clip's
``build_zero_shot_classifier``; an image's logits are its scaled cosine similarities to them. The result is a
classification ``LoadedModel``, so ``Classifier`` and the classification evaluation take it as they take a trained
head (docs/captioning.md#zero-shot-classification-and-retrieval).

Dimension letters: B images, K classes, M templates, E embedding width; image sides are written out.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

from torch import Tensor, nn

from vitattn.bundle import LoadedModel
from vitattn.errors import brief
from vitattn.fileio import read_text
from vitattn.inference.embeddings import embed_texts, embedding_model
from vitattn.models import Embedder

__all__ = [
    "DEFAULT_TEMPLATES",
    "ZeroShotClassifier",
    "check_labels",
    "class_embeddings",
    "class_prompts",
    "read_lines",
    "template_means",
    "templates_from",
    "zero_shot_model",
]

# A small general set (a few of CLIP's ImageNet prompts); a user's own beat them on their domain.
DEFAULT_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a {}.")


def read_lines(path: str | os.PathLike, what: str) -> list[str]:
    """The non-blank lines of a UTF-8 text file, stripped (``what`` names it in errors)."""
    text = read_text(path, f"{what}={path} is not a file", f"{what}={path} is not UTF-8 text (one entry a line)")
    return [line.strip() for line in text.splitlines() if line.strip()]


def check_labels(labels: Sequence[str], where: str = "labels") -> list[str]:
    """``labels`` as a list of stripped names, once each; a one-line ``ValueError`` for an empty list, a blank or
    non-string name, or a repeated one."""
    if isinstance(labels, str) or not isinstance(labels, Sequence):
        raise ValueError(f"{where}={brief(labels)} must be a list of class names")
    if not labels:
        raise ValueError(f"{where} is empty; give the class names to choose from")
    bad = [x for x in labels if not isinstance(x, str) or not x.strip()]
    if bad:
        raise ValueError(f"{where} has {brief(bad[0])}; each class name is a non-blank string")
    names = [x.strip() for x in labels]
    repeated = sorted(name for name, n in Counter(names).items() if n > 1)
    if repeated:
        raise ValueError(f"{where} repeats {brief(repeated)}; give each class name once")
    return names


def templates_from(templates: str | os.PathLike | Sequence[str] | None) -> list[str]:
    """The prompt templates of ``templates``: None -> ``DEFAULT_TEMPLATES``; a list as given; a path to a file ->
    its lines; another string -> its ``|``-separated templates. Each must hold ``{}`` (one-line ``ValueError``)."""
    if templates is None:
        found = list(DEFAULT_TEMPLATES)
    elif isinstance(templates, os.PathLike) or (isinstance(templates, str) and Path(templates).is_file()):
        found = read_lines(templates, "templates")
    elif isinstance(templates, str):
        found = [t.strip() for t in templates.split("|") if t.strip()]
    else:
        found = list(templates)
    if not found:
        raise ValueError(f"templates={brief(templates)} holds no template; give at least one, each with {{}}")
    for template in found:
        if not isinstance(template, str) or "{}" not in template:
            file = " (nor is it a file)" if isinstance(templates, str) and len(found) == 1 else ""
            raise ValueError(
                f"template {brief(template)} has no {{}}{file}; each template holds {{}} where the class name goes, "
                "e.g. 'a photo of a {}.'"
            )
    return found


def class_embeddings(bundle: LoadedModel, labels: Sequence[str], templates: Sequence[str]) -> Tensor:
    """(K, E) unit-length class embeddings of ``bundle``'s text tower (``class_prompts``, ``template_means``)."""
    return template_means(embed_texts(bundle, class_prompts(labels, templates)), len(templates))


def class_prompts(labels: Sequence[str], templates: Sequence[str]) -> list[str]:
    """The K * M prompts: each label in place of each template's ``{}``, label-major."""
    return [template.replace("{}", label) for label in labels for template in templates]


def template_means(texts: Tensor, num_templates: int) -> Tensor:
    """(K * M, E) prompt embeddings, label-major -> (K, E): each label's mean over its M templates, renormalised
    (the mean of unit vectors is shorter than one, and shorter the more its prompts disagree)."""
    return nn.functional.normalize(texts.view(-1, num_templates, texts.shape[-1]).mean(1), dim=-1)


class ZeroShotClassifier(nn.Module):
    """A ``head=coca`` model's (an ``Embedder``'s) image embedding against fixed class embeddings (K, E): (B, K)
    logits, the cosine similarities times the model's learned scale (capped at 100, as in training)."""

    def __init__(self, model: Embedder, classes: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("classes", classes.to(model.logit_scale.device), persistent=False)
        self.num_classes = len(classes)

    def forward(self, images: Tensor) -> Tensor:
        """(B, C, height, width) -> (B, K)."""
        return self.logits(self.model, self.model.embed_images(images), self.classes.to(images.dtype))

    @staticmethod
    def logits(model: Embedder, images: Tensor, classes: Tensor) -> Tensor:
        """(B, E) image embeddings, (K, E) class embeddings -> (B, K) cosines times ``model``'s scale."""
        scale = model.logit_scale.clamp(max=math.log(100.0)).exp().to(images.device)  # (1,)
        return scale * images @ classes.T  # (B, K)


def zero_shot_model(
    bundle: LoadedModel,
    labels: Sequence[str],
    templates: str | os.PathLike | Sequence[str] | None = None,
    where: str = "this",
) -> LoadedModel:
    """``bundle`` (a ``head=coca`` model) as a classification model of the classes ``labels``, named through
    ``templates`` (``templates_from``): what ``Classifier`` and ``evaluate_classification`` take."""
    names = check_labels(labels)
    prompts = templates_from(templates)
    model = embedding_model(bundle, "zero-shot classification", where)
    classifier = ZeroShotClassifier(model, class_embeddings(bundle, names, prompts)).eval()
    return dataclasses.replace(bundle, model=classifier, task="classification", class_names=names, vocab=None)
