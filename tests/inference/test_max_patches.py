"""Bundles of models trained with ``data.max_patches``: the bundle records the budget (version 2, which an older
reader refuses), the Python API and ``vitattn-caption`` batch mixed-aspect images with the padding mask, each image's
caption and logits as the image's alone (ONNX folders of these models: tests/bundle/test_onnx_patches.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from tests.helpers.bundles import CAPTION_PREPROCESS, distinct, make_caption_bundle, make_classifier_bundle
from tests.helpers.images import two_colour_images
from vitattn.bundle import BUNDLE_VERSION, load_model
from vitattn.bundle.folder import BUNDLE_FORMAT, read_config
from vitattn.cli.caption import main as caption_main
from vitattn.cli.evaluate import main as eval_main
from vitattn.data.preprocess import describe, patch_grid
from vitattn.inference.api import Captioner, Classifier
from vitattn.metrics import compute_caption_metrics
from vitattn.models.vit import Patches

PATCHES = {**CAPTION_PREPROCESS, "max_patches": 12, "patch_size": 8}
SIZES = [(96, 24), (20, 60), (40, 40), (70, 30), (33, 47), (120, 16)]  # (width, height)


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("mixed")
    for i, image in enumerate(two_colour_images(SIZES, seed=3)):
        image.save(folder / f"{i}.png")
    return folder


@pytest.fixture(scope="module")
def captioner(tmp_path_factory):
    return make_caption_bundle(tmp_path_factory.mktemp("bundle") / "caption", PATCHES)


def test_a_mixed_batch_captions_each_image_as_alone(captioner, images):
    model = Captioner.load(captioner)
    paths = [images / f"{i}.png" for i in range(len(SIZES))]
    pixels = model.pixels(paths)
    assert isinstance(pixels, Patches)  # each at its own grid, padded to the longest
    assert pixels.valid.sum(1).tolist() == [r * c for r, c in (patch_grid(h, w, 12) for w, h in SIZES)]
    together = model.caption(paths, num_beams=2)
    alone = [model.caption(path, num_beams=2) for path in paths]
    assert together == alone and distinct(together, at_least=3)


def test_a_mixed_batch_classifies_each_image_as_alone(tmp_path, images):
    model = Classifier.load(make_classifier_bundle(tmp_path / "classify", preprocess=PATCHES))
    paths = [images / f"{i}.png" for i in range(len(SIZES))]
    together = model.logits(paths)
    alone = torch.cat([model.logits([path]) for path in paths])
    torch.testing.assert_close(together, alone, rtol=0, atol=1e-5)


def test_vitattn_caption_on_a_folder_of_mixed_aspects_writes_each_images_own_caption(captioner, images, tmp_path):
    out = tmp_path / "captions.jsonl"
    args = [f"model={captioner}", f"images={images}", f"out={out}", "num_workers=0", "progress=false", "batch_size=4"]
    assert caption_main(args) == 0
    rows = {row["image"]: row["caption"] for row in map(json.loads, out.read_text().splitlines())}
    model = Captioner.load(captioner)
    assert len(rows) == len(SIZES)
    assert rows == {path: model.caption(path) for path in rows} and distinct(list(rows.values()), at_least=3)


def test_the_bundle_records_the_budget_in_a_version_an_older_reader_refuses(captioner, tmp_path):
    config = json.loads((captioner / "config.json").read_text())
    assert config["version"] == 2 and config["preprocess"]["max_patches"] == 12
    assert load_model(captioner).preprocess["max_patches"] == 12
    with pytest.raises(ValueError, match=r"has version=2; this vitattn reads version 1$"):  # the older reader's check
        read_config(captioner / "config.json", "vitattn bundle config", BUNDLE_FORMAT, BUNDLE_VERSION)
    square = json.loads((make_caption_bundle(tmp_path / "square") / "config.json").read_text())
    assert square["version"] == 1 and "max_patches" not in square["preprocess"]


def test_the_card_and_the_run_log_name_the_budget_instead_of_a_crop(captioner):
    line = describe(load_model(captioner).preprocess)
    assert line == (
        "mean (0.5, 0.5, 0.5) std (0.5, 0.5, 0.5) [Inception 0.5], bicubic, each image at its own aspect ratio, "
        "max_patches 12 of 8 px (positions of 32 px)"
    )


def test_vitattn_eval_scores_a_folder_of_mixed_aspects_as_each_image_alone(images, tmp_path):
    bundle = make_classifier_bundle(tmp_path / "classify", class_names=("cat", "dog"), preprocess=PATCHES)
    files = sorted(images.glob("*.png"))
    for k, path in enumerate(files):  # cat: the first half, dog: the second
        (tmp_path / "data" / "val" / ("cat", "dog")[k * 2 // len(files)]).mkdir(parents=True, exist_ok=True)
        (tmp_path / "data" / "val" / ("cat", "dog")[k * 2 // len(files)] / path.name).write_bytes(path.read_bytes())
    args = [f"model={bundle}", f"data_root={tmp_path / 'data'}", "split=val", f"out={tmp_path / 'out'}"]
    assert eval_main([*args, "num_workers=0", "progress=false", "batch_size=4"]) == 0
    model = Classifier.load(bundle)
    labels = [k * 2 // len(files) for k in range(len(files))]
    hits = [int(model.logits([path]).argmax()) == label for path, label in zip(files, labels)]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    assert metrics["num_images"] == len(files) and metrics["top1"] == pytest.approx(sum(hits) / len(hits))


def test_vitattn_eval_scores_captions_of_mixed_aspects_as_each_images_caption_alone(captioner, images, tmp_path):
    """Captions generated in batches of 4 mixed-aspect images, scored against a COCO file: each image's caption the
    one it gets alone, the metrics those of the captions made alone (the scorer's own function as the oracle)."""
    files = [f"{i}.png" for i in range(len(SIZES))]
    references = [[f"caption {i} of a shape", f"a shape {i}"] for i in range(len(files))]
    coco = {
        "images": [{"id": 10 + i, "file_name": name} for i, name in enumerate(files)],
        "annotations": [
            {"id": 100 * i + k, "image_id": 10 + i, "caption": ref}
            for i, refs in enumerate(references)
            for k, ref in enumerate(refs)
        ],
    }
    (tmp_path / "refs.json").write_text(json.dumps(coco))
    args = [f"model={captioner}", f"references={tmp_path / 'refs.json'}", f"image_dir={images}"]
    assert eval_main([*args, f"out={tmp_path / 'out'}", "num_workers=0", "progress=false", "batch_size=4"]) == 0
    model = Captioner.load(captioner)
    alone = [model.caption(images / name) for name in files]
    rows = [json.loads(line) for line in (tmp_path / "out" / "captions.jsonl").read_text().splitlines()]
    assert {row["image_id"]: row["caption"] for row in rows} == {10 + i: c for i, c in enumerate(alone)}
    assert distinct(alone, at_least=3)
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    expected = compute_caption_metrics(alone, references)
    assert metrics["num_images"] == len(files)
    assert {k: metrics[k] for k in expected} == pytest.approx(expected, rel=1e-12)


def test_attention_maps_of_a_max_patches_model_are_at_each_images_grid_and_aspect(captioner, images, tmp_path):
    """``Captioner.attention_maps`` of a wide image: maps at its own grid, the image shown as the model saw it (its
    grid's pixels, resized by hand and normalised there and back), the figure's panels at its aspect; and
    ``vitattn-caption attention_maps=DIR`` draws a folder of mixed aspects."""
    model = Captioner.load(captioner)
    maps = model.attention_maps(images / "0.png")  # 96 x 24 px
    rows, cols = patch_grid(24, 96, 12)  # 2 x 6
    assert cols > 2 * rows and maps.cross.shape == (len(maps.words), rows, cols) and maps.rollout.shape == (rows, cols)
    torch.testing.assert_close(maps.cross.sum((-2, -1)), torch.ones(len(maps.words)))
    seen = Image.open(images / "0.png").convert("RGB").resize((cols * 8, rows * 8), Image.BICUBIC)
    expected = torch.from_numpy(np.array(seen)).permute(2, 0, 1).float() / 255  # (3, rows*8, cols*8)
    torch.testing.assert_close(maps.image, expected, rtol=0, atol=1e-5)
    panel = maps.figure().axes[1].images[1].get_array()  # the first word's overlay, at the image's pixels
    assert panel.shape == (rows * 8, cols * 8)
    args = [f"model={captioner}", f"images={images}", f"out={tmp_path / 'c.jsonl'}", f"attention_maps={tmp_path}"]
    assert caption_main([*args, "num_workers=0", "progress=false", "batch_size=4"]) == 0
    assert sorted(p.name for p in tmp_path.glob("?.png")) == [f"{i}.png" for i in range(len(SIZES))]


def test_a_mixed_batchs_candidates_are_each_images_alone(captioner, images):
    model = Captioner.load(captioner)
    paths = [images / f"{i}.png" for i in range(len(SIZES))]
    together = model.caption(paths, num_return_sequences=2, num_beams=3)
    assert together == [model.caption([path], num_return_sequences=2, num_beams=3)[0] for path in paths]
    assert distinct([tuple(c) for c in together], at_least=3)
