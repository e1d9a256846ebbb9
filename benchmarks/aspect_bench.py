"""Section ``aspect``: each image at its own aspect ratio (``data.max_patches``) against the same image squashed to a
square or centre-cropped to one, at one token budget, one step count and one batch (issue 69, requirement 6;
docs/benchmarks.md#images-at-their-own-aspect-ratio).

    python -m benchmarks aspect                                         # the shapes at 1:1 to 4:1, captions
    python -m benchmarks aspect --sets tuxpaint --tasks classification  # Tux Paint's stamps, not padded square
    python -m benchmarks aspect --arms square --seeds 0                 # the shapes' squares: does the setting learn?

Arms, paired by the run's ``seed`` (the data are the same in every arm): ``native`` (``data.max_patches=N``, each
image's aspect kept, at most N patches), ``squash`` (the whole image resized to an ``img_size`` square, N =
(img_size / patch)^2 patches) and ``centre`` (its central square resized to ``img_size``): ``data.crop_mode`` of the
evaluation transform, crop_pct 1. ``square``: the shapes' squares (``data.max_aspect=1``). Training augmentation is
off in every arm (the shapes are never augmented), so that each arm trains on what it is scored on. Scored on the
shapes' test split, on Tux Paint's val split (it has no other), each with the learning bench's runner.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

from PIL import Image

from benchmarks import learning_bench, learning_data
from benchmarks.report import markdown_table, write_json
from vitattn.data.preprocess import patch_grid
from vitattn.data.shapes import ShapesDataset

REPO = Path(__file__).resolve().parents[1]
ARMS = {
    "native": [],  # data.max_patches=N, added with the budget
    "squash": ["data.crop_mode=squash"],
    "centre": ["data.crop_mode=center"],
    "square": [],  # the shapes' squares: data.max_aspect=1
}
METRIC = {"caption": "cider_d", "classification": "acc"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--sets", nargs="+", choices=["shapes", "tuxpaint"], default=["shapes"])
    p.add_argument("--tasks", nargs="+", choices=["caption", "classification"], default=["caption"])
    p.add_argument("--arms", nargs="+", choices=list(ARMS), default=["native", "squash", "centre"])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--steps", type=int, default=300, help="optimizer steps of every run")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--img-size", type=int, default=64, help="the squares' side; the shapes' short side")
    p.add_argument("--patch-size", type=int, default=8)
    # the learning bench's model halved in width and depth: a run within ~4 min on one shared thread
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--num-heads", type=int, default=2)
    p.add_argument("--decoder-depth", type=int, default=1)
    p.add_argument("--max-aspect", type=float, default=4.0, help="the shapes' widest frame")
    p.add_argument("--num-train", type=int, default=20000, help="shapes' training scenes")
    p.add_argument("--stamp-side", type=int, default=256, help="the Tux Paint stamps' longer side, as prepared")
    p.add_argument("--cache", type=Path, default=learning_data.DEFAULT_CACHE)
    p.add_argument("--out", type=Path, default=REPO / "bench_results" / "aspect.json")


def run(args: argparse.Namespace) -> dict[str, Any]:
    budget = (args.img_size // args.patch_size) ** 2  # the squares' patches: every arm's budget
    rows, runs = [], []
    for name in args.sets:
        data = None if name == "shapes" else learning_data.prepare(name, args.stamp_side, 0, args.cache, True)
        for task in args.tasks:
            scores: dict[str, dict[int, float]] = {arm: {} for arm in args.arms}
            tokens = {arm: valid_tokens(name, arm, args, budget, data) for arm in args.arms}
            for seed in args.seeds:  # seed by seed, so that a run cut short leaves whole pairs
                for arm in args.arms:
                    cfg = learning_bench.BenchConfig(
                        steps=args.steps,
                        threads=args.threads,
                        img_size=args.img_size,
                        patch_size=args.patch_size,
                        embed_dim=args.embed_dim,
                        depth=args.depth,
                        num_heads=args.num_heads,
                        decoder_depth=args.decoder_depth,
                        seed=seed,
                    )
                    run_dir = args.out.parent / "aspect" / f"{name}-{task}-{arm}-seed{seed}"
                    source = _source(name, task, arm, args, budget, data, cfg)
                    overrides = learning_bench.vitattn_overrides(task, data, cfg, run_dir, source)
                    side = learning_bench.run_overrides(task, overrides, args.threads, run_dir)
                    scores[arm][seed] = side.metrics[METRIC[task]]
                    runs.append(
                        dict(set=name, task=task, arm=arm, seed=seed, score=scores[arm][seed], metric=METRIC[task])
                        | dict(steps=side.steps, seconds=side.seconds, tokens=tokens[arm], command=side.command)
                    )
                    print(
                        f"{name} {task} {arm} seed {seed}: {scores[arm][seed]:.4f} ({side.seconds:.0f} s)", flush=True
                    )
            rows.extend(_row(name, task, scores, runs))
    header = ["set", "task", "arm", "score, mean (range)", "valid tokens per image, mean (range)", "seconds a run"]
    table = markdown_table(header, [[r[k] for k in ("set", "task", "arm", "score", "tokens", "seconds")] for r in rows])
    result = dict(argv=args.argv, budget=budget, rows=rows, runs=runs, created=time.strftime("%Y-%m-%d %H:%M:%S"))
    write_json(result, args.out)
    print(f"\n{table}\nwrote {args.out}")
    return result


def _source(name: str, task: str, arm: str, args: argparse.Namespace, budget: int, data: Any, cfg: Any) -> list[str]:
    """The data keys of one arm: the shapes variant or the stamps folder, the arm's crop or budget."""
    if name == "shapes":
        aspect = 1 if arm == "square" else args.max_aspect
        source = [f"head={task}", "data=shapes", f"data.max_aspect={aspect}", f"data.num_train={args.num_train}"]
        if task == "caption":
            source += [f"data.max_caption_len={cfg.max_caption_len}", f"head.decoder.depth={cfg.decoder_depth}"]
    else:
        source = ["head=classification", "data=imagefolder", f"data.root={data.root}", "data.augment.enabled=false"]
        source += ["data.crop_pct=1.0"]  # the whole image (the shapes' crop_pct is 1 already)
    return [*source, *ARMS[arm], *([f"data.max_patches={budget}"] if arm == "native" else [])]


def valid_tokens(name: str, arm: str, args: argparse.Namespace, budget: int, data: Any) -> dict[str, float]:
    """The patches each scored image gives the encoder (the class token aside): ``budget`` for a square arm, the
    image's grid (``patch_grid``) for ``native``; mean, least and most."""
    if arm != "native":
        return dict(mean=budget, min=budget, max=budget)
    if name == "shapes":
        shapes = ShapesDataset("test", 500, args.img_size, max_aspect=args.max_aspect)
        sizes = [(round(f.height * args.img_size), round(f.width * args.img_size)) for f in shapes.frames]
    else:
        sizes = [Image.open(path).size[::-1] for path in sorted((data.root / "val").glob("*/*.png"))]
    counts = [rows * cols for rows, cols in (patch_grid(h, w, budget) for h, w in sizes)]
    return dict(mean=statistics.mean(counts), min=min(counts), max=max(counts))


def _row(name: str, task: str, scores: dict[str, dict[int, float]], runs: list[dict]) -> list[dict[str, Any]]:
    """Per arm: the mean score over the seeds with its range, the valid tokens, the seconds a run; and the paired
    native - squash per seed against the seeds' spread (the larger of the two arms' ranges)."""
    out = []
    for arm, by_seed in scores.items():
        values = list(by_seed.values())
        mine = [r for r in runs if (r["set"], r["task"], r["arm"]) == (name, task, arm)]
        tokens = mine[0]["tokens"]
        out.append(
            dict(set=name, task=task, arm=arm, values=by_seed)
            | dict(score=f"{statistics.mean(values):.3f} ({min(values):.3f}–{max(values):.3f})")
            | dict(tokens=f"{tokens['mean']:.1f} ({tokens['min']}–{tokens['max']})")
            | dict(seconds=f"{statistics.mean(r['seconds'] for r in mine):.0f}")
        )
    if "native" in scores and "squash" in scores:
        seeds = sorted(set(scores["native"]) & set(scores["squash"]))
        gains = [scores["native"][s] - scores["squash"][s] for s in seeds]
        spread = max(max(scores[a].values()) - min(scores[a].values()) for a in ("native", "squash"))
        out.append(
            dict(set=name, task=task, arm="native - squash", values=dict(zip(seeds, gains)), spread=spread)
            | dict(score=f"{statistics.mean(gains):+.3f} ({min(gains):+.3f}–{max(gains):+.3f}); spread {spread:.3f}")
            | dict(tokens="", seconds="")
        )
    return out
