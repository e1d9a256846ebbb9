"""Resumable caption output: JSON Lines written whole lines at a time, converted to COCO or CSV at the end.

One ``write`` + ``fsync`` per batch, so a killed run leaves only complete records; running the same
command again captions only the images not yet in the file.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vitattn.bundle import Bundle
from vitattn.fileio import atomic_write, parse_json
from vitattn.inference.captioning import iter_caption_batches
from vitattn.inference.figures import figure_paths, write_figures
from vitattn.inference.inputs import InputImage

__all__ = ["OUTPUT_FORMATS", "CaptionSummary", "caption_to_file", "read_records"]

log = logging.getLogger(__name__)


OUTPUT_FORMATS = ("jsonl", "coco", "csv")


@dataclass
class CaptionSummary:
    """What ``caption_to_file`` did: counts over all the inputs, earlier runs' records included."""

    captioned: int
    failed: int
    skipped: int  # already in the output from an earlier run
    out: Path
    records: list[dict[str, Any]]


def read_records(path: str | os.PathLike, repair: bool = False) -> dict[str, dict[str, Any]]:
    """Records of a JSON Lines output file, keyed by image path (the first record of a path wins).

    Args:
        path: the file; missing means no records.
        repair: cut off a trailing partial line (a run killed mid-write) from the file.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if repair:
            log.warning(
                "%s: dropping an incomplete last line (%d bytes) left by an interrupted run", path, len(data) - end
            )
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        data = data[:end]
    records: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = parse_json(line)
        except ValueError:
            log.warning("%s:%d is not a JSON record; ignored", path, n)
            continue
        if isinstance(record, dict) and isinstance(record.get("image"), str):
            records.setdefault(record["image"], record)
    return records


def caption_to_file(
    bundle: Bundle,
    inputs: Sequence[InputImage],
    out: str | os.PathLike,
    *,
    format: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    attention_maps: str | os.PathLike | None = None,
    **generate_kwargs: Any,
) -> CaptionSummary:
    """Caption ``inputs`` into ``out``, resuming where an earlier run of the same command stopped.

    Records are appended to a JSON Lines progress file (``out`` itself for ``jsonl``, else
    ``out + ".partial.jsonl"``), one ``write`` and ``fsync`` per batch. Images already recorded there
    (keyed by path) are skipped, so each image appears once. For ``coco`` (``[{"image_id",
    "caption"}]``, successes only) and ``csv`` (``image,image_id,caption,error``) the progress file is
    converted at the end, atomically, and removed.

    Args:
        bundle: a caption bundle.
        inputs: from ``list_inputs``.
        out: the output file.
        format: ``jsonl``, ``coco`` or ``csv``.
        batch_size, num_workers, progress: as in ``iter_caption_batches``.
        attention_maps: a folder for one attention figure per captioned image (``<stem>.png``).
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """
    if format not in OUTPUT_FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {list(OUTPUT_FORMATS)}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"out={out} is a folder; give a file path")
    out.parent.mkdir(parents=True, exist_ok=True)
    progress_path = out if format == "jsonl" else out.with_name(out.name + ".partial.jsonl")
    first: dict[str, InputImage] = {}
    for x in inputs:
        first.setdefault(x.path, x)  # each path once, the first kept
    inputs = list(first.values())
    figures = figure_paths(inputs, Path(attention_maps)) if attention_maps is not None else None
    with open(progress_path, "ab") as f:
        _lock(f, progress_path)
        done = read_records(progress_path, repair=True)
        todo = [x for x in inputs if x.path not in done]
        skipped = len(inputs) - len(todo)
        if skipped:
            log.info(
                "%d of %d images are already in %s; captioning the other %d",
                skipped,
                len(inputs),
                progress_path,
                len(todo),
            )
        for batch in iter_caption_batches(
            bundle, todo, batch_size=batch_size, num_workers=num_workers, progress=progress, **generate_kwargs
        ):
            if figures is not None:
                write_figures(bundle, batch, figures)
            f.write("".join(_json_line(r) for r in batch.records).encode("utf-8"))  # whole lines, one write
            f.flush()
            os.fsync(f.fileno())
            for r in batch.records:
                done.setdefault(r["image"], r)
    records = [done[x.path] for x in inputs]
    if format != "jsonl":
        atomic_write(out, _coco_text(records) if format == "coco" else _csv_text(records))
        progress_path.unlink(missing_ok=True)
    failed = sum("caption" not in r for r in records)
    return CaptionSummary(len(records) - failed, failed, skipped, out, records)


def _lock(f: Any, path: Path) -> None:
    """Hold an exclusive lock on the progress file: two runs appending to it would repeat images."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"{path} is being written by another run; wait for it or choose another out=") from None


def _json_line(record: Mapping[str, Any]) -> str:
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a file name that is not valid UTF-8: \u escapes read back to the same str
        line = json.dumps(record)
    return line + "\n"


def _coco_text(records: Sequence[Mapping[str, Any]]) -> str:
    results = [{"image_id": r["image_id"], "caption": r["caption"]} for r in records if "caption" in r]
    return json.dumps(results, ensure_ascii=False, indent=1) + "\n"


def _csv_text(records: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["image", "image_id", "caption", "error"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()
