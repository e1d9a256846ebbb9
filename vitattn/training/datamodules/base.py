"""What every DataModule shares: loaders (the training one resumes mid-epoch), uint8 images normalised on the
device, the cache, the evaluation split, the tokenizer. The design: docs/training.md#the-datamodules."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import os
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from functools import partial
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities import rank_zero_only
from torch.utils.data import DataLoader, Dataset, DistributedSampler, default_collate

from vitattn.data.bad_images import (
    BAD_IMAGE_MODES,
    GuardedImages,
    PartialBatch,
    check_bad_images,
    collate_skipping,
    find_bad_images,
)
from vitattn.data.images import EvalSplit, ImageCache, check_split, read_image, should_cache
from vitattn.data.preprocess import (
    WEIGHTS_KEYS,
    Normalize,
    caption_weak_transform,
    check_preprocess,
    classification_train_transform,
    default_preprocess,
    eval_transform,
    seeded_generators,
    strong_view,
)
from vitattn.data.tokenizer import (
    KINDS,
    SubwordTokenizer,
    TokenizedCaptions,
    Tokenizer,
    Vocabulary,
    check_bpe_size,
    check_captions_per_image,
    collate_captions,
    load_tokenizer,
    train_bpe,
)
from vitattn.errors import ConfigError, first_line
from vitattn.training.bootstrap import BootstrapSettings, MixedTraining, Pool, PoolCaptions, PoolLabels, image_digests
from vitattn.training.semi import SemiSettings, WeakStrong, read_unlabelled

__all__ = [
    "EpochSampler",
    "EvaluationBatches",
    "ImageDataModule",
    "ResumableLoader",
    "SeededDraws",
    "SemiLoader",
    "UnlabelledStream",
    "rank_and_world",
    "worker_context",
]

log = logging.getLogger(__name__)


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


class SeededDraws(Dataset):
    """``dataset`` whose item ``(index, epoch seed)`` (``EpochSampler(draws=True)``'s; a bare index: seed 0) is made
    with Python's, NumPy's and torch's CPU generators seeded by the two (``seeded_generators``), the process's own put
    back after: its random augmentation a function of the sample, so a resumed epoch (any worker count) augments as
    the interrupted one."""

    draws = True

    def __init__(self, dataset: Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int | tuple[int, int]) -> Any:
        i, epoch_seed = index if isinstance(index, tuple) else (index, 0)  # bare: Lightning's sampler (overfit)
        with seeded_generators(f"augment/{epoch_seed}/{i}"):
            return self.dataset[index if getattr(self.dataset, "draws", False) else i]


class ResumableLoader(DataLoader):
    """A ``DataLoader`` over an ``EpochSampler`` whose state says how far the epoch is trained, in samples; ``len``
    is a whole epoch's batches, ``last_indices`` the dataset indices of the batch last handed out. Its batches are
    ``batch_size`` samples, or a ``batch_sampler``'s over an ``EpochSampler`` that tells each epoch's batch sizes
    (``epoch_sizes(epoch seed)``; ``PatchBatchSampler``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if isinstance(getattr(self.batch_sampler, "sampler", None), EpochSampler) and self.batch_size is None:
            # the sampler a batch sampler draws from, as Lightning looks for it (a DistributedSampler is not swapped)
            object.__setattr__(self, "sampler", self.batch_sampler.sampler)
        self.batches = 0  # batches of the current epoch handed out, those before a resume included
        self.trained = 0  # samples of this rank's share of the epoch handed out, those before a resume included
        self.last_indices: list[int] = []

    def epoch_sizes(self, epoch_seed: int) -> list[int]:
        """The number of samples of each batch of epoch ``epoch_seed`` on this rank, in order."""
        if self.batch_size is None:
            return self.batch_sampler.epoch_sizes(epoch_seed)
        share = self.sampler.num_samples
        return [min(self.batch_size, share - start) for start in range(0, share, self.batch_size)]

    def __iter__(self) -> Iterator[Any]:
        sampler = self.sampler
        if not isinstance(sampler, EpochSampler):  # Lightning swapped it (overfit_batches): a plain loader
            yield from super().__iter__()
            return
        self.trained = sampler._resume[1] if sampler._resume else 0
        sizes = self.epoch_sizes(sampler._resume[0]) if self.trained else []
        self.batches = len([end for end in itertools.accumulate(sizes) if end <= self.trained])
        epoch: list[int] = []
        for batch in super().__iter__():
            epoch = epoch or self.epoch_sizes(sampler.epoch_seed)  # the epoch's seed is drawn by now
            size = epoch[self.batches]
            self.last_indices = sampler.share[self.trained : self.trained + size]
            self.batches, self.trained = self.batches + 1, self.trained + size
            yield batch

    def _batching(self) -> tuple[int, int | None, int | None, int]:
        """(samples, batch size, patches per batch, ranks): what a mid-epoch state must match."""
        patches = getattr(self.batch_sampler, "batch_patches", None) if self.batch_size is None else None
        return self.sampler.size, self.batch_size, patches, self.sampler.num_replicas

    def state_dict(self) -> dict[str, Any]:
        """The epoch's order (its seed), how many of this rank's samples (and batches) were handed out, and what
        they were drawn from."""
        sampler = self.sampler
        if not isinstance(sampler, EpochSampler):
            return {}
        samples, batch_size, patches, ranks = self._batching()
        return {
            "epoch": sampler.epoch,
            "epoch_seed": sampler.epoch_seed,
            "batches": self.batches,
            "trained": self.trained,
            "samples": samples,
            "batch_size": batch_size,
            "batch_patches": patches,
            "ranks": ranks,
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the epoch ``state_dict`` describes, from its samples handed out, unless it was finished (the
        next one then starts afresh); a state of other data, batch size, patches per batch or ranks is refused."""
        sampler = self.sampler
        if not isinstance(sampler, EpochSampler) or not state_dict or state_dict.get("epoch_seed") is None:
            return
        # a checkpoint written before states were counted in samples: whole batches of batch_size
        trained = state_dict.get("trained", int(state_dict["batches"]) * int(state_dict.get("batch_size") or 0))
        if int(trained) >= sampler.num_samples:
            return
        keys = ("samples", "batch_size", "batch_patches", "ranks")
        saved, now = tuple(state_dict.get(k) for k in keys), self._batching()
        if saved != now:
            was, has = _per_batch(*saved[1:3]), _per_batch(*now[1:3])
            raise ValueError(
                f"the checkpoint's training loader stopped mid-epoch over {saved[0]} samples in batches of {was} on "
                f"{saved[3]} ranks, this run has {now[0]} in batches of {has} on {now[3]}: resume with the same data, "
                "data.batch_size, data.batch_patches and trainer.devices x trainer.num_nodes"
            )
        sampler.set_epoch(int(state_dict["epoch"]))
        sampler.resume(int(state_dict["epoch_seed"]), int(trained))


def _per_batch(batch_size: int | None, patches: int | None) -> str:
    return f"{patches} patches" if patches is not None else str(batch_size)


class UnlabelledStream:
    """Endless batches of a ``ResumableLoader`` over images without labels: pass after pass, each a fresh order (under
    DDP pass ``p`` seeded ``seed + p``, each rank its share, padded as ``DistributedSampler`` pads); its state is the
    loader's (the pass, its order's seed, the samples handed out, in batches), so a resumed run continues the pass."""

    def __init__(self, loader: ResumableLoader) -> None:
        self.loader = loader
        self._batches: Iterator[Any] | None = None

    def __next__(self) -> Any:
        if self._batches is None:
            self._batches = self._passes()
        return next(self._batches)

    def _passes(self) -> Iterator[Any]:
        while True:
            yield from self.loader
            self.loader.sampler.set_epoch(self.loader.sampler.epoch + 1)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue the pass ``state_dict`` describes; after a finished pass, start the next one."""
        if state_dict and state_dict.get("epoch_seed") is not None and int(state_dict["batches"]) >= len(self.loader):
            self.loader.sampler.set_epoch(int(state_dict["epoch"]) + 1)
            return
        self.loader.load_state_dict(state_dict)


class SemiLoader:
    """The training batches of ``semi=``: each labelled batch of ``labelled`` (one pass of it is an epoch, a fresh
    order each) as ``{"labelled": batch, "weak": ..., "strong": ...}`` with the ``unlabelled`` stream's next batch.
    ``sampler`` is the labelled one, which Lightning gives each epoch's number."""

    def __init__(self, labelled: ResumableLoader, unlabelled: UnlabelledStream) -> None:
        self.labelled, self.unlabelled = labelled, unlabelled
        self.sampler = labelled.sampler

    def __len__(self) -> int:
        return len(self.labelled)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        for batch in self.labelled:
            yield {"labelled": batch, **next(self.unlabelled)}


def rank_and_world(trainer: Any) -> tuple[int, int]:
    """This process's rank and the number of ranks: the trainer's, else torch.distributed's, else the plan's rank
    (``training.plan.global_rank``, which the plan gives Lightning's ``rank_zero_only``) and ``WORLD_SIZE``."""
    if trainer is not None:
        return trainer.global_rank, trainer.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return rank_zero_only.rank, int(os.environ.get("WORLD_SIZE", 1))


class EvaluationBatches:
    """A loader's batches ready for the model, for evaluation without a Trainer: each through ``finish`` (a
    DataModule's ``ready_batch``), on the CPU. ``len`` is the loader's, ``dataset`` the loader's unless given."""

    def __init__(self, loader: Any, finish: Callable[[Any], Any], dataset: Any = None) -> None:
        self.loader, self.finish = loader, finish
        self.dataset = loader.dataset if dataset is None else dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        for batch in self.loader:
            yield self.finish(batch)


class ImageDataModule(pl.LightningDataModule):
    """Loader settings shared by every DataModule; subclasses fill the datasets in ``setup``.

    ``tasks`` are the heads the data can train; ``preprocess`` describes the evaluation transform of an image file
    (timm's ``create_transform`` arguments) so that inference reproduces it. The arguments are the shared ``data.*``
    keys (conf/data/); ``cache``, ``bad_images`` and ``verify`` apply to image files (``reads_files``), the rest to
    captions (``vocab_path``: a saved ``vocab.json`` or ``tokenizer.json`` rather than one built from the captions).
    """

    tasks: tuple[str, ...] = ()
    reads_files = False  # images come from files (which may be unreadable), not from a generator
    crop = {"crop_pct": 1.0, "crop_mode": "squash", "interpolation": "bicubic"}  # whole image, squashed
    weights_keys = WEIGHTS_KEYS  # the data.* keys a run takes from its start weights (training.start_weights)
    seeded_draws = False  # training samples augmented from their epoch's seed and index (``SeededDraws``)

    def __init__(
        self,
        *,
        img_size: int = 224,
        batch_size: int = 64,
        num_workers: int | str = 0,
        mean: Sequence[float] | None = None,
        std: Sequence[float] | None = None,
        interpolation: str | None = None,
        crop_pct: float | None = None,
        crop_mode: str | None = None,
        cache: str = "none",
        bad_images: str = "raise",
        verify: bool = False,
        tokenizer: Mapping[str, Any] | None = None,
        vocab: Tokenizer | None = None,
        min_word_freq: int | str = "auto",
        max_caption_len: int = 32,
        captions_per_image: int | str = "all",
        vocab_path: str | os.PathLike | None = None,
    ) -> None:
        super().__init__()
        if batch_size < 1:
            raise ValueError(f"batch_size={batch_size} must be at least 1")
        if num_workers != "auto" and (not isinstance(num_workers, int) or num_workers < 0):
            raise ValueError(f"num_workers={num_workers!r} must be a non-negative number or auto")
        if bad_images not in BAD_IMAGE_MODES:
            raise ValueError(f"bad_images={bad_images!r} is unknown; choose {' or '.join(BAD_IMAGE_MODES)}")
        should_cache(cache, 0, 0)  # an unknown mode fails here, before any file is read
        self.batch_size, self.num_workers, self.img_size = batch_size, num_workers, img_size
        self.bad_images, self.verify, self.cache_mode = bad_images, bool(verify), cache
        self.min_word_freq, self.max_caption_len, self.vocab_path = min_word_freq, max_caption_len, vocab_path
        self.captions_per_image = check_captions_per_image(captions_per_image)
        self.train_dataset: Dataset | None = None
        self.val_dataset: Dataset | None = None
        self.test_dataset: Dataset | None = None
        self.collate_fn = None  # the DataLoader default unless captions set one
        self.vocab: Tokenizer | None = vocab  # the caption tokenizer (a word Vocabulary or a SubwordTokenizer)
        self.tokenizer_config: dict[str, Any] = dict(tokenizer or {"kind": "words"})
        if vocab is None:
            _check_tokenizer(self.tokenizer_config)
        self.train_captions: list[str] | None = None  # the training captions, when the tokenizer was built from them
        self.skipped_images: dict[str, str] = {}  # files left out of batches in this process: path -> reason
        self.skipped_counts: Counter[str] = Counter()  # items left out, by the trainer's stage (train, validate, ...)
        given = dict(mean=mean, std=std, interpolation=interpolation, crop_pct=crop_pct, crop_mode=crop_mode)
        set_keys = {k: list(v) if k in ("mean", "std") else v for k, v in given.items() if v is not None}
        self.preprocess: dict[str, Any] = {**default_preprocess(img_size), **self.crop, **set_keys}
        check_preprocess(self.preprocess, "data")
        # the loaders' uint8 images normalised (on any device): with eval_transform, inference's transform bit for bit
        self.normalize = Normalize(self.preprocess["mean"], self.preprocess["std"])
        self.last_keys: list[str] = []  # the keys of the samples of the batch last given to a training step
        self.pool: Pool | None = None  # images without labels, labelled by a teacher (``use_pool``)
        self._augmenter: Callable[..., Any] | None = None  # what builds the training transform (``transforms``)
        self.unlabelled: WeakStrong | None = None  # images without labels, labelled online (``use_unlabelled``)
        self.unlabelled_batch_size = 0
        self.last_unlabelled_keys: list[str] = []  # the names of the unlabelled images of the last training batch
        self._unlabelled_stream: UnlabelledStream | None = None
        self._unlabelled_state: dict[str, Any] | None = None  # a checkpoint's, for the stream to come
        self._train_loader: ResumableLoader | None = None
        self._train_loader_state: dict[str, Any] | None = None  # a checkpoint's, for the training loader to come

    def eval_transform(self) -> Callable[[Any], torch.Tensor]:
        """Inference's ``eval_transform(self.preprocess)`` up to its normalisation: (3, img_size, img_size) uint8."""
        return eval_transform(self.preprocess, normalize=False)

    def transforms(self, train: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[[Any], torch.Tensor]]:
        """``(training, evaluation)`` transforms: ``train(img_size, self.augment, preprocess)`` unless augmentation is
        off (then the evaluation one), and ``eval_transform``."""
        evaluate = self.eval_transform()
        self._augmenter = train  # the pool's training transform is built by it too (``pool_transform``)
        return (train(self.img_size, self.augment, self.preprocess) if self.augment.enabled else evaluate), evaluate

    def pool_transform(self, randaugment: str | None) -> Callable[..., torch.Tensor]:
        """The transform of pool images: the human training images' own with timm's RandAugment ``randaugment``
        (``bootstrap.randaugment``, noisy student's input noise) added after its crop and flip, in place of the
        data's ``augment.auto_augment`` (captions: only where no kept caption names a colour, ``CaptionAugment``);
        where the data is not augmented (the shapes; ``augment.enabled=false``), RandAugment then the evaluation
        transform."""
        augment, build = getattr(self, "augment", None), self._augmenter
        if augment is None or not augment.enabled or build is None:
            evaluate = self.eval_transform()
            return evaluate if randaugment is None else _randaugment(randaugment, evaluate)
        if randaugment is not None:
            augment = dataclasses.replace(augment, auto_augment=randaugment)
        return build(self.img_size, augment, self.preprocess)

    def normalize_batch(self, batch: Any) -> Any:
        """A loader's batch with its uint8 images (``images`` of a dict, else the first item) through ``normalize``."""
        if batch is None:
            return None
        images = batch["images"] if isinstance(batch, Mapping) else batch[0]
        if images.dtype != torch.uint8:
            raise TypeError(f"{type(self).__name__} batches hold uint8 images, not {images.dtype}: normalised twice?")
        if isinstance(batch, Mapping):
            return {**batch, "images": self.normalize(images)}
        return [self.normalize(images), *batch[1:]]

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """``normalize_batch`` on the device; what holds no uint8 images (the system's example input, which Lightning's
        model summary sends through the same hooks) passes as it is."""
        if isinstance(batch, Mapping) and "labelled" in batch:  # semi=: both views normalised too
            views = {k: self.normalize(batch[k]) for k in ("weak", "strong")}
            return {"labelled": self.normalize_batch(batch["labelled"]), **views}
        if isinstance(batch, torch.Tensor) or (
            isinstance(batch, (tuple, list)) and batch and getattr(batch[0], "dtype", None) != torch.uint8
        ):
            return batch
        return self.normalize_batch(batch)

    def ready_batch(self, batch: Any) -> Any:
        """A loader's batch as the model takes it, without a Trainer: what the batch hooks do, on the CPU."""
        return self.on_after_batch_transfer(self.on_before_batch_transfer(batch, 0), 0)

    cache: ImageCache | None = None

    def image_files(self) -> list[str]:
        """Every image file of the train, val and test splits (after ``setup``); none for generated images."""
        return []

    def _read_images(self, datasets: Any) -> None:
        """Before any step: cache the images of ``datasets`` (``cache_mode``), or with ``verify`` read each once."""
        paths = self.image_files()
        if should_cache(self.cache_mode, len(set(paths)), math.floor(self.img_size / self.preprocess["crop_pct"])):
            self.cache = ImageCache(paths, self.eval_transform().transforms[0])  # timm's eval transform: resize first
            for dataset in datasets:
                dataset.loader = self.cache.load
            bad = self.cache.bad
        elif self.verify:
            bad = find_bad_images(paths)
        else:
            return
        check_bad_images(bad, len(set(paths)), self.bad_images, listed=self.verify)

    def on_before_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """Take the skipped files off a ``PartialBatch`` (``bad_images=skip``) and count them by the trainer's stage;
        None when nothing is readable (Lightning then skips the batch)."""
        loader = self._train_loader
        if loader is not None and self.trainer is not None and self.trainer.training:
            self.last_keys = [self._training_key(i) for i in loader.last_indices]
            if self._unlabelled_stream is not None:
                unlabelled = self._unlabelled_stream.loader.last_indices
                self.last_unlabelled_keys = [self.unlabelled.pool.name(i) for i in unlabelled]
        if isinstance(batch, Mapping) and "labelled" in batch:
            labelled = self.on_before_batch_transfer(batch["labelled"], dataloader_idx)
            return None if labelled is None else {**batch, "labelled": labelled}
        if not isinstance(batch, PartialBatch):
            return batch
        stage = self.trainer.state.stage if self.trainer is not None else None
        self.skipped_counts[str(stage.value) if stage is not None else "none"] += len(batch.skipped)
        self.skipped_images.update(batch.skipped)
        return batch.batch

    def evaluation_split(self, split: str) -> EvalSplit:
        """The ``val`` or ``test`` split for scoring (after ``setup``); subclasses with files override this."""
        check_split(split)
        loader = self.val_dataloader() if split == "val" else self.test_dataloader()
        return EvalSplit(f"{type(self).__name__} {split} split", loader=EvaluationBatches(loader, self.ready_batch))

    def _use_captions(
        self, splits: tuple[Dataset, Dataset, Dataset], vocab: Tokenizer, per_image: int | str | None
    ) -> None:
        """The (train, val, test) caption datasets tokenized, up to ``max_caption_len``; training takes
        ``per_image`` references of each image (``TokenizedCaptions``)."""
        train, val, test = splits
        self.vocab = vocab
        self.train_dataset = TokenizedCaptions(train, vocab, self.max_caption_len, per_image)
        self.val_dataset = TokenizedCaptions(val, vocab, self.max_caption_len)
        self.test_dataset = TokenizedCaptions(test, vocab, self.max_caption_len)
        self.collate_fn = partial(collate_captions, pad_id=vocab.pad_id)

    def plan_workers(self, on_gpu: bool, cores: int) -> int:
        """Resolve ``num_workers=auto`` (after ``setup``) for this process's ``cores``: on GPUs ``min(8, cores - 1)``;
        on CPUs, where torch's threads share the cores, 0 for images in memory, else 1. Returns the number."""
        if self.num_workers == "auto":
            in_memory = self.cache is not None or not self.reads_files
            self.num_workers = max(0, min(8, cores - 1)) if on_gpu else (0 if in_memory else min(1, cores - 1))
        return int(self.num_workers)

    def _workers(self) -> int:
        if self.num_workers == "auto":
            self.plan_workers(torch.cuda.is_available(), len(os.sched_getaffinity(0)))
        return int(self.num_workers)

    def sample_key(self, index: int) -> str:
        """What names training sample ``index`` in ``last_keys`` (an image id or path; here the index)."""
        return str(index)

    def _training_key(self, index: int) -> str:
        """``sample_key`` of a human-labelled sample, ``pool:NAME`` of a pool image's."""
        if not isinstance(self.train_dataset, MixedTraining):
            return self.sample_key(index)
        part, i = self.train_dataset.part(index)
        return self.sample_key(i) if part == "human" else f"pool:{self.pool.name(i)}"

    def use_pool(self, settings: BootstrapSettings) -> dict[str, int]:
        """After ``setup``: the kept ``pool`` mixed into the training split (``MixedTraining``), each human-labelled
        sample ``settings.human_repeat`` times, each pool image through ``pool_transform``; pool images whose
        pixels through the evaluation transform equal a validation or test image's are left out and counted, and so
        are those equal to a human-labelled one's unless ``settings.labelled_images`` is ``keep`` (distillation:
        counted, kept). Returns the counts."""
        pool, evaluate = self.pool, self.eval_transform()
        digests = [image_digests([evaluate(pool.read(i))]).pop() for i in range(len(pool))]
        held_out = image_digests(_images(self.val_dataset)) | image_digests(_images(self.test_dataset))
        human = image_digests(self._labelled_images())
        leaked = {i for i, d in enumerate(digests) if d in held_out}
        labelled = {i for i, d in enumerate(digests) if d in human and i not in leaked}
        counts = {"pool_identical_to_val_or_test": len(leaked), "pool_identical_to_labelled": len(labelled)}
        if settings.labelled_images == "keep":  # the teacher's labels of the labelled images trained on too
            labelled = set()
        if leaked or labelled:
            log.warning(
                "bootstrap: %d pool images equal validation or test images and %d equal human-labelled ones; "
                "left out of training",
                len(leaked),
                len(labelled),
            )
            pool.keep_only(leaked | labelled)
        if not len(pool):
            raise ConfigError("bootstrap: every kept pool image is a validation, test or labelled image")
        transform = self.pool_transform(settings.randaugment)
        if pool.captions is not None:
            part: Dataset = TokenizedCaptions(PoolCaptions(pool, transform), self.vocab, self.max_caption_len, 1)
        else:
            part = PoolLabels(pool, transform)
        soft = None if pool.targets is None else len(pool.targets[0])  # a batch of one kind: every target soft
        self.train_dataset = MixedTraining(self.train_dataset, settings.human_repeat, part, soft)
        counts |= {"pool_images": len(pool), "human_samples_per_epoch": self.train_dataset.human_size}
        return counts

    def train_files(self) -> list[str]:
        """The image files of the training split, in order (after ``setup``); none for generated images."""
        return []

    def _labelled_images(self) -> Iterator[torch.Tensor]:
        """The human-labelled training images through the evaluation transform, augmented data or not: what the
        leak rule compares pool images with."""
        if not self.reads_files:  # generated images, never augmented: the items themselves
            return _images(self.train_dataset)
        evaluate = self.eval_transform()
        return (evaluate(read_image(path)) for path in self.train_files())

    def use_unlabelled(self, settings: SemiSettings) -> dict[str, int]:
        """After ``setup``: the images without labels of ``settings.images`` (``semi=``), each as a weak view (the
        training transform, for captions its crop alone; the evaluation one where the data has no augmentation) and
        a strong view (``strong_view``), ``settings.ratio`` of them per labelled image in a step. Returns the counts."""
        weak, captions = self.eval_transform(), self.vocab is not None
        if getattr(getattr(self, "augment", None), "enabled", False):
            training = caption_weak_transform if captions else classification_train_transform
            weak = training(self.img_size, self.augment, self.preprocess)
        strong = strong_view(weak, settings.strong, self.img_size, self.preprocess["mean"], captions)
        try:
            self.unlabelled = WeakStrong(read_unlabelled(settings.images), weak, strong)
        except (OSError, ValueError) as err:  # the file readers name it ``images=...``; the shard readers not
            line = first_line(err)
            line = f"semi.{line}" if line.startswith("images=") else f"semi.images={settings.images}: {line}"
            raise ConfigError(line) from None
        if not len(self.unlabelled):
            raise ConfigError(f"semi.images={settings.images} holds no image")
        self.unlabelled_batch_size = settings.ratio * self.batch_size
        return {"unlabelled_images": len(self.unlabelled), "unlabelled_per_step": self.unlabelled_batch_size}

    def _loader(self, dataset: Dataset | None, shuffle: bool) -> DataLoader:
        """Evaluation loaders in order; the training loader (``shuffle``) a ``ResumableLoader``."""
        if dataset is None:
            raise RuntimeError(f"{type(self).__name__}.setup() must run before its dataloaders")
        workers = self._workers()
        collate = self.collate_fn
        if shuffle and self.seeded_draws:
            dataset = SeededDraws(dataset)
        draws = getattr(dataset, "draws", False)
        if self.reads_files:
            dataset = GuardedImages(dataset, self.bad_images)
            if self.bad_images == "skip":
                collate = partial(collate_skipping, collate=collate or default_collate)
        settings = dict(
            batch_size=self.batch_size,
            num_workers=workers,
            collate_fn=collate,
            pin_memory=torch.cuda.is_available(),
            persistent_workers=workers > 0,
            multiprocessing_context=worker_context(workers),
        )
        if not shuffle:
            return DataLoader(dataset, **settings)
        rank, world = rank_and_world(self.trainer)
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        sampler = EpochSampler(len(dataset), world, rank, seed, draws)
        training, batching = self.training_batches(dataset, sampler)  # batch_size, or a batch_sampler in its place
        loader_settings = {k: v for k, v in settings.items() if k != "batch_size"}
        self._train_loader = ResumableLoader(training, **batching, **loader_settings)
        if self._train_loader_state is not None:
            self._train_loader.load_state_dict(self._train_loader_state)
            self._train_loader_state = None
        if self.unlabelled is None:
            return self._train_loader
        sampler = EpochSampler(len(self.unlabelled), world, rank, seed + 1)  # another order than the labelled one
        settings = {**settings, "batch_size": self.unlabelled_batch_size, "collate_fn": None}
        self._unlabelled_stream = UnlabelledStream(ResumableLoader(self.unlabelled, sampler=sampler, **settings))
        if self._unlabelled_state is not None:
            self._unlabelled_stream.load_state_dict(self._unlabelled_state)
            self._unlabelled_state = None
        return SemiLoader(self._train_loader, self._unlabelled_stream)

    def training_batches(self, dataset: Dataset, sampler: EpochSampler) -> tuple[Dataset, dict[str, Any]]:
        """The training loader's dataset and how it batches ``sampler``'s samples: ``data.batch_size`` at a time."""
        return dataset, {"sampler": sampler, "batch_size": self.batch_size}

    def state_dict(self) -> dict[str, Any]:
        """The training loader's state, in every checkpoint; Lightning's own copy comes back too late (after
        ``configure_optimizers`` has built and started the loader), a DataModule's before."""
        state = {} if self._train_loader is None else {"train_loader": self._train_loader.state_dict()}
        if self._unlabelled_stream is not None:  # semi=: the images without labels, a stream of its own
            state["unlabelled_loader"] = self._unlabelled_stream.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state, unlabelled = state_dict.get("train_loader"), state_dict.get("unlabelled_loader")
        in_use = self.trainer is not None and self.trainer.train_dataloader is not None
        if in_use and self._train_loader is not None:  # strategies that restore after setup: the loaders are built
            if state:
                self._train_loader.load_state_dict(state)
            if unlabelled and self._unlabelled_stream is not None:
                self._unlabelled_stream.load_state_dict(unlabelled)
        else:  # for the loaders the trainer builds next (not ones built before fit, as training.build.check_fit does)
            self._train_loader_state, self._unlabelled_state = state or None, unlabelled or None

    def train_dataloader(self) -> DataLoader:
        return self._loader(self.train_dataset, shuffle=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self.val_dataset, shuffle=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self.test_dataset, shuffle=False)

    def _caption_tokenizer(self, captions: Callable[[], list[str]]) -> Tokenizer:
        """The tokenizer given, else the one at ``vocab_path``, else the one ``tokenizer_config`` names."""
        if self.vocab is not None:
            return self.vocab
        if self.vocab_path is not None:
            return load_tokenizer(self.vocab_path)
        config = self.tokenizer_config
        kind = config.get("kind", "words")
        if kind == "file":
            return SubwordTokenizer.from_file(config["path"], add_specials=True)
        self.train_captions = captions()  # the human captions only: a pool's never moves the threshold
        if kind == "bpe":
            return train_bpe(self.train_captions, config.get("vocab_size", "auto"))
        return Vocabulary.build(self.train_captions, min_freq=self.min_word_freq)


def _images(dataset: Dataset | None) -> Iterator[torch.Tensor]:
    """The (3, height, width) uint8 images of a split, read in order (a caption item's ``image``, a pair's first)."""
    for i in range(len(dataset) if dataset is not None else 0):
        item = dataset[i]
        yield item["image"] if isinstance(item, Mapping) else item[0]


def _randaugment(config: str, then: Callable[[Any], torch.Tensor]) -> Callable[[Any], torch.Tensor]:
    """timm's RandAugment (``rand-m9-mstd0.5``...) of a PIL image, then ``then``: the pool's named noise."""
    from timm.data.auto_augment import rand_augment_transform
    from torchvision.transforms import Compose

    return Compose([rand_augment_transform(config, {"img_mean": (124, 116, 104)}), then])


def worker_context(workers: int) -> Any:
    """How loader workers start: by fork, except in a process group, whose threads can hold the interpreter's
    locks at the moment of a fork and hang the child (CPython 3.11); there from a fork server, forked and
    exec'd before those threads, with torch imported once."""
    if workers == 0 or not (dist.is_available() and dist.is_initialized()):
        return None
    context = torch.multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", __name__])
    return context


def _check_tokenizer(tokenizer: Mapping[str, Any]) -> None:
    kind, path = tokenizer.get("kind"), tokenizer.get("path")
    if kind not in KINDS:
        raise ConfigError(f"tokenizer kind={kind!r} is unknown; choose tokenizer=words, bpe or file")
    if kind == "file" and not path:
        raise ConfigError("tokenizer=file needs tokenizer.path=FILE, a Hugging Face tokenizer.json")
    try:
        if kind == "bpe":
            check_bpe_size(tokenizer.get("vocab_size", "auto"))
        elif kind == "file":
            SubwordTokenizer.from_file(path, add_specials=True)
    except (OSError, ValueError) as err:
        raise ConfigError(f"tokenizer.path={path}: {first_line(err)}" if path else first_line(err)) from None
