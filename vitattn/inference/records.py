"""The records a caption run has written: which images are done, and where each one's record lies.

The index (``RecordIndex``) keeps 16 bytes of path digest and 11 bytes of location per record, not
the records, so a resumed run over millions of images knows what is left without holding them.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from array import array
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from vitattn.fileio import parse_json
from vitattn.inference.file_list import InputList

__all__ = ["RecordIndex", "path_digests", "read_records"]

log = logging.getLogger(__name__)


def path_digests(paths: Iterable[str]) -> np.ndarray:
    """(n,) ``V16`` digests of image paths, the keys of ``RecordIndex`` (a 128-bit hash: no collision
    in practice at any number of images)."""
    return np.frombuffer(b"".join(map(_digest, paths)), dtype="V16")


def _first_u64(digests: np.ndarray) -> np.ndarray:
    return digests.view(">u8")[::2].astype(np.uint64)


def _digest(path: str) -> bytes:
    return hashlib.blake2b(path.encode("utf-8", "surrogatepass"), digest_size=16).digest()


@dataclass
class RecordIndex:
    """Which images have a record, and where it lies: sorted path digests and their record's location.

    Attributes:
        files: the files read, in order.
        keys: (n,) sorted ``V16`` path digests, one per recorded image (the first record of a path wins).
        file: (n,) position of the record's file in ``files`` (int16: the parts of up to 32,767 ranks).
        offset: (n,) byte offset of the record's line in that file.
        failed: (n,) whether the record is an error record.
    """

    files: list[Path]
    keys: np.ndarray
    file: np.ndarray
    offset: np.ndarray
    failed: np.ndarray

    @classmethod
    def read(cls, files: Sequence[Path], repair: bool = False) -> RecordIndex:
        """Index the JSON Lines ``files`` (earlier files win for a path recorded twice).

        Args:
            files: the files; a missing one holds no records.
            repair: cut off a trailing partial line (a run killed mid-write) from each file.
        """
        decode = json.JSONDecoder().raw_decode  # json.loads without its wrappers: a third of the time
        digests, file_ids, offsets, failed = bytearray(), array("h"), array("q"), bytearray()
        for k, path in enumerate(files):
            if not path.is_file():
                continue
            start, end = len(offsets), 0
            with open(path, "rb") as f:
                for n, line in enumerate(f, start=1):
                    if line[-1:] != b"\n":
                        break  # a partial last line
                    at, end = end, end + len(line)
                    try:
                        record = decode(line.decode("utf-8", errors="replace"))[0]
                    except (ValueError, RecursionError):  # not JSON, too deeply nested, a too long number
                        if line.strip():
                            log.warning("%s:%d is not a JSON record; ignored", path, n)
                        continue
                    image = record.get("image") if isinstance(record, dict) else None
                    if isinstance(image, str):
                        digests += _digest(image)
                        offsets.append(at)
                        failed.append("caption" not in record)
                size = f.seek(0, os.SEEK_END)
            if end < size:
                _cut_partial_line(path, end, size, repair)
            file_ids.extend([k] * (len(offsets) - start))
        keys, first = np.unique(np.frombuffer(bytes(digests), dtype="V16"), return_index=True)
        return cls(
            list(files),
            keys,
            np.frombuffer(file_ids, dtype=np.int16)[first],
            np.frombuffer(offsets, dtype=np.int64)[first],
            np.frombuffer(bytes(failed), dtype=np.bool_)[first],
        )

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, digests: np.ndarray) -> np.ndarray:
        """(n,) the index row of each digest's record, -1 where there is none."""
        if not len(self.keys):
            return np.full(len(digests), -1)
        # searchsorted on 16-byte voids compares bytes one call at a time; on their first 8 bytes as
        # integers (the same order: big-endian) it is much faster (docs/benchmarks.md), and equal firsts are looked past
        first, keys_first = _first_u64(digests), _first_u64(self.keys)
        rows = np.minimum(np.searchsorted(keys_first, first), len(self.keys) - 1)
        found = self.keys[rows] == digests
        for i in np.flatnonzero(~found & (keys_first[rows] == first)):  # 64-bit prefix shared: next rows
            row = rows[i] + 1
            while row < len(self.keys) and keys_first[row] == first[i] and not found[i]:
                found[i], rows[i] = self.keys[row] == digests[i], row
                row += 1
        return np.where(found, rows, -1)

    def missing(self, inputs: InputList) -> np.ndarray:
        """Positions in ``inputs`` that have no record, in order."""
        return np.flatnonzero(self.find(path_digests(inputs.paths)) < 0)

    def lines(self, rows: Iterable[int]) -> Iterable[bytes]:
        """The record lines of index ``rows``, read from their files."""
        with ExitStack() as stack:
            handles = [stack.enter_context(open(p, "rb")) if p.is_file() else None for p in self.files]
            for row in rows:
                f = handles[self.file[row]]
                f.seek(self.offset[row])
                yield f.readline()


def _cut_partial_line(path: Path, end: int, size: int, repair: bool) -> None:
    if not repair:
        return
    log.warning("%s: dropping an incomplete last line (%d bytes) left by an interrupted run", path, size - end)
    with open(path, "r+b") as f:
        f.truncate(end)
        os.fsync(f.fileno())


def read_records(path: str | os.PathLike, repair: bool = False) -> dict[str, dict[str, Any]]:
    """Records of a JSON Lines output file, keyed by image path (the first record of a path wins).

    Holds every record in memory: for inspecting an output; runs use ``RecordIndex``.

    Args:
        path: the file; missing means no records.
        repair: cut off a trailing partial line (a run killed mid-write) from the file.
    """
    index = RecordIndex.read([Path(path)], repair=repair)
    records: dict[str, dict[str, Any]] = {}
    for line in index.lines(np.argsort(index.offset, kind="stable")):  # file order
        record = parse_json(line.decode("utf-8", errors="replace"))
        records.setdefault(record["image"], record)
    return records
