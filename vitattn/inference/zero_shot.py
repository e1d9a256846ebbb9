"""Zero-shot classification by class name with any caption model (``head=caption`` or ``head=coca``, PyTorch or an
ONNX folder). ``zero_shot_classifier(model, vocab, labels, templates, scorer)`` builds a ``ZeroShotClassifier``
once, whose ``forward(images)`` gives (B, K) class logits; ``zero_shot_model`` wraps one as the classification
``LoadedModel`` that ``Classifier`` and the classification evaluation take.

Each class is named through M templates ("a photo of a {}."): K * M prompts, tokenised as ``encode_texts`` does.
``SCORERS``: ``contrastive`` (``head=coca``: scaled cosine with the mean prompt embedding, as open_clip),
``likelihood`` (the decoder's log-probability of each prompt given the image, ``LENGTH_NORM``, a class's the log
of its prompts' mean probability), ``both`` (the sum of the two log-softmaxes) and ``auto`` (``AUTO_COCA`` for
``head=coca``). Unspellable words are warned about, indistinct classes refused (``check_prompts``). Design and
measurements: docs/captioning.md#zero-shot-classification-and-retrieval.
Dimension letters: B images, K classes, M templates, P prompts in a chunk, T prompt tokens, E embedding width."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vitattn.bundle import LoadedModel
from vitattn.data.tokenizer import Tokenizer
from vitattn.errors import brief
from vitattn.fileio import read_text
from vitattn.inference.embeddings import encode_texts
from vitattn.layers import Memory
from vitattn.losses import MAX_LOGIT_SCALE
from vitattn.models import Embedder
from vitattn.models.generate import CaptionSearch, token_log_probs
from vitattn.precision import precision_autocast

__all__ = [
    "AUTO_COCA",
    "DEFAULT_TEMPLATES",
    "LENGTH_NORM",
    "SCORERS",
    "ZeroShotClassifier",
    "check_labels",
    "check_prompts",
    "class_prompts",
    "read_lines",
    "spellable_templates",
    "template_means",
    "templates_from",
    "unspelled_words",
    "zero_shot_classifier",
    "zero_shot_model",
]

log = logging.getLogger(__name__)

# A small general set (a few of CLIP's ImageNet prompts); a user's own beat them on their domain.
DEFAULT_TEMPLATES = ("a photo of a {}.", "a picture of a {}.", "an image of a {}.", "a {}.")
SCORERS = ("auto", "contrastive", "likelihood", "both")
AUTO_COCA = "contrastive"  # what ``auto`` means for a head=coca model (docs/captioning.md: measured)
LENGTH_NORM = "total"  # a likelihood prompt's score: its total log-probability, or "mean" per token (measured)


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


def class_prompts(labels: Sequence[str], templates: Sequence[str]) -> list[str]:
    """The K * M prompts: each label in place of each template's ``{}``, label-major."""
    return [template.replace("{}", label) for label in labels for template in templates]


def template_means(texts: Tensor, num_templates: int) -> Tensor:
    """(K * M, E) prompt embeddings, label-major -> (K, E): each label's mean over its M templates, renormalised
    (the mean of unit vectors is shorter than one, and shorter the more its prompts disagree)."""
    return nn.functional.normalize(texts.view(-1, num_templates, texts.shape[-1]).mean(1), dim=-1)


def unspelled_words(vocab: Tokenizer, texts: Sequence[str]) -> list[str]:
    """The words (split at spaces, ``{}`` left out; a final period kept only where the word is known without it,
    as "a." that the toolkit's tokenizer keeps whole) of ``texts`` that ``vocab`` encodes with ``<unk>``, once
    each, in order; none for a tokenizer without an unknown token (byte-level BPE spells everything)."""
    if vocab.unk_id is None:
        return []
    found = []
    for word in dict.fromkeys(word for text in texts for word in text.replace("{}", " ").split()):
        if _unknowns(vocab, word):
            bare = word.removesuffix(".")
            found.append(bare if bare and _unknowns(vocab, bare) else word)
    return list(dict.fromkeys(found))


def _unknowns(vocab: Tokenizer, text: str) -> int:
    return vocab.encode(text).count(vocab.unk_id)


def spellable_templates(vocab: Tokenizer, labels: Sequence[str]) -> list[str]:
    """The ``DEFAULT_TEMPLATES`` whose prompts, each of ``labels`` in place, ``vocab`` encodes with no ``<unk>``
    beyond the class name's own (all of them for a byte-level BPE): whole prompts, as the tokenizer reads them
    ("a {}." makes "letter a." end in "a.", one word); ``["{}"]`` when none is: the class name alone."""
    own = [_unknowns(vocab, label) for label in labels]
    return [
        template
        for template in DEFAULT_TEMPLATES
        if all(_unknowns(vocab, prompt) <= n for prompt, n in zip(class_prompts(labels, [template]), own))
    ] or ["{}"]


def check_prompts(vocab: Tokenizer, labels: Sequence[str], templates: Sequence[str], prompts: Tensor) -> None:
    """Say what ``vocab`` cannot spell: one warning naming the words of ``labels``, ``templates`` and the prompts
    made of them that become ``<unk>``; a one-line ``ValueError`` naming the classes whose M prompts (``prompts``,
    (K * M, T)) encode to the same tokens, which no scorer can tell apart, and a prompt of each with its words that
    become ``<unk>``; an info line with the number of distinct classes."""
    texts = class_prompts(labels, templates)  # (K * M,), label-major as ``prompts``
    unknown = unspelled_words(vocab, [*labels, *templates, *texts])
    if unknown:
        log.warning(
            "zero-shot: %d word(s) of the class names and templates are not in the vocabulary and become <unk>: %s",
            len(unknown),
            ", ".join(unknown),
        )
    rows = prompts.view(len(labels), -1).tolist()  # (K, M * T): a class's prompts, as one row
    same: dict[tuple[int, ...], list[str]] = {}
    for label, row in zip(labels, rows):
        same.setdefault(tuple(row), []).append(label)
    clashes = [names for names in same.values() if len(names) > 1]
    if clashes:
        groups = "; ".join(", ".join(names) for names in clashes)
        examples = "; ".join(
            _unspelled_prompt(vocab, texts, labels.index(names[0]), len(templates)) for names in clashes
        )
        raise ValueError(
            f"zero-shot classes {groups} encode to the same tokens ({examples}), so no scorer can tell them apart; "
            "rename them in the training captions' words, give templates that spell them, or leave them out"
        )
    log.info("zero-shot: %d classes, %d distinct class prompts, %d templates", len(labels), len(same), len(templates))


def _unspelled_prompt(vocab: Tokenizer, texts: Sequence[str], label: int, num_templates: int) -> str:
    """The first of class ``label``'s prompts with words ``vocab`` cannot spell, and those words; else its first
    prompt as ``vocab`` reads it."""
    prompts = texts[label * num_templates : (label + 1) * num_templates]
    prompt = next((p for p in prompts if unspelled_words(vocab, [p])), prompts[0])
    words = unspelled_words(vocab, [prompt])
    if words:
        return f"{prompt!r} spells {', '.join(map(repr, words))} as <unk>"
    return f"{prompt!r} reads {' '.join(vocab.tokens(vocab.encode(prompt)[1:]))!r}"


class ZeroShotClassifier(nn.Module):
    """Class logits of a caption model (``CaptionSearch``: PyTorch or ONNX) by its ``scorer`` (module docstring).

    Args:
        model: the caption model; an ``Embedder`` (``head=coca``) for ``contrastive`` and ``both``.
        prompts: (K * M, T) prompt ids, label-major, ``<bos> ... <eos>`` right-padded.
        num_templates: M.
        scorer: ``contrastive``, ``likelihood`` or ``both``: ``resolve_scorer``'s, never ``auto``.
        classes: (K, E) unit-length class embeddings for ``contrastive`` and ``both``; else None.
        max_rows: most decoder rows (images times prompts) per likelihood chunk.
        length_norm: ``LENGTH_NORM``'s choices, "total" or "mean".
    """

    def __init__(
        self,
        model: CaptionSearch,
        prompts: Tensor,
        num_templates: int,
        scorer: str,
        classes: Tensor | None = None,
        max_rows: int = 4096,
        length_norm: str = LENGTH_NORM,
    ) -> None:
        super().__init__()
        assert scorer in SCORERS[1:], f"scorer={scorer!r}: resolve_scorer's, never auto"
        assert (classes is None) == (scorer == "likelihood"), "class embeddings exactly for contrastive and both"
        if length_norm not in ("total", "mean"):
            raise ValueError(f"length_norm={length_norm!r} is unknown; choose total or mean")
        self.model, self.scorer, self.max_rows, self.length_norm = model, scorer, max_rows, length_norm
        self.num_templates = num_templates
        self.num_classes = len(prompts) // num_templates
        self.pad_id = model.special_ids.pad_id
        self.register_buffer("prompts", prompts, persistent=False)  # (K * M, T)
        self.register_buffer("lengths", (prompts[:, 1:] != self.pad_id).sum(1), persistent=False)  # (K * M,)
        self.register_buffer("classes", classes, persistent=False)  # (K, E) or None

    def forward(self, images: Tensor) -> Tensor:
        """(B, C, height, width) -> (B, K) class logits; each image encoded once."""
        if self.scorer == "contrastive":
            return self.contrastive(self.model.embed_images(images))
        if self.scorer == "likelihood":
            return self.likelihood(self.model.encode(images), images.shape[0])
        memory, embedded = self.model.encode_and_embed(images)
        both = self.contrastive(embedded).log_softmax(-1) + self.likelihood(memory, images.shape[0]).log_softmax(-1)
        return both  # (B, K)

    def contrastive(self, embedded: Tensor) -> Tensor:
        """(B, E) image embeddings -> (B, K) cosines with the class embeddings times the model's learned scale
        (capped at ``MAX_LOGIT_SCALE``, as in training)."""
        scale = self.model.logit_scale.clamp(max=MAX_LOGIT_SCALE).exp().to(embedded.device)  # (1,)
        return scale * embedded @ self.classes.to(embedded).T  # (B, K)

    def likelihood(self, memory: Any, batch_size: int) -> Tensor:
        """``encode``'s output for B images -> (B, K) fp32 class log-likelihoods (module docstring)."""
        scores = self.prompt_log_probs(memory, batch_size)  # (B, K * M)
        if self.length_norm == "mean":
            scores = scores / self.lengths.to(scores)
        per_class = scores.view(batch_size, self.num_classes, self.num_templates)  # (B, K, M)
        return per_class.logsumexp(-1) - math.log(self.num_templates)  # (B, K)

    def prompt_log_probs(self, memory: Any, batch_size: int) -> Tensor:
        """(B, K * M) fp32 total log-probability of each prompt given each image, ``max_rows`` rows at a time."""
        B, (KM, _) = batch_size, self.prompts.shape
        P = max(1, self.max_rows // B)  # prompts per chunk
        chunks = []
        for start in range(0, KM, P):
            tokens = self.prompts[start : start + P]  # (P, T)
            tokens = tokens[:, : int((tokens != self.pad_id).sum(1).max())]  # (P, T'): this chunk's longest
            rows = tokens.repeat(B, 1).to(self._device(memory))  # (B * P, T'): image b's P prompts consecutive
            step = self.model.decode_step(memory, tokens.shape[1] - 1)
            chunks.append(token_log_probs(step, rows, self.pad_id).sum(1).view(B, -1))  # (B, P)
        return torch.cat(chunks, dim=1)  # (B, K * M)

    @staticmethod
    def _device(memory: Any) -> torch.device:
        return memory.tokens.device if isinstance(memory, Memory) else torch.device("cpu")  # ONNX: numpy arrays


def zero_shot_classifier(
    model: CaptionSearch,
    vocab: Tokenizer,
    labels: Sequence[str],
    templates: str | os.PathLike | Sequence[str] | None = None,
    scorer: str = "auto",
    device: torch.device | str | None = None,
) -> ZeroShotClassifier:
    """The zero-shot classifier of ``model`` over the classes ``labels``, named through ``templates``
    (``templates_from``; None: ``spellable_templates``), scored by ``scorer`` (``SCORERS``); the class
    embeddings, if any, are computed here once, without gradients, in the caller's autocast. What ``vocab``
    cannot spell is said (``check_prompts``); a bad ``scorer`` or one the model lacks: a one-line ``ValueError``.

    ``device``: where the text tower runs (default: the model's parameters', the CPU for an ONNX folder).
    Returns an ``nn.Module``: (B, C, height, width) images -> (B, K) logits; ``labels``, ``templates`` and
    ``scorer`` as used on it.
    """
    names = check_labels(labels)
    found = spellable_templates(vocab, names) if templates is None else templates_from(templates)
    scorer = resolve_scorer(model, scorer)
    prompts = encode_texts(vocab, class_prompts(names, found), model.max_len)  # (K * M, T)
    check_prompts(vocab, names, found, prompts)
    classes = None
    if scorer != "likelihood":
        if device is None:
            device = next(model.parameters()).device if isinstance(model, nn.Module) else "cpu"
        with torch.no_grad():
            texts = model.embed_texts(prompts.to(device)).float()  # (K * M, E)
        classes = template_means(texts, len(found))  # (K, E)
    classifier = ZeroShotClassifier(model, prompts, len(found), scorer, classes)
    classifier.labels, classifier.templates = names, found
    return classifier


def resolve_scorer(model: CaptionSearch, scorer: str) -> str:
    """``scorer`` with ``auto`` resolved for ``model``; a one-line ``ValueError`` for an unknown one or
    ``contrastive``/``both`` on a model without embeddings (``head=caption``)."""
    if scorer not in SCORERS:
        raise ValueError(f"scorer={scorer!r} is unknown; choose one of {list(SCORERS)}")
    embeds = isinstance(model, Embedder)
    if scorer == "auto":
        return AUTO_COCA if embeds else "likelihood"
    if scorer != "likelihood" and not embeds:
        raise ValueError(
            f"scorer={scorer} needs image and text embeddings, which only a head=coca model has; this head=caption "
            "model classifies by scorer=likelihood (or auto)"
        )
    return scorer


def zero_shot_model(
    bundle: LoadedModel,
    labels: Sequence[str],
    templates: str | os.PathLike | Sequence[str] | None = None,
    scorer: str = "auto",
    where: str = "this",
) -> LoadedModel:
    """``bundle`` (a caption model, ``head=caption`` or ``head=coca``) as a classification model of the classes
    ``labels`` (``zero_shot_classifier``, built in the bundle's precision): what ``Classifier`` and
    ``evaluate_classification`` take; its ``model`` is the ``ZeroShotClassifier`` (templates and scorer used on it)."""
    if bundle.task == "classification":
        raise ValueError(
            f"{where} is a classification model with its own classes; zero-shot classification needs a caption model"
        )
    with precision_autocast(bundle.precision, bundle.device):
        classifier = zero_shot_classifier(bundle.model, bundle.vocab, labels, templates, scorer, bundle.device)
    return dataclasses.replace(
        bundle, model=classifier.eval(), task="classification", class_names=classifier.labels, vocab=None
    )
