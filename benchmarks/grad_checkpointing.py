"""Peak memory and time of a classification training step with and without gradient checkpointing.

    python -m benchmarks.grad_checkpointing                        # model=base (ViT-B/16), 224 px, batch 8, 3 repeats
    python -m benchmarks.grad_checkpointing --model cpu --img-size 64 --batch-size 16 --repeats 2

The step is ``model.grad_checkpointing``'s: ``vit_preset(model, grad_checkpointing=...)`` with 1000 classes
in training mode, cross-entropy, the backward pass and an AdamW step, on random images.

How memory is measured. Each setting runs in a fresh Python process (``--repeats`` times, the two settings
alternating), so that no allocation of one can be reused by the other. The process first takes one step, so
that the weights and the AdamW state are in memory as in any later step, and sets the gradients to None, as
Lightning does between steps. Then it resets the kernel's high-water mark of its resident memory (``5`` into
``/proc/self/clear_refs``; ``VmHWM`` in ``/proc/self/status``, what ``getrusage``'s ``ru_maxrss`` reports)
and takes ``--steps`` measured steps. The *step peak* is that mark minus the resident memory just before
them: the activations, the gradients and the temporaries, which is what checkpointing changes. The *process
peak* is the mark itself (Python, torch, weights and optimizer state included). The kernel counts every page
touched, whoever allocated it (``tracemalloc`` sees none of torch's allocations). glibc keeps freed blocks
under its dynamic ``mmap`` threshold for reuse, which would hide the measured step's activations in memory
the first step had already touched: the processes run with ``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB, so
every tensor buffer is mapped on allocation and unmapped on free.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
MMAP_THRESHOLD = 128 * 1024  # bytes: buffers from here up are mapped on allocation and unmapped on free
SETTINGS = ("off", "on")


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def _reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux 4.0+)


def measure_step(
    model: str, img_size: int, batch_size: int, checkpointing: bool, threads: int, steps: int
) -> dict[str, Any]:
    """``steps`` measured training steps in this process, after a first one: the step peak, the process peak,
    the resident memory before them and the gradients' size, in MiB, and the median seconds of a step."""
    import torch

    from vitattn.models import vit_preset

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = vit_preset(model, img_size=img_size, num_classes=1000, grad_checkpointing=checkpointing).train()
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4)
    images, labels = torch.randn(batch_size, 3, img_size, img_size), torch.randint(0, 1000, (batch_size,))

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(net(images), labels).backward()
        optimizer.step()

    step()  # the AdamW state now exists, as in every later step
    optimizer.zero_grad(set_to_none=True)
    before = _status_kib("VmRSS")
    _reset_peak()
    seconds = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        seconds.append(time.perf_counter() - start)
    peak = _status_kib("VmHWM")
    return dict(
        step_peak_mib=(peak - before) / 1024,
        process_peak_mib=peak / 1024,
        before_mib=before / 1024,
        gradients_mib=sum(p.numel() * p.element_size() for p in net.parameters()) / 2**20,
        seconds=statistics.median(seconds),
    )


def run_setting(args: argparse.Namespace, setting: str) -> dict[str, Any]:
    """``measure_step`` in a fresh process with glibc's mmap threshold fixed."""
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD), "OMP_NUM_THREADS": str(args.threads)}
    command = [sys.executable, "-m", "benchmarks.grad_checkpointing", "--child", setting, *_shape_args(args)]
    proc = subprocess.run(command, capture_output=True, text=True, env=env, cwd=REPO, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the {setting} process failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _shape_args(args: argparse.Namespace) -> list[str]:
    return [
        f"--model={args.model}",
        f"--img-size={args.img_size}",
        f"--batch-size={args.batch_size}",
        f"--threads={args.threads}",
        f"--steps={args.steps}",
    ]


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """Every repeat of both settings, alternating, each in its own process."""
    runs: dict[str, list[dict[str, Any]]] = {s: [] for s in SETTINGS}
    for _ in range(args.repeats):
        for setting in SETTINGS:
            runs[setting].append(run_setting(args, setting))
    return dict(
        model=args.model,
        img_size=args.img_size,
        batch_size=args.batch_size,
        threads=args.threads,
        steps=args.steps,
        mmap_threshold=MMAP_THRESHOLD,
        runs=runs,
    )


def _ratios(result: dict[str, Any], key: str) -> list[float]:
    """on / off per repeat (the processes of one repeat ran one after the other)."""
    return [on[key] / off[key] for on, off in zip(result["runs"]["on"], result["runs"]["off"])]


def report(result: dict[str, Any]) -> str:
    lines = [
        f"model={result['model']}, {result['img_size']} px, batch {result['batch_size']}, 1000 classes, AdamW, "
        f"{result['threads']} thread(s); a fresh process per setting and repeat; MiB; gradients "
        f"{result['runs']['off'][0]['gradients_mib']:.0f} MiB",
        f"{'checkpointing':<14} {'step peak':>26} {'process peak':>26} {'step s':>20}",
    ]
    for setting in SETTINGS:
        runs = result["runs"][setting]
        cells = [
            ", ".join(f"{r[k]:.0f}" if k != "seconds" else f"{r[k]:.1f}" for r in runs)
            for k in ("step_peak_mib", "process_peak_mib", "seconds")
        ]
        lines.append(f"{setting:<14} {cells[0]:>26} {cells[1]:>26} {cells[2]:>20}")
    for key, name in (("step_peak_mib", "step peak"), ("process_peak_mib", "process peak"), ("seconds", "step time")):
        ratios = _ratios(result, key)
        lines.append(
            f"on / off, {name:<12} {statistics.median(ratios):.2f}x (range {min(ratios):.2f}-{max(ratios):.2f})"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="base", help="a model size: cpu, tiny, small, base (default base)")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per setting (default 3)")
    p.add_argument("--steps", type=int, default=2, help="measured steps per process, after the first (default 2)")
    p.add_argument("--out", type=Path, default=None, help="also write the result as JSON here")
    p.add_argument("--child", choices=SETTINGS, default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child is not None:
        result = measure_step(args.model, args.img_size, args.batch_size, args.child == "on", args.threads, args.steps)
        print(json.dumps(result), flush=True)
        return result
    result = measure(args)
    print(report(result))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
