"""Layers written as ONNX Runtime's contrib ops when exported: the encoder's self-attention as
``Attention`` and, for int8 folders, GELU as ``FastGelu``.

Dimension letters: B batch, N tokens, D width, H heads, d head width.

ONNX Runtime's transformer optimizer (``onnxruntime.transformers.optimizer``) fuses the attention of
graphs that compute queries, keys and values with three matrix products; ours computes them with
one (``MultiHeadAttention.project_qkv``) and its pattern does not match. So the export writes the op
itself: ``com.microsoft::Attention`` takes the stacked ``wq``, ``wk``, ``wv`` weights and biases and
returns the heads' concatenated outputs, which ``dense`` then projects, as in the PyTorch layer.
Dynamic int8 quantization turns it into ``QAttention``.

``FastGelu`` is GELU's tanh approximation (``F.gelu(x, approximate="tanh")``, within 1e-3 of the erf
form); ONNX Runtime runs it faster than its erf ``Gelu`` (``docs/benchmarks.md``, "ONNX Runtime"). Only
int8 folders take it, as Hugging Face optimum's ``enable_gelu_approximation`` does: their products are
approximate already, and ``tests/test_onnx.py`` measures the captions against fp32's. fp32 folders keep
the exact GELU (their logits match PyTorch's within 1e-4). Only export uses this module.
"""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vitattn.layers import EncoderLayer, MultiHeadAttention

__all__ = ["FastGelu", "contrib_opsets", "for_export"]

_CONTRIB_OPSET = {"com.microsoft": 1}  # the domain of ONNX Runtime's contrib ops


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


def for_export(model: nn.Module, approximate_gelu: bool = False) -> nn.Module:
    """A copy of ``model`` whose attention exports as ONNX Runtime runs it fastest.

    The encoder layers' self-attention becomes ONNX Runtime's ``Attention`` op (they attend without a
    mask; a layer given one raises ``ValueError``). Every other ``MultiHeadAttention`` takes the explicit
    path: the exporter writes ``F.scaled_dot_product_attention`` as a transpose of the keys scaled
    before the product, a copy of the (B, H, N, d) cross-attention keys at every decoding step;
    ``q @ k.transpose(-2, -1) / sqrt(d)`` scales the (B, H, 1, N) logits instead and lets ONNX
    Runtime fold the transpose into the product (``FusedMatMul``). With ``approximate_gelu``, every
    ``nn.GELU`` becomes ``FastGelu``.
    """
    model = copy.deepcopy(model)
    if approximate_gelu:
        for parent in list(model.modules()):
            for name, child in parent.named_children():
                if isinstance(child, nn.GELU):
                    setattr(parent, name, FastGelu())
    for module in model.modules():
        if isinstance(module, MultiHeadAttention):
            module.fused_attn = False
    for layer in model.modules():
        if isinstance(layer, EncoderLayer):
            layer.mha = _ContribSelfAttention(layer.mha)
    return model


def contrib_opsets(module: nn.Module) -> dict[str, int]:
    """``torch.onnx.export``'s ``custom_opsets`` for ``module``: the contrib domain when ``for_export``
    wrote a contrib op in it (the exporter warns about a domain the graph does not use)."""
    contrib = (_ContribSelfAttention, FastGelu)
    return _CONTRIB_OPSET if any(isinstance(m, contrib) for m in module.modules()) else {}
