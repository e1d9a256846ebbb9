"""A training loader that resumes mid-epoch, each sample of an interrupted epoch trained once over both runs: the
order is drawn as Lightning's shuffled loader would, and its seed and the batches handed out are kept in
checkpoints (docs/training.md)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

__all__ = ["EpochSampler", "ResumableLoader"]


class EpochSampler(DistributedSampler):
    """This rank's share of each epoch's shuffled order of ``size`` samples, less those a resumed checkpoint
    trained; under DDP epoch ``e`` is seeded ``seed + e``. ``draws``: hand out ``(index, epoch seed)``, for datasets
    that draw from both (``TokenizedCaptions``), so a resumed epoch draws what the interrupted one would have."""

    def __init__(self, size: int, num_replicas: int = 1, rank: int = 0, seed: int = 0, draws: bool = False) -> None:
        super().__init__(range(size), num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed)
        self.size, self.draws = size, draws
        self.epoch_seed: int | None = None  # the seed of the order being drawn (None before the first epoch)
        self.share: list[int] = []  # this rank's indices of the epoch, in order, the trained ones included
        self._resume: tuple[int, int] | None = None  # (epoch seed, samples to skip) for the next epoch

    def resume(self, epoch_seed: int, skip: int) -> None:
        """Draw the next epoch with ``epoch_seed`` and leave out the first ``skip`` samples of this rank's share."""
        self._resume = (epoch_seed, skip)

    def _draw_seed(self) -> int:
        if self.num_replicas > 1:
            return self.seed + self.epoch
        return int(torch.empty((), dtype=torch.int64).random_().item())  # what RandomSampler draws

    def __iter__(self) -> Iterator[int]:
        # a generator, as RandomSampler's: nothing is drawn before the loader asks for the first index
        self.epoch_seed, skip = self._resume or (self._draw_seed(), 0)
        self._resume = None
        generator = torch.Generator()
        generator.manual_seed(self.epoch_seed)
        order = torch.randperm(self.size, generator=generator).tolist()
        padding = self.total_size - len(order)
        order += (order * math.ceil(padding / max(1, len(order))))[:padding]
        self.share = order[self.rank : self.total_size : self.num_replicas]
        if self.draws:
            yield from ((index, self.epoch_seed) for index in self.share[skip:])
        else:
            yield from self.share[skip:]


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over an ``EpochSampler`` whose state says how far the epoch is trained; ``len`` is a
    whole epoch's batches, ``last_indices`` the dataset indices of the batch last handed out."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.batches = 0  # batches of the current epoch handed out, those before a resume included
        self.last_indices: list[int] = []

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if not isinstance(sampler, EpochSampler):  # Lightning swapped it (overfit_batches): a plain loader
            yield from super().__iter__()
            return
        skip = sampler._resume[1] if sampler._resume else 0
        self.batches = skip // self.batch_size
        for batch in super().__iter__():
            start = self.batches * self.batch_size
            self.last_indices = sampler.share[start : start + self.batch_size]
            self.batches += 1
            yield batch

    def state_dict(self) -> dict[str, Any]:
        """The epoch's order (its seed), how many of its batches were handed out, and what they were drawn from."""
        sampler = self.sampler
        if not isinstance(sampler, EpochSampler):
            return {}
        return {
            "epoch": sampler.epoch,
            "epoch_seed": sampler.epoch_seed,
            "batches": self.batches,
            "samples": sampler.size,
            "batch_size": self.batch_size,
            "ranks": sampler.num_replicas,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the epoch ``state_dict`` describes, unless it was finished (the next one then starts afresh); a
        state of other data, batch size or ranks is refused."""
        sampler = self.sampler
        if not isinstance(sampler, EpochSampler) or not state_dict or state_dict.get("epoch_seed") is None:
            return
        if int(state_dict["batches"]) >= len(self):
            return
        saved = (state_dict.get("samples"), state_dict.get("batch_size"), state_dict.get("ranks"))
        now = (sampler.size, self.batch_size, sampler.num_replicas)
        if saved != now:
            raise ValueError(
                "the checkpoint's training loader stopped mid-epoch over {} samples in batches of {} on {} ranks, "
                "this run has {} in batches of {} on {}: resume with the same data, data.batch_size and "
                "trainer.devices x trainer.num_nodes".format(*saved, *now)
            )
        sampler.set_epoch(int(state_dict["epoch"]))
        sampler.resume(int(state_dict["epoch_seed"]), int(state_dict["batches"]) * self.batch_size)
