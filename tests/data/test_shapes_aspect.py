"""The shapes at other aspects (``max_aspect``, issue 69's variant): frames, order along the long side, spacing, the
patches an object keeps at the measured budget, and the three arms' images (native, squash, centre crop)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from vitattn.data.preprocess import patch_grid, resize_to_patches
from vitattn.data.shapes import (
    ASPECT_SIZES,
    BACKGROUND,
    COLOURS,
    SQUARE,
    ShapesDataset,
    generate_aspect_scene,
    generate_scene,
    render_scene,
)
from vitattn.training.datamodules import ShapesDataModule

IMG, PATCH, BUDGET = 64, 8, 64  # the size the aspect benchmark measures at (docs/benchmarks.md)
_PHRASE = r"a (small|large) (\w+) (circle|square|triangle)"


def _blobs(image: torch.Tensor, long_axis: int) -> list[tuple[str, int, int, int]]:
    """The shapes of a (3, H, W) uint8 image from its pixels: (colour, start and end along ``long_axis`` (1 rows,
    2 columns), extent across), in order along the long axis. A pixel belongs to a shape when it is over half
    way from the background to that shape's colour; columns (rows) of no shape separate the shapes; its colour is
    the one most of its pixels are nearest."""
    pixels = image.permute(1, 2, 0).numpy().astype(int)  # (H, W, 3)
    half = min(np.abs(np.subtract(c, BACKGROUND)).sum() for c in COLOURS.values()) / 2
    ink = np.abs(pixels - BACKGROUND).sum(-1) > half  # (H, W)
    along = ink.any(axis=2 - long_axis)  # a line across the long axis holding any ink
    edges = np.flatnonzero(np.diff(np.concatenate([[0], along.astype(int), [0]])))  # starts, ends
    found = []
    for start, end in zip(edges[::2], edges[1::2]):
        part = ink[:, start:end] if long_axis == 2 else ink[start:end, :]
        inked = (pixels[:, start:end] if long_axis == 2 else pixels[start:end, :])[part]  # (k, 3)
        table = np.array(list(COLOURS.values()))  # (colours, 3)
        nearest = np.abs(inked[:, None] - table[None]).sum(-1).argmin(1)  # (k,)
        colour = list(COLOURS)[np.bincount(nearest).argmax()]
        across = np.flatnonzero(part.any(axis=long_axis - 1))
        found.append((colour, int(start), int(end), int(across[-1] - across[0] + 1)))
    return found


def test_aspect_scene_image_is_its_drawn_frame_wide_or_tall():
    data = ShapesDataset("train", 80, IMG, max_aspect=4)
    aspects, tall = [], []
    for i in range(len(data)):
        _, height, width = data.image(i).shape
        short, long = min(height, width), max(height, width)
        assert short == IMG and long % 4 == 0  # 64 px short side, the long side 64 * (1 + k/16)
        assert long == round(IMG * max(data.frames[i])) and (height > width) == data.frames[i].tall
        aspects.append(long / short)
        tall.append(height > width)
    assert min(aspects) >= 1 and max(aspects) <= 4 and max(aspects) > 3.5 and 0.3 < np.mean(tall) < 0.7


def test_aspect_scene_order_word_follows_the_long_side():
    data = ShapesDataset("val", 60, IMG, max_aspect=4)
    relations = set()
    for i in range(len(data)):
        image, caption = data.image(i), data.caption(i)
        tall = image.shape[1] > image.shape[2]
        words = re.split(_PHRASE, caption)[4::4][:-1]  # the text between two phrases
        relations |= {w.strip() for w in words}
        assert all(w.strip() == ("above" if tall else "left of") for w in words), caption
        # the colours read from the pixels, in order along the long side, are the caption's
        colours = [colour for colour, *_ in _blobs(image, 1 if tall else 2)]
        assert colours == [m.group(2) for m in re.finditer(_PHRASE, caption)], (i, caption)
        assert data.references(i)[-1].count("right of" if not tall else "below") == len(words)
    assert relations == {"left of", "above"}


def test_aspect_scene_objects_do_not_overlap_and_keep_two_patches_a_side_at_the_budget():
    """Each shape is its own run of columns (rows) with free space between, and, resized to 64 patches of 8 px as
    the native arm sees it, spans at least 2 patches each way (the short side holds 4 patches at 4:1: 4 x 16)."""
    assert patch_grid(IMG, 4 * IMG, BUDGET) == (4, 16) and ASPECT_SIZES["small"] * 4 == 2
    data = ShapesDataset("test", 60, IMG, max_aspect=4)
    counts = set()
    for i in range(len(data)):
        tall = data.frames[i].tall
        blobs = _blobs(data.image(i), 1 if tall else 2)
        assert len(blobs) == len(data.scenes[i]), data.caption(i)  # a shape touching another would merge
        counts.add(len(blobs))
        native = resize_to_patches(data.image(i), PATCH, BUDGET)  # (3, rows * 8, cols * 8)
        assert native.shape[1] * native.shape[2] <= BUDGET * PATCH * PATCH
        for _, start, end, across in _blobs(native, 1 if tall else 2):
            assert min(end - start, across) >= 2 * PATCH - 1, (i, data.caption(i))  # less an antialiased pixel
    assert counts == {1, 2, 3}


def test_aspect_scene_is_a_pure_function_and_one_gives_the_squares():
    a = [generate_aspect_scene(3, "train", i, 4) for i in range(20)]
    assert a == [generate_aspect_scene(3, "train", i, 4) for i in range(20)]
    assert a != [generate_aspect_scene(3, "val", i, 4) for i in range(20)]
    squares = ShapesDataset("train", 20, 32, seed=3, max_aspect=1)
    assert squares.frames == [SQUARE] * 20 and squares.scenes == [generate_scene(3, "train", i) for i in range(20)]
    for i in range(20):
        expected = np.array(render_scene(generate_scene(3, "train", i), 32))  # (32, 32, 3)
        assert torch.equal(squares.image(i), torch.from_numpy(expected).permute(2, 0, 1))


@pytest.mark.parametrize("value", [0.5, 20, "wide", True])
def test_aspect_bad_max_aspect_is_refused_in_one_line(value):
    with pytest.raises(ValueError, match=rf"max_aspect={value!r} must be a number from 1 \(squares\) to 16"):
        ShapesDataModule(max_aspect=value)


def _arm(**kwargs) -> tuple[ShapesDataset, ShapesDataModule]:
    dm = ShapesDataModule(task="classification", img_size=IMG, num_train=0, num_val=0, num_test=6, **kwargs)
    dm.setup("test")
    return ShapesDataset("test", 6, IMG, max_aspect=4), dm


def test_aspect_arms_native_squash_and_centre_crop_see_what_they_say():
    drawn, squash = _arm(max_aspect=4, patch_size=PATCH)
    _, centre = _arm(max_aspect=4, patch_size=PATCH, crop_mode="center")
    _, native = _arm(max_aspect=4, patch_size=PATCH, max_patches=BUDGET)
    for i in range(len(drawn)):
        image = drawn.image(i)  # (3, 64, long) or (3, long, 64)
        _, height, width = image.shape
        squashed, cropped = squash.test_dataset[i][0], centre.test_dataset[i][0]
        assert squashed.shape == cropped.shape == (3, IMG, IMG)
        top, left = (height - IMG) // 2, (width - IMG) // 2
        torch.testing.assert_close(cropped, image[:, top : top + IMG, left : left + IMG], atol=1, rtol=0)
        tall = height > width
        assert len(_blobs(squashed, 1 if tall else 2)) == len(drawn.scenes[i])  # the whole frame, squashed
        patches = native.test_dataset[i][0]
        rows, cols = patch_grid(height, width, BUDGET)
        assert patches.coord[-1].tolist() == [rows - 1, cols - 1] and len(patches.patches) == rows * cols <= BUDGET
        assert (rows > cols) == tall or rows == cols
