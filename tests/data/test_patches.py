"""Images to a patch budget (``data.max_patches``): the grid against timm's ``get_image_size_for_seq``, the upright
image resized to it, cut into patches as timm's ``patchify_image`` and padded to a batch; the training crop to the
budget against timm's ``RandomResizedCropToSequence``, draw for draw."""

from __future__ import annotations

import itertools
import random

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data.naflex_transforms import RandomResizedCropToSequence, get_image_size_for_seq, patchify_image
from torchvision import transforms as T
from torchvision.transforms import functional as TF

from tests.helpers.bundles import CAPTION_PREPROCESS
from vitattn.data.images import read_image
from vitattn.data.preprocess import (
    Augment,
    Budget,
    CaptionAugment,
    RandomResizedCropToPatches,
    check_max_patches,
    pad_patches,
    patch_grid,
    patchify,
    resize_to_patches,
)

P = 8
HEIGHTS_WIDTHS = [*itertools.product(range(1, 100, 7), range(1, 100, 9)), (10, 1000), (1000, 10), (8, 4096)]


@pytest.mark.parametrize("max_patches", [4, 7, 16, 30])
def test_the_grid_is_timms_largest_size_for_the_budget(max_patches):
    for height, width in HEIGHTS_WIDTHS:
        _, (h, w) = get_image_size_for_seq((height, width), P, max_patches)
        assert patch_grid(height, width, max_patches) == (h // P, w // P), (height, width)


def test_an_image_past_the_largest_aspect_keeps_one_patch_on_its_short_side():
    assert patch_grid(10, 1000, 16) == (1, 16)
    assert patch_grid(1000, 10, 16) == (16, 1)


def test_the_upright_image_is_resized_to_its_grid(tmp_path):
    stored = Image.new("RGB", (64, 16), (10, 10, 200))  # wide as stored; EXIF turns it tall
    exif = stored.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    stored.save(tmp_path / "rotated.jpg", exif=exif, quality=95)
    image = resize_to_patches(read_image(tmp_path / "rotated.jpg"), P, 16)
    assert image.size == (2 * P, 8 * P)  # (width, height): 2 x 8 patches, the upright aspect 1:4


def test_patches_are_timms_patchify_and_pad_to_the_longest():
    images = [torch.randn(3, 16, 32), torch.randn(3, 8, 8), torch.randn(3, 24, 16)]
    for image in images:
        ours, timms = patchify(image, P), patchify_image(image, (P, P))
        assert torch.equal(ours[0], timms[0]) and torch.equal(ours[1], timms[1])
    batch = pad_patches([patchify(image, P) for image in images])
    assert batch.patches.shape == (3, 8, P * P * 3) and batch.valid.sum(1).tolist() == [8, 1, 6]
    assert torch.equal(batch.patches[1, 1:], torch.zeros(7, P * P * 3)) and not batch.valid[1, 1:].any()
    assert torch.equal(batch.coord[2, :6], patchify_image(images[2], (P, P))[1])


@pytest.mark.parametrize("max_patches", [3, 0, 2.5, True])
def test_a_budget_below_one_row_of_patches_is_refused_in_one_line(max_patches):
    with pytest.raises(ValueError, match=r"^data\.max_patches=\S+ is below one row of patches: at least 4 ") as err:
        check_max_patches(max_patches, img_size=32, patch_size=P)
    assert "\n" not in str(err.value)
    assert check_max_patches(4, img_size=32, patch_size=P) == 4


CROP_CASES = [
    ((48, 200), (0.08, 1.0), (0.75, 4 / 3)),
    ((120, 30), (0.5, 1.0), (0.8, 1.25)),
    ((40, 90), (0.9, 1.0), (2, 3)),
]


@pytest.mark.parametrize(("hw", "scale", "ratio"), CROP_CASES)
def test_the_crop_to_the_budget_is_timms_random_resized_crop_to_sequence(hw, scale, ratio):
    image = torch.randint(0, 256, (3, *hw), dtype=torch.uint8)
    ours = RandomResizedCropToPatches(P, 12, scale, ratio, "bicubic")
    timms = RandomResizedCropToSequence(P, 12, scale, ratio, "bicubic")
    for seed in range(20):  # the third case's ratio excludes the image's own aspect: timm's fallback crop too
        random.seed(seed)
        expected = timms(image)
        random.seed(seed)
        got = ours(image)
        assert got.shape == expected.shape and got.shape[1] * got.shape[2] <= 12 * P * P, seed
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("caption", "flipped"),
    [("a red square left of a blue square", False), ("a red square and a blue square", True)],
)
def test_caption_augmentation_to_the_budget_keeps_the_caption_rules(caption, flipped):
    pixels = np.zeros((16, 48, 3), dtype=np.uint8)
    pixels[:, :24, 0], pixels[:, 24:, 2] = 255, 255  # red left half, blue right half
    image = Image.fromarray(pixels)
    augment = Augment(scale=(1.0, 1.0), ratio=(1.0, 1.0), hflip=1.0, color_jitter=0.5)
    transform = CaptionAugment(32, augment, CAPTION_PREPROCESS, Budget(max_patches=6, patch_size=P))
    # the whole image (scale 1, ratio 1) at its 1 x 3 grid; a flip only without left / right, no jitter (colours)
    resized = TF.resize(image, [P, 3 * P], T.InterpolationMode.BICUBIC, antialias=True)
    expected = patchify(TF.pil_to_tensor(TF.hflip(resized) if flipped else resized), P)
    for _ in range(5):
        patches, coord = transform(image, [caption])
        assert torch.equal(patches, expected[0]) and torch.equal(coord, expected[1])
