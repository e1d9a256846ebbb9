"""``data.max_patches`` in the ImageFolder DataModule (head=classification): batches of ``Patches`` at each image's
own grid, normalised as its image would be, and a fast_dev_run through ``train``; unset, today's square batches."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.bundle import load_model
from vitattn.data.preprocess import patch_grid
from vitattn.data.shapes import ShapesDataset
from vitattn.errors import ConfigError
from vitattn.models.vit import Patches
from vitattn.training import train
from vitattn.training.config import check_config
from vitattn.training.datamodules import ImageFolderDataModule, ShapesDataModule
from vitattn.training.systems import ClassificationSystem

SIZES = [(64, 16), (16, 48), (40, 40), (50, 20)]  # (width, height): wide, tall, square, wide


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("aspect")
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in ("cat", "dog"):
            (root / split / name).mkdir(parents=True)
            for i, (w, h) in enumerate(SIZES):
                pixels = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / name / f"{i}.png")
    return root


def _datamodule(folder, cache="none", **kwargs):
    data = ImageFolderDataModule(folder, augment=False, img_size=32, batch_size=8, cache=cache, **kwargs)
    data.setup("fit")
    return data


@pytest.mark.parametrize("cache", ["none", "ram"])
def test_a_batch_holds_each_image_at_its_own_grid_normalised_as_its_image(folder, cache):
    data = _datamodule(folder, cache, max_patches=6, patch_size=8)
    assert (data.cache is not None) == (cache == "ram")  # the cache keeps each image's aspect ratio
    batch = data.ready_batch(next(iter(data.val_dataloader())))
    assert isinstance(batch[0], Patches)
    grids = [patch_grid(h, w, 6) for w, h in SIZES] * 2  # cat's images, then dog's
    assert batch[0].valid.sum(1).tolist() == [rows * cols for rows, cols in grids]
    # the first image (64 x 16, a 1 x 4 grid: 32 x 8 pixels) normalised as a square run normalises images
    assert data.preprocess["interpolation"] == "bilinear"  # timm's evaluation default, as square runs resize
    image = Image.open(data.val_dataset.samples[0][0]).resize((32, 8), Image.BILINEAR)
    image = torch.from_numpy(np.array(image))  # (8, 32, 3)
    pixels = data.normalize(image.permute(2, 0, 1))  # (3, 8, 32)
    expected = pixels.reshape(3, 1, 8, 4, 8).permute(1, 3, 2, 4, 0).reshape(4, -1)  # (4 patches, 8*8*3)
    torch.testing.assert_close(batch[0].patches[0, :4], expected)


def test_unset_the_batches_are_square_images(folder):
    data = _datamodule(folder, patch_size=8)
    images, labels = data.ready_batch(next(iter(data.val_dataloader())))
    assert images.shape == (8, 3, 32, 32) and labels.shape == (8,)


def test_augmented_training_images_keep_their_aspect_within_the_budget(folder):
    data = ImageFolderDataModule(folder, img_size=32, batch_size=8, cache="none", max_patches=6, patch_size=8)
    data.setup("fit")
    for index, (width, height) in enumerate(SIZES):
        for _ in range(10):
            (patches, coord), _ = data.train_dataset[index]
            rows, cols = (coord.max(0).values + 1).tolist()
            assert len(patches) == rows * cols <= 6
            # the crop's aspect is the image's times 3/4 to 4/3 (data.augment.ratio): wide stays wide, tall tall
            if width > 2 * height:
                assert cols > rows
            if height > 2 * width:
                assert rows > cols
    batch = data.ready_batch(next(iter(data.train_dataloader())))
    assert isinstance(batch[0], Patches) and batch[0].patches.dtype == torch.float32


def test_a_crop_that_keeps_no_aspect_is_refused_in_one_line(folder):
    data = ImageFolderDataModule(folder, augment={"crop": "pad"}, img_size=32, max_patches=6, patch_size=8)
    with pytest.raises(
        ValueError, match=r"^data\.augment\.crop=pad keeps no aspect ratio: use crop=resized with data\.max_patches$"
    ):
        data.setup("fit")


def test_fast_dev_run_trains_a_classifier_on_images_at_their_own_aspect(folder, tmp_path):
    overrides = ["head=classification", "data=imagefolder", f"data.root={folder}", "data.num_workers=0"]
    extra = ["data.max_patches=6", "trainer.fast_dev_run=true"]  # augmented: the crop keeps the aspect
    result = train(compose_train([*overrides, *TINY, *extra], tmp_path))
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.metrics["val/loss"]))


def test_mixup_of_patches_is_refused_in_one_line(folder):
    model = dict(img_size=32, patch_size=8, embed_dim=32, depth=1, num_heads=2, num_classes=2)
    system = ClassificationSystem(model, ["cat", "dog"], mixup=0.8)
    data = _datamodule(folder, max_patches=6, patch_size=8)
    batch = data.ready_batch(next(iter(data.val_dataloader())))
    with pytest.raises(ValueError, match=r"^head\.mixup and head\.cutmix mix square images: set them 0 with data\.max"):
        system._training_loss(batch)


@pytest.fixture(scope="module")
def coco(tmp_path_factory):
    """A COCO caption set of wide, tall and square images."""
    root = tmp_path_factory.mktemp("coco_aspect")
    (root / "images").mkdir()
    rng = np.random.default_rng(1)
    files = {}
    for split, first in (("train", 1), ("val", 20)):
        images, annotations = [], []
        for i, (w, h) in enumerate(SIZES):
            name = f"{split}{i}.png"
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / "images" / name)
            images.append({"id": first + i, "file_name": name})
            annotations.append({"id": first + i, "image_id": first + i, "caption": f"a red shape on the left {i}"})
        (root / f"{split}.json").write_text(json.dumps({"images": images, "annotations": annotations}))
        files[f"data.{split}_annotations"] = root / f"{split}.json"
    return [f"data.image_dir={root / 'images'}", *(f"{k}={v}" for k, v in files.items())]


@pytest.mark.parametrize(
    "data",
    [
        ["head=caption", "data=shapes", *TINY_SHAPES, "data.max_patches=9"],
        ["head=coca", "data=shapes", *TINY_SHAPES, "data.max_patches=9"],
        ["head=classification", "data=shapes", *TINY_SHAPES, "data.max_patches=9"],
        ["head=caption", "data=shapes", *TINY_SHAPES, "data.max_patches=9", "data.max_aspect=4"],
        ["head=caption", "data=coco", "data.max_patches=6", "data.augment.hflip=0.5", "data.augment.color_jitter=0.2"],
    ],
    ids=["shapes-caption", "shapes-coca", "shapes-classification", "shapes-wide-caption", "coco-caption-augmented"],
)
def test_fast_dev_run_trains_captions_at_their_own_aspect(data, coco, tmp_path):
    extra = coco if "data=coco" in data else []
    result = train(compose_train([*data, *extra, *TINY, "data.num_workers=0", "trainer.fast_dev_run=true"], tmp_path))
    assert result.global_step == 1 and torch.isfinite(torch.tensor(result.metrics["val/loss"]))
    bundle = load_model(result.bundle_dir)  # the budget recorded: inference cuts images as training did
    budget = int(next(a for a in data if a.startswith("data.max_patches=")).split("=")[1])
    assert bundle.preprocess["max_patches"] == budget and bundle.preprocess["patch_size"] == 8


def test_unset_the_shapes_caption_batch_is_the_square_drawing_and_set_its_patches():
    """Unset: the square batch as before (the drawings, normalised by hand); set to the table's 4 x 4 grid: the same
    pixels as patches, none padded."""
    square = ShapesDataModule(img_size=32, num_train=8, num_val=4, num_test=4, batch_size=4)
    patched = ShapesDataModule(
        img_size=32, num_train=8, num_val=4, num_test=4, batch_size=4, max_patches=16, patch_size=8
    )
    for data in (square, patched):
        data.setup("fit")
    drawings = torch.stack([ShapesDataset("val", 4, 32, 0).image(i) for i in range(4)]).float() / 255  # (4, 3, 32, 32)
    mean, std = torch.tensor([0.485, 0.456, 0.406]).view(3, 1, 1), torch.tensor([0.229, 0.224, 0.225]).view(3, 1, 1)
    expected = (drawings - mean) / std
    images = square.ready_batch(next(iter(square.val_dataloader())))["images"]
    torch.testing.assert_close(images, expected, rtol=0, atol=1e-6)
    patches = patched.ready_batch(next(iter(patched.val_dataloader())))["images"]
    assert isinstance(patches, Patches) and patches.valid.all() and patches.patches.shape == (4, 16, 8 * 8 * 3)
    as_patches = expected.reshape(4, 3, 4, 8, 4, 8).permute(0, 2, 4, 3, 5, 1).reshape(4, 16, -1)  # (B, N, P*P*3)
    torch.testing.assert_close(patches.patches, as_patches, rtol=0, atol=1e-6)


@pytest.mark.parametrize("merge", ["2", "[0,2]"])
def test_merging_with_max_patches_is_refused_in_one_line_before_any_data_is_read(merge, tmp_path):
    missing = tmp_path / "no_such_folder"  # a data path that is not there: the refusal comes before it is looked at
    cfg = compose_train(
        ["head=classification", "data=imagefolder", f"data.root={missing}", *TINY, "data.max_patches=6"], tmp_path
    )
    cfg.model.merge_tokens = eval(merge)  # noqa: S307 -- an int or a list, as a command line gives it
    with pytest.raises(ConfigError) as err:
        check_config(cfg)
    assert re.fullmatch(
        r"model\.merge_tokens=\S+ merges padded patches into real ones \(data\.max_patches=6\): set model\.merge_tokens"
        r"=0, or leave data\.max_patches unset",
        str(err.value),
    )
    cfg.model.merge_tokens = 0 if merge == "2" else [0, 0]
    with pytest.raises(ConfigError, match=r"^data\.root="):  # unmerged: the next check, the missing folder
        check_config(cfg)


@pytest.mark.parametrize("pool", ["semi=fixmatch", "bootstrap.teacher=RUN"])
def test_a_pool_of_images_without_labels_with_max_patches_is_refused_in_one_line(pool, tmp_path):
    """semi= and bootstrap.* read their pool images square: refused with data.max_patches, accepted without."""
    missing = tmp_path / "no_such_folder"
    overrides = ["head=classification", "data=imagefolder", f"data.root={missing}", *TINY, pool]
    overrides += ["semi.images=POOL"] if pool.startswith("semi") else []
    with pytest.raises(ConfigError) as err:
        check_config(compose_train([*overrides, "data.max_patches=6"], tmp_path))
    key = "semi=fixmatch" if pool.startswith("semi") else "bootstrap.teacher / bootstrap.candidates"
    assert str(err.value) == (
        f"{key} reads its pool images square; data.max_patches=6 batches images at their own aspect: leave "
        "data.max_patches unset for a run with a pool"
    )
    with pytest.raises(ConfigError) as err:  # without the budget: another check, not this one
        check_config(compose_train(overrides, tmp_path / "square"))
    assert "max_patches" not in str(err.value)
