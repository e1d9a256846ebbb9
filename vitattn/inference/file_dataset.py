"""Image files as model inputs, read in DataLoader workers; a bad file becomes an error string, never an exception."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vitattn.data.images import BadImageError, read_image

__all__ = ["ImageFileDataset", "collate_images"]


class ImageFileDataset(Dataset):
    """Image files as model inputs; ``__getitem__`` never raises.

    Items are ``(index, image)``: ``index`` is the file's position in ``paths``, ``image`` the
    transformed (C, height, width) tensor, or a one-line error string when the file could not be read.

    Args:
        paths: the image files.
        transform: PIL image -> tensor.
        positions: which of ``paths`` to read, in order (item k is ``paths[positions[k]]``); default all.
            A position of -1 is a placeholder: its item is ``(-1, None)``, which ``collate_images``
            drops (a distributed sampler needs at least one item for every rank).
    """

    def __init__(self, paths: Sequence[str], transform: Any, positions: Sequence[int] | None = None) -> None:
        self.paths = paths
        self.transform = transform
        self.positions = positions

    def __len__(self) -> int:
        return len(self.paths) if self.positions is None else len(self.positions)

    def __getitem__(self, k: int) -> tuple[int, Tensor | str | None]:
        index = k if self.positions is None else int(self.positions[k])
        if index < 0:
            return index, None
        path = self.paths[index]
        image = read_image(path, on_error="skip")
        return index, image.reason if isinstance(image, BadImageError) else self.transform(image)


def collate_images(
    batch: Sequence[tuple[int, Tensor | str | None]],
) -> tuple[list[int], Tensor | None, list[tuple[int, str]]]:
    """``(indices of the images read, (b, C, height, width) images or None, [(index, error)])``; placeholders
    dropped."""
    ok = [(i, x) for i, x in batch if isinstance(x, Tensor)]
    errors = [(i, x) for i, x in batch if isinstance(x, str)]
    images = torch.stack([x for _, x in ok]) if ok else None
    return [i for i, _ in ok], images, errors
