"""Sections ``train`` and ``infer``: one vitattn classifier's training step or forward pass under timm's flags.

    python -m benchmarks infer --model tiny --img-size 224 --batch-size 8 --channels-last
    python -m benchmarks train --model cpu --img-size 64 --batch-size 64 --precision bf16 --embed-dim 192
    python -m benchmarks train --model base --img-size 224 --batch-size 8 --grad-checkpointing --memory
    python -m benchmarks infer --model small --compile

A ``vit_preset`` classifier (1000 classes) on random images; a step is cross-entropy, backward and AdamW.
``--channels-last``: images and patch embedding in NHWC (a ViT's only 4-D tensors); ``--grad-checkpointing``:
each layer's activations recomputed in backward; ``--precision bf16``: autocast of the forward, weights,
gradients and AdamW in fp32 (Lightning's ``bf16-mixed``); ``--compile``: ``torch.compile``. The flagged model
is timed against the plain one in interleaved rounds (``benchmarks.timing``); a row gives flagged / plain.

``--memory`` (train, Linux) weighs a step instead, each side in a fresh process (alternating, ``--repeats``
times): one step (the AdamW state then exists), then the kernel's high-water mark reset (``5`` into
``/proc/self/clear_refs``) and ``--steps`` steps; the *step peak* is ``VmHWM`` minus the resident memory
before them. glibc's ``MALLOC_MMAP_THRESHOLD_`` is fixed at 128 KiB so that freed tensor buffers are unmapped,
not kept for reuse, which would hide a step's activations in memory the first step had touched.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks.machine import status_kib
from benchmarks.report import compare, format_table, row, write_json
from benchmarks.timing import Env, stopwatch
from vitattn.models import vit_preset

REPO = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = 128 * 1024  # bytes: buffers from here up are mapped on allocation and unmapped on free
NUM_CLASSES = 1000
FLAGS = ("channels_last", "grad_checkpointing", "precision", "compile")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The model, the flags and the timing of ``train`` and ``infer``."""
    p.add_argument("--model", default="tiny", help="a vit_preset size: cpu, tiny, small, base (default tiny)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--embed-dim", type=int, default=None, help="the preset at this width, one head per 32 channels")
    p.add_argument("--channels-last", action="store_true", help="images and patch embedding in NHWC")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute each layer's activations in backward")
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32", help="bf16: autocast of the forward")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    p.add_argument("--repeats", type=int, default=5, help="timed rounds, or fresh processes with --memory")
    p.add_argument("--steps", type=int, default=2, help="--memory: measured steps per process, after the first")
    p.add_argument("--memory", action="store_true", help="train: a step's peak memory, in fresh processes")
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    p.add_argument("--child", choices=("plain", "flagged"), default=None, help=argparse.SUPPRESS)


def _build(args: argparse.Namespace, flagged: bool) -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    width = {} if args.embed_dim is None else dict(embed_dim=args.embed_dim, num_heads=max(1, args.embed_dim // 32))
    torch.manual_seed(0)
    model = vit_preset(
        args.model,
        img_size=args.img_size,
        num_classes=NUM_CLASSES,
        grad_checkpointing=flagged and args.grad_checkpointing,
        **width,
    ).to(args.device)
    images = torch.randn(args.batch_size, 3, args.img_size, args.img_size, device=args.device)
    if flagged and args.channels_last:
        model, images = (
            model.to(memory_format=torch.channels_last),
            images.contiguous(memory_format=torch.channels_last),
        )
    labels = torch.randint(0, NUM_CLASSES, (args.batch_size,), device=args.device)
    return model, images, labels


def step_fn(args: argparse.Namespace, train: bool, flagged: bool) -> Callable[[], None]:
    """A training step or an inference forward of the plain or the flagged model."""
    model, images, labels = _build(args, flagged)
    net = torch.compile(model) if flagged and args.compile else model
    bf16 = flagged and args.precision == "bf16"
    device_type = torch.device(args.device).type
    autocast = (lambda: torch.autocast(device_type, dtype=torch.bfloat16)) if bf16 else contextlib.nullcontext
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with autocast():
            loss = nn.functional.cross_entropy(net.train()(images), labels)
        loss.backward()
        optimizer.step()

    def forward() -> None:
        with torch.inference_mode(), autocast():
            net.eval()(images)

    return train_step if train else forward


def flags_note(args: argparse.Namespace) -> str:
    on = [f"--{f.replace('_', '-')}" for f in FLAGS if getattr(args, f) not in (False, "fp32")]
    return " ".join(on).replace("--precision", f"--precision {args.precision}") or "no flags"


def time_steps(args: argparse.Namespace, train: bool) -> dict[str, Any]:
    """Flagged against plain, interleaved: one row and the samples."""
    env = Env(args.device, quick=False, repeats=args.repeats, min_time=0.0)
    fns = {"flagged": step_fn(args, train, True), "plain": step_fn(args, train, False)}
    samples = env.time(fns, warmup=2)
    name = f"{'train step' if train else 'forward'} {args.model} {args.img_size}px b{args.batch_size}"
    r = compare(name, samples["flagged"], samples["plain"], args.batch_size, "img/s", None, "plain", flags_note(args))
    return dict(rows=[r], seconds=samples)


def measure_memory(args: argparse.Namespace, flagged: bool) -> dict[str, float]:
    """In this process: the step peak, the process peak and the resident memory before, in MiB; step seconds."""
    step = step_fn(args, True, flagged)
    step()  # the AdamW state now exists, as in every later step
    before = status_kib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)
    seconds = []
    for _ in range(args.steps):
        with stopwatch() as took:
            step()
        seconds.append(took.seconds)
    peak = status_kib("VmHWM")
    return dict(
        step_peak_mib=(peak - before) / 1024,
        process_peak_mib=peak / 1024,
        before_mib=before / 1024,
        seconds=statistics.median(seconds),
    )


def memory_runs(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    """Every repeat of both sides, alternating, each in a fresh process; rows of the medians of flagged / plain."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": str(args.threads)}
    runs: dict[str, list[dict[str, float]]] = {"flagged": [], "plain": []}
    for _ in range(args.repeats):
        for side in runs:
            command = [sys.executable, "-m", "benchmarks", "train", *argv, "--child", side]
            proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
            if proc.returncode != 0:
                raise RuntimeError(f"the {side} process failed: {proc.stderr.strip().splitlines()[-1:]}")
            runs[side].append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = []
    for key, unit in (("step_peak_mib", "MiB"), ("process_peak_mib", "MiB"), ("seconds", "s")):
        ratios = [f[key] / p[key] for f, p in zip(runs["flagged"], runs["plain"])]
        flagged, plain = (statistics.median(r[key] for r in runs[side]) for side in ("flagged", "plain"))
        note = f"flagged / plain, range {min(ratios):.2f}-{max(ratios):.2f}; {flags_note(args)}"
        rows.append(
            row(
                f"{key} {args.model} b{args.batch_size}",
                flagged,
                plain,
                unit,
                statistics.median(ratios),
                None,
                "plain",
                note,
            )
        )
    return dict(rows=rows, runs=runs, mmap_threshold=MMAP_THRESHOLD)


def run(args: argparse.Namespace, train: bool) -> dict[str, Any]:
    """Time (or with ``--memory`` weigh) the flagged model against the plain one, print and return the result."""
    if args.memory and not train:
        raise SystemExit("--memory measures a training step: use the train section")
    torch.set_num_threads(args.threads)
    if args.child is not None:
        result = measure_memory(args, args.child == "flagged")
        print(json.dumps(result), flush=True)
        return result
    result = memory_runs(args, args.argv) if args.memory else time_steps(args, train)
    result.update(section="train" if train else "infer", argv=args.argv, flags=flags_note(args))
    print(format_table(result["rows"]))
    if args.out is not None:
        write_json(result, args.out)
    return result
