"""A ``Bundle`` written as an ONNX folder (``onnx_folder``), optionally int8-quantized.

Dimension letters: B images (B * K caption rows when decoding K beams), L decoder layers, H heads, d head width,
P past caption positions, N image tokens (N' after merging), M patches, D width, V vocabulary, E embedding width.

PyTorch's TorchScript-based exporter (``dynamo=False``) traces the modules the PyTorch runtime runs. The
encoder's self-attention is written as ONNX Runtime's contrib ``Attention`` op, and int8 folders take GELU's
tanh form as ``FastGelu``; why, and the int8 choices: docs/captioning.md ("ONNX Runtime"). An encoder that merges
tokens (ToMe, ``merge_tokens``) is traced with its schedule: each layer's token count is fixed in the graph. A
``data.max_patches`` model's image graphs take ``Patches`` (``PatchesInput``) on a dynamic patch axis, padding
masked on the explicit attention path.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import warnings
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from importlib.metadata import version
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.onnx import symbolic_helper

from vitattn.bundle.folder import Bundle, encoder_of, plain_json
from vitattn.bundle.onnx_folder import (
    CROSS_SIZE,
    CROSS_VALID,
    ONNX_CONFIG_FILE,
    ONNX_FORMAT,
    ONNX_PATCHES_VERSION,
    ONNX_VERSION,
    PATCH_INPUTS,
    PRECISIONS,
    graph_file,
    graph_names,
    is_onnx_folder,
    kv_names,
    require_onnxruntime,
    sha256,
)
from vitattn.data.preprocess import pad_patches, patch_grid, patchify
from vitattn.data.tokenizer import tokenizer_file_name
from vitattn.fileio import atomic_folder
from vitattn.layers import EncoderLayer, LayerCache, MultiHeadAttention
from vitattn.models import CaptionDecoder, CocaCaptioner, ImageCaptioner, VisionTransformer
from vitattn.models.vit import Patches

__all__ = [
    "OPSET",
    "DecoderStepGraph",
    "EmbeddingGraph",
    "EncoderGraph",
    "FastGelu",
    "PatchesInput",
    "export_onnx",
    "for_export",
    "kept_fp32",
]

OPSET = 17


class _Attention(torch.autograd.Function):
    """(B, N, D) tokens, the (D, 3D) stacked weights and (3D,) biases -> (B, N, D) concatenated heads."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor, num_heads: int) -> Tensor:  # noqa: ARG004
        B, N, D = x.shape
        qkv = (x @ weight + bias).view(B, N, 3, num_heads, D // num_heads)  # (B, N, 3, H, d)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, N, d) each
        return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D)  # (B, N, D)

    @staticmethod
    def symbolic(g, x, weight, bias, num_heads: int):  # noqa: ANN001, ANN205 - the exporter's graph values
        out = g.op("com.microsoft::Attention", x, weight, bias, num_heads_i=num_heads)
        out.setType(x.type())  # (B, N, D) as the input: the exporter cannot infer a contrib op's shape
        return out


class _ContribSelfAttention(nn.Module):
    """``MultiHeadAttention`` over one input and no mask, exported as ``Attention`` then ``dense``."""

    def __init__(self, mha: MultiHeadAttention) -> None:
        super().__init__()
        self.mha = mha

    def forward(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None) -> tuple[Tensor, None]:
        if not (q is k is v) or mask is not None:
            raise ValueError("the contrib Attention export covers unmasked self-attention only")
        weight, bias = self.mha.qkv_params()  # (3D, D), (3D,)
        if bias is None:
            bias = weight.new_zeros(weight.shape[0])
        out = _Attention.apply(q, weight.t(), bias, self.mha.num_heads)  # (B, N, D)
        return self.mha.dense(out), None


class _FastGelu(torch.autograd.Function):
    """GELU's tanh approximation, exported as ONNX Runtime's ``FastGelu``."""

    @staticmethod
    def forward(ctx, x: Tensor) -> Tensor:  # noqa: ARG004
        return F.gelu(x, approximate="tanh")

    @staticmethod
    def symbolic(g, x):  # noqa: ANN001, ANN205 - the exporter's graph values
        out = g.op("com.microsoft::FastGelu", x)
        out.setType(x.type())
        return out


class FastGelu(nn.Module):
    """``nn.GELU`` exported as ONNX Runtime's ``FastGelu`` (the tanh approximation)."""

    def forward(self, x: Tensor) -> Tensor:
        return _FastGelu.apply(x)


def for_export(model: nn.Module, approximate_gelu: bool = False, contrib_attention: bool = True) -> nn.Module:
    """A copy of ``model`` whose attention exports as ONNX Runtime runs it fastest: each ``EncoderLayer``'s
    self-attention as its ``Attention`` op, every other on the explicit path; ``approximate_gelu``: ``nn.GELU`` as
    ``FastGelu``; ``contrib_attention=False``: every attention explicit (the text tower's, which masks padding).

    The layers of an encoder that merges tokens stay explicit: ToMe's matching reads their keys and proportional
    attention adds log size to the logits (``EncoderLayer.forward`` over a ``Memory``). Measured (ViT-S/16 at 224,
    ``merge_tokens=16``, 8 images, 2 threads): the op with the log sizes as its ``attention_bias`` (and the keys'
    mean projected apart) ran as fast in fp32 (545 ms against 535) but slower in int8 (315 ms against 248):
    ``QAttention`` has no bias input, so that op stays fp32 (quantized, the bias would be dropped)."""
    model = copy.deepcopy(model)
    encoders = [m for m in model.modules() if isinstance(m, VisionTransformer)]
    merging = {block for encoder in encoders if any(encoder.merge_schedule) for block in encoder.blocks}
    for module in list(model.modules()):
        if isinstance(module, MultiHeadAttention):
            module.fused_attn = False
        if isinstance(module, EncoderLayer) and contrib_attention and module not in merging:
            module.mha = _ContribSelfAttention(module.mha)
        for name, child in module.named_children():
            if approximate_gelu and isinstance(child, nn.GELU):
                setattr(module, name, FastGelu())
    return model


class PatchesInput(nn.Module):
    """``module`` called with ``Patches`` given as three tensors, the ``PATCH_INPUTS`` of an ONNX graph: patches
    (B, M, P*P*C), their (B, M, 2) (row, column) and (B, M) validity, as timm's NaFlex ViT takes them."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module

    def forward(self, patches: Tensor, coord: Tensor, valid: Tensor) -> Tensor | tuple[Tensor, ...]:
        return self.module(Patches(patches, coord, valid))


class EncoderGraph(nn.Module):
    """Images (or ``Patches``) -> each decoder layer's cross-attention keys (B, H, d, N), transposed once per image
    (ONNX Runtime reads a transposed operand more slowly at every step), and values (B, H, N, d); then, when the
    encoder merges tokens, their sizes (B, N') (``CROSS_SIZE``), N' its ``num_tokens``; for ``Patches``, which
    tokens are not padding (B, N) (``CROSS_VALID``)."""

    def __init__(self, model: ImageCaptioner) -> None:
        super().__init__()
        self.model = model

    def forward(self, images: Tensor | Patches) -> tuple[Tensor, ...]:
        memory = self.model.encode(images)  # (B, N, D) tokens, (B, N) sizes or None, (B, N) valid or None
        heads = []
        for layer in self.model.decoder.layers:
            k, v = layer.mha2.project_kv(memory.tokens, memory.tokens)  # (B, H, N, d) each
            heads += [k.transpose(2, 3).contiguous(), v.contiguous()]  # (B, H, d, N), (B, H, N, d)
        rides = [t for t in (memory.sizes, memory.valid) if t is not None]  # never both: merging refuses padding
        return (*heads, *rides)


class _PastCache(LayerCache):
    """A ``LayerCache`` whose past keys/values are given and whose new ones are kept as ``present``."""

    def __init__(
        self,
        past_k: Tensor,
        past_v: Tensor,
        cross_kt: Tensor,
        cross_v: Tensor,
        sizes: Tensor | None,
        valid: Tensor | None,
    ) -> None:
        super().__init__()
        self.past = (past_k, past_v)
        # (B / K, H, d, N) -> (B / K, H, N, d); the attention's q @ kᵀ transposes back: ONNX Runtime drops the pair
        self.cross_k, self.cross_v = cross_kt.transpose(2, 3), cross_v
        self.cross_sizes = sizes  # (B / K, N) merged image tokens' sizes, or None
        self.cross_valid = valid  # (B / K, N) image tokens that are not padding, or None
        self.present: tuple[Tensor, Tensor] = self.past

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        self.present = (torch.cat([self.past[0], k], dim=2), torch.cat([self.past[1], v], dim=2))  # (B, H, P+1, d)
        return self.present


class DecoderStepGraph(nn.Module):
    """One token (B, 1), the past self-attention keys/values (B, H, P, d) and the cross ones of each
    layer, once per image (keys (B / K, H, d, N), values (B / K, H, N, d); the K beams of an image are
    consecutive rows), then, for an encoder that merges tokens, their sizes (B / K, N), or, ``padded`` (images at
    their own grids), which image tokens are not padding (B / K, N) -> the next token's logits (B, V) and the
    keys/values with the token added (B, H, P+1, d)."""

    def __init__(self, decoder: CaptionDecoder, padded: bool = False) -> None:
        super().__init__()
        self.decoder, self.padded = decoder, padded

    def forward(self, tokens: Tensor, *heads: Tensor) -> tuple[Tensor, ...]:
        L = len(self.decoder.layers)
        past, cross = heads[: 2 * L], heads[2 * L : 4 * L]
        rides = heads[4 * L] if len(heads) > 4 * L else None  # (B / K, N): merged tokens' sizes, or the validity
        sizes, valid = (None, rides) if self.padded else (rides, None)
        caches = [
            _PastCache(past[2 * i], past[2 * i + 1], cross[2 * i], cross[2 * i + 1], sizes, valid) for i in range(L)
        ]
        start = past[0].shape[2]  # P: traced as the input's size, so the position follows the past length
        # no memory: the caches hold what the cross-attention reads of it (keys, values, sizes)
        logits = self.decoder(tokens, None, caches, start=start)[:, -1]  # (B, V)
        return (logits, *(t for c in caches for t in c.present))


class EmbeddingGraph(nn.Module):
    """``CocaCaptioner.embed_images`` (``what="images"``: (B, C, height, width) or ``Patches`` -> (B, E)) or
    ``embed_texts`` (``"texts"``: (N, T) right-padded token ids, the padding found in the graph -> (N, E)), as a
    module to export."""

    def __init__(self, model: CocaCaptioner, what: str) -> None:
        super().__init__()
        self.model, self.what = model, what

    def forward(self, x: Tensor | Patches) -> Tensor:
        return self.model.embed_images(x) if self.what == "images" else self.model.embed_texts(x)


def export_onnx(
    bundle: Bundle,
    directory: str | os.PathLike,
    quantize: str | None = None,
    merge_tokens: int | Sequence[int] | None = None,
) -> Path:
    """Write ``bundle`` as an ONNX folder at ``directory``, atomically (an earlier one there replaced), in fp32 or,
    with ``quantize="int8"``, ONNX Runtime's dynamic int8 quantization. ``merge_tokens``: the tokens each encoder
    layer merges (ToMe: an int, or one count per layer; ``set_merge_tokens``), set on the exported copy and recorded
    in ``onnx.json``'s ``model``; None keeps the model's. Returns the folder."""
    precision = quantize or "fp32"
    if precision not in PRECISIONS:
        raise ValueError(f"quantize={quantize!r} is unknown; choose quantize=int8 or leave it out for fp32")
    directory = Path(directory)
    if directory.exists() and not (is_onnx_folder(directory) or (directory.is_dir() and not any(directory.iterdir()))):
        raise FileExistsError(
            f"{directory} exists and is not a vitattn ONNX folder; choose another folder or remove it"
        )
    model = _with_merge_tokens(bundle.model.to("cpu").eval(), merge_tokens)
    images = _ImageInputs.of(bundle.preprocess)
    if images.padded and any(encoder_of(model).merge_schedule):  # ``merge_tokens`` refuses padding as it runs
        raise ValueError(
            f"merge_tokens={encoder_of(model).config['merge_tokens']} merges padded patches into real ones "
            f"(data.max_patches={bundle.preprocess['max_patches']}): export with merge_tokens=0"
        )
    config: dict[str, Any] = {
        "format": ONNX_FORMAT,
        "version": ONNX_PATCHES_VERSION if images.padded else ONNX_VERSION,
        "runtime": "onnx",
        "task": bundle.task,
        "precision": precision,
        "preprocess": bundle.preprocess,
        "model": plain_json(model.config, "model.config"),
        "vitattn_version": version("vitattn"),
        "opset": OPSET,
        "exporter": f"torch.onnx TorchScript (torch {torch.__version__})",
    }
    with atomic_folder(directory) as tmp:
        if bundle.task == "caption":
            config.update(
                _export_captioner(model, images, tmp, precision),
                generate=dict(bundle.generate),
                vocab_file=tokenizer_file_name(bundle.vocab),
            )
            bundle.vocab.save(tmp / tokenizer_file_name(bundle.vocab))
            if isinstance(model, CocaCaptioner):
                config.update(_export_embedders(model, images, tmp, precision))
        else:
            graph = images.wrap(for_export(model, precision == "int8", contrib_attention=not images.padded))
            _export(graph, images.args, tmp / graph_file("classifier"), images.names, ["logits"], images.axes)
            config["class_names"] = list(bundle.class_names)
        if precision == "int8":
            _quantize(tmp, graph_names(bundle.task, config["model"]))
        config["graphs"] = {
            name: {"file": graph_file(name), "sha256": sha256(tmp / graph_file(name))}
            for name in graph_names(bundle.task, config["model"])
        }
        (tmp / ONNX_CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    return directory


class _ImageInputs(NamedTuple):
    """An image graph's example inputs (``args``), their ``names`` and dynamic ``axes``: two square images, or, for
    images at their own grids (``padded``), the ``Patches`` of a wide and a tall image, padded."""

    args: tuple[Tensor, ...]
    names: list[str]
    axes: dict[str, dict[int, str]]
    padded: bool

    @classmethod
    def of(cls, preprocess: dict[str, Any]) -> _ImageInputs:
        size, budget = preprocess["img_size"], preprocess.get("max_patches")
        if budget is None:
            return cls((torch.rand(2, 3, size, size),), ["images"], {}, False)
        P = preprocess["patch_size"]
        # traced with two grids of different lengths: padding, and no grid of the position table's size
        grids = [patch_grid(1, 3, budget), patch_grid(2, 1, budget)]
        patches = pad_patches([patchify(torch.rand(3, rows * P, cols * P), P) for rows, cols in grids])
        return cls(tuple(patches), list(PATCH_INPUTS), {name: {1: "patches"} for name in PATCH_INPUTS}, True)

    def wrap(self, module: nn.Module) -> nn.Module:
        """``module`` called with ``args``: ``PatchesInput(module)`` for patches."""
        return PatchesInput(module) if self.padded else module


def _with_merge_tokens(model: nn.Module, merge_tokens: int | Sequence[int] | None) -> nn.Module:
    """``model``, or a copy of it whose encoder merges ``merge_tokens`` (a one-line ``ValueError`` if too many)."""
    if merge_tokens is None:
        return model
    model = copy.deepcopy(model)
    encoder_of(model).set_merge_tokens(merge_tokens if isinstance(merge_tokens, int) else list(merge_tokens))
    return model


def _export_captioner(model: ImageCaptioner, images: _ImageInputs, folder: Path, precision: str) -> dict[str, Any]:
    """Write ``encoder.onnx`` and ``decoder_step.onnx``; returns the ``decoder`` sizes for ``onnx.json``."""
    approximate_gelu = precision == "int8"
    dec = model.decoder
    L = len(dec.layers)
    with torch.no_grad():
        cross = images.wrap(EncoderGraph(model))(*images.args)  # 2L x (B, H, N, d), then (B, N) sizes or validity
    rides = [CROSS_VALID if images.padded else CROSS_SIZE] if len(cross) > 2 * L else []
    cross_names = kv_names("cross", L) + rides
    # images at their own grids: N follows the patches, axis 3 of the keys (B, H, d, N), 2 of the values, 1 of the rest
    axis = {"cross_k": 3, "cross_v": 2}
    tokens_axes = {name: {axis.get(name.split(".")[0], 1): "tokens"} for name in cross_names} if images.padded else {}
    encoder = images.wrap(EncoderGraph(for_export(model, approximate_gelu, contrib_attention=not images.padded)))
    encoder_axes = _join(images.axes, tokens_axes)
    _export(encoder, images.args, folder / graph_file("encoder"), images.names, cross_names, encoder_axes)
    B, H, _, d = cross[1].shape
    # traced with 2 rows per image (beams) and a past of 3 positions: any beam count and length run alike
    past = [torch.randn(2 * B, H, 3, d) for _ in range(2 * L)]
    tokens = torch.full((2 * B, 1), dec.bos_id, dtype=torch.long)
    past_axes = {name: {0: "batch", 2: "past"} for name in kv_names("past", L)}
    present_axes = {name: {0: "batch", 2: "past_plus_one"} for name in kv_names("present", L)}
    cross_axes = _join({name: {0: "images"} for name in cross_names}, tokens_axes)
    _export(
        DecoderStepGraph(for_export(dec, approximate_gelu), padded=images.padded),
        (tokens, *past, *cross),
        folder / graph_file("decoder_step"),
        ["tokens", *kv_names("past", L), *cross_names],
        ["logits", *kv_names("present", L)],
        {"tokens": {0: "batch"}, "logits": {0: "batch"}, **past_axes, **present_axes, **cross_axes},
    )
    sizes = dict(depth=L, num_heads=H, head_dim=d, max_len=dec.max_len, vocab_size=dec.vocab_size)
    ids = dict(pad_id=dec.pad_id, bos_id=dec.bos_id, eos_id=dec.eos_id, unk_id=dec.unk_id)
    return {"decoder": {**sizes, **ids}}


def _join(*axes: dict[str, dict[int, str]]) -> dict[str, dict[int, str]]:
    """Dynamic axes of several sources, name by name."""
    joined: dict[str, dict[int, str]] = {}
    for part in axes:
        for name, named in part.items():
            joined[name] = {**joined.get(name, {}), **named}
    return joined


def _export_embedders(model: CocaCaptioner, images: _ImageInputs, folder: Path, precision: str) -> dict[str, Any]:
    """Write ``image_embed.onnx`` and ``text_embed.onnx``; returns the ``embed`` width and scale for ``onnx.json``."""
    approximate_gelu = precision == "int8"
    embed = for_export(model, approximate_gelu, contrib_attention=not images.padded)
    image = images.wrap(EmbeddingGraph(embed, "images"))
    _export(image, images.args, folder / graph_file("image_embed"), images.names, ["embeds"], images.axes)
    dec = model.decoder
    # (N, T), traced with padding (T within the text tower's positions): any N and T <= max_len run alike
    tokens = torch.full((3, min(5, dec.max_len)), dec.eos_id, dtype=torch.long)
    tokens[:, 0], tokens[1, 3:] = dec.bos_id, dec.pad_id
    axes = {"tokens": {0: "batch", 1: "length"}}
    text = EmbeddingGraph(for_export(model, approximate_gelu, contrib_attention=False), "texts")
    _export(text, (tokens,), folder / graph_file("text_embed"), ["tokens"], ["embeds"], axes)
    return {"embed": {"embed_dim": model.embed_dim, "logit_scale": float(model.logit_scale.detach()[0])}}


def _export(
    module: nn.Module,
    args: tuple[Tensor, ...],
    path: Path,
    inputs: list[str],
    outputs: list[str],
    axes: dict[str, dict[int, str]],
) -> None:
    axes = _join({name: {0: "batch"} for name in inputs + outputs}, axes)
    with torch.no_grad(), warnings.catch_warnings(), _stable_argsort_as_topk():
        # the traced shape checks (caption length within max_len, causal mask for one query) hold for every step
        warnings.simplefilter("ignore", torch.jit.TracerWarning)
        # the text tower's positions are sliced to the traced length: ONNX Runtime slices them, nothing to fold
        warnings.filterwarnings("ignore", "Constant folding - Only steps=1 can be constant folded", UserWarning)
        # the TorchScript-based exporter is chosen (dynamo=False): it traces the modules the PyTorch runtime runs
        warnings.filterwarnings("ignore", "You are using the legacy TorchScript-based ONNX export", DeprecationWarning)
        warnings.filterwarnings("ignore", "The feature will be removed", DeprecationWarning)
        # no custom_opsets: the exporter declares the contrib domain (version 1) in a graph that uses a contrib op
        torch.onnx.export(
            module.eval(),
            args,
            str(path),
            input_names=inputs,
            output_names=outputs,
            dynamic_axes=axes,
            opset_version=OPSET,
            dynamo=False,
        )


@contextmanager
def _stable_argsort_as_topk() -> Iterator[None]:
    """The exporter's ``argsort`` refuses ``stable=True`` (ToMe's matching sorts stably, ``bipartite_soft_matching``):
    while it runs, ``argsort`` is ONNX's ``TopK`` over the whole axis, which breaks ties by the lower index, as a
    stable sort does."""
    torch.onnx.register_custom_op_symbolic("aten::argsort", _argsort, OPSET)
    try:
        yield
    finally:
        torch.onnx.unregister_custom_op_symbolic("aten::argsort", OPSET)


def _argsort(g, x, *args):  # noqa: ANN001, ANN002, ANN202 - the exporter's graph values
    # args: (dim, descending) of argsort, (stable, dim, descending) of argsort.stable
    dim, descending = (symbolic_helper._get_const(a, "i", name) for a, name in zip(args[-2:], ("dim", "descending")))
    length = g.op("Gather", g.op("Shape", x), g.op("Constant", value_t=torch.tensor([dim])))  # the whole axis
    return g.op("TopK", x, length, axis_i=dim, largest_i=descending, outputs=2)[1]  # (values, indices): indices


def _quantize(folder: Path, graphs: tuple[str, ...]) -> None:
    """Replace each graph by ONNX Runtime's dynamic int8 quantization of it, ``kept_fp32``'s products and the
    non-``MatMul`` operators left in fp32: why, docs/captioning.md ("ONNX Runtime")."""
    require_onnxruntime(export=True)
    import onnx  # an optional dependency, as onnxruntime
    from onnxruntime.quantization import QuantType, quantize_dynamic  # an optional dependency

    # onnxruntime.quantization logs through the root logger: advice to pre-process (measured: no gain here)
    # and, at INFO, one line per activation whose scale is computed at run time (all of them: dynamic)
    def advice(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not message.startswith(("Please consider to run pre-processing", "Quantization parameters for tensor"))

    logging.getLogger().addFilter(advice)
    try:
        for name in graphs:
            fp32 = folder / f"fp32.{graph_file(name)}"
            (folder / graph_file(name)).rename(fp32)
            quantize_dynamic(
                fp32,
                folder / graph_file(name),
                weight_type=QuantType.QInt8,
                per_channel=True,
                reduce_range=True,
                nodes_to_exclude=kept_fp32(onnx.load(fp32).graph, name),
                op_types_to_quantize=["MatMul", "Attention"],
            )
            fp32.unlink()
    finally:
        logging.getLogger().removeFilter(advice)


def kept_fp32(graph, name: str) -> list[str]:  # noqa: ANN001 - an onnx GraphProto
    """The matrix products of graph ``name`` (its fp32 export) that int8 quantization leaves in fp32: the
    products of two activations, and the decoder step's vocabulary projection (see ``_quantize``); the embedding
    graphs' projections are quantized (kept fp32, they moved no cosine to PyTorch's by more than 1e-4)."""
    weights = {w.name for w in graph.initializer}
    activations = [n.name for n in graph.node if n.op_type == "MatMul" and not any(x in weights for x in n.input)]
    return activations + ([_logits_product(graph)] if name == "decoder_step" else [])


def _logits_product(graph) -> str:  # noqa: ANN001 - an onnx GraphProto
    """The name of the matrix product that computes the ``logits`` output (the vocabulary projection)."""
    producers = {out: node for node in graph.node for out in node.output}
    node = producers["logits"]
    while node.op_type != "MatMul":  # back through the slice of the last position and the bias
        node = next(producers[x] for x in node.input if x in producers)
    return node.name
