"""Files that are whole or absent: written to a temporary file beside the target, then renamed."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

__all__ = ["atomic_folder", "atomic_open", "atomic_write", "cache_folder", "parse_json", "read_json", "read_text"]


def cache_folder(given: str | os.PathLike | None = None) -> Path:
    """vitattn's cache folder: ``given``, else ``~/.cache/vitattn`` (shard counts, member indexes)."""
    return Path(given or Path.home() / ".cache" / "vitattn")


@contextmanager
def atomic_open(path: str | os.PathLike, mode: str = "wb", **open_kwargs: Any) -> Iterator[IO]:
    """A temporary file beside ``path``, synced and renamed to it on a clean exit: a kill leaves ``path`` as it was."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        os.fchmod(fd, 0o644)  # mkstemp's 0600 would hide results from everyone else
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write(path: str | os.PathLike, data: bytes | str) -> Path:
    """Write ``data`` (bytes, or text as UTF-8) to ``path`` atomically."""
    if isinstance(data, str):
        data = data.encode("utf-8", errors="surrogateescape")
    with atomic_open(path, "wb") as f:
        f.write(data)
    return Path(path)


@contextmanager
def atomic_folder(path: str | os.PathLike) -> Iterator[Path]:
    """A temporary folder beside ``path`` that replaces it, synced, on a clean exit (a kill leaves ``path`` whole)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    try:
        yield tmp
        for name in os.listdir(tmp):
            with open(tmp / name, "rb") as f:
                os.fsync(f.fileno())
        old = None
        if path.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{path.name}.old-", dir=path.parent))
            os.replace(path, old / path.name)
        os.replace(tmp, path)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def parse_json(text: str) -> Any:
    """``json.loads``, whose every refusal is a one-line ``ValueError`` (too deep nesting and numbers
    too long for Python included); the caller adds where the text came from."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError("it nests arrays or objects too deeply to be read") from None
    except ValueError as err:  # JSONDecodeError, or an integer of more than sys.get_int_max_str_digits() digits
        raise ValueError(" ".join(str(err).split())) from None


def read_text(path: str | os.PathLike, missing: str, not_text: str) -> str:
    """The UTF-8 text of the file at ``path``: ``FileNotFoundError(missing)`` when there is none,
    ``ValueError(not_text)`` when it is not UTF-8 (both said by the caller), ``PermissionError``, or a one-line
    ``ValueError`` when it cannot be read."""
    path = Path(path)
    try:
        if not path.is_file():
            raise FileNotFoundError(missing)
        return path.read_text(encoding="utf-8")
    except (FileNotFoundError, PermissionError):
        raise
    except UnicodeDecodeError:
        raise ValueError(not_text) from None
    except OSError as err:  # a name too long for the file system, a read error
        raise ValueError(f"{str(path)[:300]} cannot be read: {err.strerror or err}") from None


def read_json(path: str | os.PathLike, what: str) -> Any:
    """The JSON file at ``path`` (``read_text``'s errors); ``what`` names it in the one-line errors."""
    text = read_text(path, f"{what} not found: {path}", f"{what} {path} is not valid JSON: it is not UTF-8 text")
    try:
        return parse_json(text)
    except ValueError as err:
        raise ValueError(f"{what} {path} is not valid JSON: {err}") from None
