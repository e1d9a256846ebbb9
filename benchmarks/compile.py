"""Section ``compile``: our ``torch.compile``d forward against timm eager."""

from __future__ import annotations

import traceback
from collections.abc import Sequence
from typing import Any

import torch

from benchmarks import workloads
from benchmarks.report import compare, error_message, pending_row
from benchmarks.timing import Env, per_second, stopwatch, time_limit


def bench_compile(env: Env, timeout_s: float, names: Sequence[str] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Row (c): our ``torch.compile``d forward (inductor, weights frozen on CPU) vs timm eager.

    A compilation that fails or takes over ``timeout_s`` seconds becomes an ``error`` row.

    Args:
        env: the run's device and timing knobs.
        timeout_s: seconds allowed for each compilation (0: no limit).
        names: encoders of ``workloads.ENCODERS`` to run (default: all this device runs).

    Returns:
        ``(rows, details)``: one row per encoder, and per encoder the compile time and samples.
    """
    import torch._inductor.config as inductor_config

    rows, details = [], {}
    for name in workloads.encoder_names(env, names):
        cfg, B = workloads.ENCODERS[name], workloads.ENCODER_BATCH[name]
        ours, ref, _ = workloads.build_pair(cfg, workloads.NUM_CLASSES, env.device)
        images = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
        tag = f"compiled forward {name} b{B}"
        torch._dynamo.reset()
        # Freezing folds the weights into the graph as constants (inductor's CPU inference mode).
        with inductor_config.patch(freezing=not env.cuda):
            compiled = torch.compile(ours)
            try:
                with time_limit(timeout_s), stopwatch() as took:
                    workloads.forward_fn(compiled, images, env)()
                    if env.sync:
                        env.sync()
            except Exception as err:  # noqa: BLE001 - any compile failure is reported, not fatal
                msg = error_message(err)
                details[name] = dict(error=msg, traceback=traceback.format_exc(limit=3))
                rows.append(pending_row(tag, "compiled", f"compile failed: {msg}", state="error"))
                continue
            compile_s = took.seconds
            t = env.time(
                {
                    "ours_compiled": workloads.forward_fn(compiled, images, env),
                    "timm": workloads.forward_fn(ref, images, env),
                }
            )
        details[name] = dict(compile_seconds=compile_s, seconds=t, images_per_s=per_second(t, B), freezing=not env.cuda)
        rows.append(
            compare(
                tag,
                t["ours_compiled"],
                t["timm"],
                B,
                "img/s",
                "compiled",
                "timm eager",
                note=f"compile {compile_s:.0f} s",
            )
        )
        torch._dynamo.reset()
    return rows, details
