"""Transfer benchmark: caption the built-in shapes on an encoder pretrained by classification, or from scratch.

    python -m benchmarks transfer --seeds 0 1 --jobs 6 --update-doc   # the figures in docs/transfer.md
    python -m benchmarks transfer --quick                              # a smoke run: 20 steps a run
    python -m benchmarks transfer --pretrain-steps 1000 --steps 300 --vitattn-args optim.lr=1e-3
    python -m benchmarks transfer --doc-from bench_results/transfer.json  # only rewrite the doc's table

For each seed, four ``vitattn-train`` runs, each a subprocess with ``num_threads=1`` and vitattn's
training defaults (model=cpu: 64 px, 8 px patches, width 128, 4 layers, a 2-layer decoder):

1. ``head=classification`` on the shapes of ``data.seed=1`` (other images than the caption runs
   see) for ``--pretrain-steps`` steps: the encoder to transfer.
2. ``head=caption`` on the shapes of ``data.seed=0`` for ``--steps`` steps, three ways, all else the
   same: the encoder from scratch; from the classifier (``finetune.init=RUN``, its encoder, everything trains);
   and from the classifier, frozen for the whole run (``finetune.freeze_encoder_epochs=1`` of a one-epoch
   run: only the decoder trains).

Every run is one pass over ``data.num_train = steps x batch`` images, so it validates once, at its
last step; that validation (500 val images, greedy decoding) is the score. ``--jobs N`` runs N at a
time (the classifiers first); a run is deterministic for its thread count, however many run beside
it. A rerun keeps the runs already finished with the same overrides (a caption run only with its
classifier). Writes the table to stdout and ``--out`` (default ``bench_results/transfer.json``, runs
in ``transfer_runs/`` beside it); ``--update-doc`` puts it in docs/transfer.md.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.report import markdown_table, update_doc
from benchmarks.timing import stopwatch
from vitattn.run_dir import RunDir

SCHEMA = "vitattn-transfer-bench/1"
REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "transfer.md"
DOC_START, DOC_END = "<!-- transfer-bench:table:start -->", "<!-- transfer-bench:table:end -->"
PRETRAIN_DATA_SEED, CAPTION_DATA_SEED = 1, 0
# The caption runs: what each adds to the shared overrides, given the classification run's folder.
ARMS = {
    "scratch": lambda pretrained: [],
    "pretrained": lambda pretrained: [f"finetune.init={pretrained}", "finetune.init_kind=encoder"],
    "frozen": lambda pretrained: [
        f"finetune.init={pretrained}",
        "finetune.init_kind=encoder",
        "finetune.freeze_encoder_epochs=1",
    ],
}
ARM_NAMES = {
    "scratch": "from scratch",
    "pretrained": "pretrained, fine-tuned",
    "frozen": "pretrained, frozen",
}
METRICS = ("bleu4", "cider_d", "exact_match")
TABLE_METRICS = (*METRICS, "loss")  # the val loss: teacher-forced cross-entropy, beside the decoded captions' scores
LOADED = "pretrained encoder:"  # the line a run logs when an encoder of finetune.init loads


@dataclass
class BenchConfig:
    """What every run shares: steps, batch, threads, training seeds and any extra overrides."""

    pretrain_steps: int = 500
    steps: int = 300
    batch_size: int = 64
    threads: int = 1
    seeds: list[int] = field(default_factory=lambda: [0])
    vitattn_args: list[str] = field(default_factory=list)


@dataclass
class Run:
    """One finished ``vitattn-train`` run: its final validation, steps, wall seconds, command, load line."""

    run_dir: Path
    metrics: dict[str, float]
    steps: int
    seconds: float
    command: str
    loaded: str  # the run's "pretrained encoder: ..." log line, "" when nothing was loaded
    kept: bool = False  # found finished in its folder, not run again


def overrides(head: str, steps: int, seed: int, cfg: BenchConfig, run_dir: Path) -> list[str]:
    """``vitattn-train`` overrides for one pass of ``steps`` steps over fresh shapes, validated once at the end."""
    data_seed = PRETRAIN_DATA_SEED if head == "classification" else CAPTION_DATA_SEED
    return [
        f"head={head}",
        "data=shapes",
        f"data.seed={data_seed}",
        f"data.num_train={steps * cfg.batch_size}",
        f"data.batch_size={cfg.batch_size}",
        "data.num_workers=0",
        "model=cpu",
        f"trainer.max_steps={steps}",
        "trainer.max_epochs=1",
        "trainer.enable_progress_bar=false",
        "+trainer.enable_checkpointing=false",
        "callbacks=none",
        "logger=csv",
        f"num_threads={cfg.threads}",
        f"seed={seed}",
        "weights=last",
        "test=false",
        *cfg.vitattn_args,
        f"hydra.run.dir={run_dir}",
    ]


def run_train(args: list[str], run_dir: Path, threads: int, keep: bool = True) -> Run:
    """Run ``vitattn-train args`` in a subprocess (unless ``keep`` and ``run_dir`` holds that run,
    finished); its last validation is the score.

    Raises:
        RuntimeError: the run failed, or logged no validation.
    """
    kept = keep and _finished(args, run_dir)  # a rerun of the bench keeps the runs it has (same overrides)
    if kept:
        seconds = (run_dir / "csv" / "metrics.csv").stat().st_mtime - RunDir(run_dir).overrides.stat().st_mtime
    else:
        run_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HYDRA_FULL_ERROR": "1"}
        with open(run_dir / "stdout.log", "w") as f, stopwatch() as took:
            done = subprocess.run(
                [sys.executable, "-m", "vitattn.cli.train", *args], stdout=f, stderr=subprocess.STDOUT, env=env
            )
        seconds = took.seconds
        if done.returncode != 0:
            tail = (run_dir / "stdout.log").read_text(errors="replace").strip().splitlines()[-1:]
            raise RuntimeError(
                f"vitattn-train failed (exit {done.returncode}, log {run_dir}/stdout.log): {' '.join(tail)}"
            )
    validations = _validations(run_dir)
    if not validations:
        raise RuntimeError(f"{run_dir / 'csv' / 'metrics.csv'} has no validation: the run did not validate")
    metrics = {k.split("/", 1)[1]: float(v) for k, v in validations[-1].items() if k.startswith("val/") and v != ""}
    text = (run_dir / "stdout.log").read_text(errors="replace")
    loaded = next((line[line.index(LOADED) :] for line in text.splitlines() if LOADED in line), "")
    command = "vitattn-train " + " ".join(shlex.quote(a) for a in args)
    return Run(run_dir, metrics, int(validations[-1]["step"]) + 1, seconds, command, loaded, kept)


def _validations(run_dir: Path) -> list[dict[str, str]]:
    path = run_dir / "csv" / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [r for r in csv.DictReader(f) if r.get("val/loss")]


def _finished(args: list[str], run_dir: Path) -> bool:
    run = RunDir(run_dir)
    wanted = [a for a in args if not a.startswith("hydra.")]
    return (
        run.overrides.is_file()
        and run.saved_overrides() == wanted
        and (run.bundle / "config.json").is_file()
        and bool(_validations(run_dir))
    )


def bench(cfg: BenchConfig, out_dir: Path, jobs: int = 1) -> dict[str, Any]:
    """Per seed: pretrain a classifier, then caption from scratch, fine-tuned from it and frozen on it.

    Args:
        jobs: runs side by side (the classifiers first, then the caption runs); results do not depend on it.

    Returns:
        ``{"pretrain": [row per seed], "rows": [row per seed and arm]}``, rows as plain dicts, in seed order.
    """
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        classifiers = list(pool.map(lambda seed: _pretrain(cfg, seed, out_dir / f"seed{seed}" / "pretrain"), cfg.seeds))
        runs = [(seed, arm, c) for seed, c in zip(cfg.seeds, classifiers) for arm in ARMS]
        rows = list(pool.map(lambda run: _caption(cfg, *run, out_dir / f"seed{run[0]}" / run[1]), runs))
    return {"pretrain": [{"seed": seed, **_row(c)} for seed, c in zip(cfg.seeds, classifiers)], "rows": rows}


def _pretrain(cfg: BenchConfig, seed: int, run_dir: Path) -> Run:
    classifier = run_train(overrides("classification", cfg.pretrain_steps, seed, cfg, run_dir), run_dir, cfg.threads)
    print(f"seed {seed} pretrain: val acc {classifier.metrics['acc']:.3f} ({classifier.seconds:.0f} s)", flush=True)
    return classifier


def _caption(cfg: BenchConfig, seed: int, arm: str, classifier: Run, run_dir: Path) -> dict[str, Any]:
    args = overrides("caption", cfg.steps, seed, cfg, run_dir)
    extra = ARMS[arm](classifier.run_dir)
    # A caption run is kept only with the classifier it was kept with: a new one has the same path.
    run = run_train([*args[:-1], *extra, args[-1]], run_dir, cfg.threads, keep=classifier.kept)
    scores = ", ".join(f"{m} {run.metrics[m]:.3f}" for m in METRICS)
    print(f"seed {seed} {arm}: {scores} ({run.seconds:.0f} s)", flush=True)
    return {"seed": seed, "arm": arm, **_row(run)}


def _row(run: Run) -> dict[str, Any]:
    return {**asdict(run), "run_dir": str(run.run_dir)}


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """A Markdown table: one row per seed and arm, then (several seeds) the mean and range of each arm."""
    header = ["caption encoder", "seed", "val BLEU-4", "val CIDEr-D", "val exact match", "val loss", "steps", "seconds"]
    lines = []
    for r in rows:
        m = r["metrics"]
        lines.append(
            [ARM_NAMES[r["arm"]], r["seed"], f"{m['bleu4']:.3f}", f"{m['cider_d']:.3f}"]
            + [f"{100 * m['exact_match']:.1f} %", f"{m['loss']:.3f}", r["steps"], f"{r['seconds']:.0f}"]
        )
    seeds = sorted({r["seed"] for r in rows})
    if len(seeds) > 1:
        for arm in ARMS:
            values = {m: [r["metrics"][m] for r in rows if r["arm"] == arm] for m in TABLE_METRICS}
            cells = [_spread(values[m], scale=100 if m == "exact_match" else 1) for m in TABLE_METRICS]
            lines.append([f"**{ARM_NAMES[arm]}**", "mean (min-max)", *cells, "", ""])
    return markdown_table(header, lines)


def _spread(values: list[float], scale: float) -> str:
    digits, unit = (1, " %") if scale != 1 else (3, "")
    low, mean, high = (scale * v for v in (min(values), statistics.fmean(values), max(values)))
    return f"{mean:.{digits}f}{unit} ({low:.{digits}f}-{high:.{digits}f})"


def pretrain_table(rows: Sequence[dict[str, Any]]) -> str:
    """The classifiers the caption encoders came from: val accuracy, steps, seconds."""
    lines = [
        ["head=classification", r["seed"], f"{100 * r['metrics']['acc']:.1f} %", r["steps"], f"{r['seconds']:.0f}"]
        for r in rows
    ]
    return markdown_table(["classifier", "seed", "val accuracy", "steps", "seconds"], lines)


def tables(result: dict[str, Any]) -> str:
    """The caption table, then the classifiers'."""
    return f"{format_table(result['rows'])}\n\n{pretrain_table(result['pretrain'])}"


def commands_block(result: dict[str, Any], argv: Sequence[str]) -> str:
    """The bench's own command and each run's of the first seed (paths relative to the repo), as a code block."""
    lines = ["```bash", "python -m benchmarks transfer " + " ".join(shlex.quote(a) for a in argv)]
    first = result["pretrain"][0]["seed"]
    for r in [result["pretrain"][0], *(r for r in result["rows"] if r["seed"] == first)]:
        lines += [f"# {ARM_NAMES.get(r.get('arm'), 'pretrain')}", r["command"].replace(f"{REPO}{os.sep}", "")]
    return "\n".join([*lines, "```"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--pretrain-steps", type=int, default=None, help="classification steps (default 500, quick 20)")
    p.add_argument("--steps", type=int, default=None, help="steps of each caption run (default 300, quick 20)")
    p.add_argument("--quick", action="store_true", help="20 steps a run: checks that everything runs")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="training seeds; each gets all four runs")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per run (default 1)")
    p.add_argument("--jobs", type=int, default=1, help="runs side by side (default 1): classifiers, then caption runs")
    p.add_argument("--vitattn-args", nargs="*", default=[], help="extra vitattn-train overrides for every run")
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "transfer.json")
    p.add_argument("--update-doc", action="store_true", help="rewrite the table in docs/transfer.md")
    p.add_argument("--doc-from", type=Path, default=None, help="only rewrite the doc's table from a saved JSON")


def config_from(args: argparse.Namespace) -> BenchConfig:
    """The shared settings from the command line; refuses step, batch and thread counts below 1."""
    quick = 20 if args.quick else None

    def chosen(value: int | None, default: int) -> int:
        return value if value is not None else quick or default

    cfg = BenchConfig(
        pretrain_steps=chosen(args.pretrain_steps, BenchConfig.pretrain_steps),
        steps=chosen(args.steps, BenchConfig.steps),
        batch_size=args.batch_size,
        threads=args.threads,
        seeds=list(args.seeds),
        vitattn_args=list(args.vitattn_args),
    )
    for name in ("pretrain_steps", "steps", "batch_size", "threads"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} {getattr(cfg, name)} must be at least 1")
    return cfg


def run(args: argparse.Namespace) -> dict[str, Any]:
    argv = args.argv
    if args.doc_from is not None:
        saved = json.loads(args.doc_from.read_text())
        update_doc(DOC, DOC_START, DOC_END, f"{tables(saved)}\n\n{commands_block(saved, saved['argv'])}")
        print(f"table of {args.doc_from} written into {DOC}")
        return saved
    cfg = config_from(args)
    result = bench(cfg, args.out.parent / "transfer_runs", max(1, args.jobs))
    print("\n" + tables(result))
    result = {
        "schema": SCHEMA,
        "argv": argv,
        "config": asdict(cfg),
        "machine": {"platform": platform.platform(), "python": platform.python_version()},
        **result,
        "table": tables(result),
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nwritten to {args.out}")
    if args.update_doc:
        update_doc(DOC, DOC_START, DOC_END, f"{tables(result)}\n\n{commands_block(result, argv)}")
        print(f"table written into {DOC}")
    return result
