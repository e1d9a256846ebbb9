"""vitattn against itself on the learning bench's data: named variants of ``vitattn-train``, same size, steps, seeds.

    python -m benchmarks.variants_bench --variant words tokenizer=words --variant bpe tokenizer=bpe
    python -m benchmarks.variants_bench --datasets emoji --train-seeds 0 --variant fp32 --variant bf16 \\
        trainer.precision=bf16-mixed

With ``--init-steps N`` every (dataset, seed) first trains a model for N steps with the same command
(cross-entropy, vitattn's defaults), and each variant starts from it (``finetune.init``): second stages
compared from one checkpoint, e.g. ``--variant xe --variant scst finetune=scst``.

Each ``--variant NAME [OVERRIDE ...]`` is a set of extra ``vitattn-train`` overrides; every variant runs
on every dataset (``benchmarks/learning_data.py``) and training seed with the learning bench's command
(``benchmarks.learning_bench.vitattn_overrides``: its model size, batch, steps, one thread), the vitattn
side only: there is no plain loop here. ``--jobs 2`` runs two trainings at a time (one thread each);
quality does not depend on it (every run is seeded and single-threaded), wall seconds do.

The table gives, per dataset and variant, the mean over the seeds of each metric with its range, and
the mean wall seconds. Written to stdout and ``--out`` (JSON with every run).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from benchmarks import learning_data
from benchmarks.learning_bench import REPO, BenchConfig, run_vitattn

SCHEMA = "vitattn-variants-bench/1"
METRICS = {
    "caption": ("cider_d", "bleu4", "exact_match"),
    "classification": ("acc",),
}
INIT = "init"  # the variant name of the base runs of --init-steps
NAMES = {"cider_d": "CIDEr-D", "bleu4": "BLEU-4", "exact_match": "exact match", "acc": "val accuracy"}


def run_all(
    variants: dict[str, list[str]],
    datasets: Sequence[str],
    task: str,
    seeds: Sequence[int],
    cfg: BenchConfig,
    out_dir: Path,
    jobs: int,
    cache: Path,
    split_seed: int,
    init_steps: int | None = None,
) -> list[dict[str, Any]]:
    """Every (dataset, variant, seed) run: its metrics, steps and seconds; with ``init_steps``, the base runs
    (variant ``init``) first, and every variant from its (dataset, seed)'s."""
    prepared = {name: learning_data.prepare(name, cfg.img_size, split_seed, cache) for name in datasets}
    runs: list[dict[str, Any]] = []
    if init_steps:
        base = {INIT: ["export_bundle=true"]}
        runs += run_all(base, datasets, task, seeds, replace(cfg, steps=init_steps), out_dir, jobs, cache, split_seed)

    def start(dataset: str, seed: int) -> list[str]:
        return [f"finetune.init={out_dir / f'{dataset}-{task}-{INIT}-seed{seed}'}"] if init_steps else []

    plan = [(d, v, s) for d in datasets for v in variants for s in seeds]

    def one(item: tuple[str, str, int]) -> dict[str, Any]:
        dataset, variant, seed = item
        args = [*cfg.vitattn_args, *start(dataset, seed), *variants[variant]]
        run_dir = out_dir / f"{dataset}-{task}-{variant}-seed{seed}"
        side = run_vitattn(task, prepared[dataset], replace(cfg, seed=seed, vitattn_args=args), run_dir)
        shown = " ".join(f"{NAMES[m]} {side.metrics.get(m, float('nan')):.4f}" for m in METRICS[task])
        print(f"  {dataset} {variant} seed {seed}: {shown} ({side.seconds:.0f} s)", flush=True)
        return {
            "dataset": dataset,
            "variant": variant,
            "seed": seed,
            "task": task,
            "metrics": side.metrics,
            "steps": side.steps,
            "seconds": side.seconds,
            "cpu_seconds": side.cpu_seconds if jobs == 1 else None,  # children's CPU time mixes concurrent runs
            "command": side.command,
        }

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return runs + list(pool.map(one, plan))


def format_table(runs: Sequence[dict[str, Any]], task: str) -> str:
    """Per dataset and variant: each metric's mean over the seeds with its range; mean seconds."""
    metrics = METRICS[task]
    head = "| dataset | variant | " + " | ".join(NAMES[m] for m in metrics) + " | seeds | steps | s per run |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["dataset"], run["variant"]), []).append(run)
    for (dataset, variant), group in groups.items():
        cells = []
        for m in metrics:
            values = [run["metrics"].get(m, float("nan")) for run in group]
            cell = _fmt(sum(values) / len(values), m)
            if len(values) > 1:
                cell += f" ({_fmt(min(values), m).removesuffix(' %')}–{_fmt(max(values), m).removesuffix(' %')})"
            cells.append(cell)
        seconds = sum(run["seconds"] for run in group) / len(group)
        lines.append(
            f"| {dataset} | {variant} | "
            + " | ".join(cells)
            + f" | {len(group)} | {group[0]['steps']} | {seconds:.0f} |"
        )
    return "\n".join(lines)


def _fmt(value: float, metric: str) -> str:
    return f"{100 * value:.1f} %" if metric in ("acc", "exact_match") else f"{value:.3f}"


def parse_variants(pairs: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    """``[[NAME, OVERRIDE, ...], ...]`` -> ``{NAME: [OVERRIDE, ...]}``; names must be distinct."""
    variants: dict[str, list[str]] = {}
    for name, *overrides in pairs:
        if name in variants:
            raise ValueError(f"--variant {name} is given twice; give each variant its own name")
        if "=" in name:
            raise ValueError(f"--variant {name}: the first word is the variant's name, then its overrides")
        variants[name] = list(overrides)
    if not variants:
        raise ValueError("give at least one --variant NAME [OVERRIDE ...]")
    return variants


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--variant", nargs="+", action="append", default=[], metavar="NAME [OVERRIDE]")
    p.add_argument("--task", choices=tuple(METRICS), default="caption")
    p.add_argument("--datasets", nargs="+", choices=sorted(learning_data.DATASETS), default=["tuxpaint", "emoji"])
    p.add_argument("--train-seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=500, help="steps of each variant's run")
    p.add_argument("--init-steps", type=int, default=None, help="train a base model first; variants start from it")
    p.add_argument("--jobs", type=int, default=1, help="trainings at a time, one thread each (default 1)")
    p.add_argument("--seed", type=int, default=0, help="data split seed")
    p.add_argument("--vitattn-args", nargs="*", default=[], help="overrides for every variant")
    p.add_argument("--cache", type=Path, default=learning_data.DEFAULT_CACHE)
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "variants.json")
    p.add_argument("--table-from", type=Path, default=None, help="only print the table of a saved JSON file")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.table_from is not None:
        saved = json.loads(args.table_from.read_text())
        table = format_table(saved["runs"], saved["runs"][0]["task"])
        print(table)
        return {**saved, "table": table}
    variants = parse_variants(args.variant)
    if args.steps < 1 or args.jobs < 1:
        raise ValueError(f"--steps {args.steps} and --jobs {args.jobs} must be at least 1")
    cfg = BenchConfig(steps=args.steps, vitattn_args=list(args.vitattn_args))
    out_dir = args.out.parent / "variant_runs"
    if INIT in variants:
        raise ValueError(f"--variant {INIT} is the name of --init-steps' base runs; name the variant otherwise")
    runs = run_all(
        variants,
        args.datasets,
        args.task,
        args.train_seeds,
        cfg,
        out_dir,
        args.jobs,
        args.cache,
        args.seed,
        args.init_steps,
    )
    table = format_table(runs, args.task)
    print("\n" + table)
    result = {
        "schema": SCHEMA,
        "argv": argv,
        "config": asdict(cfg),
        "variants": variants,
        "jobs": args.jobs,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__},
        "runs": runs,
        "table": table,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten to {args.out}")
    return result


if __name__ == "__main__":
    try:
        main()
    except (learning_data.DataError, RuntimeError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
