"""``data=webdataset data.max_patches=N``: shard samples at their own grid as ``Patches``, each image's patches
those of the image resized alone by hand, and a resumed epoch trains the rest of the uninterrupted epoch's samples
with the same crops, none twice."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.runs import TINY, compose_train
from vitattn.bundle import load_model
from vitattn.data.preprocess import patch_grid
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.writer import ShardSample, write_shards
from vitattn.models.vit import Patches
from vitattn.training import train
from vitattn.training.datamodules import WebDatasetDataModule

SIZES = [(64, 16), (16, 48), (40, 40), (50, 20), (24, 72)]  # (width, height): wide, tall, square, wide, tall
MEAN, STD = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    """10 train samples in shards of 4, 5 val samples in one shard, at the sizes of ``SIZES``."""
    root = tmp_path_factory.mktemp("aspect_shards")
    rng = np.random.default_rng(0)

    def samples(count):
        for i in range(count):
            w, h = SIZES[i % len(SIZES)]
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, format="PNG")
            yield ShardSample(buffer.getvalue(), "png", [f"a red shape number {i}"], i % 2)

    write_shards(samples(10), root / "train", 4, class_names=["cat", "dog"])
    write_shards(samples(5), root / "val", 5, class_names=["cat", "dog"])
    return root


def _datamodule(shards, task, **kwargs):
    settings = dict(img_size=32, batch_size=3, num_workers=0, shuffle_buffer=4, count_cache=shards / "cache")
    data = WebDatasetDataModule(str(shards / "train"), str(shards / "val"), task=task, **{**settings, **kwargs})
    data.setup("fit")
    return data


def _by_hand(image: Image.Image, max_patches: int, patch: int = 8) -> torch.Tensor:
    """An image resized alone (bilinear) to its grid, normalised, cut into patches row by row."""
    rows, cols = patch_grid(image.height, image.width, max_patches)
    pixels = torch.from_numpy(np.array(image.resize((cols * patch, rows * patch), Image.BILINEAR))).float() / 255
    pixels = (pixels - MEAN) / STD  # (height, width, 3)
    return pixels.reshape(rows, patch, cols, patch, 3).permute(0, 2, 1, 3, 4).reshape(rows * cols, -1)  # (N, P*P*3)


@pytest.mark.parametrize("task", ["classification", "caption"])
def test_a_shard_batch_holds_each_image_at_its_own_grid_as_the_image_alone(shards, task):
    data = _datamodule(shards, task, max_patches=6, patch_size=8, interpolation="bilinear")
    batch = data.ready_batch(next(iter(data.val_dataloader())))
    images = batch["images"] if task == "caption" else batch[0]
    assert isinstance(images, Patches) and len(images.valid) == 3
    val = [Image.open(io.BytesIO(s["png"])).convert("RGB") for s in read_shard(expand_shards(str(shards / "val"))[0])]
    for row, image in enumerate(val[:3]):
        expected = _by_hand(image, 6)
        assert images.valid[row].sum() == len(expected) <= 6 and not images.valid[row, len(expected) :].any()
        torch.testing.assert_close(images.patches[row, : len(expected)], expected, rtol=0, atol=2e-5)


def _train(data, stop=None):
    """{key: the training sample's patches} of the epoch's batches (up to ``stop``), its positions marked trained."""
    seen = {}
    for index, batch in enumerate(data.train_dataloader()):
        if index == stop:
            break
        data.trained.add(batch.positions)
        patches = data.ready_batch(batch.batch)["images"]
        for key, row, valid in zip(batch.keys, patches.patches, patches.valid):
            assert key not in seen
            seen[key] = row[valid]
    return seen


def test_a_resumed_shard_epoch_trains_the_rest_once_with_the_uninterrupted_crops(shards):
    whole = _train(_datamodule(shards, "caption", max_patches=6, patch_size=8, augment={"hflip": 0.5}))
    interrupted = _datamodule(shards, "caption", max_patches=6, patch_size=8, augment={"hflip": 0.5})
    before = _train(interrupted, stop=2)
    resumed = _datamodule(shards, "caption", max_patches=6, patch_size=8, augment={"hflip": 0.5})
    resumed.load_state_dict(interrupted.state_dict())
    after = _train(resumed)
    assert len(before) == 6 and not before.keys() & after.keys() and sorted([*before, *after]) == sorted(whole)
    for key, patches in {**before, **after}.items():  # the crops (and their grids) of the uninterrupted epoch
        torch.testing.assert_close(patches, whole[key], rtol=0, atol=0)
    grids = {len(p) for p in whole.values()}
    assert len(grids) > 1  # random crops of mixed aspects: not one grid for all


@pytest.mark.parametrize("head", ["classification", "caption"])
def test_fast_dev_run_trains_on_shards_at_their_own_aspect(shards, head, tmp_path):
    overrides = [f"head={head}", "data=webdataset", f"data.train_shards={shards / 'train'}", *TINY]
    overrides += [f"data.val_shards={shards / 'val'}", f"data.count_cache={shards / 'cache'}", "data.num_workers=0"]
    result = train(compose_train([*overrides, "data.max_patches=6", "trainer.fast_dev_run=true"], tmp_path))
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.metrics["val/loss"]))
    assert load_model(result.bundle_dir).preprocess["max_patches"] == 6  # inference cuts images as training did
