"""vitattn.data.preprocess against timm: the evaluation transform, written without timm (so captioning imports none),
gives timm's ``create_transform`` tensors bit for bit, for every crop mode, odd sizes and aspect ratios."""

import numpy as np
import pytest
import torch
from PIL import Image
from timm.data import create_transform

from vitattn.data.preprocess import eval_transform

MEAN, STD = (0.5, 0.4, 0.3), (0.2, 0.3, 0.25)


@pytest.mark.parametrize("crop_mode", [None, "center", "squash", "border"])
@pytest.mark.parametrize("normalize", [True, False])
def test_eval_transform_is_timms_create_transform(crop_mode, normalize):
    rng = np.random.default_rng(0)
    images = [
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in [(50, 81), (97, 40), (33, 33)]
    ]
    for crop_pct, interpolation, size in [(1.0, "bicubic", 32), (0.875, "bilinear", 37), (0.9, "lanczos", 24)]:
        preprocess = dict(
            img_size=size, crop_pct=crop_pct, crop_mode=crop_mode, interpolation=interpolation, mean=MEAN, std=STD
        )
        ours = eval_transform(preprocess, normalize=normalize)
        timms = create_transform(
            input_size=size,
            is_training=False,
            use_prefetcher=not normalize,
            crop_pct=crop_pct,
            crop_mode=crop_mode,
            mean=MEAN,
            std=STD,
            interpolation=interpolation,
        )
        for image in images:
            a, b = ours(image), timms(image)
            case = f"{preprocess} normalize={normalize} image {image.size}"
            assert a.dtype == b.dtype and a.shape == b.shape == (3, size, size), case
            torch.testing.assert_close(a, b, rtol=0, atol=0, msg=case)


def test_eval_transform_refuses_an_interpolation_timm_does_not_name():
    preprocess = dict(img_size=32, crop_pct=1.0, interpolation="nearest-exact", mean=MEAN, std=STD)
    with pytest.raises(ValueError, match=r"^preprocess: interpolation='nearest-exact' is unknown; try bicubic$"):
        eval_transform(preprocess)
