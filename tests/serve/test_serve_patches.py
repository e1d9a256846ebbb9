"""``vitattn-serve`` of a ``data.max_patches`` model: a LitServe batch of mixed-aspect images captioned in groups of
similar patch counts (``length_groups``), each answer the image's caption alone."""

from __future__ import annotations

import base64
import io
from unittest import mock

import pytest
from PIL import Image

from tests.helpers.bundles import CAPTION_PREPROCESS, distinct, make_caption_bundle
from tests.helpers.images import two_colour_images
from vitattn.data.preprocess import patch_grid
from vitattn.inference.api import Captioner

pytest.importorskip("litserve")
from vitattn.serve.api import CaptionAPI, length_groups  # noqa: E402 - needs litserve

SIZES = [(96, 24), (20, 60), (40, 40), (8, 120), (70, 30), (16, 16), (120, 16)]  # (width, height)
BUDGET = 12


class _Upload:
    """A multipart upload as starlette hands it over: the file's bytes behind ``.file``."""

    def __init__(self, path) -> None:
        self.file = io.BytesIO(path.read_bytes())


def _padding(lengths: list[int]) -> float:
    """The padded share of a batch of ``lengths`` padded to its longest, by hand."""
    return 1 - sum(lengths) / (max(lengths) * len(lengths))


def test_length_groups_keep_each_groups_padding_within_the_limit_longest_first():
    lengths = [16, 8, 15, 4, 14]
    assert length_groups(lengths) == [[0, 2, 4], [1], [3]]  # 16 15 14: 6.25 % padded; 8 with them: 17 %
    assert length_groups([9, 9, 9]) == [[0, 1, 2]]  # square images: one group, in request order
    assert length_groups(lengths, max_padding=0.2) == [[0, 2, 4, 1], [3]]  # 8 joins (17 %), 4 would make it 29 %
    for limit in (0.1, 0.2, 0.3):
        groups = length_groups(lengths, limit)
        assert sorted(i for g in groups for i in g) == list(range(5))
        assert all(_padding([lengths[i] for i in g]) <= limit for g in groups)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    folder = tmp_path_factory.mktemp("served")
    for i, image in enumerate(two_colour_images(SIZES, seed=5)):
        image.save(folder / f"{i}.png")
    preprocess = {**CAPTION_PREPROCESS, "max_patches": BUDGET, "patch_size": 8}
    return make_caption_bundle(folder / "bundle", preprocess), folder


def test_a_batch_of_mixed_aspects_is_captioned_in_groups_of_similar_lengths_each_as_alone(served):
    bundle, folder = served
    api = CaptionAPI(str(bundle), max_batch_size=len(SIZES) + 1)
    api.setup("cpu")
    paths = [folder / f"{i}.png" for i in range(len(SIZES))]
    requests = [
        {"image": base64.b64encode(p.read_bytes()).decode(), "attention": str(i == 3)} for i, p in enumerate(paths)
    ]
    requests.insert(2, {"image": "not base64!"})  # a bad request keeps its place and fails alone
    calls = []
    spy = mock.patch.object(api.captioner, "caption_pixels", wraps=api.captioner.caption_pixels)
    with spy as caption_pixels:
        outputs = api.predict(api.batch([api.decode_request(r) for r in requests]))
        calls = [call.args[0].valid.sum(1).tolist() for call in caption_pixels.call_args_list]
    lengths = [r * c for r, c in (patch_grid(h, w, BUDGET) for w, h in SIZES)]
    assert sorted(n for call in calls for n in call) == sorted(lengths) and len(calls) > 1
    assert all(_padding(call) <= 0.1 for call in calls) and _padding(lengths) > 0.1  # all at once: more padding
    assert outputs.pop(2) == {"error": "'image' is not valid base64"}
    alone = [Captioner.load(bundle).caption(p) for p in paths]
    assert [out["caption"] for out in outputs] == alone and distinct(alone, at_least=3)
    png = base64.b64decode(outputs[3]["attention"].removeprefix("data:image/png;base64,"))
    assert Image.open(io.BytesIO(png)).format == "PNG" and all(
        "attention" not in o for i, o in enumerate(outputs) if i != 3
    )


def test_an_onnx_folder_of_a_max_patches_model_is_served_in_groups_each_answer_the_pytorch_models_alone(
    served, tmp_path
):
    pytest.importorskip("onnxruntime")
    from vitattn.bundle import load_model
    from vitattn.bundle.onnx_export import export_onnx

    bundle, folder = served
    onnx_folder = export_onnx(load_model(bundle), tmp_path / "onnx")
    api = CaptionAPI(str(onnx_folder), max_batch_size=len(SIZES))
    api.setup("cpu")
    paths = [folder / f"{i}.png" for i in range(len(SIZES))]
    requests = [{"image": _Upload(p)} for p in paths]  # multipart uploads, as `curl -F image=@x.png` sends
    with mock.patch.object(api.captioner, "caption_pixels", wraps=api.captioner.caption_pixels) as caption_pixels:
        outputs = api.predict(api.batch([api.decode_request(r) for r in requests]))
    assert caption_pixels.call_count > 1  # grouped by length on the ONNX runtime too
    alone = [Captioner.load(bundle).caption(p) for p in paths]  # PyTorch, each image alone
    assert [out["caption"] for out in outputs] == alone and distinct(alone, at_least=3)
