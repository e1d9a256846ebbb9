"""One command line for every benchmark: ``python -m benchmarks SECTION [options]``, as timm's ``benchmark.py``.

    python -m benchmarks [--quick] ...                 # section speed (the default): vitattn against timm and HF
    python -m benchmarks speed --no-compile --sections encoder caption --threads 2 --out /tmp/b.json
    python -m benchmarks matmul --threads 2            # this machine's fp32 matmul rate
    python -m benchmarks train --model cpu --img-size 64 --precision bf16   # flagged step against plain
    python -m benchmarks infer --channels-last --compile
    python -m benchmarks learning --quick              # vitattn-train against a plain timm loop (docs/learning.md)
    python -m benchmarks merge --threads 2             # token merging: encoder, captions, training step
    python -m benchmarks candidates --threads 2        # K caption candidates per image against greedy
    python -m benchmarks naflex --threads 2            # images at their own aspect against squares (max_patches)
    python -m benchmarks padding                       # padded share: batches by images against by patches
    python -m benchmarks batch-loss --seeds 0 1 2      # batches by patches: the loss per batch or per image
    python -m benchmarks SECTION --help

``SECTIONS`` is the registry: a section adds its options to its own sub-command and runs from the parsed
arguments. The timed sections share ``benchmarks.timing`` (interleaved rounds, paired ratios) and
``benchmarks.report`` (rows, the table, the JSON). The speed section writes a table to stdout, ``--out``
(default ``bench_results/bench.json``) and ``scaling.png`` beside it; a part that raises becomes an ``error``
row, and the other parts still run.
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks import (
    aspect_bench,
    batch_loss,
    bootstrap_bench,
    candidates,
    learning_bench,
    learning_data,
    load_serve,
    merge_bench,
    metric_parity,
    naflex_bench,
    padding,
    steps,
    transfer_bench,
)
from benchmarks.caption_bench import bench_caption
from benchmarks.compile import bench_compile
from benchmarks.e2e import bench_end_to_end
from benchmarks.encoder import bench_encoder
from benchmarks.machine import loadavg, machine_info, matmul_gflops
from benchmarks.report import SCHEMA, TARGETS, error_message, format_table, pending_row, status_counts, write_json
from benchmarks.scaling import bench_scaling
from benchmarks.timing import Env, stopwatch

SPEED_SECTIONS = ("encoder", "compile", "caption", "scaling", "e2e")
# Where each section's details go: under the JSON's ``details``; ``scaling`` has a top-level key of its own.
DETAILS_KEY = {"encoder": "encoder", "compile": "compile", "caption": "caption", "e2e": "end_to_end"}


def add_speed_arguments(p: argparse.ArgumentParser) -> None:
    """The speed run's options."""
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
    p.add_argument("--sections", nargs="+", choices=SPEED_SECTIONS, default=list(SPEED_SECTIONS))


def run_section(section: str, env: Env, args: argparse.Namespace, matmul_n: int) -> tuple[list[dict], dict[str, Any]]:
    """One part of the speed run (``SPEED_SECTIONS``): its rows, and what goes under ``DETAILS_KEY[section]``."""
    if section == "encoder":
        return bench_encoder(env, matmul_n)
    if section == "compile":
        return bench_compile(env, args.compile_timeout)
    if section == "caption":
        return bench_caption(env)
    if section == "scaling":
        return bench_scaling(env, args.out.parent / "scaling.png")
    return bench_end_to_end(env, n_images=64 if args.quick else 256)


def run_speed(args: argparse.Namespace) -> dict[str, Any]:
    """Run the speed run's chosen sections, print their tables, write the JSON (and the plot).

    Returns:
        The result written to ``--out`` (schema ``SCHEMA``).
    """
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
    with stopwatch() as took_all:
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
        sections = [s for s in SPEED_SECTIONS if s in args.sections and (s != "compile" or args.compile)]
        for section in sections:
            with stopwatch() as took:
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
            print(f"\n[{section}: {took.seconds:.0f} s]\n{format_table(new)}", flush=True)
    if not args.compile:
        rows.append(pending_row("compiled forward", "compiled", "skipped (--no-compile)", state="info"))
    result = dict(
        schema=SCHEMA,
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
        argv=args.argv,
        quick=args.quick,
        device=args.device,
        machine=info,
        matmul=mm,
        targets=TARGETS,
        rows=rows,
        details=details,
        scaling=scaling,
        total_seconds=took_all.seconds,
    )
    result["machine"]["loadavg_end"] = loadavg()
    write_json(result, args.out)
    print(f"\nall rows ({result['total_seconds']:.0f} s, threads {threads}, matmul {mm['gflops']:.1f} GFLOP/s):")
    print(format_table(rows))
    print(status_counts(rows))
    print(f"wrote {args.out}" + (f" and {scaling['plot']}" if scaling else ""))
    return result


def add_matmul_arguments(p: argparse.ArgumentParser) -> None:
    """The matmul rate's options."""
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's own)")
    p.add_argument("--size", type=int, default=2048, help="side n of the (n, n) matrices (default 2048)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs; the median counts (default 5)")


def run_matmul(args: argparse.Namespace) -> str:
    """Measure and print the fp32 matmul rate; returns the printed line."""
    if args.threads is not None:
        if args.threads < 1:
            args.error(f"--threads={args.threads} must be at least 1")
        torch.set_num_threads(args.threads)
    if args.size < 1 or args.repeats < 1:
        args.error(f"--size={args.size} and --repeats={args.repeats} must be at least 1")
    rate = matmul_gflops(args.size, repeats=args.repeats)
    line = (
        f"matmul rate: {rate['gflops']:.1f} GFLOP/s (fp32 torch.mm {args.size}x{args.size}, "
        f"{torch.get_num_threads()} torch threads, median of {args.repeats})"
    )
    print(line, flush=True)
    return line


def add_load_serve_arguments(p: argparse.ArgumentParser) -> None:
    """``key=value`` settings, parsed as vitattn's console scripts parse theirs (``load_serve.LoadConfig``)."""
    p.add_argument("settings", nargs=argparse.REMAINDER, help="model=PATH [requests=1000] [clients=16] ...")


@dataclass(frozen=True)
class Section:
    """One registry entry: its help line, what it adds to its sub-command's options, and what runs it."""

    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], Any]


SECTIONS: dict[str, Section] = {
    "speed": Section(
        "Speed of vitattn against timm and Hugging Face (docs/benchmarks.md)", add_speed_arguments, run_speed
    ),
    "matmul": Section("this machine's fp32 matmul rate (GFLOP/s)", add_matmul_arguments, run_matmul),
    "train": Section("a training step, flagged against plain", steps.add_arguments, lambda a: steps.run(a, True)),
    "infer": Section("a forward pass, flagged against plain", steps.add_arguments, lambda a: steps.run(a, False)),
    "merge": Section("token merging (ToMe) against unmerged, timm and HF", merge_bench.add_arguments, merge_bench.run),
    "merge-quality": Section(
        "captions trained and scored with token merging", merge_bench.add_quality_arguments, merge_bench.run_quality
    ),
    "naflex": Section(
        "images at their own aspect ratio against squares at an equal budget",
        naflex_bench.add_arguments,
        naflex_bench.run,
    ),
    "candidates": Section(
        "K caption candidates per image against greedy captions", candidates.add_arguments, candidates.run
    ),
    "bootstrap": Section(
        "learning from images without captions: teacher, student, oracle",
        bootstrap_bench.add_arguments,
        bootstrap_bench.run,
    ),
    "learning": Section("vitattn-train against a plain timm loop", learning_bench.add_arguments, learning_bench.run),
    "learning-data": Section("the learning datasets, from Debian", learning_data.add_arguments, learning_data.run),
    "aspect": Section(
        "images at their own aspect against squashed and centre-cropped squares",
        aspect_bench.add_arguments,
        aspect_bench.run,
    ),
    "transfer": Section("captions on a pretrained encoder", transfer_bench.add_arguments, transfer_bench.run),
    "metric-parity": Section("built-in metrics vs the COCO toolkit", metric_parity.add_arguments, metric_parity.run),
    "padding": Section(
        "padded share of batches at their own aspect, by images and by patches", padding.add_arguments, padding.run
    ),
    "batch-loss": Section(
        "the loss of batches by patches: each batch's mean or weighted by its images",
        batch_loss.add_arguments,
        batch_loss.run,
    ),
    "load-serve": Section(
        "load test of vitattn-serve on localhost", add_load_serve_arguments, lambda a: load_serve.main(a.settings)
    ),
}


def parser() -> argparse.ArgumentParser:
    """The one parser: a sub-command per section of ``SECTIONS``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="section", required=True, metavar="SECTION")
    for name, section in SECTIONS.items():
        sp = sub.add_parser(name, help=section.help, description=section.help)
        section.add_arguments(sp)
        sp.set_defaults(error=sp.error)
    return p


def main(argv: Sequence[str] | None = None) -> Any:
    """Parse ``argv`` (None: ``sys.argv[1:]``; no section named: ``speed``) and run its section."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0] not in SECTIONS and argv[0] not in ("-h", "--help")):
        argv = ["speed", *argv]
    args = parser().parse_args(argv)
    args.argv = argv[1:]
    return SECTIONS[args.section].run(args)
