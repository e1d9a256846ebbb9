"""Memory and speed of ``vitattn-caption`` over many files: does either change as a run gets longer?
And how long does a run take to start when its output already holds a million records?

    python -m benchmarks.load_caption                                  # N = 1000 and 20000, a tiny random model
    python -m benchmarks.load_caption --sizes 1000 20000 --resume-lines 1000000   # both measurements
    python -m benchmarks.load_caption --model /tmp/final_default/caption/RUN/bundle
    python -m benchmarks.load_caption --sizes 200 --num-workers 0 num_beams=3   # key=value goes to vitattn-caption

For each N: N small JPEGs (built-in shape scenes, all different) are written to a folder, and
``vitattn-caption`` captions that folder in a subprocess. Every ``--interval`` seconds the script
reads the resident memory (``VmRSS``) of the subprocess and of its descendants (the DataLoader
workers) and counts the complete lines of the JSON Lines output, which is how far the run has got.

Reported per N: peak RSS while captioning (the process tree's sum, and the main process alone) and
after the last record (``exit``: interpreter shutdown, which by itself takes ~1 s and ~170 MiB with
torch, timm and Lightning imported); the tree's RSS at 20/40/60/80/100 % of the images; images/s in each fifth of
the run, timed from the first written
batch (start-up -- imports, model load, workers -- is reported on its own); total wall time.
A run whose memory does not grow with N has the same peak at every N (within a few %), and one
that does not slow down has no downward trend over its fifths. On a shared machine a dip in one
fifth is usually a neighbour: the CPU that other processes took in each fifth is reported beside it.

The tree sum counts pages that a forked worker shares with its parent once per process, so it
overstates what the machine holds; it is the figure to compare between sizes, not a footprint.
With ``--resume-lines L``: a JSON Lines output with L synthetic records (paths that need not exist)
and a text list of those L paths plus ``--resume-new`` real images; ``vitattn-caption`` is run on
the list and that output, so it must index the L records, skip them and caption the new ones.
Reported: its start-up (to the first new record) and peak RSS, beside a run of the new images
alone into a fresh output; the difference is what resuming against L records costs.

Writes a table to stdout and JSON (with every sample) to ``--out``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.processes import RecordCounter, caption_command, tiny_bundle, write_images
from benchmarks.procfs import busy_ticks, process_tree, rss_kib, scan_processes

SCHEMA = "vitattn-load-caption/2"
FRACTIONS = (0.2, 0.4, 0.6, 0.8, 1.0)
DEFAULT_TRAINED = "/tmp/final_default/caption/*/bundle"


# ------------------------------------------------------------------------------------------ inputs


def find_trained(pattern: str = DEFAULT_TRAINED) -> str | None:
    """The newest bundle matching ``pattern``, if any."""
    found = sorted(glob.glob(pattern))
    return found[-1] if found else None


# ------------------------------------------------------------------------------------------ sampling


def run_sampled(cmd: Sequence[str], out: Path, logs: Path, interval: float, timeout: float) -> dict[str, Any]:
    """Run ``cmd`` in its own process group, sampling its tree's RSS, ``out``'s line count, and the
    CPU time that other processes (neither the tree nor this script) took meanwhile.

    Returns ``{"returncode", "total_s", "samples": [[t_s, tree_kib, main_kib, processes, lines,
    other_cpu_s], ...]}`` (``other_cpu_s`` counts from the start).
    """
    hz = os.sysconf("SC_CLK_TCK")
    count = RecordCounter(out)
    samples: list[list[float]] = []
    ticks: dict[int, int] = {}  # CPU ticks of each process of the tree, and of this script, as last seen
    with open(logs.with_suffix(".stdout"), "wb") as stdout, open(logs.with_suffix(".stderr"), "wb") as stderr:
        me, busy0 = os.getpid(), busy_ticks()
        mine0 = scan_processes().get(me, (0, 0))[1]
        start = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=stdout, stderr=stderr, start_new_session=True)
        try:
            while True:
                done = proc.poll() is not None
                t = time.perf_counter() - start
                processes = scan_processes()
                tree = process_tree(proc.pid, processes) if not done else []
                for pid in [*tree, me]:
                    ticks[pid] = processes.get(pid, (0, ticks.get(pid, 0)))[1]
                other = busy_ticks() - busy0 - (sum(ticks.values()) - mine0)
                rss = [rss_kib(p) for p in tree]
                samples.append([round(t, 3), sum(rss), rss[0] if rss else 0, len(tree), count(), round(other / hz, 2)])
                if done:
                    break
                if t > timeout:
                    raise TimeoutError(f"{' '.join(cmd)} ran past {timeout:.0f} s")
                time.sleep(interval)
        finally:
            if proc.poll() is None:  # interrupted or timed out: take the workers down too
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    total = time.perf_counter() - start
    return {"returncode": proc.returncode, "total_s": round(total, 3), "samples": samples}


# ------------------------------------------------------------------------------------------ summary


def summarise(samples: Sequence[Sequence[float]], n: int, total_s: float) -> dict[str, Any]:
    """Peak RSS, RSS at each fifth of the images, images/s per fifth, start-up and total time.

    Peaks are taken up to the sample that first sees all ``n`` records; what the process holds
    after that (interpreter shutdown, which does not depend on ``n``) is reported on its own.
    """
    live = [s for s in samples if s[3] > 0]  # the last sample is taken after exit
    if not live:
        raise ValueError("no sample was taken while the run was alive; lower --interval")
    end = next((i for i, s in enumerate(live) if s[4] >= n), len(live) - 1) + 1
    running, exiting = live[:end], live[end:]
    rss_at = {}
    for f in FRACTIONS:
        hit = next((s for s in live if s[4] >= math.ceil(f * n)), None)
        rss_at[f"{round(f * 100)}%"] = round((hit or live[-1])[1] / 1024, 1)  # exited first: the last sample
    first = next((s for s in samples if s[4] > 0), None)
    rates: list[float | None] = []
    others: list[float | None] = []  # cores' worth of CPU that other processes took in each fifth
    if first is not None:
        start = first
        for k in range(1, 6):
            end = next((s for s in samples if s[4] >= math.ceil(k * n / 5)), samples[-1])
            if end[0] > start[0] and end[4] > start[4]:
                rates.append(round((end[4] - start[4]) / (end[0] - start[0]), 1))
                others.append(round((end[5] - start[5]) / (end[0] - start[0]), 2))
                start = end
            else:  # a fifth inside one sampling interval: too short to time
                rates.append(None)
                others.append(None)
    steady = [r for r in rates if r is not None]
    return {
        "images": n,
        "captioned": int(samples[-1][4]),
        "peak_rss_tree_mib": round(max(s[1] for s in running) / 1024, 1),
        "peak_rss_main_mib": round(max(s[2] for s in running) / 1024, 1),
        "peak_rss_exit_mib": round(max(s[1] for s in exiting) / 1024, 1) if exiting else None,
        "max_processes": int(max(s[3] for s in live)),
        "rss_tree_mib_at": rss_at,
        "images_per_s_by_fifth": rates,
        "last_over_first_fifth": round(steady[-1] / steady[0], 3) if len(steady) >= 2 else None,
        "other_cpu_cores_by_fifth": others,
        "other_cpu_s": samples[-1][5],
        "startup_s": round(first[0], 2) if first else None,
        "total_s": round(total_s, 2),
    }


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    head = (
        f"{'N':>6} {'peak tree':>10} {'peak main':>10} {'exit':>7} {'RSS tree MiB at 20/40/60/80/100 %':>36}"
        f" {'images/s per fifth':>34} {'start':>6} {'total':>7}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        at = "/".join(f"{v:.0f}" for v in r["rss_tree_mib_at"].values())
        fifths = "/".join("-" if v is None else f"{v:.0f}" for v in r["images_per_s_by_fifth"])
        print(
            f"{r['images']:>6} {r['peak_rss_tree_mib']:>8.0f}Mi {r['peak_rss_main_mib']:>8.0f}Mi "
            f"{r['peak_rss_exit_mib'] or 0:>5.0f}Mi"
            f" {at:>36} {fifths:>34}"
            f" {r['startup_s'] or 0:>5.1f}s {r['total_s']:>6.1f}s"
        )
    if len(rows) >= 2:
        a, b = rows[0], rows[-1]
        print(
            f"\npeak RSS N={b['images']} / N={a['images']}: "
            f"tree {b['peak_rss_tree_mib'] / a['peak_rss_tree_mib']:.3f}, "
            f"main {b['peak_rss_main_mib'] / a['peak_rss_main_mib']:.3f}"
        )
    for r in rows:
        busy = "/".join("-" if v is None else f"{v:.2f}" for v in r["other_cpu_cores_by_fifth"])
        print(
            f"N={r['images']}: images/s last fifth / first fifth = {r['last_over_first_fifth']}; "
            f"other processes' CPU per fifth (cores, of {os.cpu_count()}): {busy}"
        )


# ------------------------------------------------------------------------------------------ main


def write_synthetic_output(out: Path, lines: int, prefix: str) -> list[str]:
    """``lines`` caption records of ``prefix/img_0000000.jpg`` ... in ``out``; returns their paths."""
    paths = [f"{prefix}/img_{i:07d}.jpg" for i in range(lines)]
    with open(out, "w") as f:
        for start in range(0, lines, 100_000):
            f.writelines(
                json.dumps(
                    {"image": p, "image_id": start + i, "caption": "a small red circle left of a large blue square"}
                )
                + "\n"
                for i, p in enumerate(paths[start : start + 100_000])
            )
    return paths


def time_resume(model: str, work: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """A run against ``--resume-lines`` recorded images, and the same new images into a fresh output."""
    new = write_images(work / "resume_images", args.resume_new, args.img_size)
    new_paths = sorted(str(p) for p in new.glob("img_*.jpg"))
    results = []
    for lines in (args.resume_lines, 0):
        out = work / f"resume_{lines}.jsonl"
        t = time.perf_counter()
        recorded = write_synthetic_output(out, lines, str(work / "gone")) if lines else []
        listing = work / f"resume_{lines}.txt"
        listing.write_text("".join(p + "\n" for p in [*recorded, *new_paths]))
        made = time.perf_counter() - t
        del recorded
        cmd = [
            *caption_command(),
            f"model={model}",
            f"images={listing}",
            f"out={out}",
            f"batch_size={args.batch_size}",
            f"num_workers={args.num_workers}",
            f"device={args.device}",
            "progress=false",
            *args.overrides,
        ]
        print(f"resume against {lines} records ({made:.1f} s to write them) ...", flush=True)
        run = run_sampled(cmd, out, work / f"resume_{lines}", args.interval, args.timeout)
        if run["returncode"] != 0:
            err = (work / f"resume_{lines}.stderr").read_text(errors="replace")[-2000:]
            raise SystemExit(f"resume L={lines}: vitattn-caption exited with {run['returncode']}:\n{err}")
        samples = run["samples"]
        first = next((s for s in samples if s[4] > lines), None)
        if samples[-1][4] != lines + args.resume_new:
            raise SystemExit(f"resume L={lines}: {samples[-1][4]} lines in {out}, expected {lines + args.resume_new}")
        results.append(
            {
                "command": cmd,
                "recorded": lines,
                "new": args.resume_new,
                "startup_s": round(first[0], 2) if first else None,
                "total_s": run["total_s"],
                "peak_rss_main_mib": round(max(s[2] for s in samples) / 1024, 1),
                "samples": samples,
            }
        )
    return results


def print_resume(results: Sequence[dict[str, Any]]) -> None:
    print(f"{'recorded':>9} {'new':>5} {'start-up':>9} {'total':>7} {'peak RSS':>9}")
    for r in results:
        print(
            f"{r['recorded']:>9} {r['new']:>5} {r['startup_s']:>8.1f}s {r['total_s']:>6.1f}s"
            f" {r['peak_rss_main_mib']:>7.0f}Mi"
        )
    big, fresh = results[0], results[-1]
    print(
        f"resume start-up over a fresh run: +{big['startup_s'] - fresh['startup_s']:.1f} s, "
        f"peak RSS +{big['peak_rss_main_mib'] - fresh['peak_rss_main_mib']:.0f} MiB for {big['recorded']} records"
    )


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", type=int, nargs="*", default=[1000, 20000], help="image counts, one run each")
    p.add_argument(
        "--resume-lines", type=int, default=0, help="also time resuming against an output of this many records"
    )
    p.add_argument("--resume-new", type=int, default=64, help="real images to caption in the resume runs")
    p.add_argument(
        "--model",
        help=f"a bundle or run folder; 'trained' = the newest {DEFAULT_TRAINED}; default: a tiny random bundle",
    )
    p.add_argument(
        "--dir", type=Path, help="where the images go (reused when the count matches); default: a temp folder"
    )
    p.add_argument("--img-size", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--device", default="auto")
    p.add_argument("--interval", type=float, default=0.2, help="seconds between samples")
    p.add_argument("--timeout", type=float, default=1800, help="seconds one run may take")
    p.add_argument("--out", type=Path, default=Path("bench_results/load_caption.json"))
    p.add_argument("--keep", action="store_true", help="keep the temp folder (images, outputs, logs)")
    p.add_argument("overrides", nargs="*", help="key=value arguments passed to vitattn-caption")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="load_caption-"))
    try:
        model = find_trained() if args.model == "trained" else args.model
        if args.model == "trained" and model is None:
            raise SystemExit(f"--model trained: nothing matches {DEFAULT_TRAINED}")
        if model is None:
            model = str(tiny_bundle(work / "tiny_bundle"))
        print(f"model: {model}", flush=True)
        rows, runs = [], []
        for n in args.sizes:
            t = time.perf_counter()
            folder = write_images((args.dir or work / "images") / f"n{n}_{args.img_size}px", n, args.img_size)
            print(f"N={n}: {n} images written in {time.perf_counter() - t:.1f} s; captioning ...", flush=True)
            out = work / f"captions_{n}.jsonl"
            out.unlink(missing_ok=True)
            cmd = [
                *caption_command(),
                f"model={model}",
                f"images={folder}",
                f"out={out}",
                f"batch_size={args.batch_size}",
                f"num_workers={args.num_workers}",
                f"device={args.device}",
                "progress=false",
                *args.overrides,
            ]
            run = run_sampled(cmd, out, work / f"run_{n}", args.interval, args.timeout)
            if run["returncode"] != 0:
                err = (work / f"run_{n}.stderr").read_text(errors="replace")[-2000:]
                raise SystemExit(f"N={n}: vitattn-caption exited with {run['returncode']}:\n{err}")
            row = summarise(run["samples"], n, run["total_s"])
            if row["captioned"] != n:
                raise SystemExit(f"N={n}: {row['captioned']} lines in {out}, expected {n}")
            rows.append(row)
            runs.append({"command": cmd, **row, "samples": run["samples"]})
        print()
        if rows:
            print_table(rows)
        resume = time_resume(model, work, args) if args.resume_lines else []
        if resume:
            print()
            print_resume(resume)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "schema": SCHEMA,
            "model": model,
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
            "settings": {k: v for k, v in vars(args).items() if k not in ("out", "dir")},
            "sample_fields": ["t_s", "rss_tree_kib", "rss_main_kib", "processes", "lines", "other_cpu_s"],
            "runs": runs,
            "resume": resume,
        }
        args.out.write_text(json.dumps(report, indent=1, default=str) + "\n")
        print(f"\nwrote {args.out}")
    finally:
        if args.keep:
            print(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
