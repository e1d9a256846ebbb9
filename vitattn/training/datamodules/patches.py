"""Images at their own aspect ratio (``data.max_patches``, docs/training.md#images-at-their-own-aspect-ratio) for
any DataModule: each image resized to its patch budget and cut into patches, batches of ``Patches`` normalised
patch by patch on the device, the training transform given the budget."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import Any

import torch

from vitattn.data.preprocess import Budget, ImagePatches, batch_images, check_max_patches
from vitattn.models.vit import Patches

__all__ = ["PatchBatches", "collate_patches"]


class PatchBatches:
    """Mixed into an ``ImageDataModule`` (before it): with ``use_budget(max_patches, patch_size)`` its ``preprocess``
    and so its transforms give ``ImagePatches``, its collate pads them into ``Patches`` (``batch_images``) and its
    batches are normalised as their images would be; without, the DataModule is as it was."""

    budget: Budget | None = None

    @property
    def seeded_draws(self) -> bool:
        """With a budget, training crops are resume-exact (``SeededDraws``); square runs draw as they always did."""
        return self.budget is not None

    def use_budget(self, max_patches: int | None, patch_size: int) -> None:
        """At most ``max_patches`` patches per image (``check_max_patches``); None: square images."""
        if max_patches is not None:
            self.budget = Budget(check_max_patches(max_patches, self.img_size, patch_size), patch_size)
            # the evaluation transform (the cache's resize its first step) and the bundle's: ``eval_transform``
            self.preprocess.update(max_patches=self.budget.max_patches, patch_size=patch_size)

    def transforms(self, train: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[[Any], Any]]:
        """The DataModule's, the training transform built with the budget (``Budget``)."""
        return super().transforms(train if self.budget is None else partial(train, budget=self.budget))

    def normalize_batch(self, batch: Any) -> Any:
        """The DataModule's, and ``Patches`` (a dict's ``images``, else the first item) normalised patch by patch."""
        images = _images(batch)
        if not isinstance(images, Patches):
            return super().normalize_batch(batch)
        P = self.budget.patch_size
        B, N, _ = images.patches.shape
        pixels = images.patches.view(B, N, P, P, 3).permute(0, 1, 4, 2, 3)  # (B, N, 3, P, P)
        normalized = images._replace(patches=self.normalize(pixels).permute(0, 1, 3, 4, 2).reshape(B, N, -1))
        return {**batch, "images": normalized} if isinstance(batch, Mapping) else [normalized, *batch[1:]]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """uint8 ``Patches`` normalised on the device; anything else as the DataModule does."""
        images = _images(batch)
        if isinstance(images, Patches) and images.patches.dtype == torch.uint8:
            return self.normalize_batch(batch)
        return super().on_after_batch_transfer(batch, dataloader_idx)


def _images(batch: Any) -> Any:
    """A batch's images: a dict's ``images``, a list's first item; None for anything else."""
    if isinstance(batch, Mapping):
        return batch.get("images")
    return batch[0] if isinstance(batch, (tuple, list)) and batch else None


def collate_patches(items: Sequence[tuple[ImagePatches, int]]) -> list[Any]:
    """``ImagePatches`` and label of B images -> [``Patches`` padded to the longest, (B,) labels]."""
    return [batch_images([image for image, _ in items]), torch.tensor([label for _, label in items])]
