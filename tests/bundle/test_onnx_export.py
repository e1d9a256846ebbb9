"""ONNX export: the copy whose encoder self-attention is ONNX Runtime's contrib ``Attention`` op, int8's
``FastGelu``, and int8 folders that are quantized: their graphs are read, not the precision label the export
writes (an export without its quantization call passed the accuracy tests of test_onnx_folder.py)."""

import pytest
import torch

from tests.helpers.bundles import make_caption_bundle, make_classifier_bundle
from tests.helpers.onnx import check_int8_graphs, record_kept_fp32
from vitattn import Classifier
from vitattn.bundle import load_bundle, save_bundle
from vitattn.bundle.onnx_export import FastGelu, export_onnx, for_export
from vitattn.data.preprocess import default_preprocess
from vitattn.layers import EncoderLayer, MultiHeadAttention
from vitattn.models import VisionTransformer

TINY_VIT = dict(img_size=32, patch_size=8, embed_dim=32, depth=2, num_heads=2, num_classes=5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_for_export_copy_computes_the_models_logits_and_leaves_it_unchanged(norm_first):
    torch.manual_seed(0)
    model = VisionTransformer(**TINY_VIT, norm_first=norm_first).eval()
    images = torch.randn(3, 3, 32, 32)
    export = for_export(model)
    with torch.no_grad():
        torch.testing.assert_close(export(images), model(images))
    assert not any(isinstance(block.mha, MultiHeadAttention) for block in export.blocks)  # the contrib op's
    assert all(isinstance(block.mha, MultiHeadAttention) for block in model.blocks)
    assert all(m.mha.fused_attn for m in model.modules() if isinstance(m, EncoderLayer))


def test_for_export_refuses_a_masked_encoder_layer():
    layer = for_export(EncoderLayer(32, 2, 64)).eval()
    x = torch.randn(2, 5, 32)
    with pytest.raises(ValueError, match="unmasked self-attention"):
        layer(x, torch.zeros(5, 5))


def test_an_exported_classifier_runs_contrib_attention_on_onnxruntime_as_pytorch(tmp_path):
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    onnx = pytest.importorskip("onnx", reason="the onnx extra: pip install -e '.[onnx]'")
    torch.manual_seed(0)
    model = VisionTransformer(**TINY_VIT).eval()
    bundle = save_bundle(tmp_path / "bundle", model, task="classification", preprocess=default_preprocess(32))
    folder = export_onnx(load_bundle(bundle), tmp_path / "onnx")
    ops = {node.op_type for node in onnx.load(folder / "classifier.onnx").graph.node}
    assert "Attention" in ops and "Softmax" not in ops
    images = torch.randn(3, 3, 32, 32)
    with torch.no_grad():
        expected = model(images)
    torch.testing.assert_close(Classifier.load(folder).model(images), expected, atol=1e-4, rtol=1e-4)


def test_approximate_gelu_swaps_every_gelu_for_fast_gelu_in_the_copy_only():
    torch.manual_seed(0)
    model = VisionTransformer(**TINY_VIT).eval()  # GELU in every block's feed-forward network
    export = for_export(model, approximate_gelu=True)
    assert not any(isinstance(m, torch.nn.GELU) for m in export.modules())
    assert sum(isinstance(m, FastGelu) for m in export.modules()) == TINY_VIT["depth"]
    assert sum(isinstance(m, torch.nn.GELU) for m in model.modules()) == TINY_VIT["depth"]
    x = torch.linspace(-6, 6, 1001)
    torch.testing.assert_close(FastGelu()(x), torch.nn.functional.gelu(x, approximate="tanh"))
    assert (FastGelu()(x) - torch.nn.functional.gelu(x)).abs().max() < 1e-3  # the tanh form is close to erf's


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_only_int8_folders_run_fast_gelu(tmp_path, quantize):
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    onnx = pytest.importorskip("onnx", reason="the onnx extra: pip install -e '.[onnx]'")
    torch.manual_seed(0)
    model = VisionTransformer(**TINY_VIT).eval()
    bundle = save_bundle(tmp_path / "bundle", model, task="classification", preprocess=default_preprocess(32))
    folder = export_onnx(load_bundle(bundle), tmp_path / "onnx", quantize=quantize)
    ops = [node.op_type for node in onnx.load(folder / "classifier.onnx").graph.node]
    assert ops.count("FastGelu") == (TINY_VIT["depth"] if quantize else 0)
    assert ("Erf" in ops) == (quantize is None)  # fp32 keeps the exact GELU


@pytest.mark.parametrize("task", ["caption", "classification"])
def test_int8_export_quantizes_the_products_with_weights_and_keeps_the_listed_ones_float(task, tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
    pytest.importorskip("onnx", reason="the onnx extra: pip install -e '.[onnx]'")
    make = make_caption_bundle if task == "caption" else make_classifier_bundle
    bundle = load_bundle(make(tmp_path / "bundle"))
    kept = record_kept_fp32(monkeypatch)
    counts = check_int8_graphs(export_onnx(bundle, tmp_path / "int8", quantize="int8"), kept)
    print({name: {op: n for op, n in ops.items() if "Quant" in op or "MatMul" in op} for name, ops in counts.items()})
    if task == "caption":  # 2 decoder layers: queries x keys and weights x values, self and cross, and the logits
        assert len(kept["decoder_step"]) == 2 * 4 + 1
