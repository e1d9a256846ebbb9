"""Where each sample of a local tar starts: an index beside the shard, computed once, so that a loader worker
seeks straight to its first sample and reads nothing before it.

``00000.tar.offsets`` lies beside the shard where its folder is writable, else in the cache
(``<cache>/shard_index/<sha1 of the shard's absolute path>.offsets``, the cache being ``data.count_cache``
or ``~/.cache/vitattn``). After the 8 bytes ``VTAOFFS1`` it holds little-endian int64s: the shard's size and
modification time (ns) when it was indexed, the sample count ``n``, then ``n + 1`` byte offsets: where each
sample's first header lies (a GNU long-name or pax header before it included) and, last, where the last
sample ends. Samples are told apart as webdataset's ``group_by_keys`` tells them apart: a new one where the
key (``base_plus_ext``) changes, members without an extension left out.

The listing step (``shard_sizes``) writes it in the pass that counts a shard's samples, or in a pass over
the headers only where ``_stats.json`` gives the count. An index whose shard has another size or time, or
whose length does not match its count, is never used: the listing step writes it again, and a reader that
finds no usable index reads the headers (``vitattn.data.shards.reading``).

Not webdataset's ``wids`` ``.index`` (a pickle of every member: not safe to load) nor DALI's ``wds2idx``
text (every member, and neither notices a rewritten shard): a sample's start is all a worker needs.
"""

from __future__ import annotations

import hashlib
import os
import struct
import sys
from array import array
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import BinaryIO

from vitattn.data.shards.tar_reader import is_plain_tar, tar_members
from vitattn.fileio import atomic_write, cache_folder

__all__ = ["INDEX_SUFFIX", "SampleCounter", "SampleIndex", "build_index", "index_files", "open_index", "sample_starts"]

INDEX_SUFFIX = ".offsets"
_MAGIC = b"VTAOFFS1"
_HEAD = struct.Struct("<8sqqq")  # magic, shard size, shard mtime (ns), samples
_INT = 8


def index_files(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> list[Path]:
    """Where a local shard's index may lie: beside it, then in the cache."""
    path = Path(path)
    digest = hashlib.sha1(str(path.absolute()).encode("utf-8", "surrogateescape")).hexdigest()
    cache = cache_folder(cache_dir) / "shard_index"
    return [path.with_name(path.name + INDEX_SUFFIX), cache / f"{digest}{INDEX_SUFFIX}"]


class SampleCounter:
    """Which sample of a tar each member belongs to, as webdataset's ``group_by_keys`` tells them apart: a new
    one where the key (``base_plus_ext``) changes; a member without an extension belongs to none."""

    def __init__(self) -> None:
        from webdataset.tariterators import base_plus_ext  # webdataset: only when shards are read

        self._split = base_plus_ext
        self.key: str | None = None
        self.offset = -1

    def __call__(self, name: str) -> tuple[int, str] | None:
        """``(sample offset, extension)`` of the member ``name`` (members in tar order), or None."""
        key, extension = self._split(name)
        if key is None:
            return None  # group_by_keys leaves it out
        if key != self.key:
            self.key, self.offset = key, self.offset + 1
        return self.offset, extension


def sample_starts(stream: BinaryIO) -> list[int]:
    """Each sample's first header in a plain tar and, last, where its last sample ends (``n + 1`` offsets);
    reads the headers only."""
    starts: list[int] = []
    end, samples = stream.tell(), SampleCounter()
    for start, name, _ in tar_members(stream, lambda name: False):
        member = samples(name)
        if member is None:
            continue
        if member[0] == len(starts):  # the first member of a new sample
            starts.append(start)
        end = stream.tell()  # the member's data and padding passed over: the next header
    return [*starts, end]


class SampleIndex:
    """An open, valid index: ``count`` samples; ``starts(a, b)`` reads offsets ``a .. b`` (both included)."""

    def __init__(self, file: BinaryIO, count: int, shard_size: int) -> None:
        self.file, self.count, self.shard_size = file, count, shard_size

    def starts(self, first: int, last: int) -> list[int] | None:
        """Offsets ``first .. last`` (``last <= count``), or None where they are not increasing inside the shard."""
        if last < first:
            return []
        self.file.seek(_HEAD.size + _INT * first)
        data = self.file.read(_INT * (last - first + 1))
        values = array("q")
        values.frombytes(data)
        if sys.byteorder == "big":
            values.byteswap()
        out = values.tolist()
        ok = len(out) == last - first + 1 and all(0 <= a < b for a, b in zip(out, out[1:]))
        return out if ok and out[-1] <= self.shard_size else None


@contextmanager
def open_index(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    opener: Callable[[str], BinaryIO] | None = None,
) -> Iterator[SampleIndex | None]:
    """The shard's index where one beside it or in the cache was written for the shard as it is now (same size,
    same modification time, as long as its count says); None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        yield None
        return
    for candidate in index_files(path, cache_dir):
        try:
            file = (opener or _open)(str(candidate))
        except OSError:
            continue
        try:
            head = file.read(_HEAD.size)
            length = os.fstat(file.fileno()).st_size
            if len(head) == _HEAD.size:
                magic, size, mtime, count = _HEAD.unpack(head)
                if (magic, size, mtime) == (_MAGIC, st.st_size, st.st_mtime_ns) and length == _HEAD.size + _INT * (
                    count + 1
                ):
                    yield SampleIndex(file, count, size)
                    return
        finally:
            file.close()
    yield None


def _open(path: str) -> BinaryIO:
    return open(path, "rb", buffering=0)  # noqa: SIM115 - closed by open_index


def build_index(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    opener: Callable[[str], BinaryIO] | None = None,
) -> int | None:
    """Index a local shard (its headers read once) beside it, else in the cache; its sample count, or None where
    it is not a plain tar (left to ``tarfile``: no index).

    Raises:
        tarfile.ReadError: the tar is damaged (a bad header, a member that ends early).
        OSError: the shard cannot be read.
    """
    with (opener or _open)(str(path)) as stream:
        if not is_plain_tar(stream):
            return None
        st = os.fstat(stream.fileno())
        starts = sample_starts(stream)
    body = array("q", starts)
    if sys.byteorder == "big":
        body.byteswap()
    data = _HEAD.pack(_MAGIC, st.st_size, st.st_mtime_ns, len(starts) - 1) + body.tobytes()
    for candidate in index_files(path, cache_dir):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(candidate, data)
            break
        except OSError:
            continue
    return len(starts) - 1
