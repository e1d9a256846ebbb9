"""WebDataset shards as img2dataset writes them: which a spec names (``expand_shards``), their sample counts
(``shard_sizes``), one shard's samples: a plain local tar from its headers and member index, anything else through
webdataset (docs/shards.md)."""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import re
import struct
import tarfile
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from functools import partial
from itertools import groupby
from operator import itemgetter
from pathlib import Path
from typing import Any, BinaryIO

from webdataset.gopen import gopen
from webdataset.shardlists import expand_urls  # braces, ``::`` and $WDS_ variables as webdataset reads them
from webdataset.tariterators import base_plus_ext, group_by_keys, tar_file_expander

from vitattn.errors import first_line
from vitattn.fileio import atomic_write, cache_folder

__all__ = [
    "BLOCK",
    "CLASSES_FILE",
    "expand_shards",
    "shard_sizes",
    "build_index",
    "index_files",
    "INDEX_SUFFIX",
    "is_plain_tar",
    "local_path",
    "open_index",
    "open_shard",
    "read_samples",
    "read_shard",
    "ShardError",
    "ShortShard",
    "tar_members",
]

log = logging.getLogger(__name__)

CLASSES_FILE = "classes.txt"  # a classification shard set's class names, one a line, beside its shards
LIST_SUFFIXES = (".txt", ".list", ".shards")  # a file naming one shard a line
BLOCK = 512
# name, mode, uid, gid, size, mtime, chksum, typeflag, linkname, magic, version, uname, gname, devmajor,
# devminor, prefix (POSIX.1-1988 ustar; GNU and pax tars share the layout)
_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s")
_FIELDS = itemgetter(0, 4, 6, 7, 9, 15)  # name, size, chksum, typeflag, magic, prefix
_META = re.compile(r"__[^/]*__($|/)")  # webdataset's metadata members (``__key__``, ...), skipped as it skips them
_FILES = (b"0", b"\0", b"7")  # regular file (old and new spelling), contiguous file
_SKIPPED = (b"1", b"2", b"3", b"4", b"5", b"6", b"g")  # links, devices, directories, fifos, pax global header
_NAMES = (b"L", b"x")  # GNU long name, pax extended header of the next member
_ZEROS = bytes(BLOCK)


def _checksum_ok(header: bytes, stored: bytes) -> bool:
    try:
        expected = int(stored.rstrip(b"\0 ").strip() or b"-1", 8)
    except ValueError:
        return False
    unsigned = 256 + sum(header[:148]) + sum(header[156:])  # the checksum field counts as eight spaces
    if expected == unsigned:
        return True
    high = sum(1 for b in header[:148] + header[156:] if b > 127)
    return expected == unsigned - 256 * high  # the signed sum some old tars wrote


def _size(field: bytes) -> int | None:
    if field[:1] in (b"\x80", b"\xff"):  # base-256 (sizes over 8 GiB): left to tarfile
        return None
    try:
        return int(field.rstrip(b"\0 ").strip() or b"0", 8)
    except ValueError:
        return None


def is_plain_tar(stream: BinaryIO) -> bool:
    """Whether ``stream`` (a seekable file, left at its start) begins with a header ``tar_members`` reads."""
    header = stream.read(BLOCK)
    stream.seek(0)
    if len(header) < BLOCK:
        return False
    _, size, chksum, kind, _, _ = _FIELDS(_HEADER.unpack_from(header))
    return _checksum_ok(header, chksum) and _size(size) is not None and kind in _FILES + _SKIPPED + _NAMES


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header; ``tarfile.ReadError`` for a malformed one or a size record."""
    path, pos = None, 0
    while pos < len(data) and data[pos] != 0:
        space = data.find(b" ", pos)
        try:
            length = int(data[pos:space])
        except ValueError:
            raise tarfile.ReadError("invalid pax header") from None
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        if key == b"path":
            path = value.decode("utf-8", "surrogateescape")
        elif key == b"size":
            raise tarfile.ReadError("a member over 8 GiB (pax size record)")
        pos += length
    return path


def tar_members(
    stream: BinaryIO, wants: Callable[[str], bool] | None = None, stop: int | None = None
) -> Iterator[tuple[int, str, bytes | None]]:
    """``(start, name, data)`` of each regular file of an uncompressed, seekable tar, in order, from the stream's
    position to ``stop``; ``start`` is the file's first header (a long-name or pax header before it included), and
    a name ``wants`` refuses comes with data None (its bytes passed over by seeking).

    Raises:
        tarfile.ReadError: a bad checksum, an unknown header kind, data that ends inside a member.
    """
    pos = stream.tell()
    end = stream.seek(0, io.SEEK_END)  # a member passed over must still end inside the file
    stream.seek(pos)
    long_name: str | None = None
    start = pos  # the first header of the member being read
    while stop is None or pos < stop:
        header = stream.read(BLOCK)
        if len(header) < BLOCK or header == _ZEROS:  # the end (tarfile also accepts a tar without its end blocks)
            if 0 < len(header) < BLOCK:
                raise tarfile.ReadError("unexpected end of data")
            return
        name, size_field, chksum, kind, magic, prefix = _FIELDS(_HEADER.unpack_from(header))
        size = _size(size_field)
        if not _checksum_ok(header, chksum) or size is None:
            raise tarfile.ReadError("bad checksum" if size is not None else "unsupported member size")
        pos += BLOCK + size + -size % BLOCK  # the next header
        if kind in _FILES:
            if long_name is None:
                long_name = name.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
                if magic.startswith(b"ustar") and prefix[:1] not in (b"\0", b""):
                    long_name = prefix.split(b"\0", 1)[0].decode("utf-8", "surrogateescape") + "/" + long_name
            meta = _META.match(long_name)
            data = _data(stream, size, end, read=not meta and (wants is None or wants(long_name)))
            if not meta:
                yield start, long_name, data
            long_name, start = None, pos
            continue
        data = _data(stream, size, end, read=kind in _NAMES)
        if kind == b"L":
            long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif kind == b"x":
            long_name = _pax_path(data) or long_name
        elif kind in _SKIPPED:
            long_name, start = None, pos
        else:
            raise tarfile.ReadError(f"unknown member kind {kind!r}")


def _data(stream: BinaryIO, size: int, end: int, read: bool) -> bytes | None:
    """A member's ``size`` bytes (None when not ``read``: passed over), the stream left at the next header."""
    padded = size + -size % BLOCK
    if not read:
        if stream.tell() + size > end:
            raise tarfile.ReadError("unexpected end of data")
        stream.seek(padded, io.SEEK_CUR)
        return None
    data = stream.read(size)
    if len(data) < size:
        raise tarfile.ReadError("unexpected end of data")
    stream.seek(padded - size, io.SEEK_CUR)  # the padding to the next header
    return data


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
        self.key: str | None = None
        self.offset = -1

    def __call__(self, name: str) -> tuple[int, str] | None:
        """``(sample offset, extension)`` of the member ``name`` (members in tar order), or None."""
        key, extension = base_plus_ext(name)
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
        if len(data) != _INT * (last - first + 1):
            return None
        out = list(struct.unpack(f"<{last - first + 1}q", data))
        ok = all(0 <= a < b for a, b in zip(out, out[1:]))
        return out if ok and out[-1] <= self.shard_size else None


@contextmanager
def open_index(path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Iterator[SampleIndex | None]:
    """The shard's index where one beside it or in the cache was written for the shard as it is now (same size,
    same modification time, as long as its count says); None where there is none."""
    try:
        st = os.stat(path)
    except OSError:
        yield None
        return
    for candidate in index_files(path, cache_dir):
        try:
            file = open_shard(str(candidate))
        except OSError:
            continue
        try:
            head = file.read(_HEAD.size)
            if len(head) == _HEAD.size:
                magic, size, mtime, count = _HEAD.unpack(head)
                whole = os.fstat(file.fileno()).st_size == _HEAD.size + _INT * (count + 1)
                if whole and (magic, size, mtime) == (_MAGIC, st.st_size, st.st_mtime_ns):
                    yield SampleIndex(file, count, size)
                    return
        finally:
            file.close()
    yield None


def build_index(
    path: str | os.PathLike,
    cache_dir: str | os.PathLike | None = None,
    opener: Callable[[str], BinaryIO] | None = None,
) -> int | None:
    """Index a local shard's sample starts (its headers read once) beside it, else in the cache; its sample
    count, or None for a tar that is not plain (no index).

    Raises:
        tarfile.ReadError: a damaged tar.
        OSError: the shard cannot be read.
    """
    with (opener or open_shard)(str(path)) as stream:
        if not is_plain_tar(stream):
            return None
        st = os.fstat(stream.fileno())
        starts = sample_starts(stream)
    data = _HEAD.pack(_MAGIC, st.st_size, st.st_mtime_ns, len(starts) - 1) + struct.pack(f"<{len(starts)}q", *starts)
    for candidate in index_files(path, cache_dir):
        try:
            candidate.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(candidate, data)
            break
        except OSError:
            continue
    return len(starts) - 1


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
    return gopen(url, "rb")


def read_shard(url: str, extensions: set[str] | None = None) -> Iterator[dict[str, Any]]:
    """The samples of one shard in tar order, ``{"__key__": KEY, "jpg": bytes, ...}`` (extensions lower case;
    ``extensions`` keeps only those members, every sample still yielded).

    Raises:
        ShardError: the shard cannot be opened, is not a tar, or ends early (naming it and the last key).
    """
    for _, sample in _guarded(url, partial(_walked, url, extensions, None)):
        yield sample


def read_samples(
    url: str,
    offsets: Sequence[int],
    extensions: set[str] | None = None,
    index_dir: str | os.PathLike | None = None,
) -> Iterator[tuple[int, dict]]:
    """``(offset, sample)`` of the samples at ascending ``offsets``: with a valid member index (beside the shard
    or in ``index_dir``) only their bytes, else the headers before them too, nothing after the last.

    Raises:
        ShortShard: the shard ends before the last offset.
        ShardError: as ``read_shard``, or the samples are not where the index says.
    """
    if not offsets:
        return
    path = local_path(url)
    if path is not None:
        with open_index(path, index_dir) as index:
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
    """``(offset, sample)`` from the shard's start; the members of samples not ``wanted`` hold None."""
    if local_path(url) is not None and is_plain_tar(stream):  # the common case, without tarfile's cost
        wants = _MemberFilter(extensions, wanted)
        files = ({"fname": name, "data": data, "__url__": url} for _, name, data in tar_members(stream, wants))
    else:
        files = tar_file_expander([{"url": url, "stream": stream}], eof_value=None)
    yield from enumerate(group_by_keys(files, suffixes=extensions))


def _indexed(
    url: str, offsets: Sequence[int], extensions: set[str] | None, starts: list[int], stream: BinaryIO
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The samples at ``offsets`` below the index's count: each run of consecutive ones read from its first
    sample's header (``starts[i]``: offset ``offsets[0] + i``) to the next sample's."""
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
    """``[a, b)`` of each run of consecutive offsets (ascending): those whose offset minus place is the same."""
    for _, group in groupby(enumerate(offsets), lambda place_offset: place_offset[1] - place_offset[0]):
        run = [offset for _, offset in group]
        yield run[0], run[-1] + 1


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


def expand_shards(spec: str | os.PathLike | Sequence[str | os.PathLike], where: str = "shards") -> list[str]:
    """Shard addresses (local paths, ``pipe:`` commands, URLs) from brace notation, ``::``-joined patterns, a
    list, a file listing one a line (paths relative to it), or a folder (its ``*.tar``, sorted).

    Raises:
        ValueError: nothing is named, or a named local shard does not exist.
    """
    if spec is None or (isinstance(spec, str) and not spec.strip()):
        raise ValueError(f"{where} is empty; give shards as DIR/{{00000..00009}}.tar, a list, or a file listing them")
    if isinstance(spec, (str, os.PathLike)):
        text = str(spec)
        if not text.startswith("pipe:") and Path(text).is_dir():
            urls = sorted(str(p) for p in Path(text).glob("*.tar"))
        elif not text.startswith("pipe:") and text.endswith(LIST_SUFFIXES) and Path(text).is_file():
            base = Path(text).parent
            lines = [ln.strip() for ln in Path(text).read_text().splitlines()]
            urls = [ln if ln.startswith("pipe:") or os.path.isabs(ln) else str(base / ln) for ln in lines if ln]
        else:
            urls = expand_urls(text)
    else:
        urls = [u for item in spec for u in expand_urls(str(item))]
    if not urls:
        raise ValueError(f"{where}={spec!r} names no shard")
    missing = [u for u in urls if local_path(u) is not None and not os.path.isfile(local_path(u))]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{where}: shard {missing[0]} does not exist{more}; check the path or the brace range")
    return urls


def shard_sizes(urls: Sequence[str], cache_dir: str | os.PathLike | None = None, threads: int = 8) -> list[int]:
    """Each shard's sample count: its ``_stats.json``'s ``successes`` (or ``.parquet`` rows), else its member
    index's, else one counting pass cached in ``cache_dir`` (``~/.cache/vitattn``) by address, size and time; a
    local plain tar gets its member index too.

    Raises:
        ShardError: a shard that has to be counted cannot be read.
    """
    cache_file = cache_folder(cache_dir) / "shard_sizes.json"
    try:
        cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    except (OSError, ValueError):
        cache = {}
    stated = {url: _stated_size(url) for url in urls}
    indexed = {url: _indexed_count(url, cache_dir) for url in urls if local_path(url) is not None}
    to_index = [url for url, n in indexed.items() if n is None]
    if to_index:
        log.info("indexing where the samples of %d shards start, once (their headers read)", len(to_index))
        with ThreadPoolExecutor(max(1, min(threads, len(to_index)))) as pool:
            indexed.update(zip(to_index, pool.map(partial(_index, cache_dir=cache_dir), to_index)))
    sizes: dict[str, int] = {}
    to_count = []
    for url in urls:
        for n in (stated[url], indexed.get(url), cache.get(_cache_key(url))):
            if n is not None:
                sizes[url] = int(n)
                break
        else:
            to_count.append(url)
    if to_count:
        log.info("counting the samples of %d shards once (no _stats.json beside them)", len(to_count))
        with ThreadPoolExecutor(max(1, min(threads, len(to_count)))) as pool:
            for url, n in zip(to_count, pool.map(_count, to_count)):
                sizes[url] = cache[_cache_key(url)] = n
        try:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            atomic_write(cache_file, json.dumps(cache, indent=0, sort_keys=True))
        except OSError as err:
            log.warning("shard counts not cached in %s: %s", cache_file, first_line(err))
    return [sizes[url] for url in urls]


def _indexed_count(url: str, cache_dir: str | os.PathLike | None) -> int | None:
    """The sample count of a local shard's index, where one was written for the shard as it is now."""
    with open_index(local_path(url), cache_dir) as index:
        return None if index is None else index.count


def _index(url: str, cache_dir: str | os.PathLike | None) -> int | None:
    """Index a local shard: its sample count, or None where it is not a plain tar or cannot be read."""
    try:
        return build_index(local_path(url), cache_dir)
    except (OSError, tarfile.ReadError) as err:
        log.warning("shard %s not indexed: %s", url, first_line(err))
        return None


def _stated_size(url: str) -> int | None:
    """``successes`` of img2dataset's ``NNNNN_stats.json`` beside a local ``NNNNN.tar``, else the ``success`` rows
    of its ``NNNNN.parquet`` (pyarrow)."""
    if local_path(url) is None:
        return None
    path = Path(local_path(url)).with_name(Path(local_path(url)).name.rsplit(".", 1)[0] + "_stats.json")
    if path.is_file():
        try:
            return int(json.loads(path.read_text())["successes"])
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("%s has no readable 'successes' count; counting the shard instead", path)
            return None
    table = path.with_name(path.name[: -len("_stats.json")] + ".parquet")
    if not table.is_file():
        return None
    try:
        import pyarrow.parquet as pq  # optional: only img2dataset's parquet beside a shard needs it

        status = pq.read_table(table, columns=["status"]).column("status").to_pylist()
    except (ImportError, OSError, KeyError, ValueError):
        return None
    return sum(1 for s in status if s == "success")


def _cache_key(url: str) -> str:
    path = local_path(url)
    if path is not None and os.path.isfile(path):
        st = os.stat(path)
        url = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha1(url.encode()).hexdigest()


def _count(url: str) -> int:
    return sum(1 for _ in read_shard(url, extensions=set()))
