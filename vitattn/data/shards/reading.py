"""Reading one WebDataset shard: its samples in tar order, from a local file, a ``pipe:`` command or a URL.

The ``webdataset`` library opens shards (``gopen``: files, ``pipe:``, URLs) and splits tars into samples
(``tar_file_expander``, ``group_by_keys``), so img2dataset's layout is read as it is, with no conversion; the
members of a plain local tar come from ``vitattn.data.shards.tar_reader``, which skips ``tarfile``'s
per-member bookkeeping (figures in docs/benchmarks.md).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from vitattn.data.shards.tar_reader import is_plain_tar, tar_files
from vitattn.errors import first_line

__all__ = ["ShardError", "local_path", "read_shard"]


class ShardError(ValueError):
    """A shard that cannot be read (missing, not a tar, truncated); the message names it."""


def local_path(url: str) -> str | None:
    """The file a shard address reads, or None for a ``pipe:`` command or a URL."""
    if url.startswith("pipe:") or "://" in url and not url.startswith("file://"):
        return None
    return url[len("file://") :] if url.startswith("file://") else url


def read_shard(url: str, extensions: set[str] | None = None) -> Iterator[dict[str, Any]]:
    """The samples of one shard, in tar order: dicts ``{"__key__": KEY, "jpg": bytes, "txt": bytes, ...}``
    (extensions lower case; ``extensions`` keeps only those members, every sample is still yielded).

    Raises:
        ShardError: the shard cannot be opened, is not a tar, or ends early; the message names the shard and
            the last whole sample's key.
    """
    # webdataset loads only when shards are read, not with every import of vitattn.data
    from webdataset.gopen import gopen
    from webdataset.tariterators import group_by_keys, tar_file_expander

    key = None
    try:
        stream = gopen(url, "rb")
    except Exception as err:  # noqa: BLE001 - any failure to open becomes the one line naming the shard
        raise ShardError(f"shard {url} cannot be opened: {first_line(err)}") from None
    try:
        if local_path(url) is not None and is_plain_tar(stream):  # the common case, without tarfile's cost
            files = ({"fname": name, "data": data, "__url__": url} for name, data in tar_files(stream))
        else:
            files = tar_file_expander([{"url": url, "stream": stream}], eof_value=None)
        for sample in group_by_keys(files, suffixes=extensions):
            key = sample["__key__"]
            yield sample
    except Exception as err:  # noqa: BLE001 - tarfile's ReadError, a dead pipe: one line naming the shard
        after = f" after sample {key}" if key is not None else ""
        raise ShardError(f"shard {url} is unreadable{after}: {_reason(err)}") from None
    finally:
        stream.close()


def _reason(err: BaseException) -> str:
    text = first_line(err).split(" @ ")[0]  # webdataset appends " @ <stream>" to tar errors
    return text if text.strip() else type(err).__name__
