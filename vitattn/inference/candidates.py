"""Scored caption candidates, the first half of learning from images without captions: K captions of each image
from one encoding (``CaptionSearch.candidates``), those the COCO toolkit tokenises alike kept once with a
``count``, each scored by a filter model, and the manifest written beside the side files that hold them
(docs/captioning.md#caption-candidates).

Dimension letters: B images, R candidates of an image, T tokens.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from vitattn.bundle import LoadedModel
from vitattn.fileio import atomic_open
from vitattn.inference.embeddings import embedding_model, encode_texts
from vitattn.metrics.tokenize import COCO_PUNCTUATION, coco_tokenize
from vitattn.models import Embedder
from vitattn.models.generate import token_log_probs
from vitattn.precision import precision_autocast

__all__ = [
    "QUANTILES",
    "SCORE_KINDS",
    "CandidateFilter",
    "CandidateOptions",
    "candidate_lists",
    "read_records",
    "write_manifest",
]

SCORE_KINDS = ("auto", "contrastive", "likelihood")
QUANTILES = (0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)


class CandidateFilter:
    """A caption model (``head=caption`` or ``head=coca``; the captioner itself or one trained apart) that scores
    candidates: ``contrastive``, the cosine of the image and text embeddings (``head=coca``; ``auto``'s choice for
    one), or ``likelihood``, the mean over a caption's tokens (``<eos>`` included) of the plain model's
    log-probability given the image (``auto``'s for ``head=caption``). A candidate whose words the filter's
    vocabulary turns into ``<unk>`` scores None."""

    def __init__(self, bundle: LoadedModel, name: str, kind: str = "auto") -> None:
        if bundle.task != "caption":
            raise ValueError(
                f"score={name} is a {bundle.task} model; a filter is a caption model (head=caption or head=coca)"
            )
        if kind not in SCORE_KINDS:
            raise ValueError(f"score_by={kind!r} is unknown; choose one of {list(SCORE_KINDS)}")
        if kind == "auto":
            kind = "contrastive" if isinstance(bundle.model, Embedder) else "likelihood"
        if kind == "contrastive":
            embedding_model(bundle, "score_by=contrastive", f"score={name}")
        self.bundle, self.name, self.kind = bundle, name, kind

    @property
    def transform(self) -> Any:
        """The filter's own preprocessing: it sees each image as it was trained to."""
        return self.bundle.transform

    def describe(self) -> dict[str, Any]:
        return {"model": self.name, "score": self.kind, "runtime": self.bundle.runtime}

    def score(self, pixels: Tensor, texts: Sequence[Sequence[str]]) -> list[list[float | None]]:
        """(B, C, height, width) the filter's inputs of B images, each image's candidate ``texts`` -> their scores."""
        vocab, model, device = self.bundle.vocab, self.bundle.model, self.bundle.device
        unknown = [[vocab.unk_id is not None and vocab.unk_id in vocab.encode(t) for t in ts] for ts in texts]
        with torch.inference_mode(), precision_autocast(self.bundle.precision, device):
            pixels = pixels.to(device)
            if self.kind == "contrastive":
                flat = [t for ts in texts for t in ts]
                owner = torch.tensor([b for b, ts in enumerate(texts) for _ in ts], device=device)  # (sum R,)
                image = model.embed_images(pixels).float()  # (B, E)
                text = model.embed_texts(encode_texts(vocab, flat, model.max_len).to(device)).float()  # (sum R, E)
                values = (image[owner] * text).sum(-1).tolist()  # both unit length: the cosine
            else:
                values = self._likelihood(pixels, texts)
        found = iter(values)
        return [[None if unk else round(next(found), 6) for unk in unks] for unks in unknown]

    def _likelihood(self, pixels: Tensor, texts: Sequence[Sequence[str]]) -> list[float]:
        """The mean token log-probability of each text, image by image; every image's rows padded to the most
        candidates by repeating its first (a ``decode_step`` takes the same number of rows of each image)."""
        vocab, model, device = self.bundle.vocab, self.bundle.model, self.bundle.device
        R = max(len(ts) for ts in texts)
        rows = [t for ts in texts for t in [*ts, *[ts[0]] * (R - len(ts))]]  # (B * R)
        tokens = encode_texts(vocab, rows, model.max_len).to(device)  # (B * R, T)
        step = model.decode_step(model.encode(pixels), tokens.shape[1] - 1)
        total = token_log_probs(step, tokens, vocab.pad_id).sum(1)  # (B * R,)
        mean = (total / (tokens[:, 1:] != vocab.pad_id).sum(1)).view(len(texts), R)
        return [v for b, ts in enumerate(texts) for v in mean[b, : len(ts)].tolist()]


@dataclass
class CandidateOptions:
    """What ``vitattn-caption num_return_sequences=K`` writes: K candidates of each image (``include_greedy``:
    and its greedy caption), sampled with ``seed`` and the image's key, scored by ``filter`` if any;
    ``captioner``: the model's name as the manifest records it."""

    num_return_sequences: int
    include_greedy: bool = False
    seed: int = 0
    filter: CandidateFilter | None = None
    captioner: str = ""
    settings: dict[str, Any] = field(default_factory=dict)

    def describe(self, generate: dict[str, Any]) -> dict[str, Any]:
        """The manifest's record of how the candidates were made."""
        return {
            "captioner": self.captioner,
            "filter": None if self.filter is None else self.filter.describe(),
            "settings": {
                "num_return_sequences": self.num_return_sequences,
                "include_greedy": self.include_greedy,
                "seed": self.seed,
                **{k: v for k, v in generate.items() if k != "generator"},
                **self.settings,
            },
        }


def candidate_lists(
    model: LoadedModel,
    pixels: Tensor,
    keys: Sequence[str],
    options: CandidateOptions,
    generate: dict[str, Any],
    filter_pixels: Tensor | None = None,
) -> list[list[dict[str, Any]]]:
    """Each image's candidates, ``{"text", "logprob", "length", "count"}`` (``"greedy": true`` on the greedy
    caption, first; ``"score"`` with a filter), in the order drawn, a caption the toolkit tokenises as an earlier
    one counted there. ``pixels`` (B, C, height, width): the captioner's inputs; ``filter_pixels``: the filter's
    (default: the same)."""
    with torch.inference_mode(), precision_autocast(model.precision, pixels.device):
        found = model.model.candidates(
            pixels, options.num_return_sequences, keys, options.seed, options.include_greedy, **generate
        )
    B, R, _ = found.tokens.shape
    texts = model.vocab.decode_batch(found.tokens.flatten(0, 1))  # (B * R)
    lists = []
    for b in range(B):
        kept: dict[str, dict[str, Any]] = {}
        for r in range(R):
            text = texts[b * R + r]
            words = " ".join(w for w in coco_tokenize(text) if w not in COCO_PUNCTUATION)
            if words in kept:
                kept[words]["count"] += 1
                continue
            record = {"text": text, "logprob": round(float(found.log_prob[b, r]), 6), "length": int(found.length[b, r])}
            kept[words] = {**record, "count": 1, **({"greedy": True} if found.greedy and r == 0 else {})}
        lists.append(list(kept.values()))
    if options.filter is not None:
        scores = options.filter.score(
            pixels if filter_pixels is None else filter_pixels, [[c["text"] for c in cs] for cs in lists]
        )
        for candidates, values in zip(lists, scores):
            for candidate, value in zip(candidates, values):
                candidate["score"] = value
    return lists


def read_records(paths: Iterable[Path]) -> Iterator[dict[str, Any]]:
    """The records of side files (jsonl or parquet, by suffix), file by file."""
    for path in paths:
        if path.suffix == ".parquet":
            import pyarrow.parquet as pq  # optional: parquet output only

            yield from pq.read_table(path).to_pylist()
        else:
            with open(path, encoding="utf-8", errors="surrogateescape") as f:
                yield from (json.loads(line) for line in f if line.strip())


def write_manifest(path: str | os.PathLike, outputs: Sequence[Path], record: dict[str, Any]) -> dict[str, Any]:
    """Write ``path``, the manifest of the candidate side files ``outputs``: ``record`` (captioner, filter,
    settings), the side files, the counts (images, captioned, candidates, drawn, unreadable with each reason,
    null scores) and the score quantiles (``QUANTILES``), read back from the files themselves; returns it."""
    counts = Counter()
    unreadable: list[dict[str, str]] = []
    scores: list[float] = []
    for row in read_records(outputs):
        counts["images"] += 1
        if row.get("error") is not None:
            unreadable.append({k: row[k] for k in ("image", "key", "error") if row.get(k) is not None})
            continue
        counts["captioned"] += 1
        for candidate in row.get("candidates") or ():
            counts["candidates"] += 1
            counts["drawn"] += candidate["count"]
            if "score" in candidate:
                if candidate["score"] is None:
                    counts["null_scores"] += 1
                else:
                    scores.append(candidate["score"])
    quantiles = {}
    if scores:
        values = torch.quantile(torch.tensor(scores, dtype=torch.float64), torch.tensor(QUANTILES, dtype=torch.float64))
        quantiles = {f"{q:g}": round(float(v), 6) for q, v in zip(QUANTILES, values)}
    manifest = {
        **record,
        "files": [p.name for p in outputs],
        "counts": {k: counts[k] for k in ("images", "captioned", "candidates", "drawn", "null_scores")}
        | {"unreadable": len(unreadable)},
        "unreadable": unreadable,
        "score_quantiles": quantiles,
    }
    with atomic_open(Path(path), "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=2, ensure_ascii=False)
        f.write("\n")
    return manifest
