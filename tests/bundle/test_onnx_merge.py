"""ONNX folders of an encoder that merges tokens (ToMe, ``merge_tokens``) against the PyTorch model merging the same:
each layer's token count fixed in the graphs, the merged tokens' sizes passed from the encoder to the decoder step,
captions, step logits, image embeddings, zero-shot classification and a classifier, in fp32 and int8; the
``merge_tokens`` setting of ``vitattn-export``; an unmerged export as it was."""

import copy
import dataclasses
import json

import numpy as np
import pytest
import torch
from torch import nn

from tests.helpers.bundles import CAPTION_PREPROCESS, distinct, make_caption_bundle
from tests.helpers.coca import COLOURS, colour_image
from tests.helpers.onnx import OnnxFolders, check_int8_graphs, record_kept_fp32
from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle, load_model, save_bundle
from vitattn.bundle.onnx_export import export_onnx
from vitattn.bundle.onnx_folder import CROSS_SIZE, ONNX_CONFIG_FILE, kv_names
from vitattn.cli.export import main as export_main
from vitattn.data.preprocess import default_preprocess, eval_transform, normalize
from vitattn.data.shapes import ShapesDataset
from vitattn.inference.embeddings import embed_pixels
from vitattn.inference.zero_shot import zero_shot_model
from vitattn.metrics import compute_caption_metrics
from vitattn.models import VisionTransformer, captioner_from_config

pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
onnx = pytest.importorskip("onnx", reason="the onnx extra: pip install -e '.[onnx]'")

R = 4  # tokens each layer merges: the tests' 32 px models of 8 px patches hold 17 tokens, then 13, then 9
EQUAL_CAPTIONS = 0.98  # of the images whose captions equal the PyTorch model's (fp32): the merges are argmaxes
INT8_MIN_COSINE = 0.999  # as tests/bundle/test_onnx_embeddings.py
NOISE = 16  # noise images after the colour ones (``_pixels``): the numbers are compared on these (see there)


def _merged(bundle) -> torch.nn.Module:
    """The PyTorch model of ``bundle`` (a path) merging R tokens a layer."""
    model = load_bundle(bundle).model
    (model.encoder if hasattr(model, "encoder") else model).set_merge_tokens(R)
    return model.eval()


def _export_merged(bundle, root) -> OnnxFolders:
    """``bundle``'s fp32 and int8 ONNX folders exported with ``merge_tokens=R``, and what int8 kept in fp32."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        kept = record_kept_fp32(monkeypatch)
        int8 = export_onnx(load_bundle(bundle), root / "onnx-int8", quantize="int8", merge_tokens=R)
    return OnnxFolders(export_onnx(load_bundle(bundle), root / "onnx", merge_tokens=R), int8, kept)


@pytest.fixture(scope="module")
def coca(colour_coca_both, tmp_path_factory):
    """The colour coca model whose embeddings and caption decoder both learned (tests/conftest.py) merging R tokens
    a layer: its bundle, the PyTorch model and its fp32 and int8 ONNX folders."""
    folders = _export_merged(colour_coca_both, tmp_path_factory.mktemp("merged_coca"))
    return colour_coca_both, _merged(colour_coca_both), folders


def _pixels(per_colour: int = 8) -> tuple[torch.Tensor, list[str]]:
    """(4 * per_colour + NOISE, 3, 32, 32) model inputs: colour images, then noise; and the colours. A flat colour
    square's patches are near twins: which of two merges is float rounding's choice, ONNX Runtime's or PyTorch's,
    and moves a logit by up to 1e-3 (measured); the noise images' patches are distinct (1e-7)."""
    rng = np.random.default_rng(7)
    names = [c for c in COLOURS for _ in range(per_colour)]
    pixels = torch.stack([eval_transform(CAPTION_PREPROCESS)(colour_image(c, rng)) for c in names])
    return torch.cat([pixels, torch.randn(NOISE, 3, 32, 32, generator=torch.Generator().manual_seed(0))]), names


def _equal(a: list, b: list) -> float:
    return sum(x == y for x, y in zip(a, b, strict=True)) / len(a)


def test_the_encoder_graph_has_each_layers_merged_token_count_and_hands_their_sizes_to_the_decoder_step(coca):
    _, model, folders = coca
    config = json.loads((folders.fp32 / ONNX_CONFIG_FILE).read_text())
    assert config["model"]["encoder"]["merge_tokens"] == R and model.encoder.num_tokens == 9
    L = config["decoder"]["depth"]
    encoder = onnx.load(folders.fp32 / "encoder.onnx").graph
    assert [o.name for o in encoder.output] == [*kv_names("cross", L), CROSS_SIZE]
    assert [i.name for i in onnx.load(folders.fp32 / "decoder_step.onnx").graph.input][-1] == CROSS_SIZE
    assert "Attention" not in {n.op_type for n in encoder.node}  # merged layers: the explicit path (for_export)
    onnx_model = Captioner.load(folders.fp32).model
    noise = _pixels(per_colour=1)[0][-NOISE:]  # the same merges, not near twins (``_pixels``)
    for batch in (1, 5):  # the counts are the graph's, whatever the batch
        memory = onnx_model.encode(noise[:batch])
        N = model.encoder.num_tokens
        assert [m.shape for m in memory.cross[:2]] == [(batch, 2, 16, N), (batch, 2, N, 16)]
        with torch.no_grad():
            expected = model.encode(noise[:batch]).sizes  # (B, N)
        torch.testing.assert_close(torch.from_numpy(memory.sizes), expected, rtol=0, atol=0)
        assert memory.sizes.sum(1).tolist() == [17.0] * batch


@pytest.mark.parametrize("generate", [{}, {"num_beams": 3}], ids=["greedy", "beam3"])
def test_merged_onnx_fp32_captions_equal_pytorchs(coca, generate):
    _, model, folders = coca
    pixels, _ = _pixels()
    with torch.no_grad():
        expected = model.generate(pixels, **generate).tolist()
        got = Captioner.load(folders.fp32).model.generate(pixels, **generate).tolist()
    distinct(expected, at_least=6)
    print(f"merged fp32 ONNX: {_equal(got, expected):.1%} of {len(got)} captions equal PyTorch's")
    assert _equal(got, expected) >= EQUAL_CAPTIONS


@pytest.mark.parametrize("settings", [dict(do_sample=True, top_p=0.9), dict(num_beams=4)], ids=["sampled", "beam4"])
def test_merged_onnx_fp32_candidates_equal_pytorchs(coca, settings):
    """K candidates and the greedy caption from one encoding on ONNX Runtime too: its step reads each image's one
    row of cross-attention keys and sizes for the image's K + 1 rows; the plain log-probabilities agree."""
    _, model, folders = coca
    pixels, _ = _pixels()
    keys = [f"k{i}" for i in range(len(pixels))]
    with torch.no_grad():
        expected = model.candidates(pixels, 3, keys, include_greedy=True, **settings)
        got = Captioner.load(folders.fp32).model.candidates(pixels, 3, keys, include_greedy=True, **settings)
    width = max(expected.tokens.shape[-1], got.tokens.shape[-1])
    pad = model.decoder.pad_id
    a, b = (nn.functional.pad(c.tokens, (0, width - c.tokens.shape[-1]), value=pad) for c in (expected, got))
    same = (a == b).all(-1).all(-1)  # (B,) every row of the image equal
    print(f"merged fp32 ONNX candidates: {same.float().mean():.1%} of {len(same)} images equal PyTorch's")
    assert same.float().mean() >= EQUAL_CAPTIONS
    torch.testing.assert_close(got.log_prob[same], expected.log_prob[same], rtol=0, atol=2e-3)


def test_merged_onnx_fp32_step_logits_within_1e4_of_pytorch(coca):
    """Every decoder step's logits along PyTorch's greedy captions, the ONNX step (its cross-attention weighing the
    merged tokens by size) against one teacher-forced PyTorch pass; 3 rows per image, as 3 beams."""
    _, model, folders = coca
    pixels = _pixels(per_colour=1)[0][-NOISE:]
    onnx_model = Captioner.load(folders.fp32).model
    with torch.no_grad():
        generated = model.generate(pixels).repeat_interleave(3, dim=0)  # (3B, T'): an image's rows consecutive
        tokens = torch.cat([torch.full_like(generated[:, :1], model.decoder.bos_id), generated], dim=1)
        expected = model(pixels, tokens[:, :-1], torch.arange(len(pixels)).repeat_interleave(3))  # (3B, T', V)
        step = onnx_model.decode_step(onnx_model.encode(pixels), generated.shape[1])
        got = torch.stack([step(tokens[:, : i + 1]) for i in range(generated.shape[1])], dim=1)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= 1e-4


def test_merged_onnx_int8_keeps_95_percent_of_fp32_captions(coca):
    """The bar of unmerged int8 folders (tests/bundle/test_onnx_folder.py): 95 % of fp32's greedy captions."""
    _, _, folders = coca
    check_int8_graphs(folders.int8, folders.kept_fp32)  # quantized, the merged layers' products of activations fp32
    pixels, _ = _pixels()
    with torch.no_grad():
        fp32 = Captioner.load(folders.fp32).model.generate(pixels).tolist()
        int8 = Captioner.load(folders.int8).model.generate(pixels).tolist()
    print(f"merged int8 ONNX: {_equal(int8, fp32):.1%} of {len(fp32)} greedy captions equal fp32's")
    assert _equal(int8, fp32) >= 0.95


@pytest.mark.parametrize("pool", ["cls", "mean"])
def test_merged_onnx_image_embeddings_equal_pytorchs(coca, pool, tmp_path):
    """fp32 within 1e-5, int8 in the direction of PyTorch's; ``mean``: the colour model pooling its patch tokens,
    each merged token weighed by its size."""
    bundle, model, folders = coca
    if pool == "mean":
        config = copy.deepcopy(model.config)  # the shared model's own dicts otherwise
        config["encoder"]["global_pool"] = "mean"
        model = captioner_from_config(config).eval()
        model.load_state_dict(load_bundle(bundle).model.state_dict())  # the same modules: no fc_norm for mean
        pooled = load_bundle(bundle)
        bundle = save_bundle(tmp_path / "mean", model, task="caption", preprocess=pooled.preprocess, vocab=pooled.vocab)
        folders = _export_merged(bundle, tmp_path)
    pixels, _ = _pixels(per_colour=2)
    with torch.no_grad():
        expected = model.embed_images(pixels)
    fp32, int8 = (embed_pixels(load_model(folder), pixels) for folder in (folders.fp32, folders.int8))
    assert (fp32 - expected)[-NOISE:].abs().max().item() <= 1e-5
    assert (fp32 * expected).sum(-1).min().item() >= 1 - 1e-6  # the colour squares: other merges of near twins
    assert (int8 * expected).sum(-1).min().item() >= INT8_MIN_COSINE


@pytest.mark.parametrize("scorer", ["contrastive", "likelihood"])
def test_zero_shot_and_similarity_from_a_merged_onnx_folder_choose_as_pytorch(coca, scorer):
    """The colour of every colour image, as the PyTorch model merging the same: by the image embeddings
    (``contrastive``) or by the caption decoder, each image's prompts its rows over one encoding (``likelihood``)."""
    bundle, model, folders = coca
    labels = ["yellow", "red", "blue", "green"]
    eager = dataclasses.replace(load_model(bundle), model=model)
    pixels, truth = _pixels(per_colour=3)
    logits = {}
    for name, loaded in (("torch", eager), ("onnx", load_model(folders.fp32))):
        with torch.no_grad():
            logits[name] = zero_shot_model(loaded, labels, scorer=scorer).model(pixels)  # (B, 4)
    assert [labels[i] for i in logits["onnx"][: len(truth)].argmax(-1)] == truth
    assert logits["onnx"].argmax(-1).tolist() == logits["torch"].argmax(-1).tolist()  # the noise images too
    torch.testing.assert_close(logits["onnx"][-NOISE:], logits["torch"][-NOISE:], rtol=0, atol=1e-4)
    images = [colour_image(c, np.random.default_rng(3)) for c in COLOURS]
    texts = [f"a photo of a {c}." for c in reversed(COLOURS)]
    similarity = Captioner.load(folders.fp32).similarity(images, texts)
    assert similarity.argmax(-1).tolist() == Captioner(eager).similarity(images, texts).argmax(-1).tolist()
    assert similarity.argmax(-1).tolist() == [3, 2, 1, 0]


def test_a_merged_classifier_folder_gives_pytorchs_logits(tmp_path):
    """timm's ``avg`` pool: the size-weighted mean of the merged patch tokens, then ``fc_norm``."""
    torch.manual_seed(0)
    tiny = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    model = VisionTransformer(**tiny, global_pool="avg", merge_tokens=[4, 3]).eval()
    bundle = save_bundle(tmp_path / "bundle", model, task="classification", preprocess=default_preprocess(32))
    with pytest.MonkeyPatch.context() as monkeypatch:
        kept = record_kept_fp32(monkeypatch)
        int8 = export_onnx(load_bundle(bundle), tmp_path / "int8", quantize="int8")  # merge_tokens: the bundle's
    fp32 = export_onnx(load_bundle(bundle), tmp_path / "fp32")
    assert json.loads((fp32 / ONNX_CONFIG_FILE).read_text())["model"]["merge_tokens"] == [4, 3]
    check_int8_graphs(int8, kept)
    images = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        expected = model(images)
    torch.testing.assert_close(Classifier.load(fp32).model(images), expected, atol=1e-4, rtol=1e-4)
    assert Classifier.load(int8).model(images).argmax(-1).tolist() == expected.argmax(-1).tolist()


def test_vitattn_export_merge_tokens_sets_the_exported_copy_and_records_it(tmp_path, capsys):
    bundle = make_caption_bundle(tmp_path / "bundle")
    common = [f"model={bundle}", "format=onnx"]
    assert export_main([*common, f"out={tmp_path / 'onnx'}", "merge_tokens=[3,2]"]) == 0
    assert capsys.readouterr().out.startswith("caption ONNX folder (fp32, merge_tokens=[3, 2]) of ")
    config = json.loads((tmp_path / "onnx" / ONNX_CONFIG_FILE).read_text())
    assert config["model"]["encoder"]["merge_tokens"] == [3, 2]
    assert Captioner.load(tmp_path / "onnx").model.encode(torch.randn(2, 3, 32, 32)).sizes.shape == (2, 17 - 5)
    assert load_bundle(bundle).model.config["encoder"]["merge_tokens"] == 0  # the bundle is left as it was
    for args, message in [
        ([*common, "merge_tokens=9"], "error: merge_tokens=9 is too large for 17 tokens: at most 8"),
        ([*common, "merge_tokens=a"], "error: merge_tokens='a' must be the tokens each encoder layer merges"),
        ([f"model={bundle}", "merge_tokens=3"], "error: merge_tokens=3 needs format=onnx (or format=hub hub_format"),
    ]:
        assert export_main([*args, f"out={tmp_path / 'refused'}"]) == 2
        err = capsys.readouterr().err
        assert err.startswith(message) and err.count("\n") == 1, err
        assert not (tmp_path / "refused").exists()


def test_merge_tokens_0_exports_an_unmerged_folder_as_before(tmp_path):
    """No sizes in or out, the encoder's attention ONNX Runtime's op: the graphs of folders exported before merging
    (older folders still load), whatever the bundle's model merges."""
    bundle = load_bundle(make_caption_bundle(tmp_path / "bundle"))
    bundle.model.encoder.set_merge_tokens(3)
    merged = export_onnx(bundle, tmp_path / "merged")  # None: the model's
    folder = export_onnx(bundle, tmp_path / "onnx", merge_tokens=0)
    assert bundle.model.encoder.merge_schedule == [3, 3]  # set on the exported copy only
    L = 2
    encoder, step = (onnx.load(folder / f"{name}.onnx").graph for name in ("encoder", "decoder_step"))
    assert [o.name for o in encoder.output] == kv_names("cross", L)
    assert [i.name for i in step.input] == ["tokens", *kv_names("past", L), *kv_names("cross", L)]
    assert "Attention" in {n.op_type for n in encoder.node}
    assert Captioner.load(folder).model.encode(torch.randn(2, 3, 32, 32)).sizes is None
    assert [o.name for o in onnx.load(merged / "encoder.onnx").graph.output][-1] == CROSS_SIZE


def test_merged_shapes_captioner_onnx_captions_equal_pytorchs_and_int8_keeps_the_unmerged_bar(
    shapes_caption_run, tmp_path_factory
):
    """The shared shapes captioner (tests/conftest.py) on 200 of its test images. fp32: 98 % of the greedy captions
    equal PyTorch's merging the same; int8: the bar of unmerged int8 folders (tests/bundle/test_onnx_folder.py), 95 %
    of fp32's captions and CIDEr-D within 2 %."""
    folders = _export_merged(shapes_caption_run, tmp_path_factory.mktemp("merged_shapes"))
    check_int8_graphs(folders.int8, folders.kept_fp32)
    data = ShapesDataset("test", 200, img_size=32, seed=0, task="caption", transform=normalize())  # the run's first
    images = torch.stack([data[i]["image"] for i in range(len(data))])
    references = [data.references(i) for i in range(len(data))]
    captions = {}
    with torch.no_grad():
        captions["torch"] = _merged(shapes_caption_run).generate(images).tolist()
        for name in ("fp32", "int8"):
            captions[name] = Captioner.load(getattr(folders, name)).model.generate(images).tolist()
    distinct(captions["torch"], at_least=30)
    vocab = load_bundle(shapes_caption_run).vocab
    cider = {k: compute_caption_metrics(vocab.decode_batch(v), references)["cider_d"] for k, v in captions.items()}
    print(
        f"merged (merge_tokens={R}): fp32 {_equal(captions['fp32'], captions['torch']):.1%} of PyTorch's captions, "
        f"int8 {_equal(captions['int8'], captions['fp32']):.1%} of fp32's; CIDEr-D {cider}"
    )
    assert _equal(captions["fp32"], captions["torch"]) >= EQUAL_CAPTIONS
    assert _equal(captions["int8"], captions["fp32"]) >= 0.95
    assert abs(cider["int8"] - cider["fp32"]) <= 0.02 * cider["fp32"]
