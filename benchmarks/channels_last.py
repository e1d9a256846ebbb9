"""``channels_last`` for a ViT's input, and (on a GPU) the copy of a batch to the device as uint8 or float32.

    python -m benchmarks.channels_last                  # CPU, fp32, one thread: ViT-Ti/16 224 b8, 32 px config b64
    python -m benchmarks.channels_last --device cuda    # bf16 autocast, ViT-B/16 b128 too; and the batch copy

A ViT's only 4-D tensors are its images and the patch embedding's weight: ``channels_last`` changes that one
convolution (NHWC, whose output then flattens into tokens without a copy) and nothing after it. Each model's
forward pass and training step (cross-entropy, backward, AdamW) are timed in NCHW and in NHWC, interleaved in
rounds (``benchmarks.timing.interleaved``); the speed-up is the median of the per-round ratios, with quartiles.
On the CPU the convolution's own time is also read from the profiler (three forward passes of each layout), a
figure that a busy machine's noise does not drown.

On a GPU it also times the host-to-device copy of one (B, 3, 224, 224) batch from pinned memory with
``non_blocking``, as Lightning copies the loaders' batches: uint8 (what the loaders yield) against float32
(what they yielded before), the normalisation on the device included on the uint8 side.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from benchmarks import workloads
from benchmarks.timing import interleaved, paired_speedup, ratio_quartiles
from vitattn.data.preprocess import normalize
from vitattn.models import VisionTransformer

__all__ = ["convolution_share", "main", "measure_channels_last", "measure_transfer"]


def _step_fns(name: str, device: str, memory_format: torch.memory_format) -> dict[str, Callable[[], Any]]:
    cfg, batch = workloads.ENCODERS[name], workloads.ENCODER_BATCH[name]
    torch.manual_seed(0)
    model = VisionTransformer(num_classes=workloads.NUM_CLASSES, **cfg).to(device, memory_format=memory_format)
    images = torch.randn(batch, 3, cfg["img_size"], cfg["img_size"], device=device)
    images = images.contiguous(memory_format=memory_format)
    labels = torch.randint(0, workloads.NUM_CLASSES, (batch,), device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device == "cuda" else contextlib.nullcontext

    def forward() -> None:
        with torch.inference_mode(), autocast():
            model.eval()(images)

    def train_step() -> None:
        model.train()
        with autocast():
            loss = nn.functional.cross_entropy(model(images), labels)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

    return {"forward": forward, "train step": train_step}


def measure_channels_last(names: Sequence[str], device: str, repeats: int) -> list[dict[str, Any]]:
    """Per model and pass: images/s in NCHW and NHWC (medians) and the NHWC speed-up with its quartiles."""
    sync = torch.cuda.synchronize if device == "cuda" else None
    rows = []
    for name in names:
        nchw = _step_fns(name, device, torch.contiguous_format)
        nhwc = _step_fns(name, device, torch.channels_last)
        batch = workloads.ENCODER_BATCH[name]
        for kind in ("forward", "train step"):
            t = interleaved({"nchw": nchw[kind], "nhwc": nhwc[kind]}, repeats=repeats, warmup=2, sync=sync)
            rows.append(
                {
                    "model": f"{name} b{batch}",
                    "pass": kind,
                    "nchw img/s": batch / statistics.median(t["nchw"]),
                    "nhwc img/s": batch / statistics.median(t["nhwc"]),
                    "speed-up": paired_speedup(t["nhwc"], t["nchw"]),
                    "quartiles": ratio_quartiles(t["nhwc"], t["nchw"]),
                }
            )
    return rows


def convolution_share(name: str, memory_format: torch.memory_format) -> tuple[float, float]:
    """The patch embedding's convolution on the CPU: milliseconds per forward pass, and its share of the pass's
    operator time (the profiler's self time of three passes)."""
    forward = _step_fns(name, "cpu", memory_format)["forward"]
    forward(), forward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            forward()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    conv = sum(e.self_cpu_time_total for e in events if "convolution" in e.key)
    return conv / 3 / 1000, conv / total


def measure_transfer(batch: int, img_size: int, repeats: int) -> dict[str, float]:
    """Milliseconds to copy a pinned (batch, 3, img_size, img_size) batch to the GPU with ``non_blocking``: uint8
    then normalised there, and float32 (already normalised)."""
    pixels = torch.randint(0, 256, (batch, 3, img_size, img_size), dtype=torch.uint8).pin_memory()
    floats = normalize()(pixels).pin_memory()
    finish = normalize()
    fns = {
        "uint8": lambda: finish(pixels.to("cuda", non_blocking=True)),
        "float32": lambda: floats.to("cuda", non_blocking=True),
    }
    t = interleaved(fns, repeats=repeats, warmup=3, min_time=0.05, sync=torch.cuda.synchronize)
    return {name: 1000 * statistics.median(seconds) for name, seconds in t.items()}


def main(argv: Sequence[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m benchmarks.channels_last", description=__doc__.splitlines()[0])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads on the CPU (default 1)")
    p.add_argument("--repeats", type=int, default=7, help="timed rounds (default 7)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    names = [n for n in workloads.ENCODERS if args.device == "cuda" or n not in workloads.GPU_ONLY]
    precision = "bf16 autocast" if args.device == "cuda" else f"fp32, {torch.get_num_threads()} thread(s)"
    print(f"channels_last vs contiguous (NCHW), {args.device}, {precision}, {args.repeats} rounds")
    for r in measure_channels_last(names, args.device, args.repeats):
        q1, _, q3 = r["quartiles"]
        print(
            f"{r['model']:>20} {r['pass']:>10}: NCHW {r['nchw img/s']:8.1f} img/s, NHWC {r['nhwc img/s']:8.1f} img/s, "
            f"NHWC speed-up {r['speed-up']:.3f}x (IQR {q1:.3f}-{q3:.3f})"
        )
    if args.device == "cpu":
        for name in names:
            (nchw, share), (nhwc, _) = (
                convolution_share(name, f) for f in (torch.contiguous_format, torch.channels_last)
            )
            print(
                f"{name:>20} patch-embedding convolution: NCHW {nchw:.2f} ms, NHWC {nhwc:.2f} ms per forward pass "
                f"({100 * share:.1f} % of the NCHW pass's operator time)"
            )
    if args.device == "cuda":
        ms = measure_transfer(256, 224, args.repeats)
        print(
            f"copy of a pinned (256, 3, 224, 224) batch to the GPU: uint8 + normalise {ms['uint8']:.2f} ms, "
            f"float32 {ms['float32']:.2f} ms ({ms['float32'] / ms['uint8']:.1f}x)"
        )


if __name__ == "__main__":
    main()
