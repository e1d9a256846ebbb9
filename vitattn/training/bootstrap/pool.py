"""The kept pool (``Pool``), as a caption or a classification dataset, and the one training stream that mixes
it with the human-labelled data (``MixedTraining``)."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import Dataset

from vitattn.data.images import read_image

__all__ = ["MixedTraining", "Pool", "PoolCaptions", "PoolLabels", "image_digests"]

_OWN = ("human", "pool", "repeat", "human_size", "num_classes")  # MixedTraining's own attributes


@dataclass
class Pool:
    """The kept pool: each image (a path, or a shard sample's bytes by key) with its kept captions or label."""

    sources: list[Any]  # a path, or (key, image bytes)
    captions: list[list[str]] | None = None  # each image's kept captions (caption teacher)
    labels: list[int] | None = None  # each image's kept class (classification teacher)
    targets: list[list[float]] | None = None  # each image's teacher probabilities (bootstrap.soft)
    counts: dict[str, int] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sources)

    def name(self, i: int) -> str:
        source = self.sources[i]
        return source if isinstance(source, str) else source[0]

    def read(self, i: int) -> Any:
        """Image ``i`` as a PIL image (``read_image``'s, as captioning read it)."""
        source = self.sources[i]
        return read_image(source if isinstance(source, str) else io.BytesIO(source[1]))

    def keep_only(self, drop: set[int]) -> None:
        keep = [i for i in range(len(self)) if i not in drop]
        self.sources = [self.sources[i] for i in keep]
        if self.captions is not None:
            self.captions = [self.captions[i] for i in keep]
        if self.labels is not None:
            self.labels = [self.labels[i] for i in keep]
        if self.targets is not None:
            self.targets = [self.targets[i] for i in keep]


class PoolCaptions(Dataset):
    """The kept pool as a caption dataset (``TokenizedCaptions`` draws one kept caption of an image per visit):
    ``image`` (3, height, width) uint8 by ``transform``, its ``references`` the kept captions."""

    def __init__(self, pool: Pool, transform: Callable[[Any], torch.Tensor]) -> None:
        self.pool, self.transform = pool, transform

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, index: int) -> dict[str, Any]:
        captions = self.pool.captions[index]
        image = self.pool.read(index)
        if getattr(self.transform, "reads_captions", False):  # CaptionAugment: what no kept caption contradicts
            image = self.transform(image, captions)
        else:
            image = self.transform(image)
        return {"image": image, "caption": captions[0], "references": captions, "image_id": -1 - index}


class PoolLabels(Dataset):
    """The kept pool as a classification dataset: ``(image, label)``, the image (3, height, width) uint8; the label
    the teacher's probabilities (classes,) float where the pool holds them (``bootstrap.soft``)."""

    def __init__(self, pool: Pool, transform: Callable[[Any], torch.Tensor]) -> None:
        self.pool, self.transform = pool, transform

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int | torch.Tensor]:
        image = self.transform(self.pool.read(index))
        if self.pool.targets is not None:
            return image, torch.tensor(self.pool.targets[index], dtype=torch.float32)
        return image, self.pool.labels[index]


class MixedTraining(Dataset):
    """One training stream: the human-labelled ``human`` dataset ``repeat`` times, then ``pool``; an index (or an
    ``(index, epoch seed)`` pair from ``EpochSampler(draws=True)``) goes to its part, so a resumed epoch reads what
    the interrupted one would have. Each repeat of a human sample draws its own references (a seed of its own
    from the epoch's seed and the repeat). ``num_classes``: a soft pool's; a human ``(image, label)`` then comes
    as ``(image, one-hot (num_classes,) float)``, so a batch collates one kind of target."""

    draws = True

    def __init__(self, human: Dataset, repeat: int, pool: Dataset, num_classes: int | None = None) -> None:
        self.human, self.repeat, self.pool, self.num_classes = human, repeat, pool, num_classes
        self.human_size = len(human) * repeat

    def __len__(self) -> int:
        return self.human_size + len(self.pool)

    def __getitem__(self, index: int | tuple[int, int]) -> Any:
        index, seed = index if isinstance(index, tuple) else (index, 0)
        if index < self.human_size:
            repeat, i = divmod(index, len(self.human))
            if getattr(self.human, "draws", False):
                return self.human[(i, seed * self.repeat + repeat)]  # each repeat its own draw
            if self.num_classes is not None:
                image, label = self.human[i]
                return image, torch.nn.functional.one_hot(torch.tensor(label), self.num_classes).float()
            return self.human[i]
        i = index - self.human_size
        return self.pool[(i, seed)] if getattr(self.pool, "draws", False) else self.pool[i]

    def __getattr__(self, name: str) -> Any:
        if name in _OWN:  # not set yet (unpickling in a loader worker)
            raise AttributeError(name)
        return getattr(self.human, name)  # the DataModule's own readers of its training split (``samples``, ...)

    def part(self, index: int) -> tuple[str, int]:
        """``("human", i)`` or ``("pool", i)``: where training sample ``index`` comes from."""
        if index < self.human_size:
            return "human", index % len(self.human)
        return "pool", index - self.human_size


def image_digests(images: Iterable[torch.Tensor]) -> set[str]:
    """The digests of (3, height, width) uint8 images as the model takes them: identical pixels, identical digest."""
    return {hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).hexdigest() for image in images}
