"""vitattn-serve with a ``data.max_patches`` model: a batch of mixed-aspect requests captioned with the padding
mask, each as the image alone (``Captioner``)."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from tests.helpers.bundles import CAPTION_PREPROCESS, distinct, make_caption_bundle
from vitattn.inference.api import Captioner

pytest.importorskip("litserve")
pytest.importorskip("multipart", reason="python-multipart (the serve extra) parses uploaded files")
from vitattn.serve import CaptionAPI  # noqa: E402 - needs litserve


class _Upload:
    def __init__(self, path) -> None:
        self.file = io.BytesIO(path.read_bytes())


def test_a_batch_of_mixed_aspects_is_captioned_as_each_image_alone(tmp_path):
    bundle = make_caption_bundle(tmp_path / "bundle", {**CAPTION_PREPROCESS, "max_patches": 12, "patch_size": 8})
    rng, paths = np.random.default_rng(5), []
    for i, (w, h) in enumerate([(96, 24), (20, 60), (40, 40), (120, 16)]):
        pixels = np.zeros((h, w, 3), dtype=np.uint8)
        pixels[:, : w // 2], pixels[:, w // 2 :] = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        Image.fromarray(pixels).save(tmp_path / f"{i}.png")
        paths.append(tmp_path / f"{i}.png")
    api = CaptionAPI(str(bundle), max_image_bytes=100_000, max_batch_size=4)
    api.setup("cpu")
    outputs = api.unbatch(api.predict(api.batch([api.decode_request({"image": _Upload(p)}) for p in paths])))
    alone = [Captioner.load(bundle).caption(p) for p in paths]
    assert [o["caption"] for o in outputs] == alone and distinct(alone, at_least=3)
