"""The document's point-wise feed-forward network, ``EncoderLayer`` and ``DecoderLayer`` (docs/layers.md).

Dimension letters: B batch, L sequence length, D width (``d_model``), N image tokens, t new positions.
``norm_first=False`` is the document's post-norm layer, ``True`` the pre-norm layer of pretrained ViTs.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torchvision.ops import StochasticDepth

from vitattn.layers.attention import MultiHeadAttention, padding_mask
from vitattn.layers.merge import Memory, bipartite_soft_matching

__all__ = [
    "ACTIVATIONS",
    "DecoderLayer",
    "EncoderLayer",
    "LayerCache",
    "point_wise_feed_forward_network",
    "QuickGELU",
]


class QuickGELU(nn.Module):
    """CLIP's sigmoid approximation of GELU, ``x * sigmoid(1.702 x)``: OpenAI's CLIP weights were trained with it."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


# ``relu``: the document's; ``gelu``: ViT's; ``quick_gelu``: OpenAI CLIP's
ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "quick_gelu": QuickGELU}


def point_wise_feed_forward_network(d_model: int, dff: int, activation: str = "relu") -> nn.Sequential:
    """``nn.Sequential(Linear(D, dff), activation, Linear(dff, D))``, the same at every position."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation={activation!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
    return nn.Sequential(nn.Linear(d_model, dff), ACTIVATIONS[activation](), nn.Linear(dff, d_model))


class EncoderLayer(nn.Module):
    """The document's encoder layer (post-norm, ReLU), with pre-norm, GELU and stochastic depth switches.

    Args:
        d_model, num_heads, dff, rate: the document's (``rate``: dropout after each sub-layer).
        norm_first: pre-norm (ViT) instead of the document's post-norm.
        activation: ``relu`` (the document), ``gelu`` or ``quick_gelu`` (``ACTIVATIONS``).
        attn_drop, drop_path: dropout on the attention weights; stochastic-depth rate of the residual branches.
        layer_norm_eps, qkv_bias, fused_attn: LayerNorm epsilon (the document's 1e-6), ``wq``/``wk``/``wv`` bias,
            fused attention when weights are not asked for.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dff: int,
        rate: float = 0.1,
        norm_first: bool = False,
        activation: str = "relu",
        attn_drop: float = 0.0,
        drop_path: float = 0.0,
        layer_norm_eps: float = 1e-6,
        qkv_bias: bool = True,
        fused_attn: bool = True,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.mha = MultiHeadAttention(d_model, num_heads, qkv_bias, attn_drop, fused_attn)
        self.ffn = point_wise_feed_forward_network(d_model, dff, activation)
        self.layernorm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.layernorm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(rate)
        self.dropout2 = nn.Dropout(rate)
        self.drop_path1 = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()
        self.drop_path2 = StochasticDepth(drop_path, "row") if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor | Memory, mask: Tensor | None = None, r: int = 0) -> Tensor | Memory:
        """(B, L, D) -> (B, L, D); ``mask`` as in ``MultiHeadAttention`` (1 = masked out).

        Given the ``Memory`` of merged tokens (ToMe, ``vitattn.layers.merge``), returns the ``Memory`` of
        (B, N - r, D): the attention is proportional (log size added to the logits), then the ``r`` most similar
        token pairs, matched by their keys, are merged before the feed-forward network. Its padded tokens
        (``memory.valid`` False) are masked as keys, the document's ``mask * -1e9``.
        """
        given_memory = isinstance(x, Memory)
        memory = x if given_memory else Memory(x)
        x = memory.tokens
        mask = padding_mask(memory.valid, mask)  # (B, 1, 1, N) with padding, or as given
        h = self.layernorm1(x) if self.norm_first else x
        if r == 0 and memory.sizes is None:  # the document's attention, no bias: the fused kernel as without ToMe
            attn_output, k = self.mha(h, h, h, mask)[0], None
        else:
            q, k, v = self.mha.project_qkv(h)  # (B, H, N, d) each
            attn_output, _ = self.mha.attend(q, k, v, mask, size=memory.sizes)
        if self.norm_first:
            x = x + self.drop_path1(self.dropout1(attn_output))
        else:
            x = self.layernorm1(x + self.drop_path1(self.dropout1(attn_output)))  # the document's out1
        if r > 0:  # merged here: between the attention and the feed-forward network; keys: mean over heads
            memory = bipartite_soft_matching(k.mean(dim=1), r).merge_tokens(memory._replace(tokens=x))
            x = memory.tokens
        if self.norm_first:
            x = x + self.drop_path2(self.dropout2(self.ffn(self.layernorm2(x))))
        else:
            x = self.layernorm2(x + self.drop_path2(self.dropout2(self.ffn(x))))
        return memory._replace(tokens=x) if given_memory else x


class LayerCache:
    """One decoder layer's cached heads: self-attention keys/values grown t positions a call (in buffers
    of ``capacity`` positions allocated once; None: grown to fit), cross-attention keys/values and the fused
    q/k/v weights computed at the first call."""

    def __init__(self, capacity: int | None = None) -> None:
        self.capacity = capacity
        self.length = 0  # positions cached
        self._k: Tensor | None = None  # (B, H, >= length, d)
        self._v: Tensor | None = None
        self.cross_k: Tensor | None = None  # (B / K, H, N, d): one row per image, shared by its K beams
        self.cross_v: Tensor | None = None
        self.cross_sizes: Tensor | None = None  # (B / K, N) merged image tokens' sizes (None: not merged)
        self.cross_valid: Tensor | None = None  # (B / K, N) image tokens that are not padding (None: none padded)
        self.qkv_params: tuple[Tensor, Tensor | None] | None = None  # (3D, D) weight, (3D,) bias

    @property
    def k(self) -> Tensor | None:
        """(B, H, T, d) cached self-attention keys, or None before the first call."""
        return None if self._k is None else self._k[:, :, : self.length]

    @property
    def v(self) -> Tensor | None:
        """(B, H, T, d) cached self-attention values, or None before the first call."""
        return None if self._v is None else self._v[:, :, : self.length]

    def append(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Add t new positions (B, H, t, d) each; return every cached position, (B, H, T, d) each."""
        end = self.length + k.shape[2]
        if self._k is None or end > self._k.shape[2]:
            B, H, _, d = k.shape
            size = max(end, self.capacity or 0)
            new_k, new_v = k.new_empty(B, H, size, d), v.new_empty(B, H, size, d)
            if self.length:
                new_k[:, :, : self.length] = self.k
                new_v[:, :, : self.length] = self.v
            self._k, self._v = new_k, new_v
        self._k[:, :, self.length : end] = k
        self._v[:, :, self.length : end] = v
        self.length = end
        return self.k, self.v

    def reorder(self, index: Tensor) -> None:
        """Keep the batch rows in ``index`` (beam search); the cross heads, one per image, stay."""
        if self._k is not None:
            self._k = self._k.index_select(0, index)
            self._v = self._v.index_select(0, index)


class DecoderLayer(nn.Module):
    """Masked self-attention, cross-attention over image tokens, feed-forward; arguments as ``EncoderLayer``'s."""

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dff: int,
        rate: float = 0.1,
        norm_first: bool = False,
        activation: str = "relu",
        attn_drop: float = 0.0,
        layer_norm_eps: float = 1e-6,
        fused_attn: bool = True,
    ) -> None:
        super().__init__()
        self.norm_first = norm_first
        self.mha1 = MultiHeadAttention(d_model, num_heads, attn_drop=attn_drop, fused_attn=fused_attn)
        self.mha2 = MultiHeadAttention(d_model, num_heads, attn_drop=attn_drop, fused_attn=fused_attn)
        self.ffn = point_wise_feed_forward_network(d_model, dff, activation)
        self.layernorm1 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.layernorm2 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.layernorm3 = nn.LayerNorm(d_model, eps=layer_norm_eps)
        self.dropout1 = nn.Dropout(rate)
        self.dropout2 = nn.Dropout(rate)
        self.dropout3 = nn.Dropout(rate)

    def _self_attention(self, h: Tensor, cache: LayerCache | None) -> Tensor:
        if cache is None:
            q, k, v = self.mha1.project_qkv(h)  # (B, H, t, d) each
        else:
            if cache.qkv_params is None:  # concatenated once per decoding, not once per step
                cache.qkv_params = self.mha1.qkv_params()
            q, k, v = self.mha1.project_qkv(h, cache.qkv_params)
            k, v = cache.append(k, v)  # (B, H, T, d)
        return self.mha1.attend(q, k, v, is_causal=True)[0]

    def _cross_attention(self, h: Tensor, memory: Memory, cache: LayerCache | None) -> Tensor:
        if cache is not None and cache.cross_k is not None:
            k, v, sizes, valid = cache.cross_k, cache.cross_v, cache.cross_sizes, cache.cross_valid  # (B / K, N)
        else:
            tokens, sizes, valid = memory.tokens, memory.sizes, memory.valid  # (B / K, N, D), (B / K, N) or None
            if h.shape[0] % tokens.shape[0]:
                raise ValueError(f"memory batch {tokens.shape[0]} must divide the caption batch {h.shape[0]}")
            k, v = self.mha2.project_kv(tokens, tokens)  # (B / K, H, N, d): once per image
            if cache is not None:
                # Copied once into their own (B / K, H, N, d) blocks: every later step reads them, and CPU
                # attention is slower over the interleaved k/v views of the fused projection (docs/benchmarks.md).
                cache.cross_k, cache.cross_v = k.contiguous(), v.contiguous()
                k, v, cache.cross_sizes, cache.cross_valid = cache.cross_k, cache.cross_v, sizes, valid
        q = self.mha2.project_q(h)  # (B, H, t, d)
        B, H, t, d = q.shape
        images = k.shape[0]
        mask = padding_mask(valid)  # (B / K, 1, 1, N): padded image tokens, or None
        # merged image tokens (ToMe): proportional attention, as over the tokens each one holds
        if B == images:
            return self.mha2.attend(q, k, v, mask, size=sizes)[0]
        # K beams per image: the image's K rows of queries attend together over its one copy of the keys
        # and values, (B / K, H, K * t, d): one product per image and head reads them once, not K times.
        # The mask is per image and key only, so each query's result is the same as attending alone.
        q = q.reshape(images, -1, H, t, d).transpose(1, 2).reshape(images, H, -1, d)  # (B / K, H, K * t, d)
        out = self.mha2.attend(q, k, v, mask, size=sizes)[0]  # (B / K, K * t, D), rows ordered (beam, position)
        return out.reshape(B, t, -1)  # (B, t, D)

    def forward(self, x: Tensor, memory: Memory, cache: LayerCache | None = None) -> Tensor:
        """(B, t, D) new caption positions (all T without ``cache``) over the ``Memory`` of (B, N, D) image tokens
        -> (B, t, D); merged tokens (ToMe) weigh by their sizes, padded ones (``memory.valid``) are masked out.

        ``memory`` may hold (B / K, N, D), one row per K beams of an image; ``cache`` is extended in place, and once
        it holds the cross-attention's keys, values, sizes and validity, ``memory`` is not read.
        """
        if self.norm_first:
            x = x + self.dropout1(self._self_attention(self.layernorm1(x), cache))
            x = x + self.dropout2(self._cross_attention(self.layernorm2(x), memory, cache))
            return x + self.dropout3(self.ffn(self.layernorm3(x)))
        out1 = self.layernorm1(x + self.dropout1(self._self_attention(x, cache)))
        out2 = self.layernorm2(out1 + self.dropout2(self._cross_attention(out1, memory, cache)))
        return self.layernorm3(out2 + self.dropout3(self.ffn(out2)))
