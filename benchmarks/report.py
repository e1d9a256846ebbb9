"""The output of a run: its rows against their targets, the Markdown table, the JSON and the plot.

Ratios are speeds, ours / reference (> 1: ours is faster), or fractions shown as percentages.
A row's note gives the quartiles of its per-round ratios. See docs/benchmarks.md for each row.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from benchmarks.timing import paired_speedup, ratio_quartiles

SCHEMA = "vitattn-bench/1"
STATUSES = ("PASS", "MISS", "info", "pending", "error")

# Targets: row kind -> threshold on its ratio (a speed ratio ours / reference, or a fraction).
TARGETS = {
    "forward": 1.0,  # encoder forward >= timm eager
    "train": 1.0,  # training step >= timm
    "compiled": 1.15,  # our compiled forward >= 1.15x timm eager
    "mfu": 0.80,  # forward GFLOP/s >= 80 % of the measured matmul rate (224 px only)
    "cache_vs_recompute": 3.0,
    "cache_vs_hf": 2.0,
    "generate_vs_hf": 1.0,  # captioning from images, encoder included, >= Hugging Face generate
    "e2e": 0.80,  # files -> captions >= 80 % of model-only images/s
    "merge_forward": 1.6,  # ViT-S/16 forward merging 16 tokens per layer >= 1.6x timm eager
    "merge_captions": 1.3,  # ViT-S/16 captions (encoder + beam 3 with the cache) merging 16 >= 1.3x unmerged
    "merge_quality": 0.98,  # CIDEr-D merged >= 98 % of unmerged (<= 2 % relative lost)
    "candidates": 1.0,  # K=5 candidates take <= greedy + 5 x greedy's decode x 1.1
}


def status(value: float | None, target: float | None) -> str:
    """``PASS`` / ``MISS`` against a target (None target: ``info``; None value: ``error``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "error"
    if target is None:
        return "info"
    return "PASS" if value >= target else "MISS"


def row(
    name: str,
    ours: float | None,
    ref: float | None,
    unit: str,
    ratio: float | None,
    kind: str | None,
    ref_name: str = "",
    note: str = "",
    percent: bool = False,
) -> dict[str, Any]:
    """One table row; ``kind`` names its target in ``TARGETS`` (None: informational).

    Args:
        name: the row's label.
        ours: our rate (None: not measured).
        ref: the reference's rate.
        unit: unit of both rates (``img/s``, ``tok/s``, ``GFLOP/s``).
        ratio: ours / reference, a speed ratio or a fraction.
        kind: key of the target in ``TARGETS``, or None.
        ref_name: what the reference is.
        note: free text (the quartiles of the ratio, ...).
        percent: show the ratio and target as percentages.

    Returns:
        The row as stored in the JSON, with ``target`` and ``status`` filled in.
    """
    target = TARGETS[kind] if kind else None
    return dict(
        name=name,
        ours=ours,
        ref=ref,
        unit=unit,
        ref_name=ref_name,
        ratio=ratio,
        percent=percent,
        target=target,
        kind=kind,
        status=status(ratio, target),
        note=note,
    )


def compare(
    name: str,
    ours: Sequence[float],
    ref: Sequence[float],
    work: float,
    unit: str,
    kind: str | None,
    ref_name: str,
    note: str = "",
    percent: bool = False,
) -> dict[str, Any]:
    """A row from interleaved samples (seconds per call) of one call doing ``work`` units (images, tokens).

    ``ours`` and ``ref`` are ``work / median seconds``; the ratio is ``paired_speedup``; the note
    adds the quartiles of the per-round ratios, a measure of the noise.
    """
    speedup = paired_speedup(ours, ref)  # first: it checks the samples pair up
    q = ratio_quartiles(ours, ref)

    def fmt(x: float) -> str:
        return f"{100 * x:.0f}%" if percent else f"{x:.3f}"

    spread = f"IQR {fmt(q[0])}-{fmt(q[2])}"
    if kind and q[0] <= TARGETS[kind] <= q[2]:
        spread += ", target inside: within noise"
    return row(
        name,
        work / statistics.median(ours),
        work / statistics.median(ref),
        unit,
        speedup,
        kind,
        ref_name,
        note=f"{spread}; {note}" if note else spread,
        percent=percent,
    )


def pending_row(name: str, kind: str | None, note: str, state: str = "pending") -> dict[str, Any]:
    """A row with nothing measured: ``state`` is ``pending``, ``error`` or ``info`` and ``note`` says why."""
    r = row(name, None, None, "", None, kind, note=note)
    r["status"] = state
    return r


def error_message(err: BaseException) -> str:
    """``Type: message`` on one line, at most 200 characters of message, for a row's note."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[Any]], right: Sequence[int] = ()) -> str:
    """A Markdown table of ``header`` and ``rows`` of cells, the columns ``right`` right-aligned: every bench's
    table."""
    rule = "|" + "".join("---:|" if i in right else "---|" for i in range(len(header)))
    return "\n".join([_line(header), rule, *map(_line, rows)])


def _line(cells: Sequence[Any]) -> str:
    return "| " + " | ".join(map(str, cells)) + " |"


def update_doc(path: Path, start: str, end: str, text: str) -> None:
    """Replace what lies between the ``start`` and ``end`` markers of the document ``path`` with ``text``; a
    ``ValueError`` naming the markers when it has not both."""
    doc = path.read_text(encoding="utf-8")
    if start not in doc or end not in doc:
        raise ValueError(f"{path} has no {start} ... {end} markers to put the table between")
    before, rest = doc.split(start, 1)
    path.write_text(f"{before}{start}\n{text}\n{end}{rest.split(end, 1)[1]}", encoding="utf-8")


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table."""

    def num(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"

    lines = []
    for r in rows:
        unit = f" {r['unit']}" if r["unit"] else ""
        ref = f"{num(r['ref'])}{unit} ({r['ref_name']})" if r["ref"] is not None else (r["ref_name"] or "-")
        if r["ratio"] is None:
            ratio = "-"
        else:
            ratio = f"{100 * r['ratio']:.0f} %" if r["percent"] else f"{r['ratio']:.3f}x"
        if r["target"] is None:
            target = "-"
        else:
            target = f">= {100 * r['target']:.0f} %" if r["percent"] else f">= {r['target']:.2f}x"
        ours = f"{num(r['ours'])}{unit}" if r["ours"] is not None else "-"
        lines.append([r["name"], ours, ref, ratio, target, r["status"], r["note"]])
    header = ["row", "ours", "reference", "ratio", "target", "status", "note"]
    return markdown_table(header, lines, right=(1, 2, 3, 4))


def status_counts(rows: Sequence[Mapping[str, Any]]) -> str:
    """How many rows have each status, as ``targets: 7 PASS, 5 MISS`` (statuses with no row left out)."""
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    return "targets: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n)


def write_json(result: Mapping[str, Any], path: Path) -> None:
    """Write the run's result (schema ``SCHEMA``), creating the folder; non-JSON values become strings."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1, default=str) + "\n")


def plot_scaling(by_size: Sequence[Mapping], by_batch: Sequence[Mapping], path: Path) -> None:
    """Two panels: ms per image vs tokens (batch 8), images/s vs batch (224 px).

    Args:
        by_size: points with ``img_size``, ``tokens``, ``batch``, ``ours_ms``, ``timm_ms``.
        by_batch: points with ``batch``, ``ours_ms``, ``timm_ms``.
        path: the PNG to write (its folder is created).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import torch
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, style in (("ours_ms", "vitattn", "o-"), ("timm_ms", "timm", "s--")):
        a.plot([r["tokens"] for r in by_size], [r[key] / r["batch"] for r in by_size], style, label=label)
        b.plot([r["batch"] for r in by_batch], [1e3 * r["batch"] / r[key] for r in by_batch], style, label=label)
    sizes = ", ".join(str(r["img_size"]) for r in by_size)
    a.set(
        xscale="log",
        yscale="log",
        xlabel=f"tokens per image (ViT-Ti/16 at {sizes} px)",
        ylabel="ms per image",
        title="forward time vs tokens, batch 8",
    )
    b.set(xscale="log", xlabel="batch", ylabel="images / s", title="forward throughput vs batch, 224 px")
    b.set_ylim(bottom=0)
    for ax, ticks in ((a, [r["tokens"] for r in by_size]), (b, [r["batch"] for r in by_batch])):
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    a.yaxis.set_major_formatter(ScalarFormatter())
    n = torch.get_num_threads()
    fig.suptitle(f"fp32 forward, torch {torch.__version__}, {n} thread{'s' if n != 1 else ''}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
