"""Captioning WebDataset shards: one output file per input shard, written whole when its shard is done.

``OUTDIR/00000.jsonl`` (or ``.parquet``) holds one row per sample of ``00000.tar``: ``key`` and ``caption``,
or ``key`` and ``error`` for a sample whose image cannot be read (a shard that ends early adds a row with
the shard's error); the input's ``url`` and original caption (``.txt``) come along when the sample has
them. Each file is written to a temporary name and renamed once its shard is captioned, so nothing is
merged across ranks and a run killed at any moment (any rank, ``kill -9``) is continued by running the
same command: finished shards are skipped, unfinished ones are captioned again from their start.

The unfinished shards are shared among the ranks by their sample counts, largest first, each to the rank
with the least work so far (longest-processing-time scheduling), so all ranks stay busy when shards
differ in size. Every rank computes the same plan from the same listing of finished outputs, taken before
any rank writes.
"""

from __future__ import annotations

import io
import json
import logging
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from vitattn.bundle.runtime import LoadedModel
from vitattn.data.images import BadImageError, read_image
from vitattn.data.shards import ShardError, read_shard, shard_sizes
from vitattn.data.shards.stream import image_member, sample_caption
from vitattn.fileio import atomic_open
from vitattn.inference.captioning import generate_tokens
from vitattn.inference.processes import Processes

__all__ = [
    "SHARD_FORMATS",
    "ShardCaptionSummary",
    "caption_shards",
    "caption_shards_in_processes",
    "finished_outputs",
    "output_path",
    "assign_shards",
    "remove_temporaries",
]

log = logging.getLogger(__name__)

SHARD_FORMATS = ("jsonl", "parquet")


@dataclass
class ShardCaptionSummary:
    """What this rank did: shards and samples captioned, samples with an error, shards skipped as finished."""

    shards: int = 0
    captioned: int = 0
    failed: int = 0
    finished_before: int = 0


def output_path(out_dir: str | Path, url: str, fmt: str) -> Path:
    """The output of shard ``url``: ``OUTDIR/<shard name without .tar>.<fmt>``."""
    name = url.rstrip("/").rsplit("/", 1)[-1].split(" ")[-1]
    return Path(out_dir) / f"{name.rsplit('.tar', 1)[0]}.{fmt}"


def assign_shards(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Shard indices per rank: largest first, each to the rank with the fewest samples so far."""
    load, plans = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        plans[rank].append(i)
        load[rank] += sizes[i]
    return plans


class _ShardImages(IterableDataset):
    """The samples of some shards as ``(shard index, key, pixels or None, row)``; workers take whole shards."""

    def __init__(self, urls: Sequence[str], shards: Sequence[int], transform: Callable[[Any], torch.Tensor]) -> None:
        self.urls, self.shards, self.transform = list(urls), list(shards), transform

    def __iter__(self) -> Iterator[tuple[int, str, torch.Tensor | None, dict[str, Any]]]:
        info = get_worker_info()
        mine = self.shards if info is None else self.shards[info.id :: info.num_workers]
        for shard in mine:
            url = self.urls[shard]
            try:
                for sample in read_shard(url):
                    yield (shard, *self._decode(sample, url))
            except ShardError as err:
                yield shard, "", None, {"error": str(err)}
            yield shard, "", None, {"end": True}  # the shard's last row

    def _decode(self, sample: dict[str, Any], url: str) -> tuple[str, torch.Tensor | None, dict[str, Any]]:
        row: dict[str, Any] = {"key": sample["__key__"]}
        original = sample_caption(sample, None)
        if original is not None:
            row["original_caption"] = original
        try:
            row["url"] = json.loads(sample.get("json") or b"{}").get("url")
        except (ValueError, AttributeError):
            pass
        if row.get("url") is None:
            row.pop("url", None)
        name = image_member(sample)
        if name is None:
            return sample["__key__"], None, {**row, "error": "no image member"}
        image = read_image(io.BytesIO(sample[name]), on_error="skip")
        if isinstance(image, BadImageError):  # an undecodable image is an error row, not a stop
            return sample["__key__"], None, {**row, "error": image.reason}
        return sample["__key__"], self.transform(image), row


def _collate(items: list[Any]) -> tuple[list[tuple[int, dict[str, Any]]], torch.Tensor | None, list[int]]:
    """In the worker: ``(shard, row)`` of each item, the decoded images stacked (b, C, height, width)
    (one tensor to send to the main process, not one per image), and the items they belong to."""
    decoded = [i for i, item in enumerate(items) if item[2] is not None]
    images = torch.stack([items[i][2] for i in decoded]) if decoded else None
    return [(item[0], item[3]) for item in items], images, decoded


def caption_shards(
    bundle: LoadedModel,
    urls: Sequence[str],
    sizes: Sequence[int],
    out_dir: str | Path,
    *,
    fmt: str = "jsonl",
    rank: int = 0,
    world_size: int = 1,
    finished: set[str] | None = None,
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    **generate_kwargs: Any,
) -> ShardCaptionSummary:
    """Caption this rank's share of the unfinished shards, one output file per shard.

    Args:
        bundle: a caption bundle (on the device to caption with).
        urls, sizes: the shards and their sample counts (``vitattn.data.shards``).
        out_dir: where the outputs go; those there already (``finished``, the same listing on every rank)
            are skipped.
        fmt: ``jsonl`` or ``parquet`` (needs pyarrow).
        rank, world_size: this process among all captioning ones.
        batch_size, num_workers: images per ``generate`` call; shard-reading processes.
        progress: one bar of samples (and shards) on stderr.
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """
    if fmt not in SHARD_FORMATS:
        raise ValueError(f"format={fmt!r} is unknown for shards; choose one of {list(SHARD_FORMATS)}")
    if fmt == "parquet":
        import pyarrow  # noqa: F401 - optional: only parquet output needs it; fail before any work

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    finished = finished if finished is not None else finished_outputs(out_dir, urls, fmt)
    todo = [i for i, url in enumerate(urls) if output_path(out_dir, url, fmt).name not in finished]
    mine = [todo[i] for i in assign_shards([sizes[i] for i in todo], world_size)[rank]]
    summary = ShardCaptionSummary(finished_before=len(urls) - len(todo))
    model, device = bundle.model, bundle.device
    loader = DataLoader(
        _ShardImages(urls, mine, bundle.transform),
        batch_size=batch_size,
        num_workers=min(num_workers, len(mine)),
        collate_fn=_collate,
    )
    rows: dict[int, list[dict[str, Any]]] = {}
    total = sum(sizes[i] for i in mine)
    with tqdm(total=total, unit="img", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        bar.set_postfix(shards=f"0/{len(mine)}")
        for rows_of_batch, images, decoded in loader:
            captions: dict[int, str] = {}
            if images is not None:
                tokens = generate_tokens(model, images.to(device), bundle.precision, **generate_kwargs)  # (b, T')
                captions = dict(zip(decoded, bundle.vocab.decode_batch(tokens)))
            for i, (shard, row) in enumerate(rows_of_batch):
                if row.get("end"):
                    _write(output_path(out_dir, urls[shard], fmt), rows.pop(shard, []), fmt)
                    summary.shards += 1
                    bar.set_postfix(shards=f"{summary.shards}/{len(mine)}")
                    continue
                if i in captions:
                    row = {**row, "caption": captions[i]}
                    summary.captioned += 1
                else:
                    summary.failed += 1
                rows.setdefault(shard, []).append(row)
                bar.update(1 if row.get("key") else 0)
    return summary


def caption_shards_in_processes(
    model: LoadedModel,
    urls: Sequence[str],
    out_dir: str | Path,
    processes: Processes,
    *,
    fmt: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> ShardCaptionSummary:
    """Caption the unfinished shards of ``urls`` into ``out_dir``, this process's share of them; called the same
    way on every rank (``processes``: ``launch_processes``). Returns the counts of all ranks, on every rank.

    Args:
        model: a caption model on this rank's device.
        seed: seeds sampling, ``seed + rank`` on each rank.
        fmt, batch_size, num_workers, progress, **generate_kwargs: as in ``caption_shards``.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    finished = finished_outputs(out_dir, urls, fmt)
    if processes.is_zero:
        remove_temporaries(out_dir, urls, fmt)
    finished = processes.broadcast(finished)  # the same listing on every rank, taken before any writes
    if seed is not None:
        generate_kwargs["generator"] = processes.generator(seed)
    if processes.is_zero:
        log.info(
            "captioning %d shards (%d finished before) on %d process(es)",
            len(urls),
            len(finished),
            processes.world_size,
        )
    mine = caption_shards(
        model,
        urls,
        shard_sizes(urls),
        out_dir,
        fmt=fmt,
        rank=processes.rank,
        world_size=processes.world_size,
        finished=finished,
        batch_size=batch_size,
        num_workers=num_workers,
        progress=progress and processes.is_zero,
        **generate_kwargs,
    )
    shards, captioned, failed = processes.sum([mine.shards, mine.captioned, mine.failed])
    return ShardCaptionSummary(shards, captioned, failed, mine.finished_before)


def finished_outputs(out_dir: str | Path, urls: Sequence[str], fmt: str) -> set[str]:
    """The output files of ``urls`` already in ``out_dir`` (whole: they are only ever renamed into place)."""
    names = {output_path(out_dir, url, fmt).name for url in urls}
    return {p.name for p in Path(out_dir).iterdir() if p.name in names}


def remove_temporaries(out_dir: str | Path, urls: Sequence[str], fmt: str) -> int:
    """Remove what a killed run left half-written in ``out_dir`` (``atomic_open``'s ``.NAME.*.tmp``); returns how
    many. Call it before any process of this run writes."""
    names = {output_path(out_dir, url, fmt).name for url in urls}
    stale = [p for p in Path(out_dir).glob(".*.tmp") if p.name[1:].split(".tmp")[0].rsplit(".", 1)[0] in names]
    for path in stale:
        path.unlink(missing_ok=True)
    return len(stale)


def _write(path: Path, rows: list[dict[str, Any]], fmt: str) -> None:
    if fmt == "jsonl":
        with atomic_open(path, "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
        return
    # optional: parquet output only
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = sorted({k for row in rows for k in row} | {"key", "caption"})
    table = pa.table({c: [row.get(c) for row in rows] for c in columns})
    with atomic_open(path, "wb") as f:
        pq.write_table(table, f)
