"""ONNX folders of ``data.max_patches`` models: the image graphs take patches, their coordinates and validity with a
dynamic patch axis; a mixed-aspect batch on ONNX Runtime gives each image what PyTorch gives it alone (the oracle:
no padding at all), its encoder output, logits, decoder steps and greedy and beam captions; the folder's version
(3) refused by an older reader, older folders read, a newer one refused in one line.

Dimension letters: B images, N image tokens, H heads, d head width, V vocabulary.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from tests.helpers.bundles import CAPTION_PREPROCESS, distinct, make_caption_bundle, make_classifier_bundle
from tests.helpers.images import two_colour_images
from tests.helpers.onnx import check_int8_graphs, record_kept_fp32
from vitattn.bundle import load_model
from vitattn.bundle.folder import read_config
from vitattn.bundle.onnx_export import export_onnx
from vitattn.bundle.onnx_folder import (
    CROSS_VALID,
    ONNX_CONFIG_FILE,
    ONNX_FORMAT,
    ONNX_PATCHES_VERSION,
    ONNX_VERSION,
    ONNX_VERSIONS,
    PATCH_INPUTS,
    image_feed,
    kv_names,
)
from vitattn.data.preprocess import batch_images, patch_grid
from vitattn.inference.api import Captioner, Classifier

pytest.importorskip("onnxruntime")

BUDGET = 16
PATCHES = {**CAPTION_PREPROCESS, "max_patches": BUDGET, "patch_size": 8}
SIZES = [(32, 16), (16, 32), (32, 32), (24, 8), (40, 24), (8, 40)]  # (width, height): wide, tall, square


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """The captioner's and the classifier's bundles and fp32 ONNX folders, exported once for the module."""
    root = tmp_path_factory.mktemp("patches")
    caption = make_caption_bundle(root / "caption", PATCHES)
    classify = make_classifier_bundle(root / "cls", preprocess=PATCHES)
    caption_onnx, classify_onnx = (export_onnx(load_model(b), root / f"{b.name}.onnx") for b in (caption, classify))
    return caption, caption_onnx, classify, classify_onnx


@pytest.fixture(scope="module")
def images():
    return two_colour_images(SIZES, seed=3)


def _alone(model, image):
    """The PyTorch input of one image: its own patches, no padding."""
    return batch_images([model.transform(image)])


def test_each_images_encoder_output_and_logits_on_onnx_equal_pytorchs_for_it_alone(folders, images):
    caption, caption_onnx, classify, classify_onnx = folders
    torch_model, onnx_model = load_model(caption, precision="fp32"), load_model(caption_onnx)
    batch = Captioner.load(caption_onnx).pixels(images)  # the ONNX runtime's own preprocessing
    assert [int(n) for n in batch.valid.sum(1)] == [r * c for r, c in (patch_grid(h, w, BUDGET) for w, h in SIZES)]
    assert len(set(batch.valid.sum(1).tolist())) > 2  # grids of several lengths: padding in the batch
    outputs = onnx_model.model.encoder_session.run(None, image_feed(batch))
    L = len(torch_model.model.decoder.layers)
    for i, image in enumerate(images):
        with torch.no_grad():
            memory = torch_model.model.encode(_alone(torch_model, image))  # (1, N, D): all valid
        n = memory.tokens.shape[1]
        assert outputs[-1][i].tolist() == [True] * n + [False] * (outputs[-1].shape[1] - n)  # cross_valid
        for layer, (kt, v) in zip(torch_model.model.decoder.layers, zip(outputs[: 2 * L : 2], outputs[1 : 2 * L : 2])):
            k_alone, v_alone = layer.mha2.project_kv(memory.tokens, memory.tokens)  # (1, H, N, d) each
            torch.testing.assert_close(
                torch.from_numpy(kt[i, :, :, :n]), k_alone[0].transpose(1, 2).detach(), atol=1e-5, rtol=0
            )
            torch.testing.assert_close(torch.from_numpy(v[i, :, :n]), v_alone[0].detach(), atol=1e-5, rtol=0)
    torch_classifier = load_model(classify, precision="fp32")
    logits = Classifier.load(classify_onnx).logits(images)  # (B, classes), one mixed batch
    with torch.no_grad():
        alone = torch.cat([torch_classifier.model(_alone(torch_classifier, image)) for image in images])
    torch.testing.assert_close(logits, alone, atol=1e-5, rtol=0)
    distinct(logits.argmax(1).tolist(), at_least=2)


@pytest.mark.parametrize("num_beams", [1, 2])
def test_a_mixed_batchs_captions_on_onnx_are_pytorchs_for_each_image_alone(folders, images, num_beams):
    caption, caption_onnx = folders[:2]
    torch_model, onnx_model = load_model(caption, precision="fp32"), load_model(caption_onnx)
    batch = Captioner.load(caption_onnx).pixels(images)
    tokens = onnx_model.model.generate(batch, num_beams=num_beams)  # (B, T')
    alone = [torch_model.model.generate(_alone(torch_model, image), num_beams=num_beams)[0] for image in images]
    for row, own in zip(tokens, alone):
        assert row[row != 0].tolist() == own[own != 0].tolist()  # pad id 0 after <eos>
    distinct([tuple(t.tolist()) for t in tokens], at_least=3)


def test_each_decoder_step_over_a_mixed_batch_masks_the_padded_image_tokens(folders, images):
    """Step logits (the cross-attention's mask, step by step through the cache), not only the argmax."""
    caption, caption_onnx = folders[:2]
    torch_model, onnx_model = load_model(caption, precision="fp32"), load_model(caption_onnx)
    batch = Captioner.load(caption_onnx).pixels(images)
    generated = onnx_model.model.generate(batch)  # (B, T')
    bos = torch.full((len(images), 1), torch_model.model.decoder.bos_id)
    tokens = torch.cat([bos, generated], dim=1)[:, :4]  # (B, 4)
    step = onnx_model.model.decode_step(onnx_model.model.encode(batch), 4)
    logits = torch.stack([step(tokens[:, : t + 1]) for t in range(4)], dim=1)  # (B, 4, V)
    for i, image in enumerate(images):
        with torch.no_grad():
            own = torch_model.model.decode_step(torch_model.model.encode(_alone(torch_model, image)), 4)
            expected = torch.stack([own(tokens[i : i + 1, : t + 1])[0] for t in range(4)])  # (4, V)
        torch.testing.assert_close(logits[i], expected, atol=1e-5, rtol=0)


def test_the_graphs_take_patches_coordinates_and_validity_on_a_dynamic_patch_axis(folders):
    import onnx

    caption_onnx, classify_onnx = folders[1], folders[3]
    for graph in (caption_onnx / "encoder.onnx", classify_onnx / "classifier.onnx"):
        inputs = onnx.load(graph).graph.input
        assert [i.name for i in inputs] == list(PATCH_INPUTS)
        dims = [[d.dim_param or d.dim_value for d in i.type.tensor_type.shape.dim] for i in inputs]
        assert dims == [["batch", "patches", 8 * 8 * 3], ["batch", "patches", 2], ["batch", "patches"]]
    step = {i.name for i in onnx.load(caption_onnx / "decoder_step.onnx").graph.input}
    assert CROSS_VALID in step and set(kv_names("cross", 2)) <= step
    config = json.loads((caption_onnx / ONNX_CONFIG_FILE).read_text())
    assert config["version"] == ONNX_PATCHES_VERSION and config["preprocess"]["max_patches"] == BUDGET


def test_an_older_reader_refuses_a_patches_folder_and_reads_a_square_one(folders, tmp_path):
    with pytest.raises(
        ValueError, match=r"has version=3 \(written by vitattn '[^']+'\); this vitattn reads version 2$"
    ):
        read_config(folders[1] / ONNX_CONFIG_FILE, "vitattn ONNX config", ONNX_FORMAT, ONNX_VERSION)  # its check
    square = export_onnx(load_model(make_classifier_bundle(tmp_path / "square")), tmp_path / "square.onnx")
    assert json.loads((square / ONNX_CONFIG_FILE).read_text())["version"] == ONNX_VERSION == 2
    assert load_model(square).model(torch.zeros(1, 3, 32, 32)).shape == (1, 3)


def test_a_folder_of_a_newer_version_is_refused_in_one_line_naming_the_upgrade(folders, tmp_path):
    folder = shutil.copytree(folders[3], tmp_path / "newer")
    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())
    (folder / ONNX_CONFIG_FILE).write_text(json.dumps({**config, "version": max(ONNX_VERSIONS) + 1}))
    with pytest.raises(ValueError) as err:
        load_model(folder)
    assert str(err.value) == (
        f"{folder / ONNX_CONFIG_FILE} has version=4 (written by vitattn {config['vitattn_version']!r}); this vitattn "
        "reads version 2 or 3; a newer vitattn wrote it: upgrade vitattn (pip install -U vitattn) to run it, or "
        "export it again with this vitattn: vitattn-export model=RUN format=onnx out=DIR"
    )


def test_a_version_that_disagrees_with_the_preprocessing_is_refused_in_one_line(folders, tmp_path):
    folder = shutil.copytree(folders[3], tmp_path / "older")
    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())
    (folder / ONNX_CONFIG_FILE).write_text(json.dumps({**config, "version": ONNX_VERSION}))
    with pytest.raises(ValueError, match=r"has version=2 but its preprocess holds max_patches, which needs version 3"):
        load_model(folder)


def test_merging_a_max_patches_models_tokens_on_export_is_refused_in_one_line(folders, tmp_path):
    with pytest.raises(
        ValueError, match=r"^merge_tokens=2 merges padded patches into real ones \(data\.max_patches=16\)"
    ):
        export_onnx(load_model(folders[2]), tmp_path / "merged", merge_tokens=2)
    assert not (tmp_path / "merged").exists()


def test_an_int8_folder_of_a_max_patches_captioner_is_quantized_and_captions_as_pytorch(folders, images, monkeypatch):
    kept = record_kept_fp32(monkeypatch)
    folder = export_onnx(load_model(folders[0]), folders[1].parent / "caption-int8.onnx", quantize="int8")
    check_int8_graphs(folder, kept)
    torch_model = Captioner.load(folders[0], precision="fp32")
    ours, theirs = Captioner.load(folder).caption(images), [torch_model.caption(image) for image in images]
    assert sum(a == b for a, b in zip(ours, theirs)) >= len(images) - 1, (ours, theirs)  # measured: 6 of 6


def test_a_coca_folders_image_embeddings_of_a_mixed_batch_are_pytorchs_for_each_image_alone(images, tmp_path):
    from vitattn.bundle import save_bundle
    from vitattn.data.tokenizer import Vocabulary
    from vitattn.models import CaptionDecoder, CocaCaptioner, VisionTransformer

    torch.manual_seed(0)
    vocab = Vocabulary(["a", "red", "circle"])
    decoder = CaptionDecoder(len(vocab), embed_dim=32, depth=1, num_heads=2, mlp_ratio=2.0, max_len=8)
    encoder = VisionTransformer(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, mlp_ratio=2.0)
    model = CocaCaptioner(encoder, decoder, embed_dim=16, text_depth=1, text_num_heads=2).eval()
    bundle = save_bundle(tmp_path / "coca", model, task="caption", preprocess=PATCHES, vocab=vocab)
    folder = export_onnx(load_model(bundle), tmp_path / "coca.onnx")
    torch_model, onnx_model = load_model(bundle, precision="fp32"), load_model(folder)
    embeds = onnx_model.model.embed_images(batch_images([onnx_model.transform(image) for image in images]))  # (B, E)
    with torch.no_grad():
        alone = torch.cat([torch_model.model.embed_images(_alone(torch_model, image)) for image in images])
    torch.testing.assert_close(embeds, alone, atol=1e-5, rtol=0)


def test_vitattn_caption_on_an_onnx_folder_captions_a_folder_of_mixed_aspects_as_pytorch(folders, images, tmp_path):
    from vitattn.cli.caption import main as caption_main

    for i, image in enumerate(images):
        image.save(tmp_path / f"{i}.png")
    out = tmp_path / "captions.jsonl"
    args = [
        f"model={folders[1]}",
        f"images={tmp_path}",
        f"out={out}",
        "num_workers=0",
        "progress=false",
        "batch_size=4",
    ]
    assert caption_main(args) == 0
    rows = {row["image"]: row["caption"] for row in map(json.loads, out.read_text().splitlines())}
    torch_model = Captioner.load(folders[0], precision="fp32")
    assert len(rows) == len(images) and rows == {path: torch_model.caption(path) for path in rows}


def test_vitattn_eval_on_an_onnx_classifier_scores_mixed_aspects_as_pytorch_alone(folders, images, tmp_path):
    from vitattn.cli.evaluate import main as eval_main

    labels = [k * 2 // len(images) for k in range(len(images))]  # cat: the first half, dog: the second
    for k, (image, label) in enumerate(zip(images, labels)):
        (tmp_path / "data" / "val" / ("cat", "dog", "bird")[label]).mkdir(parents=True, exist_ok=True)
        image.save(tmp_path / "data" / "val" / ("cat", "dog", "bird")[label] / f"{k}.png")
    args = [f"model={folders[3]}", f"data_root={tmp_path / 'data'}", "split=val", f"out={tmp_path / 'out'}"]
    assert eval_main([*args, "num_workers=0", "progress=false", "batch_size=4"]) == 0
    torch_model = load_model(folders[2], precision="fp32")
    with torch.no_grad():
        hits = [int(torch_model.model(_alone(torch_model, image)).argmax()) == y for image, y in zip(images, labels)]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())["metrics"]
    assert metrics["num_images"] == len(images) and metrics["top1"] == pytest.approx(sum(hits) / len(hits))
    assert 0 < sum(hits) < len(hits)  # a score that a wrong image order or mask could move
