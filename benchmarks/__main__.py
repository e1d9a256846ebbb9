"""``python -m benchmarks``: this machine's fp32 matmul rate, or the whole bench.

    python -m benchmarks matmul               # GFLOP/s of a 2048x2048 fp32 torch.mm, torch's default threads
    python -m benchmarks matmul --threads 2   # with 2 torch threads (what make train uses on 2 cores)
    python -m benchmarks [--quick] ...        # the speed bench (benchmarks.cli, docs/benchmarks.md)

A training run's speed follows the machine's matmul rate as much as the code: the README gives its
``make train`` times together with this rate, so that a run elsewhere can be compared.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from benchmarks.cli import main as bench_main
from benchmarks.machine import matmul_gflops

__all__ = ["main", "matmul_main"]


def matmul_main(argv: Sequence[str]) -> str:
    """Measure and print the fp32 matmul rate; returns the printed line."""
    p = argparse.ArgumentParser(prog="python -m benchmarks matmul", description=matmul_main.__doc__)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--size", type=int, default=2048, help="side n of the (n, n) matrices (default 2048)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median counts (default 5)")
    args = p.parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            p.error(f"--threads={args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    if args.size < 1 or args.repeats < 1:
        p.error(f"--size={args.size} and --repeats={args.repeats} must be at least 1")
    rate = matmul_gflops(args.size, repeats=args.repeats)
    line = (
        f"matmul rate: {rate['gflops']:.1f} GFLOP/s (fp32 torch.mm {args.size}x{args.size}, "
        f"{torch.get_num_threads()} torch threads, median of {args.repeats})"
    )
    print(line, flush=True)
    return line


def main(argv: Sequence[str] | None = None) -> None:
    """``matmul [options]``: the matmul rate; anything else: the bench (``benchmarks.cli``)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["matmul"]:
        matmul_main(argv[1:])
        return
    bench_main(argv)


if __name__ == "__main__":
    main()
