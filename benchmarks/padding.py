"""Section ``padding``: the padded share of training batches of images at their own aspect ratio, batches of
``data.batch_size`` images against batches by patches (``data.batch_patches``), on generated images of aspects 1:1
to 4:1, wide and tall (docs/training.md#images-at-their-own-aspect-ratio).

    python -m benchmarks padding                       # max_patches 64 and 256, one epoch of 512 images each
    python -m benchmarks padding --max-patches 256 --images 2048 --out bench_results/padding.json

Each arm is the ImageFolder DataModule's own training loader (augmentation on: the crop that keeps the aspect),
read for one epoch; a batch's padded share is its padding patches over all its patches (the class token not
counted), as the model is given them; ``packed``: the mean share were a batch's images packed several to a row of
its length (NaViT's packing, ``packed_rows``; ``python -m benchmarks naflex`` times it in longer rows).
``batch_patches`` is ``batch_size x max_patches``: the same largest batch as ``data.batch_size`` alone, as timm's
NaFlex loader sets ``max_tokens_per_batch``.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from benchmarks.report import write_json
from vitattn.training.datamodules import ImageFolderDataModule
from vitattn.training.datamodules.patches import patch_buckets


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The section's options."""
    p.add_argument("--max-patches", type=int, nargs="+", default=[64, 256], help="data.max_patches of each arm")
    p.add_argument("--patch-size", type=int, default=16)
    p.add_argument("--batch-size", type=int, default=32, help="data.batch_size; batch_patches is this x max_patches")
    p.add_argument("--images", type=int, default=512, help="generated training images")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="JSON of the numbers")


def make_images(root: Path, count: int, seed: int) -> None:
    """``count`` images under ``root/{train,val}/<class>``, each of an aspect drawn from 1:1 to 4:1 (log-uniform),
    wide or tall at even odds, short side 64 px."""
    rng = np.random.default_rng(seed)
    for split, n in (("train", count), ("val", 2)):
        for name in ("a", "b"):
            (root / split / name).mkdir(parents=True)
        for i in range(n):
            aspect = float(np.exp(rng.uniform(0, np.log(4))))
            long = round(64 * aspect)
            width, height = (long, 64) if rng.random() < 0.5 else (64, long)
            pixels = rng.integers(0, 256, (height, width, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(root / split / ("a" if i % 2 else "b") / f"{i}.png")


def padded_shares(root: Path, max_patches: int, patch_size: int, batch_size: int, batch_patches: int | None) -> dict:
    """One epoch of the training loader: each batch's padded share and its images."""
    data = ImageFolderDataModule(
        root,
        img_size=patch_size * int(max_patches**0.5),
        batch_size=batch_size,
        num_workers=0,
        cache="ram",
        max_patches=max_patches,
        patch_size=patch_size,
        batch_patches=batch_patches,
    )
    data.setup("fit")
    shares, packed, images, patches = [], [], [], []
    for batch, _ in data.train_dataloader():
        valid = batch.valid  # (B, N)
        shares.append(1 - valid.sum().item() / valid.numel())
        rows = packed_rows(valid.sum(1).tolist(), valid.shape[1])
        packed.append(1 - valid.sum().item() / (rows * valid.shape[1]))
        images.append(valid.shape[0])
        patches.append(valid.numel())
    return {
        "batches": len(shares),
        "padded_share_mean": statistics.mean(shares),
        "padded_share_max": max(shares),
        "padded_share_all": 1 - sum((1 - s) * n for s, n in zip(shares, patches, strict=True)) / sum(patches),
        "packed_share_mean": statistics.mean(packed),
        "images_per_batch_mean": statistics.mean(images),
        "patches_per_batch_max": max(patches),
    }


def first_fit(lengths: list[int], row: int) -> list[tuple[int, int]]:
    """Where each of ``lengths`` goes in rows of ``row`` slots packed first-fit decreasing (NaViT's packing): its
    (row, offset), in the order given; the longest first, each in the first row with room."""
    if max(lengths) > row:
        raise ValueError(f"an image of {max(lengths)} tokens does not fit a row of {row}")
    free: list[int] = []
    places: list[tuple[int, int]] = [(0, 0)] * len(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        fit = next((r for r, room in enumerate(free) if room >= lengths[i]), len(free))
        if fit == len(free):
            free.append(row)
        places[i] = (fit, row - free[fit])
        free[fit] -= lengths[i]
    return places


def packed_rows(lengths: list[int], row: int) -> int:
    """Rows of ``row`` patches that hold images of ``lengths`` patches packed several to a row (``first_fit``)."""
    return 1 + max(r for r, _ in first_fit(lengths, row))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Both arms at each ``--max-patches``; prints a table, writes ``--out``."""
    torch.manual_seed(args.seed)
    results: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items() if k not in ("out", "run")}}
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        make_images(root, args.images, args.seed)
        for n in args.max_patches:
            buckets = patch_buckets(n, int(n**0.5))
            arms = {"batch_size": None, "batch_patches": args.batch_size * n}
            for arm, patches in arms.items():
                found = padded_shares(root, n, args.patch_size, args.batch_size, patches)
                found["buckets"] = list(buckets) if patches else [n]
                results[f"max_patches={n} {arm}"] = found
                rows.append((n, arm if patches is None else f"batch_patches={patches}", found))
    print("| max_patches | batches of | buckets | batches | images/batch | padded share: mean | max | all | packed |")
    print("|---|---|---|---|---|---|---|---|---|")
    for n, arm, f in rows:
        print(
            f"| {n} | {arm} | {', '.join(map(str, f['buckets']))} | {f['batches']} | {f['images_per_batch_mean']:.1f} "
            f"| {100 * f['padded_share_mean']:.1f} % | {100 * f['padded_share_max']:.1f} % "
            f"| {100 * f['padded_share_all']:.1f} % | {100 * f['packed_share_mean']:.1f} % |"
        )
    if args.out is not None:
        write_json(results, args.out)
    return results
