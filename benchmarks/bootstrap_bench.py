"""Section ``bootstrap``: learning from images without captions on the learning bench's data (docs/bootstrap.md).

    python -m benchmarks bootstrap --datasets tuxpaint emoji --tasks caption classification --seeds 0 1 2
    python -m benchmarks bootstrap --arms teacher student oracle student_beam student_nofilter student_k1
    python -m benchmarks bootstrap --tasks classification --arms teacher semi oracle semi_weight0 semi_freematch

A low-label split per seed: ``--share`` (10 %) of the training images keep their captions or labels, at least one
per class, chosen by the seed; the rest is the pool, without them. Paired per dataset and seed: the ``teacher``
(the split's labelled share only), the ``student`` (the same config plus the teacher's kept candidates of the
pool, ``bootstrap.*`` at its defaults) and the ``oracle`` (the same config on every label); the ablations
change one ``bootstrap`` setting of the student; the ``semi`` arms learn the pool online on the teacher's data
(``semi=``; no teacher run). Gap closed = (student - teacher) / (oracle - teacher).

Arms that train a model of their own first: ``filter`` (a run on the labelled share only, its own seed: the
filter trained apart that ``student_filter`` scores the teacher's candidates or labels with) and ``teacher_4x`` (4x
the student's parameters, width doubled, on every label: the teacher of ``distill``, which labels every training
image, the labelled ones kept too, ``bootstrap.labelled_images=keep``). List them before the arms that read them.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time
from collections import defaultdict
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import learning_bench, learning_data
from benchmarks.report import markdown_table, write_json

# The student's ablations: one bootstrap setting each, against the student's defaults.
ARMS = {
    "teacher": [],
    "student": [],
    "oracle": [],
    "student_beam": ["bootstrap.do_sample=false"],
    "student_nofilter": ["bootstrap.filter=none"],
    "student_k1": ["bootstrap.samples=1", "bootstrap.keep.top_k=1"],
    "student_noise": ["bootstrap.randaugment=rand-m6-mstd0.5"],
    # each labelled sample as often per epoch as the pool's images are, together (the pool is 9x the 10 % share)
    "student_repeat": ["bootstrap.human_repeat=9"],
    "student_soft": ["bootstrap.soft=true"],  # classes: the teacher's probabilities as targets (noisy student)
    "filter": [],  # the labelled share only, seed + 1000: a filter trained apart from the teacher
    "student_filter": [],  # bootstrap.filter=the filter run
    "teacher_4x": [],  # every label, embed_dim doubled: 4x the student's parameters
    "distill": ["bootstrap.labelled_images=keep"],  # teacher_4x labels every training image
    # online pseudo-labels of the same pool (docs/bootstrap.md#online-pseudo-labels), on the labelled share's data
    "semi": ["semi=fixmatch"],
    "semi_weight0": ["semi=fixmatch", "semi.weight=0"],  # the same pipeline, no unlabelled loss
    "semi_ema": ["semi=fixmatch", "semi.ema_decay=0.999"],
    "semi_freematch": ["semi=freematch"],
}
FILTER_SEED = 1000  # the filter's seed offset: trained apart, not the teacher again
REPO = Path(__file__).resolve().parents[1]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", choices=sorted(learning_data.DATASETS), default=["tuxpaint", "emoji"])
    p.add_argument("--tasks", nargs="+", choices=["caption", "classification"], default=["caption", "classification"])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["teacher", "student", "oracle"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="each chooses the labelled share")
    p.add_argument("--share", type=float, default=0.1, help="the training images that keep their labels")
    p.add_argument("--steps", type=int, default=500, help="optimizer steps of every run")
    p.add_argument("--threads", type=int, default=1)
    # USB's ViT settings (config/usb_cv/fixmatch/*.yaml: uratio 1); FixMatch's 7 is for its WideResNets
    p.add_argument("--mu", type=int, default=1, help="the semi arms' semi.ratio: unlabelled images per labelled one")
    p.add_argument("--img-size", type=int, default=32)
    # FixMatch's recipe trains classes without label smoothing (the head's 0.1 caps every probability below its
    # 0.95 threshold): every classification arm, so that the arms stay paired
    p.add_argument("--class-smoothing", type=float, default=0.0, help="head.label_smoothing of the classes' arms")
    p.add_argument("--cache", type=Path, default=learning_data.DEFAULT_CACHE)
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "bootstrap.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rows, runs = [], []
    for name in args.datasets:
        data = learning_data.prepare(name, args.img_size, 0, args.cache)
        for task in args.tasks:
            scores: dict[str, dict[int, float]] = defaultdict(dict)
            for seed in args.seeds:
                folder = args.out.parent / "bootstrap" / f"{name}-{task}-seed{seed}"
                low, pool = _low_label_split(data, task, seed, args.share, folder)
                for arm in args.arms:
                    extra = _arm_overrides(arm, folder, pool, data, args.mu)
                    source = data if arm in ("oracle", "teacher_4x") else low
                    run_seed = seed + FILTER_SEED if arm == "filter" else seed
                    wide = {"embed_dim": 2 * learning_bench.BenchConfig.embed_dim} if arm == "teacher_4x" else {}
                    export = arm in ("teacher", "filter", "teacher_4x")
                    mu = args.mu if arm.startswith("semi") else 0
                    result = _train(task, source, args, run_seed, folder / arm, extra, export, wide, mu)
                    scores[arm][seed] = result["score"]
                    runs.append({"dataset": name, "task": task, "seed": seed, "arm": arm, **result})
                    print(
                        f"{name} {task} seed {seed} {arm}: {result['score']:.4f} "
                        f"({result['steps']} steps, {result['images_seen']} images, {result['seconds']:.0f} s)",
                        flush=True,
                    )
            rows.append(_row(name, task, scores))
    table = markdown_table(
        ["dataset", "task", "metric", *args.arms, "student (or semi) - teacher", "gap closed", "seeds"],
        [[r[k] for k in ("dataset", "task", "metric", *args.arms, "gain", "closed", "seeds")] for r in rows],
    )
    result = dict(argv=args.argv, rows=rows, runs=runs, created=time.strftime("%Y-%m-%d %H:%M:%S"))
    write_json(result, args.out)
    print(f"\n{table}\nwrote {args.out}")
    return result


def _low_label_split(data: Any, task: str, seed: int, share: float, folder: Path) -> tuple[Any, Path]:
    """The seed's labelled share (at least one image per class) as the data a run reads, and the pool: a file
    list of the other training images."""
    folder.mkdir(parents=True, exist_ok=True)
    by_class = defaultdict(list)
    for path in sorted((data.root / "train").glob("*/*")):
        by_class[path.parent.name].append(path)
    rng = random.Random(seed)
    kept = set()
    for paths in by_class.values():
        kept.update(rng.sample(paths, max(1, round(share * len(paths)))))
    pool = folder / "pool.txt"
    pool.write_text("".join(f"{p}\n" for paths in by_class.values() for p in paths if p not in kept))
    if task == "classification":
        root = folder / "low"
        for path in kept:
            link = root / "train" / path.parent.name / path.name
            link.parent.mkdir(parents=True, exist_ok=True)
            if not link.exists():
                link.symlink_to(path)
        if not (root / "val").exists():
            (root / "val").symlink_to(data.root / "val")
        return SimpleNamespace(root=root), pool
    coco = json.loads(data.train_annotations.read_text())
    names = {p.relative_to(data.root).as_posix() for p in kept}
    images = [im for im in coco["images"] if im["file_name"] in names]
    ids = {im["id"] for im in images}
    low = {**coco, "images": images, "annotations": [a for a in coco["annotations"] if a["image_id"] in ids]}
    (folder / "captions_low.json").write_text(json.dumps(low))
    return SimpleNamespace(
        root=data.root, train_annotations=folder / "captions_low.json", val_annotations=data.val_annotations
    ), pool


def _arm_overrides(arm: str, folder: Path, pool: Path, data: Any, mu: int) -> list[str]:
    """A student arm's ``bootstrap`` keys: its teacher, its pool (distill: every training image) and its setting."""
    if arm == "distill":
        every = folder / "every_image.txt"
        every.write_text("".join(f"{p}\n" for p in sorted((data.root / "train").glob("*/*"))))
        return [f"bootstrap.teacher={folder / 'teacher_4x'}", f"bootstrap.images={every}", *ARMS[arm]]
    if arm.startswith("semi"):
        return [f"semi.images={pool}", f"semi.ratio={mu}", *ARMS[arm]]
    if not arm.startswith("student"):
        return []
    scorer = [f"bootstrap.filter={folder / 'filter'}"] if arm == "student_filter" else []
    return [f"bootstrap.teacher={folder / 'teacher'}", f"bootstrap.images={pool}", *scorer, *ARMS[arm]]


def _train(
    task: str,
    data: Any,
    args: argparse.Namespace,
    seed: int,
    run_dir: Path,
    extra: list[str],
    export: bool,
    size: dict[str, int] | None = None,
    mu: int = 0,
) -> dict[str, Any]:
    """One ``vitattn-train`` run of the learning bench's config (``size``: other model sizes; ``mu``: unlabelled
    images per labelled one, for the images seen); its val score (CIDEr-D or accuracy)."""
    cfg = learning_bench.BenchConfig(steps=args.steps, threads=args.threads, img_size=args.img_size, seed=seed)
    cfg = dataclasses.replace(cfg, **(size or {}))
    smoothing = [f"head.label_smoothing={args.class_smoothing}"] if task == "classification" else []
    cfg.vitattn_args = [*smoothing, *extra, *(["export_bundle=true"] if export else [])]
    side = learning_bench.run_vitattn(task, data, cfg, run_dir)
    metric = "cider_d" if task == "caption" else "acc"
    seen = side.steps * cfg.batch_size * (1 + mu)  # labelled images, plus mu unlabelled ones each
    result = {
        "score": side.metrics[metric],
        "metric": metric,
        "steps": side.steps,
        "images_seen": seen,
        "seconds": side.seconds,
        "command": side.command,
    }
    return result | (pseudo_label_stats(run_dir) if task == "classification" and mu else {})


def pseudo_label_stats(run_dir: Path) -> dict[str, float]:
    """A ``semi`` run's pseudo-labels against the pool's true classes (each image's folder), from the run's
    ``semi/pseudo_labels.rank*.jsonl``, never from a training key: the share kept, the accuracy of the kept ones
    and of all, over the whole run and its last quarter of steps."""
    records = [json.loads(x) for f in sorted((run_dir / "semi").glob("pseudo_labels.rank*.jsonl")) for x in open(f)]
    if not records:
        return {}
    last = max(r["step"] for r in records)
    stats = {}
    for name, part in (("", records), ("_last_quarter", [r for r in records if r["step"] >= 0.75 * last])):
        right = [r["label"] == Path(r["key"]).parent.name for r in part]
        kept = [ok for ok, r in zip(right, part) if r["kept"]]
        stats[f"pseudo_kept{name}"] = len(kept) / len(part)
        stats[f"pseudo_kept_accuracy{name}"] = sum(kept) / len(kept) if kept else float("nan")
        stats[f"pseudo_accuracy{name}"] = sum(right) / len(right)
    return stats


def _row(name: str, task: str, scores: dict[str, dict[int, float]]) -> dict[str, Any]:
    """Means over the seeds with their ranges; the paired student - teacher and the gap closed."""

    def cell(arm: str) -> str:
        values = list(scores[arm].values())
        return f"{statistics.mean(values):.3f} ({min(values):.3f}–{max(values):.3f})" if values else "–"

    row = {"dataset": name, "task": task, "metric": "CIDEr-D" if task == "caption" else "accuracy"}
    row |= {arm: cell(arm) for arm in scores}
    seeds = sorted(scores.get("teacher", {}))
    row["seeds"] = len(seeds)
    row["gain"] = row["closed"] = "–"
    learner = next((arm for arm in ("student", "semi") if arm in scores), None)  # the offline or online learner
    if seeds and learner:
        gains = [scores[learner][s] - scores["teacher"][s] for s in seeds]
        row["gain"] = f"{statistics.mean(gains):+.3f} ({min(gains):+.3f}–{max(gains):+.3f})"
        if "oracle" in scores:
            closed = [
                g / (scores["oracle"][s] - scores["teacher"][s])
                for g, s in zip(gains, seeds)
                if scores["oracle"][s] != scores["teacher"][s]
            ]
            if closed:
                row["closed"] = (
                    f"{100 * statistics.mean(closed):.0f} % ({100 * min(closed):.0f}–{100 * max(closed):.0f})"
                )
    return row
