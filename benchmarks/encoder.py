"""Section ``encoder``: forward and training step against timm eager, and the achieved GFLOP/s."""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks import workloads
from benchmarks.flops import vit_flops
from benchmarks.machine import matmul_fn
from benchmarks.report import compare, row
from benchmarks.timing import Env, paired_speedup, per_second


def bench_encoder(env: Env, matmul_n: int, names: Sequence[str] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Rows (a) forward and training step vs timm and (b) achieved GFLOP/s vs the matmul rate.

    The (matmul_n, matmul_n) ``torch.mm`` runs in the same rounds as the forwards, so that the
    percentage compares rates measured under the same load.

    Args:
        env: the run's device and timing knobs.
        matmul_n: side of the reference matmul.
        names: encoders of ``workloads.ENCODERS`` to run (default: all this device runs).

    Returns:
        ``(rows, details)``: four rows per encoder, and per encoder every sample and rate.
    """
    rows, details = [], {}
    mm = matmul_fn(matmul_n, env.device, torch.bfloat16 if env.cuda else torch.float32)
    for name in workloads.encoder_names(env, names):
        cfg, B = workloads.ENCODERS[name], workloads.ENCODER_BATCH[name]
        ours, ref, diff = workloads.build_pair(cfg, workloads.NUM_CLASSES, env.device)
        images = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
        labels = torch.randint(0, workloads.NUM_CLASSES, (B,), device=env.device)
        fwd = env.time(
            {
                "ours": workloads.forward_fn(ours, images, env),
                "timm": workloads.forward_fn(ref, images, env),
                "matmul": mm,
            }
        )
        mm_seconds = fwd.pop("matmul")
        ours.train(), ref.train()
        train = env.time(
            {
                "ours": workloads.train_step_fn(ours, images, labels, env),
                "timm": workloads.train_step_fn(ref, images, labels, env),
            }
        )
        ours.eval(), ref.eval()
        flops, mm_flops = vit_flops(**cfg, num_classes=workloads.NUM_CLASSES) * B, 2 * matmul_n**3
        gflops = {k: flops / statistics.median(v) / 1e9 for k, v in fwd.items()}
        mm_gflops = mm_flops / statistics.median(mm_seconds) / 1e9
        # Per round: (flops / t_forward) / (mm_flops / t_mm); the median over rounds.
        share = {k: flops / mm_flops * paired_speedup(v, mm_seconds) for k, v in fwd.items()}
        details[name] = dict(
            config=cfg,
            batch=B,
            max_abs_diff_vs_timm=diff,
            forward_seconds=fwd,
            train_seconds=train,
            matmul_n=matmul_n,
            matmul_seconds=mm_seconds,
            matmul_gflops=mm_gflops,
            forward_share_of_matmul=share,
            forward_images_per_s=per_second(fwd, B),
            train_images_per_s=per_second(train, B),
            forward_gflop=flops / 1e9,
            forward_gflops=gflops,
            train_gflops_3x={k: 3 * flops / statistics.median(v) / 1e9 for k, v in train.items()},
        )
        tag = f"{name} b{B}"
        rows.append(compare(f"forward {tag}", fwd["ours"], fwd["timm"], B, "img/s", "forward", "timm eager"))
        rows.append(compare(f"train step {tag}", train["ours"], train["timm"], B, "img/s", "train", "timm eager"))
        rows.append(
            row(
                f"forward GFLOP/s {tag}",
                gflops["ours"],
                mm_gflops,
                "GFLOP/s",
                share["ours"],
                "mfu" if cfg["img_size"] == 224 else None,
                f"{matmul_n}² matmul",
                percent=True,
                note=f"timm {100 * share['timm']:.0f} %",
            )
        )
        # Training step model-FLOP utilisation: 3x the forward FLOPs (forward + backward) per step,
        # against the matmul rate measured in this run (bf16 on a GPU, fp32 on a CPU).
        train_share = {k: 3 * flops / mm_flops * paired_speedup(v, mm_seconds) for k, v in train.items()}
        details[name]["train_share_of_matmul"] = train_share
        rows.append(
            row(
                f"train step MFU {tag}",
                3 * flops / statistics.median(train["ours"]) / 1e9,
                mm_gflops,
                "GFLOP/s",
                train_share["ours"],
                None,
                f"{matmul_n}² matmul",
                percent=True,
                note=f"timm {100 * train_share['timm']:.0f} %",
            )
        )
        del ours, ref
    return rows, details
