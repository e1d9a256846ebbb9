"""int8 ONNX folders are quantized: their graphs are read, not the precision label the export writes (an
export without its quantization call passed the accuracy tests of tests/test_onnx.py, which fp32 meets)."""

import pytest

from tests.helpers import check_int8_graphs, make_caption_bundle, make_classifier_bundle, record_kept_fp32
from vitattn.bundle import load_bundle

pytest.importorskip("onnxruntime", reason="the onnx extra: pip install -e '.[onnx]'")
pytest.importorskip("onnx", reason="the onnx extra: pip install -e '.[onnx]'")


@pytest.mark.parametrize("task", ["caption", "classification"])
def test_int8_export_quantizes_the_products_with_weights_and_keeps_the_listed_ones_float(task, tmp_path, monkeypatch):
    from vitattn.bundle.onnx_export import export_onnx

    make = make_caption_bundle if task == "caption" else make_classifier_bundle
    bundle = load_bundle(make(tmp_path / "bundle"))
    kept = record_kept_fp32(monkeypatch)
    counts = check_int8_graphs(export_onnx(bundle, tmp_path / "int8", quantize="int8"), kept)
    print({name: {op: n for op, n in ops.items() if "Quant" in op or "MatMul" in op} for name, ops in counts.items()})
    if task == "caption":  # 2 decoder layers: queries x keys and weights x values, self and cross, and the logits
        assert len(kept["decoder_step"]) == 2 * 4 + 1
