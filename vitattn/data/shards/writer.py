"""Writing WebDataset shards in the img2dataset layout (docs/shards.md), from image files, COCO or Karpathy
captions or the built-in shapes; image bytes as they are, every file written atomically."""

from __future__ import annotations

import io
import json
import tarfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from vitattn.data.coco import CocoImage
from vitattn.data.images import open_image_folder
from vitattn.data.shapes import generate_scene, render_scene, scene_label, scene_references
from vitattn.data.shards.reading import CLASSES_FILE
from vitattn.fileio import atomic_open, atomic_write

__all__ = ["ShardSample", "coco_samples", "folder_samples", "shapes_samples", "write_shards"]


@dataclass
class ShardSample:
    """One sample to write: the image's bytes and extension, its captions and its class (or None)."""

    image: bytes
    ext: str
    captions: list[str] = field(default_factory=list)
    label: int | None = None
    meta: dict = field(default_factory=dict)


def folder_samples(folder: str | Path) -> tuple[Iterator[ShardSample], list[str]]:
    """The images of ``folder/<class>/<image>`` (sorted) with their class; returns ``(samples, class names)``.
    The caption is the class name."""
    tree = open_image_folder(folder)

    def samples() -> Iterator[ShardSample]:
        for path, label in tree.samples:
            ext = Path(path).suffix.lstrip(".").lower()
            meta = {"source": str(path)}
            yield ShardSample(Path(path).read_bytes(), ext, [tree.classes[label]], label, meta)

    return samples(), list(tree.classes)


def coco_samples(image_dir: str | Path, images: Iterable[CocoImage]) -> Iterator[ShardSample]:
    """COCO or Karpathy images (``load_coco_captions``, ``load_karpathy``) with all their captions."""
    for image in images:
        path = Path(image_dir) / image.file_name
        meta = {"source": image.file_name, "image_id": image.image_id}
        yield ShardSample(path.read_bytes(), path.suffix.lstrip(".").lower(), list(image.captions), None, meta)


def shapes_samples(split: str, count: int, img_size: int = 64, seed: int = 0) -> Iterator[ShardSample]:
    """The built-in shapes ``split`` (``vitattn.data.shapes``) as JPEG images with caption and class."""
    for index in range(count):
        scene = generate_scene(seed, split, index)
        buffer = io.BytesIO()
        render_scene(scene, img_size).save(buffer, format="JPEG", quality=95)
        meta = {"source": f"shapes {split} {index}"}
        yield ShardSample(buffer.getvalue(), "jpg", scene_references(scene), scene_label(scene), meta)


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), int(time.time()), 0o644
    tar.addfile(info, io.BytesIO(data))


def write_shards(
    samples: Iterable[ShardSample],
    out_dir: str | Path,
    samples_per_shard: int = 10000,
    class_names: list[str] | None = None,
    parquet: bool = False,
) -> list[Path]:
    """Write ``samples`` as shards of ``samples_per_shard`` (keys ``SSSSSIIII``, img2dataset's) into ``out_dir``;
    returns the shard paths."""
    if samples_per_shard < 1:
        raise ValueError(f"--samples-per-shard={samples_per_shard} must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if class_names is not None:
        atomic_write(out / CLASSES_FILE, "".join(f"{name}\n" for name in class_names))
    digits = max(4, len(str(samples_per_shard - 1)))
    shards: list[Path] = []
    iterator = iter(samples)
    while True:
        batch = list(islice(iterator, samples_per_shard))
        if not batch:
            return shards
        number = len(shards)
        path = out / f"{number:05d}.tar"
        keys = [f"{number:05d}{i:0{digits}d}" for i in range(len(batch))]
        with atomic_open(path, "wb") as f, tarfile.open(fileobj=f, mode="w", format=tarfile.PAX_FORMAT) as tar:
            for key, sample in zip(keys, batch):
                meta = {"key": key, **sample.meta, "captions": sample.captions}
                _add(tar, f"{key}.{sample.ext}", sample.image)
                if sample.captions:
                    _add(tar, f"{key}.txt", sample.captions[0].encode())
                if sample.label is not None:
                    meta["label"] = sample.label
                    _add(tar, f"{key}.cls", str(sample.label).encode())
                _add(tar, f"{key}.json", json.dumps(meta).encode())
        if parquet:
            rows = [
                {"key": key, "caption": (s.captions or [None])[0], "status": "success", "source": s.meta.get("source")}
                for key, s in zip(keys, batch)
            ]
            _write_parquet(out / f"{number:05d}.parquet", rows)
        stats = {"count": len(batch), "successes": len(batch), "failed_to_download": 0, "failed_to_resize": 0}
        atomic_write(out / f"{number:05d}_stats.json", json.dumps(stats, indent=1) + "\n")
        shards.append(path)


def _write_parquet(path: Path, rows: list[dict]) -> None:
    # optional: only parquet=True needs pyarrow
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({column: [row[column] for row in rows] for column in rows[0]})
    with atomic_open(path, "wb") as f:
        pq.write_table(table, f)
