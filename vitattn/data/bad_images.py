"""Images that cannot be read while training: ``data.bad_images=raise`` stops at the first with one line naming
it, ``skip`` leaves it out of its batch and counts it; ``find_bad_images`` reads every file beforehand
(``data.verify``, ``vitattn-check-data``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch.distributed as dist
from torch.utils.data import Dataset

from vitattn.data.images import BadImageError, read_image, read_many

__all__ = [
    "BAD_IMAGE_MODES",
    "GuardedImages",
    "PartialBatch",
    "SkippedImage",
    "check_bad_images",
    "collate_skipping",
    "find_bad_images",
    "gather_skipped",
]

log = logging.getLogger(__name__)

BAD_IMAGE_MODES = ("raise", "skip")
_HINT = "data.bad_images=skip trains without such files; vitattn-check-data lists them all"


class SkippedImage(NamedTuple):
    """An item left out of its batch: the file and why it cannot be read."""

    path: str
    reason: str


class PartialBatch(NamedTuple):
    """A batch some of whose images could not be read; ``batch`` is None when none could."""

    batch: Any
    skipped: list[SkippedImage]


class GuardedImages(Dataset):
    """``dataset``, whose ``BadImageError`` items stop the run (``raise``) or become ``SkippedImage`` (``skip``)."""

    def __init__(self, dataset: Dataset, mode: str) -> None:
        self.dataset, self.mode = dataset, mode

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except BadImageError as err:
            if self.mode == "raise":
                raise BadImageError(f"{err}; {_HINT}", err.path, err.reason) from None
            return SkippedImage(err.path or "", err.reason or str(err))


def collate_skipping(items: Sequence[Any], collate: Callable[[list[Any]], Any]) -> Any:
    """``collate`` of the readable items; a ``PartialBatch`` when some were skipped (its batch None when all were)."""
    kept = [item for item in items if not isinstance(item, SkippedImage)]
    if len(kept) == len(items):
        return collate(kept)
    skipped = [item for item in items if isinstance(item, SkippedImage)]
    return PartialBatch(collate(kept) if kept else None, skipped)


def find_bad_images(paths: Sequence[str | os.PathLike], threads: int = 0) -> dict[str, str]:
    """Read each file once, in parallel (``read_many``); path -> why it cannot be read, for the bad ones."""
    _, bad = read_many(paths, _read_only, threads)
    return bad


def _read_only(path: str) -> None:
    read_image(path)  # decoded in full, as training reads it, then dropped


def check_bad_images(bad: dict[str, str], total: int, mode: str, listed: bool) -> None:
    """Act on the ``bad`` files found before training among ``total``: log each (``listed``), then ``raise``
    stops naming the first (``BadImageError``) and ``skip`` warns."""
    if listed:
        for path, reason in bad.items():
            log.warning("unreadable image: %s: %s", path, reason)
    if not bad:
        if listed:
            log.info("read %d images: every one can be read", total)
        return
    if mode == "raise":
        path, reason = next(iter(bad.items()))
        more = f" (and {len(bad) - 1} more unreadable images)" if len(bad) > 1 else ""
        raise BadImageError(f"{path}: {reason}{more}; {_HINT}", path, reason)
    log.warning(
        "%d of %d images cannot be read; data.bad_images=skip leaves them out of their batches", len(bad), total
    )


def gather_skipped(local: dict[str, str]) -> dict[str, str]:
    """Every rank's skipped files (path -> reason), sorted by path."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(parts, local)
        local = {path: reason for part in parts for path, reason in part.items()}
    return dict(sorted(local.items()))
