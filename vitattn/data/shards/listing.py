"""WebDataset shards as img2dataset writes them (``00000.tar`` with ``00000_stats.json`` beside it): which
shards a spec names (``expand_shards``) and how many samples each holds (``shard_sizes``), counted once and
cached, a local tar's member index written on the way (docs/shards.md)."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tarfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path

from webdataset.shardlists import expand_urls  # braces, ``::`` and $WDS_ variables as webdataset reads them

from vitattn.data.shards.reading import build_index, local_path, open_index, read_shard
from vitattn.errors import first_line
from vitattn.fileio import atomic_write, cache_folder

__all__ = ["CLASSES_FILE", "expand_shards", "shard_sizes", "stats_path"]

log = logging.getLogger(__name__)

CLASSES_FILE = "classes.txt"  # a classification shard set's class names, one a line, beside its shards
LIST_SUFFIXES = (".txt", ".list", ".shards")  # a file naming one shard a line


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


def stats_path(url: str) -> Path | None:
    """img2dataset's ``NNNNN_stats.json`` beside a local shard ``NNNNN.tar``."""
    path = local_path(url)
    if path is None:
        return None
    return Path(path).with_name(Path(path).name.rsplit(".", 1)[0] + "_stats.json")


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
