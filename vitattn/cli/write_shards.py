"""``vitattn-shards``: write WebDataset shards (the img2dataset layout) from image data, for data=webdataset.

    vitattn-shards source=folder folder=DIR/train out=OUT [samples_per_shard=10000] [parquet=true]
    vitattn-shards source=coco annotations=captions_train2017.json image_dir=DIR out=OUT
    vitattn-shards source=karpathy dataset_json=dataset_coco.json image_dir=DIR split=train out=OUT
    vitattn-shards source=shapes split=train count=30000 img_size=64 out=OUT

``folder`` is one split of an ImageFolder tree (``DIR/<class>/<image>``); its class names go to
``OUT/classes.txt``. Karpathy's ``split=train`` includes ``restval``. Image files are stored as they are
(no re-encoding). ``OUT/00000.tar``, ``OUT/00000_stats.json``, ...; then train with
``vitattn-train data=webdataset data.train_shards='OUT/{00000..0000N}.tar' ...``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass

from omegaconf import MISSING

from vitattn.cli.args import UsageError, parse_key_values, run_main

__all__ = ["main"]

SOURCES = ("folder", "coco", "karpathy", "shapes")


@dataclass
class ShardsArgs:
    out: str = MISSING
    source: str = MISSING
    folder: str | None = None
    annotations: str | None = None
    dataset_json: str | None = None
    image_dir: str | None = None
    split: str = "train"
    count: int = 1000
    img_size: int = 64
    samples_per_shard: int = 10000
    parquet: bool = False  # also OUT/NNNNN.parquet (key, caption, status, source), as img2dataset; needs pyarrow


def _need(args: ShardsArgs, *keys: str) -> None:
    missing = [k for k in keys if getattr(args, k) is None]
    if missing:
        raise UsageError(f"source={args.source} needs {', '.join(f'{k}=...' for k in missing)}")


def parse(argv: list[str]) -> ShardsArgs:
    args = parse_key_values(argv, ShardsArgs, "vitattn-shards")
    if args.source not in SOURCES:
        raise UsageError(f"source={args.source!r} is unknown; choose one of {', '.join(SOURCES)}")
    return args


def run(args: ShardsArgs) -> int:
    from vitattn.data.coco import load_coco_captions, load_karpathy
    from vitattn.data.shapes import CLASS_NAMES
    from vitattn.data.shards.writer import coco_samples, folder_samples, shapes_samples, write_shards

    classes = None
    if args.source == "folder":
        _need(args, "folder")
        samples, classes = folder_samples(args.folder)
    elif args.source == "coco":
        _need(args, "annotations", "image_dir")
        samples = coco_samples(args.image_dir, load_coco_captions(args.annotations))
    elif args.source == "karpathy":
        _need(args, "dataset_json", "image_dir")
        splits = load_karpathy(args.dataset_json)
        if args.split not in splits:
            raise UsageError(f"split={args.split!r} is unknown; choose one of {', '.join(splits)}")
        images = splits[args.split] + (splits["restval"] if args.split == "train" else [])
        samples = coco_samples(args.image_dir, images)
    else:
        samples, classes = shapes_samples(args.split, args.count, args.img_size), CLASS_NAMES
    shards = write_shards(samples, args.out, args.samples_per_shard, classes, parquet=args.parquet)
    last = f"{len(shards) - 1:05d}" if shards else "none"
    print(f"{len(shards)} shards in {args.out}: {args.out}/{{00000..{last}}}.tar", file=sys.stdout)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_main(__doc__, argv, parse, run)


if __name__ == "__main__":
    sys.exit(main())
