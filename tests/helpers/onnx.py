"""A model's ONNX folders and the checks of an int8 export: what it quantized, what it kept in fp32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple


class OnnxFolders(NamedTuple):
    """A model's ONNX folders (``fp32``; ``int8`` or None) and, graph name -> products, what the int8 export kept
    in fp32 (``record_kept_fp32``; for ``check_int8_graphs``)."""

    fp32: Path
    int8: Path | None
    kept_fp32: dict


def record_kept_fp32(monkeypatch) -> dict[str, list[str]]:
    """Graph name -> the products the next int8 exports keep in fp32, as the export lists them
    (``vitattn.bundle.onnx_export.kept_fp32``, recorded while it quantizes)."""
    import vitattn.bundle.onnx_export as onnx_export

    kept: dict[str, list[str]] = {}
    listed = onnx_export.kept_fp32

    def record(graph, name: str) -> list[str]:
        kept[name] = listed(graph, name)
        return kept[name]

    monkeypatch.setattr(onnx_export, "kept_fp32", record)
    return kept


def check_int8_graphs(folder: Path, kept: dict[str, list[str]]) -> dict[str, dict[str, int]]:
    """Assert that the graphs of int8 ONNX folder ``folder`` are quantized, whatever its ``onnx.json`` says:
    activations quantized at run time (``DynamicQuantizeLinear``), the products with weights integer
    (``MatMulInteger``; the image encoder's attention ``QAttention`` unless it merges or pads tokens, no fp32
    ``Attention`` left), and the float ``MatMul``s exactly the products the export keeps in fp32 (``kept``,
    ``record_kept_fp32``), each with float inputs. Returns each graph's operator counts."""
    from collections import Counter

    import onnx

    from vitattn.bundle.onnx_folder import ONNX_CONFIG_FILE

    config = json.loads((folder / ONNX_CONFIG_FILE).read_text())
    graphs, model = config["graphs"], config["model"]
    merge_tokens = model.get("encoder", model).get("merge_tokens", 0)  # a captioner's encoder, or the classifier
    merging = any(merge_tokens) if isinstance(merge_tokens, list) else merge_tokens > 0
    padded = config["preprocess"].get("max_patches") is not None  # images at their own grids: masked attention
    counts = {}
    for name, entry in graphs.items():
        graph = onnx.shape_inference.infer_shapes(onnx.load(folder / entry["file"])).graph
        types = {v.name: v.type.tensor_type.elem_type for v in [*graph.value_info, *graph.input, *graph.output]}
        types |= {w.name: w.data_type for w in graph.initializer}
        ops = Counter(node.op_type for node in graph.node)
        counts[name] = dict(ops)
        assert ops["DynamicQuantizeLinear"] and ops["MatMulInteger"], f"{name}: not quantized, operators {dict(ops)}"
        # attention on the explicit path: masked, cached, or over merged tokens (``for_export``)
        explicit = name in ("decoder_step", "text_embed") or merging or padded
        assert not ops["Attention"] and (ops["QAttention"] or explicit), f"{name}: {dict(ops)}"
        assert name in kept, f"the export listed no products to keep in fp32 for {name}"
        float_products = {node.name: node for node in graph.node if node.op_type == "MatMul"}
        assert sorted(float_products) == sorted(kept[name]), f"{name}: fp32 products other than those kept"
        for node in float_products.values():
            inputs = {x: onnx.TensorProto.DataType.Name(types.get(x, 0)) for x in node.input}
            assert set(inputs.values()) == {"FLOAT"}, f"{name}: {node.name} kept in fp32 multiplies {inputs}"
    assert kept.get("decoder_step", True), "the decoder step keeps its attention and vocabulary products in fp32"
    return counts
