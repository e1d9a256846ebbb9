"""The document's attention: ``scaled_dot_product_attention`` and ``MultiHeadAttention`` (docs/layers.md).

Dimension letters: B batch, H heads, L/Lq/Lk sequence lengths, D width (``d_model``), d head width.
A mask holds 1 (or True) where attention is not allowed, added to the logits as ``mask * -1e9``. The fused
path (``F.scaled_dot_product_attention``) returns no weights; the explicit one, the document's, does.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "scaled_dot_product_attention",
    "MultiHeadAttention",
    "record_attention",
    "causal_mask",
    "check_heads",
    "padding_mask",
]


def _additive_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    """The document's ``mask * -1e9``, in a dtype that can hold it (fp16 saturates at its minimum)."""
    big = min(1e9, torch.finfo(dtype).max)
    return mask.to(dtype) * -big


def _log_size(size: Tensor) -> Tensor:
    """(B, Lk) merged-token sizes -> (B, 1, 1, Lk) fp32 log sizes to add to (B, H, Lq, Lk) logits."""
    return size.float().log()[:, None, None, :]


def _fp32_scores(q: Tensor, k: Tensor) -> Tensor:
    """q kᵀ (..., Lq, Lk) in fp32 whatever q's dtype or autocast, as the fused kernels keep their scores: the
    mask's -1e9 and the softmax then stay fp32 too (in bf16, 3 significant digits, the weights would not)."""
    if q.dtype == torch.float32 and not torch.is_autocast_enabled(q.device.type):
        return q @ k.transpose(-2, -1)
    with torch.autocast(q.device.type, enabled=False):
        return q.float() @ k.float().transpose(-2, -1)


def check_heads(num_heads: int, width: int, width_name: str = "embed_dim") -> None:
    """Raise ``ValueError`` unless ``num_heads`` is positive and divides the model width ``width``."""
    if num_heads <= 0 or width % num_heads != 0:
        raise ValueError(f"num_heads={num_heads} must divide {width_name}={width}")


def causal_mask(lq: int, lk: int, device: torch.device | None = None) -> Tensor:
    """(Lq, Lk) look-ahead mask (1 = masked out) for ``lq`` new queries at the end of ``lk`` keys."""
    return torch.ones(lq, lk, device=device).triu(diagonal=lk - lq + 1)


def padding_mask(valid: Tensor | None, mask: Tensor | None = None) -> Tensor | None:
    """(B, Lk) key validity (False: padding) -> the document's (B, 1, 1, Lk) mask, True where a key is padding, so
    that no query attends to it; joined with ``mask`` (True or 1 = masked out) when given. None without either."""
    if valid is None:
        return mask
    padded = ~valid[:, None, None, :]  # (B, 1, 1, Lk)
    return padded if mask is None else (mask.to(torch.bool) | padded)


def scaled_dot_product_attention(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None = None, dropout_p: float = 0.0, size: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """The document's softmax(q kᵀ / √d + mask · -1e9) v, scores and softmax in fp32 for any dtype.

    q (..., Lq, d), k (..., Lk, d), v (..., Lk, dv), mask broadcastable to (..., Lq, Lk); returns the output
    (..., Lq, dv) and the fp32 weights (..., Lq, Lk). ``dropout_p`` is not in the document (0 keeps it exact);
    nor is ``size`` (B, Lk), the tokens each merged key holds: ToMe's proportional attention adds log size.
    """
    matmul_qk = _fp32_scores(q, k)  # (..., Lq, Lk)
    dk = k.shape[-1]
    scaled_attention_logits = matmul_qk / math.sqrt(dk)
    if mask is not None:
        scaled_attention_logits = scaled_attention_logits + _additive_mask(mask, torch.float32)
    if size is not None:
        scaled_attention_logits = scaled_attention_logits + _log_size(size)
    attention_weights = scaled_attention_logits.softmax(dim=-1)  # (..., Lq, Lk)
    if dropout_p > 0.0:
        attention_weights = F.dropout(attention_weights, p=dropout_p)
    output = attention_weights.to(v.dtype) @ v  # (..., Lq, dv)
    return output, attention_weights


class MultiHeadAttention(nn.Module):
    """The document's ``MultiHeadAttention`` (``wq``, ``wk``, ``wv``, ``dense``, ``split_heads``), called
    ``mha(q, k, v, mask)`` where Keras calls ``call(v, k, q, mask)``; self-attention runs one fused projection.

    Args:
        d_model: width D, divisible by ``num_heads`` (H).
        qkv_bias: bias in ``wq``, ``wk``, ``wv`` (the document's Dense layers have one).
        attn_drop: dropout on the attention weights.
        fused_attn: ``F.scaled_dot_product_attention`` when weights are not asked for.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        qkv_bias: bool = True,
        attn_drop: float = 0.0,
        fused_attn: bool = True,
    ) -> None:
        super().__init__()
        check_heads(num_heads, d_model, "d_model")
        self.num_heads = num_heads
        self.d_model = d_model
        self.head_dim = d_model // num_heads  # d: the width of one head
        self.attn_drop = attn_drop
        self.fused_attn = fused_attn
        self.wq = nn.Linear(d_model, d_model, bias=qkv_bias)
        self.wk = nn.Linear(d_model, d_model, bias=qkv_bias)
        self.wv = nn.Linear(d_model, d_model, bias=qkv_bias)
        self.dense = nn.Linear(d_model, d_model)
        self._record: list[Tensor] | None = None  # set by `record_attention`

    def split_heads(self, x: Tensor, batch_size: int) -> Tensor:
        """(B, L, D) -> (B, H, L, d), as the document's ``split_heads``."""
        x = x.view(batch_size, -1, self.num_heads, self.head_dim)  # (B, L, H, d)
        return x.transpose(1, 2)  # (B, H, L, d)

    def project_q(self, q: Tensor) -> Tensor:
        """(B, Lq, D) -> query heads (B, H, Lq, d)."""
        return self.split_heads(self.wq(q), q.shape[0])

    def project_kv(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """(B, Lk, D) keys and values -> heads (B, H, Lk, d) each; one matmul when ``k is v``."""
        if k is v:
            return self._fused(k, _cat(self.wk.weight, self.wv.weight), _cat(self.wk.bias, self.wv.bias))
        return self.split_heads(self.wk(k), k.shape[0]), self.split_heads(self.wv(v), v.shape[0])

    def qkv_params(self) -> tuple[Tensor, Tensor | None]:
        """``wq``, ``wk``, ``wv`` stacked: the (3D, D) weight and (3D,) bias (None without bias) of ``project_qkv``."""
        return _cat(self.wq.weight, self.wk.weight, self.wv.weight), _cat(self.wq.bias, self.wk.bias, self.wv.bias)

    def project_qkv(
        self, x: Tensor, params: tuple[Tensor, Tensor | None] | None = None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """(B, L, D) -> three (B, H, L, d) in one matmul; ``params``: ``qkv_params()`` stacked once beforehand."""
        return self._fused(x, *(params or self.qkv_params()))

    def _fused(self, x: Tensor, w: Tensor, b: Tensor | None) -> tuple[Tensor, ...]:
        """(B, L, D) through P stacked projections (P·D, D) -> P heads (B, H, L, d), views of one matmul."""
        B, L, _ = x.shape
        out = F.linear(x, w, b).view(B, L, -1, self.num_heads, self.head_dim)  # (B, L, P, H, d)
        # unbind's one backward (a stack), not P that zero-fill the gradient (docs/benchmarks.md)
        return out.permute(2, 0, 3, 1, 4).unbind(0)  # P x (B, H, L, d)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = False,
        is_causal: bool = False,
        size: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Attention of (B, H, Lq, d) heads over (B, H, Lk, d) ones, concatenated and ``dense``: (B, Lq, D)
        and the (B, H, Lq, Lk) weights when ``need_weights`` (else None); ``is_causal`` adds the look-ahead mask;
        ``size`` (B, Lk): merged keys' sizes, their log added to the logits (proportional attention)."""
        B, _, Lq, _ = q.shape
        Lk = k.shape[2]
        dropout_p = self.attn_drop if self.training else 0.0
        explicit = need_weights or self._record is not None or not self.fused_attn
        # A plain square causal mask goes to the fused kernel as `is_causal` (flash attention takes
        # no explicit mask); any other look-ahead is built as a mask.
        # bool(): under the ONNX exporter's tracing, sizes are tensors (the comparisons are fixed by the traced shapes)
        fused_causal = is_causal and not explicit and mask is None and size is None and bool(Lq == Lk)
        if is_causal and Lq > 1 and not fused_causal:
            look_ahead = causal_mask(Lq, Lk, q.device).to(torch.bool)
            mask = look_ahead if mask is None else (mask.to(torch.bool) | look_ahead)
        if explicit:
            out, weights = scaled_dot_product_attention(q, k, v, mask, dropout_p, size)
            if self._record is not None:
                self._record.append(weights.detach())
        else:
            # in q's dtype, as the kernels take it; they add it to fp32 scores (-1e9 is -998244352 in bf16)
            attn_mask = None if mask is None else _additive_mask(mask, q.dtype)
            if size is not None:  # the log in fp32, as the explicit path and ONNX take it, rounded once
                log_size = _log_size(size).to(q.dtype)
                attn_mask = log_size if attn_mask is None else attn_mask + log_size
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=fused_causal and bool(Lq > 1)
            )
            weights = None
        out = out.transpose(1, 2).reshape(B, Lq, self.d_model)  # (B, Lq, D)
        return self.dense(out), (weights if need_weights else None)

    def forward(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        mask: Tensor | None = None,
        need_weights: bool = False,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        """Queries (B, Lq, D) over keys and values (B, Lk, D) -> (B, Lq, D) and the (B, H, Lq, Lk) weights, or
        None for them unless ``need_weights`` (the explicit path, for this call only)."""
        if q is k and k is v:
            qh, kh, vh = self.project_qkv(q)
        else:
            qh = self.project_q(q)
            kh, vh = self.project_kv(k, v)
        return self.attend(qh, kh, vh, mask, need_weights, is_causal)


def _cat(*tensors: Tensor | None) -> Tensor | None:
    return None if tensors[0] is None else torch.cat(tensors)


@contextmanager
def record_attention(model: nn.Module) -> Iterator[dict[str, list[Tensor]]]:
    """Record the detached (B, H, Lq, Lk) weights of every ``MultiHeadAttention`` of ``model`` inside the block,
    one entry per call under the layer's name: ``with record_attention(model) as maps: model(images)``."""
    layers = {n: m for n, m in model.named_modules() if isinstance(m, MultiHeadAttention)}
    records: dict[str, list[Tensor]] = {name: [] for name in layers}
    for name, layer in layers.items():
        layer._record = records[name]
    try:
        yield records
    finally:
        for layer in layers.values():
            layer._record = None
