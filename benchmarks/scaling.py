"""Section ``scaling``: forward time against tokens and against batch, ours and timm, plotted."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import workloads
from benchmarks.report import plot_scaling, row
from benchmarks.timing import Env, paired_speedup


def bench_scaling(env: Env, out_png: Path) -> tuple[list[dict], dict[str, Any]]:
    """Row (e): forward time vs image size (tokens) and vs batch, ours and timm (ViT-Ti/16), plotted.

    Args:
        env: the run's device and timing knobs (``quick``: fewer sizes and batches).
        out_png: where the plot goes.

    Returns:
        ``(rows, scaling)``: two rows (median speedups), and every point of the plot.
    """
    cfg = dict(workloads.ENCODERS["vit_ti16_224"])
    sizes = (64, 128, 224) if env.quick else (64, 128, 224, 320)
    batches = (1, 4, 8) if env.quick else (1, 2, 4, 8, 16)
    repeats = 3 if env.quick else 5
    by_size, by_batch = [], []
    for img in sizes:
        ours, ref, _ = workloads.build_pair({**cfg, "img_size": img}, 0, env.device)
        x = torch.randn(8, 3, img, img, device=env.device)
        by_size.append(
            dict(
                img_size=img,
                tokens=(img // cfg["patch_size"]) ** 2 + 1,
                batch=8,
                **_forward_point(ours, ref, x, env, repeats),
            )
        )
    ours, ref, _ = workloads.build_pair(cfg, 0, env.device)
    for B in batches:
        x = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
        by_batch.append(dict(img_size=cfg["img_size"], batch=B, **_forward_point(ours, ref, x, env, repeats)))
    plot_scaling(by_size, by_batch, out_png)
    rows = [
        _median_speedup_row(f"scaling: forward vs tokens ({by_size[0]['tokens']}..{by_size[-1]['tokens']})", by_size),
        _median_speedup_row(f"scaling: forward vs batch ({batches[0]}..{batches[-1]})", by_batch),
    ]
    return rows, dict(model=cfg, by_image_size=by_size, by_batch=by_batch, plot=str(out_png))


def _forward_point(ours: nn.Module, ref: nn.Module, x: torch.Tensor, env: Env, repeats: int) -> dict[str, float]:
    """Both forwards of ``x`` timed in rounds: median ms per call of each, and the paired speedup."""
    t = env.time(
        {"ours": workloads.forward_fn(ours, x, env), "timm": workloads.forward_fn(ref, x, env)}, repeats=repeats
    )
    return dict(
        ours_ms=1e3 * statistics.median(t["ours"]),
        timm_ms=1e3 * statistics.median(t["timm"]),
        speedup=paired_speedup(t["ours"], t["timm"]),
    )


def _median_speedup_row(name: str, points: Sequence[Mapping[str, float]]) -> dict[str, Any]:
    """An informational row: the median of the points' speedups over timm eager."""
    return row(
        name,
        None,
        None,
        "",
        statistics.median(p["speedup"] for p in points),
        None,
        "timm eager",
        note="median speedup, see plot",
    )
