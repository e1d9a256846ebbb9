"""Batches by patches (``data.batch_patches``, vitattn.training.datamodules.patches): timm's NaFlex buckets and
schedule, every sample once an epoch on one rank and on simulated ranks (``num_replicas``/``rank``, no processes),
as many batches on every rank, each batch within its patches, a resume from a sample offset, and runs through
``train``: a fast_dev_run, the learning-rate horizon and a mid-epoch resume that trains the uninterrupted crops."""

from __future__ import annotations

import inspect
import math
import re
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.naflex_loader import create_naflex_loader
from torch.utils.data import Dataset, DistributedSampler

from tests.helpers.processes import sample_keys
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from tests.training.test_data_resume import _overrides, _record_batches, _stopped_and_resumed
from vitattn.data.preprocess import _PATCH_LIMIT, patch_grid
from vitattn.errors import ConfigError
from vitattn.models.vit import Patches
from vitattn.training import train
from vitattn.training.config import check_config
from vitattn.training.datamodules import ImageFolderDataModule, WebDatasetDataModule
from vitattn.training.datamodules.base import EpochSampler, ResumableLoader
from vitattn.training.datamodules.patches import BucketItems, PatchBatchSampler, patch_buckets
from vitattn.training.systems import base as system_base

BUCKETS, T = (8, 16, 36, 49, 64), 160  # patch_buckets(64, 8): max_patches 64 of 8 px at img_size 64


class _Items(Dataset):
    """Item ``(index, epoch seed)``: the pair itself, and the patch limit it was made under (None: none)."""

    draws = True

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, item: tuple[int, int]) -> tuple[int, int | None]:
        return item[0], _PATCH_LIMIT.get()


def _loader(size: int, ranks: int, rank: int, epoch: int = 1, workers: int = 0) -> ResumableLoader:
    sampler = EpochSampler(size, ranks, rank, seed=5, draws=True)
    sampler.set_epoch(epoch)
    batches = PatchBatchSampler(sampler, BUCKETS, T, seed=5)
    return ResumableLoader(BucketItems(_Items(size)), batch_sampler=batches, collate_fn=list, num_workers=workers)


def test_the_buckets_are_timms_train_seq_lens_scaled_to_max_patches():
    timms = inspect.signature(create_naflex_loader).parameters["train_seq_lens"].default
    assert patch_buckets(1024, 32) == timms  # timm's own at its largest
    assert patch_buckets(64, 8) == BUCKETS  # 1/8, 1/4, 9/16, 49/64 and all of 64
    assert patch_buckets(16, 4) == (4, 9, 12, 16)  # 1/8 of 16 (2) is below one row of 4 patches: left out


@pytest.mark.parametrize("size", [37, 40])
@pytest.mark.parametrize("ranks", [1, 2, 3])
def test_every_sample_once_an_epoch_and_as_many_batches_on_every_rank(ranks, size):
    per_rank = math.ceil(size / ranks)
    for epoch in (1, 2):
        batches = [list(_loader(size, ranks, rank, epoch)) for rank in range(ranks)]
        assert len({len(b) for b in batches}) == 1  # or DDP hangs at the epoch's end
        assert [len(b) for b in batches] == [len(_loader(size, ranks, rank, epoch)) for rank in range(ranks)]
        for rank_batches in batches:
            assert sum(len(batch) for batch in rank_batches) == per_rank
            for batch in rank_batches:
                (length,) = {limit for _, limit in batch}  # one sequence length a batch, from the buckets
                assert length in BUCKETS and len(batch) * length <= T
        seen = Counter(i for rank_batches in batches for batch in rank_batches for i, _ in batch)
        assert set(seen) == set(range(size))
        # the remainder: DistributedSampler's rule, the first of the epoch's order once more to fill the last rank
        order = torch.randperm(size, generator=torch.Generator().manual_seed(5 + epoch)).tolist()
        again = per_rank * ranks - size
        assert sorted(i for i, n in seen.items() if n == 2) == sorted(order[:again]) and max(seen.values()) <= 2


def test_the_schedule_is_drawn_anew_each_epoch_and_the_same_on_every_rank():
    orders = {
        (epoch, rank): [batch[0][1] for batch in _loader(40, 2, rank, epoch)] for epoch in (1, 2) for rank in (0, 1)
    }
    assert orders[1, 0] == orders[1, 1] and orders[2, 0] == orders[2, 1]  # ranks step through the same lengths
    assert orders[1, 0] != orders[2, 0] and sorted(orders[1, 0]) == sorted(orders[2, 0])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("ranks", [1, 2])
def test_a_loader_state_after_some_samples_resumes_the_rest_of_the_epoch(ranks, workers):
    for rank in range(ranks):
        torch.manual_seed(0)
        whole = list(_loader(81, ranks, rank, workers=workers))
        torch.manual_seed(0)
        first, seen = _loader(81, ranks, rank, workers=workers), []
        assert len(first) == len(whole) > 4
        for batch in first:
            seen.append(batch)
            assert first.last_indices == [i for i, _ in batch]
            if len(seen) == len(whole) // 2:
                break
        state = first.state_dict()
        assert state["trained"] == sum(len(b) for b in seen) and state["batches"] == len(seen)
        torch.manual_seed(1)  # another global seed: the order and the schedule's come from the state
        second = _loader(81, ranks, rank, workers=workers)
        second.load_state_dict(state)
        rest = list(second)
        assert seen + rest == whole
        assert second.state_dict()["trained"] == math.ceil(81 / ranks)


def test_the_loader_shows_lightning_its_distributed_sampler():
    """Under DDP (``use_distributed_sampler``) Lightning swaps a loader's ``sampler`` unless it is a
    ``DistributedSampler``, and cannot swap one under a batch sampler of its own: the loader shows ``EpochSampler``."""
    loader = _loader(37, 2, 1)
    assert loader.sampler is loader.batch_sampler.sampler and isinstance(loader.sampler, DistributedSampler)


def test_a_state_of_other_batch_patches_is_refused_in_one_line():
    state = _loader(37, 1, 0).state_dict()
    state.update(epoch_seed=1, trained=5)
    sampler = EpochSampler(37, seed=5, draws=True)
    other = ResumableLoader(_Items(37), batch_sampler=PatchBatchSampler(sampler, BUCKETS, 2 * T), collate_fn=list)
    with pytest.raises(ValueError) as err:
        other.load_state_dict(state)
    assert re.fullmatch(
        r"the checkpoint's training loader stopped mid-epoch over 37 samples in batches of 160 patches on 1 ranks, "
        r"this run has 37 in batches of 320 patches on 1: .*data\.batch_patches.*",
        str(err.value),
    )


ASPECTS = [(1, 1), (2, 1), (3, 1), (4, 1), (1, 2), (1, 3), (1, 4), (3, 2)]  # (width, height) shares


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """An ImageFolder of images of aspects 1:1 to 4:1, wide and tall."""
    root, rng = tmp_path_factory.mktemp("aspects"), np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i, (w, h) in enumerate(ASPECTS):
                pixels = rng.integers(0, 256, (24 * h, 24 * w, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def _datamodule(folder, **kwargs) -> ImageFolderDataModule:
    settings = dict(img_size=32, batch_size=4, cache="none", max_patches=16, patch_size=8, batch_patches=40)
    data = ImageFolderDataModule(folder, **{**settings, **kwargs})
    data.setup("fit")
    return data


def _batches(data, state=None) -> list[tuple[list[int], Patches]]:
    if state is not None:
        data.load_state_dict(state)
    loader = data.train_dataloader()
    return [(list(loader.last_indices), data.ready_batch(batch)[0]) for batch in loader]


def test_each_batch_of_images_holds_at_most_batch_patches_each_image_within_its_length(folder):
    data = _datamodule(folder, augment={"ratio": [0.5, 2.0]})
    batches = _batches(data)
    loader = data._train_loader
    schedule = loader.batch_sampler.epoch_schedule(loader.sampler.epoch_seed)
    assert len(batches) == len(schedule) == len(loader)
    for (indices, images), (length, size) in zip(batches, schedule, strict=True):
        B, N, _ = images.patches.shape
        assert B * N <= 40  # padding included
        assert B == len(indices) == size <= 40 // length and (images.valid.sum(1) <= length).all()
    assert len({length for length, _ in schedule}) > 1


def test_a_resume_from_a_sample_offset_gives_the_rest_of_the_epochs_crops(folder):
    """The rest of an epoch after a loader state: the same samples, crops and grids (``SeededDraws`` within the
    batch's ``patch_limit``), pixel for pixel, as the uninterrupted epoch's."""
    augment = {"ratio": [0.5, 2.0], "hflip": 0.5}
    torch.manual_seed(0)
    whole = _batches(_datamodule(folder, augment=augment))
    torch.manual_seed(0)
    first = _datamodule(folder, augment=augment)
    loader = first.train_dataloader()
    for k, _ in enumerate(loader, 1):
        if k == 2:
            break
    state = first.state_dict()
    torch.manual_seed(1)
    rest = _batches(_datamodule(folder, augment=augment), state)
    assert len(rest) == len(whole) - 2
    for (indices, ours), (expected_indices, theirs) in zip(rest, whole[2:], strict=True):
        assert indices == expected_indices
        for a, b in zip(ours, theirs, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_without_batch_patches_the_images_of_a_batch_are_resized_to_max_patches(folder):
    data = _datamodule(folder, augment=False, batch_patches=None)
    indices, images = _batches(data)[0]
    expected = []
    for i in indices:
        w, h = ASPECTS[i % len(ASPECTS)]
        rows, cols = patch_grid(24 * h, 24 * w, 16)
        expected.append(rows * cols)
    assert images.valid.sum(1).tolist() == expected and len(indices) == 4


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (dict(max_patches=None, batch_patches=64), r"data\.batch_patches=64 sizes batches of images at their own "),
        (dict(batch_patches=15), r"data\.batch_patches=15 must be a whole number of at least data\.max_patches=16,"),
        (dict(batch_patches=True), r"data\.batch_patches=True must be a whole number of at least"),
    ],
)
def test_batch_patches_without_or_below_max_patches_is_refused_in_one_line(folder, settings, message):
    with pytest.raises(ValueError, match=f"^{message}") as err:
        ImageFolderDataModule(folder, img_size=32, patch_size=8, **{"max_patches": 16, **settings})
    assert "\n" not in str(err.value)


def test_batch_patches_with_shards_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^data\.batch_patches=64 is not supported with data=webdataset") as err:
        WebDatasetDataModule(str(tmp_path / "a.tar"), str(tmp_path / "b.tar"), batch_patches=64)
    assert "\n" not in str(err.value)


def test_fast_dev_run_trains_captions_in_batches_by_patches(tmp_path):
    data = ["head=caption", "data=shapes", *TINY_SHAPES, "data.max_patches=16", "data.batch_patches=64"]
    result = train(compose_train([*data, *TINY, "data.num_workers=0", "trainer.fast_dev_run=true"], tmp_path))
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.metrics["val/loss"]))


def test_an_epoch_by_patches_resumed_mid_epoch_trains_the_uninterrupted_samples_and_crops(tmp_path, monkeypatch):
    """One epoch of 24 images, stopped after 3 steps with a step checkpoint and resumed from it: the resumed steps
    get the uninterrupted run's samples, crops and grids; the learning-rate horizon is the schedule's batches."""
    overrides, expected = _overrides("imagefolder", 24, tmp_path / "data")
    overrides += ["data.max_patches=16", "data.batch_patches=48", "data.augment.enabled=true"]
    overrides += ["data.augment.ratio=[0.5,2.0]", "data.num_workers=0"]
    seen, horizons = _record_batches(monkeypatch), []
    build = system_base.build_optimizer
    monkeypatch.setattr(
        system_base, "build_optimizer", lambda *a, **k: horizons.append(k["total_steps"]) or build(*a, **k)
    )
    train(compose_train([*overrides, f"+callbacks.sample_keys.folder={tmp_path / 'whole'}"], tmp_path / "whole_run"))
    whole, whole_keys = list(seen), [k for _, _, ks in sample_keys(tmp_path / "whole") for k in ks]
    assert sorted(whole_keys) == sorted(expected)  # every sample once
    assert horizons == [len(whole)] and len(whole) > 2  # the schedule's batches, not 24 / data.batch_size
    assert len({max(counts) for _, _, counts in whole}) > 1  # more than one sequence length

    seen.clear()
    assert _stopped_and_resumed(overrides, 2, tmp_path) == whole_keys
    assert seen == whole  # steps 0-1 stopped, then the resumed steps: the same pixels, crops and grids


def test_overfit_batches_with_batch_patches_is_refused_in_one_line_before_any_data_is_read(tmp_path):
    """Lightning's overfit_batches puts a sampler of its own under the loader, which a batch sampler refuses."""
    missing = tmp_path / "no_such_folder"  # the refusal comes before the data path is looked at
    overrides = ["head=classification", "data=imagefolder", f"data.root={missing}", *TINY, "data.max_patches=16"]
    cfg = compose_train([*overrides, "data.batch_patches=64", "trainer.overfit_batches=2"], tmp_path)
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert str(err.value) == (
        "trainer.overfit_batches=2 replays batches of data.batch_size, not batches by patches "
        "(data.batch_patches=64): leave data.batch_patches unset to overfit"
    )
    cfg.trainer.overfit_batches = 0
    with pytest.raises(ConfigError, match=r"^data\.root="):  # not overfitting: the next check, the missing folder
        check_config(cfg)
