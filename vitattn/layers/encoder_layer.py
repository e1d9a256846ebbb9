"""The document's ``EncoderLayer``: self-attention and feed-forward, each with dropout and LayerNorm.

Dimension letters: B batch, L sequence length, D width (``d_model``).

``norm_first=False`` (the default) is the document's post-norm layer:
``out1 = layernorm1(x + dropout1(mha(x)))``, ``out2 = layernorm2(out1 + dropout2(ffn(out1)))``.
``norm_first=True`` is the pre-norm layer of pretrained ViTs:
``x = x + dropout1(mha(layernorm1(x)))``, ``x = x + dropout2(ffn(layernorm2(x)))``.
Stochastic depth (timm's ``DropPath``) wraps each residual branch when ``drop_path > 0``.
"""

from __future__ import annotations

from timm.layers import DropPath
from torch import Tensor, nn

from vitattn.layers.attention import MultiHeadAttention
from vitattn.layers.feedforward import point_wise_feed_forward_network

__all__ = ["EncoderLayer"]


class EncoderLayer(nn.Module):
    """The document's encoder layer (post-norm, ReLU) with a pre-norm / GELU switch.

    Args:
        d_model: width D.
        num_heads: attention heads; must divide ``d_model``.
        dff: feed-forward hidden width.
        rate: dropout after attention and after the feed-forward network.
        norm_first: pre-norm (ViT) instead of the document's post-norm.
        activation: ``relu`` (document), ``gelu`` or ``quick_gelu`` (see ``get_activation``).
        attn_drop: dropout on attention weights.
        drop_path: stochastic-depth rate of the residual branches.
        layer_norm_eps: LayerNorm epsilon (the document's 1e-6).
        qkv_bias: bias in ``wq``, ``wk``, ``wv``.
        fused_attn: fused attention kernels when weights are not asked for.
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
        self.drop_path1 = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.drop_path2 = DropPath(drop_path) if drop_path > 0 else nn.Identity()

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """(B, L, D) -> (B, L, D); ``mask`` as in ``MultiHeadAttention`` (1 = masked out)."""
        if self.norm_first:
            h = self.layernorm1(x)
            x = x + self.drop_path1(self.dropout1(self.mha(h, h, h, mask)[0]))
            return x + self.drop_path2(self.dropout2(self.ffn(self.layernorm2(x))))
        attn_output, _ = self.mha(x, x, x, mask)
        out1 = self.layernorm1(x + self.drop_path1(self.dropout1(attn_output)))
        ffn_output = self.ffn(out1)
        return self.layernorm2(out1 + self.drop_path2(self.dropout2(ffn_output)))
