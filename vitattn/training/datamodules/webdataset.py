"""Training from WebDataset shards (the img2dataset layout), across ranks and workers, every sample once per
epoch and resumable mid-epoch from the positions trained on every rank (``state_dict``). The design: docs/shards.md."""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import default_collate
from tqdm.auto import tqdm

from vitattn.data.images import EvalSplit
from vitattn.data.preprocess import CAPTION_CROP_SCALE, Augment, CaptionAugment, classification_train_transform
from vitattn.data.shards import expand_shards, local_path, read_shard, shard_sizes
from vitattn.data.shards.epoch_split import EpochOrder, PositionSet, batches_per_rank, read_factor, split_epoch
from vitattn.data.shards.reading import CLASSES_FILE
from vitattn.data.shards.stream import (
    EpochLoader,
    ShardBatch,
    ShardSamples,
    ShardStream,
    sample_caption,
    sample_references,
)
from vitattn.data.tokenizer import collate_captions
from vitattn.training.datamodules.base import EvaluationBatches, ImageDataModule, rank_and_world, worker_context
from vitattn.training.datamodules.image_folder import ImageFolderDataModule
from vitattn.training.datamodules.patches import PatchBatches, collate_patches

__all__ = ["WebDatasetDataModule", "shard_captions", "shard_references"]

log = logging.getLogger(__name__)


def shard_captions(urls: Sequence[str], caption_key: str | None) -> list[str]:
    """Every reference of every sample of the shards (training draws from them); samples without one left out."""
    return [caption for refs in shard_references(urls, caption_key, "vocabulary: reading captions") for caption in refs]


def shard_references(
    urls: Sequence[str], caption_key: str | None, desc: str = "CIDEr-D: reading references"
) -> list[list[str]]:
    """Every sample's references (``sample_references``), samples in shard order; those without a caption left out."""

    def read(url: str) -> list[list[str]]:
        items = []
        for sample in read_shard(url, extensions={"txt", "json"}):
            caption = sample_caption(sample, caption_key)
            if caption is not None:
                items.append(sample_references(sample, caption))
        bar.update(1)
        return items

    with tqdm(total=len(urls), desc=desc, unit="shard", disable=None) as bar:
        with ThreadPoolExecutor(max(1, min(8, len(urls)))) as pool:
            return [item for part in pool.map(read, urls) for item in part]


def _class_names(value: Any, urls: Sequence[str]) -> list[str]:
    if isinstance(value, str):
        return [line.strip() for line in Path(value).read_text().splitlines() if line.strip()]
    if value is not None:
        return [str(name) for name in value]
    first = local_path(urls[0])
    listing = Path(first).with_name(CLASSES_FILE) if first else None
    if listing is None or not listing.is_file():
        raise ValueError(
            "head=classification needs the class names: data.class_names=[...] or a file with one name a line "
            "(vitattn-shards writes classes.txt beside the shards)"
        )
    return _class_names(str(listing), urls)


class WebDatasetDataModule(PatchBatches, ImageDataModule):
    """Captions (``.txt``, or ``caption_key`` inside ``.json``) or classes (``.cls``) from tar shards.

    The arguments are the ``data.*`` keys that conf/data/webdataset.yaml describes (``settings``:
    ``ImageDataModule``'s); ``task`` is the head's, and ``mean`` to ``crop_mode`` default to the head's file
    DataModule's (``ImageFolderDataModule``'s or ``KarpathyDataModule``'s). ``max_patches``: each image at its own
    aspect ratio, at most that many ``patch_size`` patches (``PatchBatches``), its training crop drawn from the
    sample's epoch and position; None: squares of ``img_size``.
    """

    tasks = ("caption", "classification")
    reads_files = True

    def __init__(
        self,
        train_shards: str | Sequence[str],
        val_shards: str | Sequence[str],
        test_shards: str | Sequence[str] | None = None,
        task: str = "caption",
        caption_key: str | None = None,
        class_names: str | Sequence[str] | None = None,
        augment: bool | Mapping[str, Any] = True,
        shuffle_buffer: int = 1000,
        seed: int = 0,
        samples_per_epoch: int | None = None,
        count_cache: str | os.PathLike | None = None,
        cache: str = "none",
        max_patches: int | None = None,
        patch_size: int = 16,
        batch_patches: int | None = None,
        **settings: Any,
    ) -> None:
        if batch_patches is not None:
            raise ValueError(
                f"data.batch_patches={batch_patches} is not supported with data=webdataset (shards plan their own "
                "batches): leave it unset"
            )
        if task not in self.tasks:
            raise ValueError(f"task={task!r} is unknown; choose one of {list(self.tasks)}")
        self.task = task  # before the base builds the preprocessing: ``crop`` is the task's
        super().__init__(**{"num_workers": "auto", **settings})
        if cache not in ("none", "auto") or self.verify:
            what = f"data.cache={cache!r}" if cache not in ("none", "auto") else "data.verify=true"
            raise ValueError(f"{what}: shards are streamed, not cached or read beforehand; use data.cache=none")
        if samples_per_epoch is not None and samples_per_epoch < 1:
            raise ValueError(f"data.samples_per_epoch={samples_per_epoch} must be at least 1, or null for all")
        self.use_budget(max_patches, patch_size)
        self.shards = {"train": train_shards, "val": val_shards, "test": test_shards}
        self.caption_key, self.class_names_spec = caption_key, class_names
        scale = CAPTION_CROP_SCALE if task == "caption" else "auto"
        self.augment = Augment.from_config(augment, scale=scale, **({"hflip": 0.0} if task == "caption" else {}))
        self.shuffle_buffer, self.seed, self.samples_per_epoch = int(shuffle_buffer), int(seed), samples_per_epoch
        self.count_cache = count_cache
        self.class_names: list[str] | None = None
        self.num_classes: int | None = None
        self.trained = PositionSet()  # epoch positions trained in this epoch (this rank; all ranks after a resume)
        self.epoch: int | None = None  # the epoch ``trained`` belongs to
        self._resume: dict[str, Any] | None = None
        self._warned: set[int] = set()  # the streams whose read factor was warned about

    @property
    def crop(self) -> dict[str, Any]:  # the evaluation transform of the data the head's file DataModules use
        return ImageFolderDataModule.crop if self.task == "classification" else ImageDataModule.crop

    def prepare_data(self) -> None:
        """Count and index the shards once a machine (its first process, before any ``setup``) for the other ranks."""
        for split, spec in self.shards.items():
            if spec:
                shard_sizes(expand_shards(spec, f"data.{split}_shards"), self.count_cache)

    def setup(self, stage: str | None = None) -> None:
        if self.train_dataset is not None:
            return
        urls = {split: expand_shards(spec, f"data.{split}_shards") for split, spec in self.shards.items() if spec}
        urls.setdefault("test", urls["val"])
        sizes = {split: shard_sizes(u, self.count_cache) for split, u in urls.items()}
        if sum(sizes["train"]) == 0:
            raise ValueError(f"data.train_shards: the {len(urls['train'])} shards hold no sample")
        if self.task == "caption":
            vocab = self._caption_tokenizer(lambda: shard_captions(urls["train"], self.caption_key))
            self.vocab = vocab
            augmenter, collate = CaptionAugment, partial(collate_captions, pad_id=vocab.pad_id)
        else:
            self.class_names = _class_names(self.class_names_spec, urls["train"])
            self.num_classes, vocab = len(self.class_names), None
            augmenter = classification_train_transform
            collate = default_collate if self.budget is None else collate_patches
        training, evaluate = self.transforms(augmenter)

        def stream(split: str, transform: Any, buffer: int) -> ShardStream:
            per_image = self.captions_per_image if split == "train" else None
            seeded = split == "train" and self.seeded_draws
            samples = ShardSamples(
                self.task, transform, self.caption_key, vocab, self.max_caption_len, self.num_classes, per_image, seeded
            )
            return ShardStream(urls[split], sizes[split], samples, collate, self.bad_images, buffer, self.count_cache)

        self.train_dataset = stream("train", training, self.shuffle_buffer)
        self.val_dataset = stream("val", evaluate, 0)
        self.test_dataset = self.val_dataset if urls["test"] == urls["val"] else stream("test", evaluate, 0)
        for dataset in {self.train_dataset, self.val_dataset, self.test_dataset}:
            self._set_length(dataset, dataset is self.train_dataset)
        log.info(
            "shards: %d train (%d samples), %d val (%d samples)",
            len(urls["train"]),
            sum(sizes["train"]),
            len(urls["val"]),
            sum(sizes["val"]),
        )

    def _epoch_order(self, stream: ShardStream, epoch: int, train: bool) -> EpochOrder:
        limit = self.samples_per_epoch if train else None
        return EpochOrder(stream.sizes, self.seed, epoch, shuffle=train, limit=limit)

    def _set_length(self, stream: ShardStream, train: bool) -> None:
        """A whole epoch's batches on each rank (``len``), before any pass is planned."""
        order, world = self._epoch_order(stream, 0, train), rank_and_world(self.trainer)[1]
        stream.batches = batches_per_rank(order.total, world, self.batch_size)
        if _streamed(stream):  # whole shards to each worker: as many batches as the fullest one needs
            plans = split_epoch([(0, order.total)], world, max(1, self._workers()), self.batch_size, order)
            stream.batches = sum(len(plan.batch_sizes) for plan in plans[0])

    def _plan(self, stream: ShardStream, train: bool) -> None:
        """Give ``stream`` this rank's plan for the epoch now starting, less what a resumed checkpoint trained."""
        rank, world = rank_and_world(self.trainer)
        epoch = self.trainer.current_epoch if (train and self.trainer is not None) else 0
        order = self._epoch_order(stream, epoch, train)
        done = PositionSet()
        if train:
            if self._resume is not None and self._resume.get("epoch") == epoch:
                done = PositionSet(self._resume.get("trained", []))
                log.info("resuming epoch %d: %d of its %d samples trained already", epoch, len(done), order.total)
            self._resume = None
            self.trained, self.epoch = done, epoch
        self._set_length(stream, train)
        workers, remaining = max(1, self._workers()), done.complement(order.total)
        plans = split_epoch(remaining, world, workers, self.batch_size, order if _streamed(stream) else None)
        if sum(len(plan.batch_sizes) for plan in plans[0]) > stream.batches:  # never more batches than len()
            plans = split_epoch(remaining, world, workers, self.batch_size)
        if _streamed(stream) and rank == 0 and id(stream) not in self._warned:
            self._warn_reads(stream, order, plans, remaining, resumed=len(done) > 0)
        seed = f"{self.seed}/{epoch}/{rank}/{len(done)}"
        stream.configure(order, plans[rank], stream.batches, seed)

    def _warn_reads(self, stream: ShardStream, order: EpochOrder, plans: Any, remaining: Any, resumed: bool) -> None:
        """One warning a stream where ``plans`` (``[rank][worker]``) read streamed shards more than once."""
        factor = read_factor(order, plans)
        if factor <= 1.05:
            return
        self._warned.add(id(stream))
        shards, world, workers = len(order.shard_runs(remaining)), len(plans), len(plans[0])
        why = (
            "a resumed epoch reads again the trained samples before those left in a shard"
            if resumed
            else f"{shards} shards are fewer than the {world} ranks x {workers} loader workers, so several workers "
            "read the same shard from its start"
        )
        log.warning("pipe:/URL shards are read %.2fx per sample trained: %s", factor, why)

    def _loader(self, dataset: Any, shuffle: bool) -> EpochLoader:
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its dataloaders")
        self._set_length(dataset, shuffle)  # the ranks are known now
        workers = self._workers()
        return EpochLoader(
            dataset,
            partial(self._plan, dataset, shuffle),
            num_workers=workers,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=False,  # each pass starts workers with that pass's plan
            multiprocessing_context=worker_context(workers),
        )

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Record which samples a training step gets (positions, and keys in ``last_keys``), then the base's."""
        if isinstance(batch, ShardBatch):
            if self.trainer is not None and self.trainer.training:
                self.trained.add(batch.positions)
                self.last_keys = list(batch.keys)
            batch = batch.batch
        return super().on_before_batch_transfer(batch, dataloader_idx)

    def state_dict(self) -> dict[str, Any]:
        """The epoch and the positions trained in it on every rank (a collective call under DDP)."""
        trained = self.trained
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            parts: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(parts, trained.ranges)
            trained = PositionSet([r for part in parts for r in part])
        return {
            "epoch": self.epoch,
            "trained": [list(r) for r in trained.ranges],
            "seed": self.seed,
            "shards": self._fingerprint(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        changed = [k for k, now in (("seed", self.seed), ("shards", self._fingerprint())) if state_dict.get(k) != now]
        if changed:  # positions would name other samples: the epoch starts over rather than skip or repeat blindly
            what = "data.seed" if changed == ["seed"] else "the train shards (or data.samples_per_epoch)"
            log.warning("%s changed since the checkpoint: epoch %s starts over", what, state_dict.get("epoch"))
            return
        self._resume = dict(state_dict)

    def _fingerprint(self) -> str:
        """What the epoch positions refer to: the train shards in order, their sizes, the epoch's length limit."""
        stream = self.train_dataset
        listing = [] if stream is None else [f"{u} {n}" for u, n in zip(stream.urls, stream.sizes)]
        text = "\n".join([*listing, str(self.samples_per_epoch)])
        return hashlib.sha1(text.encode()).hexdigest()

    def train_references(self) -> list[list[str]]:
        """Each training sample's references, read from the training shards (after ``setup``)."""
        if self.task != "caption":
            return []
        return shard_references(expand_shards(self.shards["train"], "data.train_shards"), self.caption_key)

    def evaluation_split(self, split: str) -> EvalSplit:
        stream = self.val_dataset if split == "val" else self.test_dataset
        source = f"shards {self.shards[split] or self.shards['val']}"
        references = {} if self.task == "caption" else None  # the batches carry them; sized for progress bars
        batches = EvaluationBatches(self._loader(stream, False), self.ready_batch, range(sum(stream.sizes)))
        return EvalSplit(source, loader=batches, references=references)


def _streamed(stream: ShardStream) -> bool:
    """Whether a worker reads some of the stream's shards from their start (``pipe:`` commands, URLs)."""
    return any(local_path(url) is None for url in stream.urls)
