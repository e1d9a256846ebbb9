"""The files of an uncompressed local tar, read straight from its 512-byte headers.

Python's ``tarfile``, which ``webdataset`` reads shards with, parses each header field by field in Python,
which makes it a large part of what a training sample from a shard costs a loader worker (the figures:
``docs/benchmarks.md``, "Data from WebDataset shards").
``tar_files`` reads the same members with one ``struct`` unpack and one checksum a header. It reads what
``tarfile`` writes (ustar, GNU and POSIX/pax, as img2dataset's and ``vitattn-shards``' writers do): long
names (GNU ``L`` members, pax ``path`` records), directories and links skipped. Anything else (a compressed
tar, an unknown header kind, a size in base-256) makes ``is_plain_tar`` false and ``read_shard`` leaves the
file to ``tarfile``; a header whose checksum fails or data that ends early raises ``tarfile.ReadError``, as
``tarfile`` would.

A member whose bytes are not wanted (``tar_files(stream, wants)``) is passed over by seeking from its header
to the next: a loader worker reads the headers of the samples before its own, not their images.
"""

from __future__ import annotations

import io
import re
import struct
import tarfile
from collections.abc import Callable, Iterator
from typing import BinaryIO

__all__ = ["is_plain_tar", "tar_files", "tar_members"]

BLOCK = 512
# name, mode, uid, gid, size, mtime, chksum, typeflag, linkname, magic, version, uname, gname, devmajor,
# devminor, prefix (POSIX.1-1988 ustar; GNU and pax tars share the layout)
_HEADER = struct.Struct("100s8s8s8s12s12s8sc100s6s2s32s32s8s8s155s")
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
    """Whether ``stream`` (a seekable file, left at its start) begins with a header ``tar_files`` reads."""
    header = stream.read(BLOCK)
    stream.seek(0)
    if len(header) < BLOCK:
        return False
    fields = _HEADER.unpack_from(header)
    kind = fields[7]
    return (
        _checksum_ok(header, fields[6])
        and _size(fields[4]) is not None
        and (kind in _FILES or kind in _SKIPPED or kind in _NAMES)
    )


def _pax_path(data: bytes) -> str | None:
    """The ``path`` record of a pax extended header (``"<length> <key>=<value>\\n"`` records).

    Raises:
        tarfile.ReadError: the header is malformed, or gives the next member's size (members over 8 GiB).
    """
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


def tar_files(stream: BinaryIO, wants: Callable[[str], bool] | None = None) -> Iterator[tuple[str, bytes | None]]:
    """``(name, data)`` of each regular file of an uncompressed tar, in order.

    Args:
        stream: the tar, seekable (padding, and the members not wanted, are passed over by seeking).
        wants: called with each file's name, in order, before its bytes: False passes over them (the file
            comes with data None, only its header read); None reads every file.

    Raises:
        tarfile.ReadError: a bad header checksum, a header kind this reader does not know, or data that
            ends inside a member.
    """
    for _, name, data in tar_members(stream, wants):
        yield name, data


def tar_members(
    stream: BinaryIO, wants: Callable[[str], bool] | None = None, stop: int | None = None
) -> Iterator[tuple[int, str, bytes | None]]:
    """``(start, name, data)`` of each regular file, as ``tar_files`` gives them, from the stream's position:
    ``start`` is where the file's first header lies (a GNU long-name or pax header before its own included).

    Args:
        stop: where to end (a header that starts there or after is not read); None: the tar's end.
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
        fields = _HEADER.unpack_from(header)
        name, size_field, chksum, kind, magic, prefix = (
            fields[0],
            fields[4],
            fields[6],
            fields[7],
            fields[9],
            fields[15],
        )
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
