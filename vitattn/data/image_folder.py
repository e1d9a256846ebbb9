"""An ImageFolder tree, ``ROOT/<split>/<class>/<image>``: where a split is and which files it lists.

Shared by the ImageFolder DataModule (training) and by evaluation on a user's tree, which needs no Lightning.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from torchvision.datasets import ImageFolder

from vitattn.data.images import IMAGE_EXTENSIONS, read_image

__all__ = ["image_folder_split", "open_image_folder"]


def image_folder_split(root: str | os.PathLike, split: str) -> Path:
    """The folder of ``split`` under an ImageFolder ``root``: ``root/<split>``; ``test`` falls back to
    ``root/val`` when ``root/test`` does not exist (training then tests on val)."""
    root = Path(root)
    if split == "test" and not (root / "test").exists():
        return root / "val"
    return root / split


def _is_image_file(path: str) -> bool:
    name = os.path.basename(path)
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def open_image_folder(directory: str | os.PathLike, transform: Callable[[Any], Any] | None = None) -> ImageFolder:
    """``directory/<class>/<image>`` as a torchvision ``ImageFolder`` read with ``read_image`` (an unreadable file
    raises ``BadImageError``); the same file extensions as the captioner (``IMAGE_EXTENSIONS``), hidden files
    skipped. Listing reads no image."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder not found: {directory} (expected {directory}/<class>/<image>)")
    try:
        return ImageFolder(directory, transform=transform, loader=read_image, is_valid_file=_is_image_file)
    except FileNotFoundError as err:  # torchvision's word for "no class folders" or "no images"
        raise ValueError(f"image folder {directory} is empty: {err}") from None
