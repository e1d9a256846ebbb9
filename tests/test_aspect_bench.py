"""The aspect bench (``python -m benchmarks aspect``): its arms compose into the crops they name, the valid tokens
it reports, and the stamps prepared without padding."""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import hydra
import pytest
import torch
from PIL import Image, ImageDraw

from benchmarks import aspect_bench, learning_bench, learning_data
from tests.helpers.runs import compose_train

ARGS = argparse.Namespace(img_size=64, patch_size=8, max_aspect=4.0, num_train=0)


def test_aspect_on_white_keeps_the_aspect_without_padding():
    image = Image.new("RGBA", (60, 20), (0, 0, 0, 0))
    ImageDraw.Draw(image).rectangle((10, 5, 29, 14), fill=(255, 0, 0, 255))  # a 20 x 10 red bar
    out = learning_data.aspect_on_white(image, 16)
    assert out.mode == "RGB" and out.size == (16, 8)  # the bar's 2:1, its longer side 16
    assert all(out.getpixel(xy)[0] > 200 and out.getpixel(xy)[1] < 60 for xy in [(0, 0), (15, 7), (8, 4)])  # no pad
    see_through = learning_data.aspect_on_white(Image.new("RGBA", (30, 10), (0, 0, 0, 0)), 12)
    assert see_through.size == (12, 4) and see_through.getpixel((0, 0)) == (255, 255, 255)  # flattened on white


@pytest.mark.parametrize("arm", ["native", "squash", "centre", "square"])
def test_aspect_arms_compose_into_their_crops(arm, tmp_path):
    cfg = learning_bench.BenchConfig(steps=3, img_size=64, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    source = aspect_bench._source("shapes", "classification", arm, ARGS, 64, None, cfg)
    overrides = learning_bench.vitattn_overrides("classification", None, cfg, tmp_path, source)
    composed = compose_train([o for o in overrides if not o.startswith("hydra.")], tmp_path / "run")
    composed.data.num_val, composed.data.num_test = 0, 4
    data = hydra.utils.instantiate(composed.data)
    data.setup("test")
    for i in range(4):
        image = data.test_dataset[i][0]
        if arm == "native":  # the frame's own grid within 64 patches
            assert len(image.patches) <= 64 and image.patches.shape[1] == 8 * 8 * 3
        else:
            assert tuple(image.shape) == (3, 64, 64)
    assert (data.max_aspect, data.preprocess.get("max_patches")) == {
        "native": (4.0, 64),
        "squash": (4.0, None),
        "centre": (4.0, None),
        "square": (1.0, None),
    }[arm]
    assert data.preprocess["crop_mode"] == ("center" if arm == "centre" else "squash")


def test_valid_tokens_count_each_grid_by_hand(tmp_path):
    for i, size in enumerate([(256, 64), (64, 256), (256, 128), (200, 200)]):  # (width, height)
        (tmp_path / "val" / "c").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", size, (255, 255, 255)).save(tmp_path / "val" / "c" / f"{i}.png")
    data = SimpleNamespace(root=tmp_path)
    tokens = aspect_bench.valid_tokens("tuxpaint", "native", ARGS, 64, data)
    # 4:1 and 1:4 at 64 patches: 4 x 16 = 64; 2:1: 5 x 10 = 50 (6 x 12 = 72 is over); 1:1: 8 x 8 = 64
    assert tokens == dict(mean=(64 + 64 + 50 + 64) / 4, min=50, max=64)
    assert aspect_bench.valid_tokens("tuxpaint", "squash", ARGS, 64, data) == dict(mean=64, min=64, max=64)
    shapes = aspect_bench.valid_tokens("shapes", "native", ARGS, 64, None)
    assert shapes["max"] == 64 and 40 <= shapes["min"] and shapes["mean"] < 64


@pytest.mark.parametrize("arm", ["native", "squash", "centre"])
def test_aspect_arms_on_a_folder_see_the_whole_image_or_its_centre(arm, tmp_path):
    """A 4:1 image, a red quarter, a shaded green half, a blue quarter: squashed it keeps red and blue at its
    ends, its centre square is green alone, at its own aspect it is a 4 x 16 grid (64 patches); untransformed
    by augmentation, as it is scored."""
    image = Image.new("RGB", (128, 32), (0, 200, 0))
    for x in range(32, 96):  # the green half shaded along x, so that any other crop of it differs
        ImageDraw.Draw(image).line((x, 0, x, 31), fill=(0, 200, x - 32))
    ImageDraw.Draw(image).rectangle((0, 0, 31, 31), fill=(200, 0, 0))
    ImageDraw.Draw(image).rectangle((96, 0, 127, 31), fill=(0, 0, 200))
    for split in ("train", "val"):
        (tmp_path / split / "c").mkdir(parents=True)
        image.save(tmp_path / split / "c" / "wide.png")
    cfg = learning_bench.BenchConfig(steps=3, img_size=64, patch_size=8, embed_dim=16, depth=1, num_heads=2)
    data = SimpleNamespace(root=tmp_path)
    source = aspect_bench._source("tuxpaint", "classification", arm, ARGS, 64, data, cfg)
    overrides = learning_bench.vitattn_overrides("classification", data, cfg, tmp_path / "run", source)
    composed = compose_train([o for o in overrides if not o.startswith("hydra.")], tmp_path / "run")
    datamodule = hydra.utils.instantiate(composed.data)
    datamodule.setup("fit")
    seen = datamodule.train_dataset[0][0]
    scored = datamodule.val_dataset[0][0]
    assert all(torch.equal(a, b) for a, b in zip(seen, scored)) if arm == "native" else torch.equal(seen, scored)
    if arm == "native":
        assert seen.coord[-1].tolist() == [3, 15] and len(seen.patches) == 64
        return
    assert tuple(seen.shape) == (3, 64, 64)
    left, right = seen[:, 32, 0].tolist(), seen[:, 32, 63].tolist()
    if arm == "squash":
        assert left[0] > 150 > left[1] and right[2] > 150 > right[1]
    else:
        assert left[1] > 150 > left[0] and right[1] > 150 > right[2]
