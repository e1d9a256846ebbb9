"""Small datasets decoded once: each image file read and resized for evaluation a single time, kept as uint8.

The cached image is the evaluation transform's first step (the resize) applied to ``read_image``'s
output, so the evaluation transform gives exactly the same tensor from the cache as from the file,
and training crops come from the image at evaluation size instead of from the full-size file (the
usual way to train on small images: JPEG decoding and resizing a large photo stop costing every
epoch). ``data.cache``: ``ram`` always caches, ``none`` never, ``auto`` caches when the images take
at most ``AUTO_LIMIT_BYTES`` and a quarter of the free memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from vitattn.data.images import BadImageError, read_image, read_many

__all__ = ["AUTO_LIMIT_BYTES", "CACHE_MODES", "ImageCache", "should_cache"]

log = logging.getLogger(__name__)

CACHE_MODES = ("auto", "ram", "none")
AUTO_LIMIT_BYTES = 4 << 30


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return AUTO_LIMIT_BYTES * 4


def should_cache(mode: str, num_images: int, side: int) -> bool:
    """Whether ``num_images`` images of about ``side`` x ``side`` pixels are cached under ``mode``."""
    if mode not in CACHE_MODES:
        raise ValueError(f"data.cache={mode!r} is unknown; choose one of {list(CACHE_MODES)}")
    if mode != "auto":
        return mode == "ram"
    need = num_images * 3 * side * side
    return need <= min(AUTO_LIMIT_BYTES, _available_memory() // 4)


class ImageCache:
    """uint8 (height, width, 3) arrays of image files after ``resize``, read in parallel; ``load(path)`` gives a PIL
    image.

    Args:
        paths: the files; those that cannot be read are kept in ``bad`` (path -> reason), and loading
            one raises its ``BadImageError``.
        resize: the evaluation transform's resize (PIL image -> PIL image).
        threads: reading threads (PIL decodes and resizes without the GIL).
    """

    def __init__(self, paths: Sequence[str], resize: Callable[[Image.Image], Image.Image], threads: int = 0) -> None:
        self.resize = resize
        self.images, self.bad = read_many(paths, self._read, threads or max(1, min(8, os.cpu_count() or 1)))
        self.nbytes = sum(a.nbytes for a in self.images.values())
        log.info("cached %d images in memory (%.1f MiB)", len(self.images), self.nbytes / 2**20)

    def _read(self, path: str) -> np.ndarray:
        return np.asarray(self.resize(read_image(path)), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self.images)

    def load(self, path: Any) -> Image.Image:
        """The cached image of ``path`` (a PIL view of the array; cheap).

        Raises:
            BadImageError: ``path`` could not be read when the cache was built.
        """
        key = str(path)
        if key in self.bad:
            raise BadImageError(f"{key}: {self.bad[key]}", key, self.bad[key])
        return Image.fromarray(self.images[key])

    def tensor(self, path: Any) -> torch.Tensor:
        """The cached image of ``path`` as (3, height, width) uint8."""
        return torch.from_numpy(self.images[str(path)]).permute(2, 0, 1)
