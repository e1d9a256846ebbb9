"""Resumable caption output: JSON Lines written whole lines at a time, merged or converted at the end.

One ``write`` + ``fsync`` per batch, so a killed run leaves only complete records; running the same
command again captions only the images not yet recorded. A run in one process appends to its
progress file (``out`` itself for ``jsonl``, else ``out + ".partial.jsonl"``); a run in several
processes appends each rank's records to its own part file (``out + ".rank<k>.partial.jsonl"``) and
rank 0 merges them into ``out`` in input order. Either kind of run resumes from what either left.
Which images are already done is read by ``vitattn.inference.records``.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import numpy as np

from vitattn.bundle.runtime import LoadedModel
from vitattn.fileio import atomic_open
from vitattn.inference.captioning import iter_caption_batches
from vitattn.inference.figures import figure_paths, write_figures
from vitattn.inference.file_list import InputImage, InputList
from vitattn.inference.records import RecordIndex, path_digests

__all__ = [
    "OUTPUT_FORMATS",
    "CaptionSummary",
    "LineCounter",
    "OutputFiles",
    "append_records",
    "caption_to_file",
]

log = logging.getLogger(__name__)


OUTPUT_FORMATS = ("jsonl", "coco", "csv")


@dataclass
class CaptionSummary:
    """What a captioning run did: counts over all the inputs, earlier runs' records included."""

    captioned: int
    failed: int
    skipped: int  # already recorded by an earlier run
    out: Path


@dataclass(frozen=True)
class OutputFiles:
    """The files of one ``out``: the final file, the single-process progress file and the rank part files."""

    out: Path
    format: str

    def __post_init__(self) -> None:
        if self.format not in OUTPUT_FORMATS:
            raise ValueError(f"format={self.format!r} is unknown; choose one of {list(OUTPUT_FORMATS)}")
        if self.out.is_dir():
            raise ValueError(f"out={self.out} is a folder; give a file path")

    @property
    def progress(self) -> Path:
        """Where a single process appends records (and what every run locks)."""
        return self.out if self.format == "jsonl" else self.out.with_name(self.out.name + ".partial.jsonl")

    def part(self, rank: int) -> Path:
        """Where rank ``rank`` of a multi-process run appends its records."""
        return self.out.with_name(f"{self.out.name}.rank{rank}.partial.jsonl")

    def parts(self) -> list[Path]:
        """The part files on disk, by rank."""
        pattern = re.compile(re.escape(self.out.name) + r"\.rank(\d+)\.partial\.jsonl")
        found = []
        if self.out.parent.is_dir():
            with os.scandir(self.out.parent) as entries:
                found = [(int(m[1]), Path(e.path)) for e in entries if (m := pattern.fullmatch(e.name))]
        return [p for _, p in sorted(found)]

    def sources(self) -> list[Path]:
        """Every file that may hold records of an earlier run: the progress file first, then the parts."""
        return [p for p in (self.progress, *self.parts()) if p.is_file()]

    def lock(self) -> IO[bytes]:
        """Open the progress file for appending, holding an exclusive lock: two runs writing the same
        records would repeat images. Raises ValueError, in one line, when another run holds it."""
        self.out.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.progress, "ab")  # noqa: SIM115 - held for the whole run
        try:
            import fcntl  # optional: POSIX only; elsewhere the progress file is not locked
        except ImportError:  # pragma: no cover - not on POSIX
            return f
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ValueError(
                f"{self.progress} is being written by another run; wait for it or choose another out="
            ) from None
        return f


def append_records(f: IO[bytes], records: Sequence[Mapping[str, Any]]) -> None:
    """Append ``records`` as whole JSON lines in one ``write``, then ``fsync``: a kill leaves at most
    one partial line, which the next run cuts off."""
    f.write("".join(_json_line(r) for r in records).encode("utf-8"))
    f.flush()
    os.fsync(f.fileno())


def write_output(files: OutputFiles, inputs: InputList, index: RecordIndex) -> tuple[int, int]:
    """Write every input's record into ``files.out`` in input order, atomically; returns ``(captioned,
    failed)``. ``jsonl`` keeps records of images that are not among ``inputs`` (after those that are);
    ``coco`` (``[{"image_id", "caption"}]``) writes the captioned images only; ``csv`` is
    ``image,image_id,caption,error``."""
    rows = index.find(path_digests(inputs.paths))
    if (rows < 0).any():
        missing = inputs[int(np.flatnonzero(rows < 0)[0])].path
        raise RuntimeError(f"{int((rows < 0).sum())} images have no record (the first: {missing})")
    failed = int(index.failed[rows].sum())
    if files.format == "jsonl":
        extra = np.ones(len(index), dtype=bool)
        extra[rows] = False
        rows = np.concatenate([rows, np.flatnonzero(extra)])
    with atomic_open(files.out, "wb") as f:
        if files.format == "jsonl":
            for line in index.lines(rows):
                f.write(line)
        else:
            text = io.TextIOWrapper(f, encoding="utf-8", errors="surrogateescape", newline="")
            records = (json.loads(line.decode("utf-8", errors="replace")) for line in index.lines(rows))
            (_write_coco if files.format == "coco" else _write_csv)(text, records)
            text.flush()
            text.detach()
    return len(inputs) - failed, failed


def count_failed(inputs: InputList, index: RecordIndex) -> int:
    """How many of ``inputs`` have an error record."""
    rows = index.find(path_digests(inputs.paths))
    return int(index.failed[rows[rows >= 0]].sum())


class LineCounter:
    """Complete lines of a growing file, read incrementally from ``offset``.

    The file stays open once it exists, so lines written before it is removed (a part file merged
    away) are still counted.
    """

    def __init__(self, path: Path, offset: int = 0) -> None:
        self.path, self.offset, self.lines = path, offset, 0
        self.file: IO[bytes] | None = None

    def __call__(self) -> int:
        if self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 - kept open, see the class docstring
            except FileNotFoundError:
                return self.lines
        self.file.seek(self.offset)
        data = self.file.read()
        end = data.rfind(b"\n") + 1  # a partial last line is counted once it is complete
        self.lines += data.count(b"\n", 0, end)
        self.offset += end
        return self.lines

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def caption_to_file(
    bundle: LoadedModel,
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
    """Caption ``inputs`` into ``out`` in this process, resuming where an earlier run of the same command stopped.

    Records are appended to the progress file (``out`` itself for ``jsonl``, else
    ``out + ".partial.jsonl"``), one ``write`` and ``fsync`` per batch. Images already recorded there
    or in part files of a multi-process run (keyed by path) are skipped, so each image appears once.
    For ``coco`` and ``csv``, and when part files were found, the records are written into ``out`` at
    the end, in input order, atomically (see ``write_output``), and the other files are removed.

    Args:
        bundle: a caption bundle.
        inputs: from ``list_inputs``.
        out: the output file.
        format: ``jsonl``, ``coco`` or ``csv``.
        batch_size, num_workers, progress: as in ``iter_caption_batches``.
        attention_maps: a folder for one attention figure per captioned image (``<stem>.png``).
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """
    files = OutputFiles(Path(out), format)
    inputs = InputList.unique(inputs)
    figures = figure_paths(inputs, Path(attention_maps)) if attention_maps is not None else None
    with files.lock() as f:
        parts = files.parts()
        index = RecordIndex.read(files.sources(), repair=True)
        todo = index.missing(inputs)
        skipped = len(inputs) - len(todo)
        failed = count_failed(inputs, index) if skipped else 0
        if skipped:
            log.info("%d of %d images are already recorded; captioning the other %d", skipped, len(inputs), len(todo))
        for batch in iter_caption_batches(
            bundle,
            inputs,
            positions=todo,
            batch_size=batch_size,
            num_workers=num_workers,
            progress=progress,
            **generate_kwargs,
        ):
            if figures is not None:
                write_figures(bundle, batch, figures)
            append_records(f, batch.records)
            failed += sum("caption" not in r for r in batch.records)
        if format != "jsonl" or parts:  # else out is the progress file: nothing to merge
            failed = write_output(files, inputs, RecordIndex.read(files.sources()))[1]
            remove_partial_files(files)
    return CaptionSummary(len(inputs) - failed, failed, skipped, files.out)


def remove_partial_files(files: OutputFiles) -> None:
    """Remove the part files and, unless it is ``out``, the progress file: ``out`` holds their records now."""
    for path in files.parts():
        path.unlink(missing_ok=True)
    if files.progress != files.out:
        files.progress.unlink(missing_ok=True)


def _json_line(record: Mapping[str, Any]) -> str:
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a file name that is not valid UTF-8: \u escapes read back to the same str
        line = json.dumps(record)
    return line + "\n"


def _write_coco(f: IO[str], records: Iterable[Mapping[str, Any]]) -> None:
    f.write("[")
    sep = "\n"
    for r in records:
        if "caption" in r:
            f.write(sep + " " + json.dumps({"image_id": r["image_id"], "caption": r["caption"]}, ensure_ascii=False))
            sep = ",\n"
    f.write("\n]\n")


def _write_csv(f: IO[str], records: Iterable[Mapping[str, Any]]) -> None:
    writer = csv.DictWriter(f, fieldnames=["image", "image_id", "caption", "error"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
