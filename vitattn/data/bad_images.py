"""Training and validation images that cannot be read: ``data.bad_images=raise|skip`` and ``data.verify``.

``raise`` stops at the first unreadable file with one line naming it and why (``BadImageError``).
``skip`` drops the item from its batch: the loader's dataset (``GuardedImages``) yields a
``SkippedImage`` in its place, ``collate_skipping`` batches the rest and carries the dropped files
with the batch (a ``PartialBatch``) out of the worker process, and the DataModule takes them off the
batch before it reaches the model, keeps them and counts them (``train/skipped_images``). A batch
whose every image is bad becomes ``None``, which the systems pass over.

``find_bad_images`` reads every file once, in parallel, before training (``data.verify=true``,
``vitattn-check-data``).
"""

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
    """``dataset``, whose unreadable images stop the run with one line (``raise``) or become ``SkippedImage`` items
    (``skip``). The dataset's loader raises ``BadImageError`` for them (``read_image``, ``ImageCache.load``)."""

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
    """What to do about the ``bad`` files found before training among ``total``: ``listed`` logs each one;
    ``raise`` then stops with one line naming the first, ``skip`` warns that they will be skipped.

    Raises:
        BadImageError: ``mode`` is ``raise`` and there are bad files.
    """
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
