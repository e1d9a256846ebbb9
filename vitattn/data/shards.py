"""WebDataset shards as img2dataset writes them: listing, reading, and how many samples each holds.

A shard is a tar file (``00000.tar``) whose members ``KEY.jpg``, ``KEY.txt``, ``KEY.json``, ``KEY.cls``
belong to the sample ``KEY``; beside it img2dataset writes ``00000_stats.json`` (``successes``: the
samples in the tar) and ``00000.parquet``. ``expand_shards`` turns brace notation
(``/data/cc/{00000..00999}.tar``), a list, or a file listing shards into shard addresses: local paths
or ``pipe:`` commands (``pipe:aws s3 cp s3://b/00000.tar -``). The ``webdataset`` library opens them
(``gopen``: files, ``pipe:``, URLs) and splits tars into samples (``tar_file_expander``, ``group_by_keys``),
so the layout is read as it is, with no conversion; the members of a plain local tar come from
``vitattn.data.tar_reader``, which reads the same files faster than ``tarfile`` (``docs/benchmarks.md``).

``shard_sizes`` gives each shard's sample count from its ``_stats.json`` (or the ``success`` rows of its
``.parquet``) where there is one, else from one counting pass over the shard (members are grouped into
samples, nothing is decoded), kept in a cache file so that the pass runs once per shard.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from vitattn.data.tar_reader import is_plain_tar, tar_files
from vitattn.errors import first_line
from vitattn.fileio import atomic_write

__all__ = ["ShardError", "expand_shards", "local_path", "read_shard", "shard_sizes", "stats_path"]

log = logging.getLogger(__name__)

LIST_SUFFIXES = (".txt", ".list", ".shards")  # a file naming one shard a line


class ShardError(ValueError):
    """A shard that cannot be read (missing, not a tar, truncated); the message names it."""


def expand_shards(spec: str | os.PathLike | Sequence[str | os.PathLike], where: str = "shards") -> list[str]:
    """Shard addresses from brace notation, a list, a file listing one shard a line (``.txt``, ``.list``), or a
    folder (its ``*.tar``, sorted).

    Relative paths in a listing file are relative to the file's folder; ``::`` separates several patterns.

    Raises:
        ValueError: nothing is named, or a named local shard does not exist.
    """
    from webdataset.shardlists import expand_urls  # braces, ``::`` and $WDS_ variables as webdataset reads them

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


def local_path(url: str) -> str | None:
    """The file a shard address reads, or None for a ``pipe:`` command or a URL."""
    if url.startswith("pipe:") or "://" in url and not url.startswith("file://"):
        return None
    return url[len("file://") :] if url.startswith("file://") else url


def stats_path(url: str) -> Path | None:
    """img2dataset's ``NNNNN_stats.json`` beside a local shard ``NNNNN.tar``."""
    path = local_path(url)
    if path is None:
        return None
    return Path(path).with_name(Path(path).name.rsplit(".", 1)[0] + "_stats.json")


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


def shard_sizes(urls: Sequence[str], cache_dir: str | os.PathLike | None = None, threads: int = 8) -> list[int]:
    """The number of samples in each shard: its ``_stats.json``'s ``successes`` where there is one, else a
    counting pass over the shard's member names, cached in ``cache_dir`` (default ``~/.cache/vitattn``) by
    the shard's address, size and modification time.

    Raises:
        ShardError: a shard that has to be counted cannot be read.
    """
    cache_file = Path(cache_dir or Path.home() / ".cache" / "vitattn") / "shard_sizes.json"
    try:
        cache = json.loads(cache_file.read_text()) if cache_file.is_file() else {}
    except (OSError, ValueError):
        cache = {}
    sizes: dict[str, int] = {}
    to_count = []
    for url in urls:
        stated = _stated_size(url)
        if stated is not None:
            sizes[url] = stated
        elif _cache_key(url) in cache:
            sizes[url] = int(cache[_cache_key(url)])
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


def _stated_size(url: str) -> int | None:
    """``successes`` of the shard's ``_stats.json``, else the ``success`` rows of its ``.parquet`` (pyarrow)."""
    path = stats_path(url)
    if path is None:
        return None
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
