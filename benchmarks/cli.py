"""Speed of vitattn against timm and Hugging Face, on the same machine, in the same process.

    python -m benchmarks                 # full run (3 min on a quiet core, < 10 min shared), docs/benchmarks.md
    python -m benchmarks --quick         # a short version (about a minute)
    python -m benchmarks --no-compile --sections encoder caption
    python -m benchmarks --device cuda   # bf16 autocast on a GPU: UNTESTED (no GPU where this was written)

Writes a table to stdout, ``--out`` (default ``bench_results/bench.json``) and ``scaling.png`` beside it.
A section that raises becomes an ``error`` row, and the other sections still run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from benchmarks.caption import bench_caption
from benchmarks.compile import bench_compile
from benchmarks.data import bench_data
from benchmarks.e2e import bench_end_to_end
from benchmarks.encoder import bench_encoder
from benchmarks.env import Env
from benchmarks.machine import loadavg, machine_info, matmul_gflops
from benchmarks.processes import bench_processes
from benchmarks.report import (
    SCHEMA,
    TARGETS,
    error_message,
    format_table,
    pending_row,
    status_counts,
    write_json,
)
from benchmarks.scaling import bench_scaling

SECTIONS = ("encoder", "compile", "caption", "scaling", "e2e", "data", "processes")
# Where each section's details go: under the JSON's ``details``; ``scaling`` has a top-level key of its own.
DETAILS_KEY = {
    "encoder": "encoder",
    "compile": "compile",
    "caption": "caption",
    "e2e": "end_to_end",
    "data": "data",
    "processes": "processes",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line (``argv``; None: ``sys.argv[1:]``)."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes (about two minutes)")
    p.add_argument(
        "--out", type=Path, default=Path("bench_results/bench.json"), help="JSON results; scaling.png goes beside it"
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (bf16 autocast; untested on this project's CPU machines)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: repeatable on a shared machine; see docs/benchmarks.md)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed samples per side (default 7, quick 3)")
    p.add_argument(
        "--min-time", type=float, default=None, help="shortest timed sample in seconds (default 0.2, quick 0.05)"
    )
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="benchmark torch.compile (default on)"
    )
    p.add_argument("--compile-timeout", type=float, default=300.0, help="seconds allowed for each compilation")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    return p.parse_args(argv)


def run_section(section: str, env: Env, args: argparse.Namespace, matmul_n: int) -> tuple[list[dict], dict[str, Any]]:
    """Run one section.

    Args:
        section: one of ``SECTIONS``.
        env: the run's device and timing knobs.
        args: the command line.
        matmul_n: side of the reference matmul of the run.

    Returns:
        ``(rows, details)``: the section's rows, and what goes under ``DETAILS_KEY[section]``.
    """
    if section == "encoder":
        return bench_encoder(env, matmul_n)
    if section == "compile":
        return bench_compile(env, args.compile_timeout)
    if section == "caption":
        return bench_caption(env)
    if section == "scaling":
        return bench_scaling(env, args.out.parent / "scaling.png")
    if section == "data":
        return bench_data(env, n_images=128 if args.quick else 512)
    if section == "processes":
        return bench_processes(env, n_images=400 if args.quick else 2000)
    return bench_end_to_end(env, n_images=64 if args.quick else 256)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    """Run the chosen sections, print their tables, write the JSON (and the plot).

    Args:
        argv: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The result written to ``--out`` (schema ``SCHEMA``).
    """
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    threads = args.threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    env = Env(args.device, args.quick, args.repeats, args.min_time)
    info = machine_info(torch.get_num_threads())
    print(
        f"torch {info['torch']} | threads {info['torch_threads']} | {info['cpu']} | device {args.device}"
        f" | {'quick' if args.quick else 'full'} | load {info['loadavg_start']}",
        flush=True,
    )
    started = time.perf_counter()
    mm = matmul_gflops(
        1024 if args.quick else 2048,
        repeats=env.repeats,
        device=args.device,
        dtype=torch.bfloat16 if env.cuda else torch.float32,
    )
    print(f"matmul rate: {mm['gflops']:.1f} GFLOP/s ({mm['n']}x{mm['n']} torch.mm)", flush=True)
    rows: list[dict] = []
    details: dict[str, Any] = {}
    scaling: dict[str, Any] = {}
    sections = [s for s in SECTIONS if s in args.sections and (s != "compile" or args.compile)]
    for section in sections:
        t0 = time.perf_counter()
        try:
            new, found = run_section(section, env, args, mm["n"])
        except Exception as err:  # noqa: BLE001 - one broken section must not lose the others
            msg = error_message(err)
            new = [pending_row(section, None, msg, state="error")]
            details[section] = dict(error=msg, traceback=traceback.format_exc(limit=5))
        else:
            if section == "scaling":
                scaling = found
            else:
                details[DETAILS_KEY[section]] = found
        rows += new
        print(f"\n[{section}: {time.perf_counter() - t0:.0f} s]\n{format_table(new)}", flush=True)
    if not args.compile:
        rows.append(pending_row("compiled forward", "compiled", "skipped (--no-compile)", state="info"))
    result = dict(
        schema=SCHEMA,
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
        argv=list(argv if argv is not None else sys.argv[1:]),
        quick=args.quick,
        device=args.device,
        machine=info,
        matmul=mm,
        targets=TARGETS,
        rows=rows,
        details=details,
        scaling=scaling,
        total_seconds=time.perf_counter() - started,
    )
    result["machine"]["loadavg_end"] = loadavg()
    write_json(result, args.out)
    print(f"\nall rows ({result['total_seconds']:.0f} s, threads {threads}, matmul {mm['gflops']:.1f} GFLOP/s):")
    print(format_table(rows))
    print(status_counts(rows))
    print(f"wrote {args.out}" + (f" and {scaling['plot']}" if scaling else ""))
    return result
