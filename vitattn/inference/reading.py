"""Image files as model inputs, read in DataLoader workers; a bad file becomes an error string, never an exception."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitattn.data.images import read_image, unreadable_reason

__all__ = ["ImageFileDataset", "collate_images"]


class ImageFileDataset(Dataset):
    """Image files as model inputs; ``__getitem__`` never raises.

    Items are ``(index, image)``: ``image`` is the transformed (C, H, W) tensor, or a one-line error
    string when the file could not be read.
    """

    def __init__(self, paths: Sequence[str], transform: Any) -> None:
        self.paths = list(paths)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, Tensor | str]:
        path = self.paths[index]
        try:
            return index, self.transform(read_image(path))
        except Exception as err:  # noqa: BLE001 - any failure (bomb warnings too) becomes an error record
            return index, unreadable_reason(path, err)


def collate_images(batch: Sequence[tuple[int, Tensor | str]]) -> tuple[list[int], Tensor | None, list[tuple[int, str]]]:
    """``(indices of the images read, (b, C, H, W) images or None, [(index, error)])``."""
    ok = [(i, x) for i, x in batch if isinstance(x, Tensor)]
    errors = [(i, x) for i, x in batch if not isinstance(x, Tensor)]
    images = torch.stack([x for _, x in ok]) if ok else None
    return [i for i, _ in ok], images, errors
