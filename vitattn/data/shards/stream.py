"""Batches read from WebDataset shards by loader workers as each epoch's plan says, every sample once, each
batch with its samples' positions and keys (docs/shards.md)."""

from __future__ import annotations

import io
import json
import os
import random
from collections.abc import Callable, Iterator, Sequence
from contextlib import nullcontext
from functools import partial
from itertools import islice
from typing import Any, NamedTuple

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.filters import shuffle

from vitattn.data.bad_images import SkippedImage, collate_skipping
from vitattn.data.images import IMAGE_EXTENSIONS, BadImageError, read_image
from vitattn.data.preprocess import seeded_generators
from vitattn.data.shards.epoch_split import EpochOrder, WorkerPlan
from vitattn.data.shards.reading import ShardError, ShortShard, read_samples
from vitattn.data.tokenizer import Tokenizer, draw_captions

__all__ = [
    "EpochLoader",
    "ShardBatch",
    "ShardSamples",
    "ShardStream",
    "image_member",
    "sample_caption",
    "sample_references",
]

_IMAGE_KEYS = tuple(ext.lstrip(".") for ext in sorted(IMAGE_EXTENSIONS))
_HINT = "data.bad_images=skip trains without such samples"


class ShardBatch(NamedTuple):
    """A batch (or a ``PartialBatch`` when samples were skipped) with its samples' epoch positions and keys."""

    batch: Any
    positions: list[int]
    keys: list[str]


def image_member(sample: dict[str, Any]) -> str | None:
    """The extension of a sample's image member (``jpg``, ``png``, ...), or None when it has none."""
    return next((k for k in _IMAGE_KEYS if k in sample), None)


def sample_caption(sample: dict[str, Any], caption_key: str | None) -> str | None:
    """A sample's caption: its ``.txt``, or ``caption_key`` inside its ``.json``; None when it has none."""
    if caption_key is None:
        data = sample.get("txt")
        text = data.decode("utf-8", errors="replace") if data is not None else None
    else:
        try:
            text = json.loads(sample.get("json") or b"{}").get(caption_key)
        except (ValueError, AttributeError):
            text = None
    return text.strip() if isinstance(text, str) and text.strip() else None


class ShardSamples:
    """A shard sample as a head trains on it: ``{"image", "tokens", "references", "image_id"}`` (``vocab``,
    ``max_len``; the caption from ``.txt`` or the ``caption_key`` of ``.json``, or ``per_image`` of its references
    drawn by ``draw_captions``), or ``(image, label)`` from ``.cls`` (below ``num_classes``); ``transform`` makes
    the image's tensor (``seeded``: with the generators seeded by the sample's draw, so a resumed epoch augments
    each sample as the interrupted one did)."""

    def __init__(
        self,
        task: str,
        transform: Callable[..., torch.Tensor],
        caption_key: str | None = None,
        vocab: Tokenizer | None = None,
        max_len: int = 32,
        num_classes: int | None = None,
        per_image: int | str | None = None,
        seeded: bool = False,
    ) -> None:
        self.task, self.transform, self.caption_key, self.seeded = task, transform, caption_key, seeded
        self.vocab, self.max_len, self.num_classes, self.per_image = vocab, max_len, num_classes, per_image

    def __call__(self, sample: dict[str, Any], sample_id: int, draw: str = "") -> Any:
        """The item, its captions drawn with the seed ``draw`` (the epoch's and the position's); raises
        ``BadImageError`` (``<shard>: <key>: <reason>``) for a sample that cannot be used."""
        where = f"{sample.get('__url__', '?')}: {sample['__key__']}"
        name = image_member(sample)
        if name is None:
            raise BadImageError(f"{where}: no image member", where, "no image member")
        if self.task == "caption":
            caption = sample_caption(sample, self.caption_key)
            if caption is None:
                what = f"no '{self.caption_key}' in .json" if self.caption_key else "no .txt caption"
                raise BadImageError(f"{where}: {what}", where, what)
        else:
            label = self._label(sample, where)
        image = read_image(io.BytesIO(sample[name]), on_error="skip")
        if isinstance(image, BadImageError):
            raise BadImageError(f"{where}: {image.reason}", where, image.reason)
        if self.task != "caption":
            with seeded_generators(f"augment/{draw}") if self.seeded else nullcontext():
                return self.transform(image), label
        references = sample_references(sample, caption)
        if self.per_image is not None:
            captions = draw_captions(references, self.per_image, random.Random(draw))
        else:
            captions = [caption]
        with seeded_generators(f"augment/{draw}") if self.seeded else nullcontext():
            if getattr(self.transform, "reads_captions", False):  # CaptionAugment: flips and colours captions allow
                pixels = self.transform(image, captions)
            else:
                pixels = self.transform(image)
        rows = tuple(torch.tensor(self.vocab.encode(c, max_len=self.max_len), dtype=torch.long) for c in captions)
        return {
            "image": pixels,
            "tokens": rows[0] if self.per_image is None else rows,
            "references": references,
            "image_id": sample_id,
        }

    def _label(self, sample: dict[str, Any], where: str) -> int:
        raw = sample.get("cls")
        try:
            label = int(raw.decode().strip()) if raw is not None else None
        except ValueError:
            label = None
        if label is None or not 0 <= label < (self.num_classes or 0):
            what = "no .cls label" if raw is None else f"class {raw[:20]!r} is not a number below {self.num_classes}"
            raise BadImageError(f"{where}: {what}", where, what)
        return label


def sample_references(sample: dict[str, Any], caption: str) -> list[str]:
    """Every caption of the sample: the ``captions`` list of its ``.json`` (vitattn-shards writes it), else the one."""
    try:
        listed = json.loads(sample.get("json") or b"{}").get("captions")
    except (ValueError, AttributeError):
        listed = None
    if isinstance(listed, list) and listed and all(isinstance(c, str) for c in listed):
        return listed
    return [caption]


def _as_is(batch: Any) -> Any:
    return batch


class EpochLoader(DataLoader):
    """A ``DataLoader`` of a ``ShardStream`` (its batches whole) that calls ``before_epoch()`` before each
    pass, so the workers it starts get that epoch's plan."""

    def __init__(self, dataset: ShardStream, before_epoch: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=None, collate_fn=_as_is, **kwargs)
        self.before_epoch = before_epoch

    def __iter__(self) -> Any:
        self.before_epoch()
        return super().__iter__()


class ShardStream(IterableDataset):
    """The samples of ``urls`` (``sizes`` samples each) as batches, one epoch at a time as ``configure`` plans
    it: decoded by ``samples``, batched by ``collate``, ``shuffle_buffer`` samples shuffled per worker (0: read
    order); ``index_dir``: the cache holding member indexes the listing could not write beside a shard."""

    def __init__(
        self,
        urls: Sequence[str],
        sizes: Sequence[int],
        samples: ShardSamples,
        collate: Callable[[list[Any]], Any],
        bad_images: str = "raise",
        shuffle_buffer: int = 0,
        index_dir: str | os.PathLike | None = None,
    ) -> None:
        self.urls, self.sizes, self.samples = list(urls), list(sizes), samples
        self.index_dir = index_dir
        self.collate = collate if bad_images == "raise" else partial(collate_skipping, collate=collate)
        self.bad_images, self.shuffle_buffer = bad_images, shuffle_buffer
        self.order = EpochOrder(self.sizes, shuffle=False)
        self.plans: list[WorkerPlan] = []
        self.batches = 0  # this rank's batches in a whole epoch
        self.seed = ""

    def configure(self, order: EpochOrder, plans: list[WorkerPlan], batches: int, seed: str) -> None:
        """The epoch to read next: its shard order, this rank's plan per worker, the rank's batches in a whole
        epoch (``len``) and the shuffle seed."""
        self.order, self.plans, self.batches, self.seed = order, plans, batches, seed

    def __len__(self) -> int:
        return self.batches

    def __iter__(self) -> Iterator[ShardBatch]:
        info = get_worker_info()
        worker = info.id if info is not None else 0
        if worker >= len(self.plans):
            return
        plan = self.plans[worker]
        stream = self._read(plan.ranges)
        if self.shuffle_buffer > 1:
            rng = random.Random(f"{self.seed}/{worker}")
            stream = shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(stream)  # webdataset's
        for size in plan.batch_sizes:
            chunk = list(islice(stream, size))
            if not chunk:
                return
            items = [self._item(*entry) for entry in chunk]
            keys = [key for _, key, _ in chunk]
            yield ShardBatch(self.collate(items), [p for p, _, _ in chunk], keys)

    def __getitem__(self, index: int) -> Any:
        """Sample ``index`` in the listed order (a few first samples for pictures; reads the shards up to it)."""
        for shard, offsets in self.order.shard_runs([(index, index + 1)]):
            for _, (key, sample) in self._shard(shard, offsets):
                return self._item(index, key, sample)
        raise IndexError(index)

    def _item(self, position: int, key: str, sample: Any) -> Any:
        if isinstance(sample, SkippedImage):
            return sample
        shard, offset = self.order.locate(position)
        try:
            draw = f"{self.order.seed}/{self.order.epoch}/{position}"  # the same whatever the plan or a resume
            return self.samples(sample, self.order.sample_id(shard, offset), draw)
        except BadImageError as err:
            if self.bad_images == "raise":
                raise BadImageError(f"{err}; {_HINT}", err.path, err.reason) from None
            return SkippedImage(err.path or key, err.reason or str(err))

    def _read(self, ranges: list[tuple[int, int]]) -> Iterator[tuple[int, str, Any]]:
        """``(position, key, sample)`` of each position of ``ranges``, in order; a ``SkippedImage`` stands for a
        sample its shard could not give (``skip``)."""
        for shard, offsets in self.order.shard_runs(ranges):
            base = self.order.start_of(shard)
            for offset, (key, sample) in self._shard(shard, offsets):
                yield base + offset, key, sample

    def _shard(self, shard: int, offsets: list[tuple[int, int]]) -> Iterator[tuple[int, tuple[str, Any]]]:
        """The samples at ``offsets`` of a shard (from a local tar: nothing of the others' bytes)."""
        url, wanted = self.urls[shard], [o for a, b in offsets for o in range(a, b)]
        given = 0
        try:
            for offset, sample in read_samples(url, wanted, index_dir=self.index_dir):
                given += 1
                yield offset, (sample["__key__"], sample)
            return
        except ShortShard as err:
            reason = f"shard {url} holds {err.samples} samples, fewer than the {self.sizes[shard]} counted"
            if self.bad_images == "raise":
                raise ShardError(f"{reason}; {_HINT}") from None
        except ShardError as err:
            if self.bad_images == "raise":
                raise ShardError(f"{err}; {_HINT}") from None
            reason = str(err)
        for offset in wanted[given:]:  # what the shard could not give, counted as skipped
            where = f"{url}: #{offset}"
            yield offset, (where, SkippedImage(where, reason))
