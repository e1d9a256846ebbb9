"""Images at their own aspect ratio (``data.max_patches``, docs/training.md#images-at-their-own-aspect-ratio) for
any DataModule: each image resized to its patch budget and cut into patches, batches of ``Patches`` normalised
patch by patch on the device, the training transform given the budget; batches by patches (``data.batch_patches``,
timm's NaFlex loader): a sequence length per batch, as many images as its patches allow."""

from __future__ import annotations

import numbers
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import torch
from torch.utils.data import Dataset, Sampler

from vitattn.data.preprocess import Budget, ImagePatches, batch_images, check_max_patches, patch_limit
from vitattn.errors import brief
from vitattn.models.vit import Patches
from vitattn.training.datamodules.base import EpochSampler

__all__ = [
    "BucketItems",
    "PatchBatchSampler",
    "PatchBatches",
    "check_batch_patches",
    "collate_patches",
    "patch_buckets",
]

# timm's NaFlex ``train_seq_lens`` for its largest, 1024: a batch's sequence length is one of these shares of
# ``data.max_patches`` (the squares of 1/2, 3/4, 7/8 and 1 of the side, and 1/8 of the patches)
TIMM_SEQ_LENS = (128, 256, 576, 784, 1024)


def patch_buckets(max_patches: int, row: int) -> tuple[int, ...]:
    """The sequence lengths of batches by patches: timm's ``train_seq_lens`` scaled from 1024 to ``max_patches``,
    rounded, those below one ``row`` of the position table left out (``check_max_patches``'s floor)."""
    scaled = (round(max_patches * n / TIMM_SEQ_LENS[-1]) for n in TIMM_SEQ_LENS)
    return tuple(sorted({n for n in scaled if n >= row}))


class PatchBatchSampler(Sampler[list[Any]]):
    """Batches of ``sampler``'s share of each epoch (``EpochSampler``: this rank's, padded as ``DistributedSampler``
    pads), each of a sequence length L from ``buckets`` and ``batch_patches // L`` images: timm's NaFlex schedule,
    drawn once from ``seed`` and this rank's number of samples, so every rank has as many batches; each epoch takes
    it in an order drawn from the epoch's seed. Items are ``(index, epoch seed, L)`` (``BucketItems``)."""

    def __init__(self, sampler: EpochSampler, buckets: Sequence[int], batch_patches: int, seed: int = 0) -> None:
        self.sampler, self.buckets, self.batch_patches = sampler, tuple(buckets), batch_patches
        assert self.buckets and max(self.buckets) <= batch_patches, (buckets, batch_patches)
        draw, left = random.Random(f"buckets/{seed}"), sampler.num_samples
        self.schedule: list[tuple[int, int]] = []  # (sequence length, images), the same on every rank
        while left > 0:
            length = draw.choice(self.buckets)
            size = min(batch_patches // length, left)  # the last batch takes what is left
            self.schedule.append((length, size))
            left -= size

    def __len__(self) -> int:
        return len(self.schedule)

    def epoch_schedule(self, epoch_seed: int) -> list[tuple[int, int]]:
        """The schedule in epoch ``epoch_seed``'s order: (sequence length, images) of each batch."""
        order = list(self.schedule)
        random.Random(f"buckets/{epoch_seed}").shuffle(order)
        return order

    def epoch_sizes(self, epoch_seed: int) -> list[int]:
        """The images of each of epoch ``epoch_seed``'s batches, in order (``ResumableLoader`` counts samples)."""
        return [size for _, size in self.epoch_schedule(epoch_seed)]

    def __iter__(self) -> Iterator[list[Any]]:
        items = list(self.sampler)  # the share less what a resumed checkpoint trained; draws the epoch's seed
        seed, start = self.sampler.epoch_seed, len(items) - self.sampler.num_samples  # start: minus the skipped
        for length, size in self.epoch_schedule(seed):
            if start >= 0:
                yield [(*_index_and_seed(item, seed), length) for item in items[start : start + size]]
            else:
                assert start + size <= 0, "a resumed epoch starts between two batches"
            start += size


def _index_and_seed(item: Any, epoch_seed: int) -> tuple[int, int]:
    return item if isinstance(item, tuple) else (item, epoch_seed)


class BucketItems(Dataset):
    """``dataset`` whose item ``(index, epoch seed, L)`` (``PatchBatchSampler``'s) is made within ``patch_limit(L)``:
    its image resized (or cropped) to at most L patches by whatever transform the dataset holds."""

    draws = True

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int, int]) -> Any:
        index, epoch_seed, length = item
        with patch_limit(length):
            return self.dataset[(index, epoch_seed)]


class PatchBatches:
    """Mixed into an ``ImageDataModule`` (before it): with ``use_budget(max_patches, patch_size)`` its ``preprocess``
    and so its transforms give ``ImagePatches``, its collate pads them into ``Patches`` (``batch_images``) and its
    batches are normalised as their images would be; with ``batch_patches`` too, its training batches are sized by
    patches (``PatchBatchSampler``); without, the DataModule is as it was."""

    budget: Budget | None = None
    batch_patches: int | None = None

    @property
    def seeded_draws(self) -> bool:
        """With a budget, training crops are resume-exact (``SeededDraws``); square runs draw as they always did."""
        return self.budget is not None

    def use_budget(self, max_patches: int | None, patch_size: int, batch_patches: int | None = None) -> None:
        """At most ``max_patches`` patches per image (``check_max_patches``); None: square images. ``batch_patches``:
        training batches of at most that many patches, padding included (``check_batch_patches``)."""
        if max_patches is not None:
            self.budget = Budget(check_max_patches(max_patches, self.img_size, patch_size), patch_size)
            # the evaluation transform (the cache's resize its first step) and the bundle's: ``eval_transform``
            self.preprocess.update(max_patches=self.budget.max_patches, patch_size=patch_size)
        self.batch_patches = check_batch_patches(batch_patches, self.budget and self.budget.max_patches)

    def training_batches(self, dataset: Dataset, sampler: EpochSampler) -> tuple[Dataset, dict[str, Any]]:
        """The DataModule's, or with ``batch_patches`` the batches of ``PatchBatchSampler`` over ``patch_buckets``."""
        if self.batch_patches is None:
            return super().training_batches(dataset, sampler)
        buckets = patch_buckets(self.budget.max_patches, self.img_size // self.budget.patch_size)
        batches = PatchBatchSampler(sampler, buckets, self.batch_patches, sampler.seed)
        return BucketItems(dataset), {"batch_sampler": batches}

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


def check_batch_patches(batch_patches: Any, max_patches: int | None) -> int | None:
    """``data.batch_patches`` as an int (None: batches of ``data.batch_size``), refused in one line without
    ``data.max_patches`` or below it (a batch must hold one image of the largest sequence length)."""
    if batch_patches is None:
        return None
    if max_patches is None:
        raise ValueError(
            f"data.batch_patches={brief(batch_patches)} sizes batches of images at their own aspect ratio: "
            "set data.max_patches too, or leave data.batch_patches unset"
        )
    if (
        isinstance(batch_patches, bool)
        or not isinstance(batch_patches, numbers.Integral)
        or batch_patches < max_patches
    ):
        raise ValueError(
            f"data.batch_patches={brief(batch_patches)} must be a whole number of at least data.max_patches="
            f"{max_patches}, so that a batch holds one image"
        )
    return int(batch_patches)


def _images(batch: Any) -> Any:
    """A batch's images: a dict's ``images``, a list's first item; None for anything else."""
    if isinstance(batch, Mapping):
        return batch.get("images")
    return batch[0] if isinstance(batch, (tuple, list)) and batch else None


def collate_patches(items: Sequence[tuple[ImagePatches, int]]) -> list[Any]:
    """``ImagePatches`` and label of B images -> [``Patches`` padded to the longest, (B,) labels]."""
    return [batch_images([image for image, _ in items]), torch.tensor([label for _, label in items])]
