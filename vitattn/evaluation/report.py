"""An evaluation's result, and how it is shown and kept: a table, ``metrics.json``, captions, a confusion matrix."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from torch import Tensor

from vitattn.bundle.folder import merge_setting
from vitattn.fileio import atomic_write
from vitattn.inference.attention_maps import figure_png
from vitattn.metrics.retrieval import RECALL

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["EvalReport", "confusion_figure", "format_report", "save_confusion_matrix", "write_report"]


_LABELS = {
    **{f"bleu{n}": f"BLEU-{n}" for n in range(1, 5)},
    "rouge_l": "ROUGE-L",
    "cider_d": "CIDEr-D",
    "meteor": "METEOR",
    "exact_match": "exact match",
    "distinct": "distinct captions",
    "top1": "top-1 accuracy",
    "top5": "top-5 accuracy",
    **{
        f"{way}_r{k}": f"{name} R@{k}" for way, name in (("i2t", "image->text"), ("t2i", "text->image")) for k in RECALL
    },
    "i2t_median_rank": "image->text median rank",
    "t2i_median_rank": "text->image median rank",
    "num_texts": "texts",
    "num_texts_cut": "texts cut to max_len",
    "unknown_words": "ref. words outside vocab",
    "num_images": "images",
    "num_failed": "images failed",
    "num_missing": "images without a prediction",
}


@dataclass
class EvalReport:
    """One evaluation: what was scored (``task``, ``split``, ``data``, ``predictions``), how (``decoding``: the
    ``generate`` settings, or zero-shot's templates), and the scores: ``metrics`` (BLEU, ROUGE-L, CIDEr-D,
    ``distinct``, ``exact_match``, ``unknown_words``, or ``top1``, ``top5``, or retrieval's recalls and median ranks;
    ``num_images``, ``num_failed``, ``num_missing``), ``captions`` (``(image_id, caption, references)`` sorted
    by id), ``confusion`` ((K, K), rows true, columns predicted) with ``class_names``, ``coco``, the COCO
    toolkit's own numbers (``scorer="coco"``), and ``merge_tokens``, the tokens each encoder layer merged (ToMe)
    as the model ran (None: no model ran, ``predictions`` were read).
    """

    task: str
    split: str
    data: str
    metrics: dict[str, float]
    decoding: dict[str, Any] = field(default_factory=dict)
    predictions: str | None = None
    captions: list[tuple[Any, str, list[str]]] = field(default_factory=list)
    confusion: Tensor | None = None
    class_names: list[str] | None = None
    coco: dict[str, float] = field(default_factory=dict)
    merge_tokens: int | list[int] | None = None

    @property
    def complete(self) -> bool:
        """Every image of the split was scored."""
        return not self.metrics.get("num_failed") and not self.metrics.get("num_missing")


def confusion_figure(
    confusion: Tensor, class_names: Sequence[str], title: str | None = None, named: int = 100, counted: int = 30
) -> Figure:
    """A (K, K) confusion matrix, rows true and columns predicted, with the class names on the axes up to
    ``named`` classes and the counts in the cells up to ``counted``."""
    # heavy: matplotlib is imported only when a figure is drawn; no pyplot: no global state, Agg chosen by savefig
    from matplotlib.figure import Figure

    counts = confusion.cpu().numpy()
    k = len(class_names)
    side = min(4.0 + 0.4 * k, 40.0)
    fig = Figure(figsize=(side + 1.5, side))
    ax = fig.add_subplot()
    shown = ax.imshow(counts, cmap="Blues", interpolation="nearest")
    fig.colorbar(shown, ax=ax, fraction=0.046, pad=0.04)
    if k <= named:
        ax.set_xticks(range(k), labels=list(class_names), rotation=90, fontsize=8)
        ax.set_yticks(range(k), labels=list(class_names), fontsize=8)
    if k <= counted:
        high = counts.max() / 2 if counts.size else 0
        for (i, j), count in np.ndenumerate(counts):
            if count:
                color = "white" if count > high else "black"
                ax.text(j, i, str(count), ha="center", va="center", fontsize=7, color=color)
    ax.set_xlabel("predicted")
    ax.set_ylabel("true")
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    return fig


def save_confusion_matrix(
    confusion: Tensor, class_names: Sequence[str], path: str | os.PathLike, title: str | None = None
) -> Path:
    """Write ``confusion_figure`` as a PNG, atomically."""
    return atomic_write(path, figure_png(confusion_figure(confusion, class_names, title), dpi=100))


def _plain(metrics: Mapping[str, float]) -> dict[str, float | int]:
    return {k: int(v) if k.startswith("num_") else float(v) for k, v in metrics.items()}


def write_report(report: EvalReport, out_dir: str | os.PathLike, *, model: str) -> list[Path]:
    """Write ``metrics.json`` into ``out_dir``, with ``captions.jsonl`` for generated captions or
    ``confusion_matrix.png`` and ``.json`` for a classifier; returns the files written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    if report.task == "caption" and report.predictions is None:
        lines = (
            json.dumps({"image_id": k, "caption": c, "references": r}, ensure_ascii=False) + "\n"
            for k, c, r in report.captions
        )
        written.append(atomic_write(out / "captions.jsonl", "".join(lines)))
    if report.confusion is not None:
        table = {
            "class_names": report.class_names,
            "rows": "true class",
            "columns": "predicted class",
            "matrix": report.confusion.tolist(),
            "per_class": [{"class": c, "images": n, "accuracy": a} for c, n, a in _class_accuracies(report)],
        }
        written.append(atomic_write(out / "confusion_matrix.json", json.dumps(table) + "\n"))
        title = f"{report.split}: top-1 {report.metrics['top1']:.3f} over {report.metrics['num_images']} images"
        written.append(save_confusion_matrix(report.confusion, report.class_names, out / "confusion_matrix.png", title))
    summary = {
        "task": report.task,
        "model": model,
        "split": report.split,
        "data": report.data,
        "predictions": report.predictions,
        "decoding": report.decoding,
        "merge_tokens": report.merge_tokens,
        "metrics": _plain(report.metrics),
    }
    if report.coco:
        summary["coco"] = _plain(report.coco)
    return [atomic_write(out / "metrics.json", json.dumps(summary, indent=2) + "\n"), *written]


def _class_accuracies(report: EvalReport) -> list[tuple[str, int, float | None]]:
    """Each class's name, images and accuracy (the share of its images predicted as it; None without images),
    from the confusion matrix."""
    images = report.confusion.sum(dim=1).tolist()
    right = report.confusion.diagonal().tolist()
    return [(c, n, r / n if n else None) for c, n, r in zip(report.class_names, images, right)]


def _per_class_lines(report: EvalReport, shown: int = 20) -> list[str]:
    """The per-class rows of the table: every class up to ``shown`` of them, else the ``shown`` weakest."""
    rows = [row for row in _class_accuracies(report) if row[1]]
    title = "  per class: accuracy (images)"
    if len(rows) > shown:
        rows = sorted(rows, key=lambda row: row[2])[:shown]
        title += f", the {shown} weakest of {len(report.class_names)} (all in confusion_matrix.json)"
    return [title, *(f"    {name:<26} {accuracy:>8.4f}  ({n})" for name, n, accuracy in rows)]


def format_report(report: EvalReport) -> str:
    """The report as a small table of the metrics, with what was scored above it."""
    lines = [f"{report.task} evaluation, split {report.split}: {report.data}"]
    if report.predictions:
        lines.append(f"predictions: {report.predictions}")
    if report.decoding:
        lines.append("decoding: " + " ".join(f"{k}={v}" for k, v in report.decoding.items()))
    if report.merge_tokens:
        lines.append(f"token merging (ToMe): merge_tokens={merge_setting(report.merge_tokens)}")
    metrics, coco = _plain(report.metrics), _plain(report.coco)
    keys = list(metrics)
    if coco:  # the toolkit's column beside ours; its METEOR, which has no built-in, after BLEU-4
        lines.append(f"  {'':<28} {'built-in':>8}  {'COCO toolkit':>12}")
        at = keys.index("bleu4") + 1 if "bleu4" in keys else len(keys)
        keys[at:at] = [k for k in coco if k not in metrics]
    for key in keys:
        value = metrics.get(key)
        shown = "-" if value is None else str(value) if isinstance(value, int) else f"{value:.4f}"
        row = f"  {_LABELS.get(key, key):<28} {shown:>8}"
        if key in coco:
            row += f"  {coco[key]:>12.4f}"
        lines.append(row)
    if report.confusion is not None:
        lines += _per_class_lines(report)
    return "\n".join(lines)
