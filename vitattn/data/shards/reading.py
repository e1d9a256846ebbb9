"""Reading one WebDataset shard: its samples in tar order, from a local file, a ``pipe:`` command or a URL.

The ``webdataset`` library opens shards (``gopen``: files, ``pipe:``, URLs) and splits tars into samples
(``tar_file_expander``, ``group_by_keys``), so img2dataset's layout is read as it is, with no conversion; the
members of a plain local tar come from ``vitattn.data.shards.tar_reader``, which skips ``tarfile``'s
per-member bookkeeping (figures in docs/benchmarks.md).

``read_samples`` reads the samples at some offsets of a shard. From a plain local tar with a member index
(``vitattn.data.shards.member_index``: where each sample starts, written once by the listing step) it reads
the index's offsets for those samples, then each run of consecutive samples from its first header to the
next sample's, and nothing else. Without an index it reads the headers of the other samples and none of
their bytes (the tar reader seeks past them; ``group_by_keys`` gets their members with data None, so that
samples are told apart exactly as it tells them apart), and it stops after the last sample asked for. A
``pipe:`` command or a URL is a stream: it is read from its start.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial
from typing import Any, BinaryIO

from vitattn.data.shards.member_index import SampleCounter, open_index
from vitattn.data.shards.tar_reader import is_plain_tar, tar_files, tar_members
from vitattn.errors import first_line

__all__ = ["ShardError", "ShortShard", "local_path", "open_shard", "read_samples", "read_shard"]


class ShardError(ValueError):
    """A shard that cannot be read (missing, not a tar, truncated); the message names it."""


class ShortShard(ShardError):
    """A shard that ends before a sample asked of it; ``samples`` is how many it holds."""

    def __init__(self, url: str, samples: int) -> None:
        super().__init__(f"shard {url} holds {samples} samples")
        self.samples = samples


def local_path(url: str) -> str | None:
    """The file a shard address reads, or None for a ``pipe:`` command or a URL."""
    if url.startswith("pipe:") or "://" in url and not url.startswith("file://"):
        return None
    return url[len("file://") :] if url.startswith("file://") else url


def open_shard(url: str) -> BinaryIO:
    """A shard's bytes: a local file unbuffered (the tar reader seeks past what it does not read, and a buffer
    would read ahead into it), a ``pipe:`` command or a URL through webdataset's ``gopen``."""
    path = local_path(url)
    if path is not None:
        return open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the reader
    from webdataset.gopen import gopen  # webdataset loads only when shards are read

    return gopen(url, "rb")


def read_shard(url: str, extensions: set[str] | None = None) -> Iterator[dict[str, Any]]:
    """The samples of one shard, in tar order: dicts ``{"__key__": KEY, "jpg": bytes, "txt": bytes, ...}``
    (extensions lower case; ``extensions`` keeps only those members, every sample is still yielded; from a
    plain local tar the other members are not read).

    Raises:
        ShardError: the shard cannot be opened, is not a tar, or ends early; the message names the shard and
            the last whole sample's key.
    """
    for _, sample in _guarded(url, partial(_walked, url, extensions, None)):
        yield sample


def read_samples(
    url: str,
    offsets: Sequence[int],
    extensions: set[str] | None = None,
    index_dir: str | os.PathLike | None = None,
) -> Iterator[tuple[int, dict]]:
    """``(offset, sample)`` of the samples at ``offsets`` (ascending) of one shard, as ``read_shard`` gives
    them. From a local tar with a valid index (``vitattn.data.shards.member_index``, beside the shard or in
    ``index_dir``) the wanted samples' bytes only, after the index's offsets for them; without one, the other
    samples' headers too, nothing after the last.

    Raises:
        ShortShard: the shard ends before the last offset.
        ShardError: as ``read_shard``, or the shard's samples are not where its index says.
    """
    if not offsets:
        return
    path = local_path(url)
    if path is not None:
        with open_index(path, index_dir, open_shard) as index:
            starts = index.starts(offsets[0], min(offsets[-1] + 1, index.count)) if index is not None else None
        if starts is not None:
            yield from _guarded(url, partial(_indexed, url, offsets, extensions, starts))
            if offsets[-1] >= index.count:
                raise ShortShard(url, index.count)
            return
    wanted, last, seen = set(offsets), offsets[-1], 0
    for offset, sample in _guarded(url, partial(_walked, url, extensions, wanted.__contains__)):
        seen = offset + 1
        if offset in wanted:
            yield offset, sample
        if offset == last:
            return
    raise ShortShard(url, seen)


def _guarded(url: str, read: Callable[[BinaryIO], Iterator[tuple[int, dict]]]) -> Iterator[tuple[int, dict]]:
    """``read(stream)`` over the shard opened, any failure one ``ShardError`` naming the shard."""
    key = None
    try:
        stream = open_shard(url)
    except Exception as err:  # noqa: BLE001 - any failure to open becomes the one line naming the shard
        raise ShardError(f"shard {url} cannot be opened: {first_line(err)}") from None
    try:
        for offset, sample in read(stream):
            key = sample["__key__"]
            yield offset, sample
    except ShardError:
        raise
    except Exception as err:  # noqa: BLE001 - tarfile's ReadError, a dead pipe: one line naming the shard
        after = f" after sample {key}" if key is not None else ""
        raise ShardError(f"shard {url} is unreadable{after}: {_reason(err)}") from None
    finally:
        stream.close()


def _walked(
    url: str, extensions: set[str] | None, wanted: Callable[[int], bool] | None, stream: BinaryIO
) -> Iterator[tuple[int, dict[str, Any]]]:
    """``(offset, sample)`` of every sample from the shard's start; those not ``wanted`` hold None for members
    not read."""
    from webdataset.tariterators import group_by_keys, tar_file_expander  # webdataset: only when read

    if local_path(url) is not None and is_plain_tar(stream):  # the common case, without tarfile's cost
        wants = _MemberFilter(extensions, wanted)
        files = ({"fname": name, "data": data, "__url__": url} for name, data in tar_files(stream, wants))
    else:
        files = tar_file_expander([{"url": url, "stream": stream}], eof_value=None)
    yield from enumerate(group_by_keys(files, suffixes=extensions))


def _indexed(
    url: str, offsets: Sequence[int], extensions: set[str] | None, starts: list[int], stream: BinaryIO
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The samples at ``offsets`` below the index's count: each run of consecutive ones read from its first
    sample's header (``starts[i]``: offset ``offsets[0] + i``) to the next sample's."""
    from webdataset.tariterators import group_by_keys  # webdataset: only when read

    first, count = offsets[0], offsets[0] + len(starts) - 1
    for a, b in _runs(o for o in offsets if o < count):
        stream.seek(starts[a - first])
        members = tar_members(stream, _MemberFilter(extensions, None), stop=starts[b - first])
        files = ({"fname": name, "data": data, "__url__": url} for _, name, data in members)
        given = 0
        for given, sample in enumerate(group_by_keys(files, suffixes=extensions), 1):
            yield a + given - 1, sample
        if given != b - a:
            raise ShardError(
                f"shard {url} holds {given} samples where its index says {b - a} (#{a} to #{b - 1}); "
                "it changed without a new size or time: delete its .offsets file and list the shards again"
            )


def _runs(offsets: Iterable[int]) -> Iterator[tuple[int, int]]:
    """``[a, b)`` of each run of consecutive offsets (ascending)."""
    run: list[int] = []
    for o in offsets:
        if run and o != run[1]:
            yield run[0], run[1]
            run = []
        run = [run[0] if run else o, o + 1]
    if run:
        yield run[0], run[1]


class _MemberFilter:
    """Whether a member's bytes are read: its sample (``SampleCounter``) is wanted, and its extension kept."""

    def __init__(self, extensions: set[str] | None, wanted: Callable[[int], bool] | None) -> None:
        self.samples, self.extensions, self.wanted = SampleCounter(), extensions, wanted

    def __call__(self, name: str) -> bool:
        member = self.samples(name)
        if member is None:
            return False
        offset, extension = member
        if self.extensions is not None and extension.lower() not in self.extensions:
            return False
        return self.wanted is None or self.wanted(offset)


def _reason(err: BaseException) -> str:
    text = first_line(err).split(" @ ")[0]  # webdataset appends " @ <stream>" to tar errors
    return text if text.strip() else type(err).__name__
