"""The document's layers in PyTorch: attention, feed-forward, encoder and decoder layers."""

from vitattn.layers.attention import (
    MultiHeadAttention,
    causal_mask,
    check_heads,
    padding_mask,
    record_attention,
    scaled_dot_product_attention,
)
from vitattn.layers.merge import Memory, merge_schedule
from vitattn.layers.transformer import (
    DecoderLayer,
    EncoderLayer,
    LayerCache,
    point_wise_feed_forward_network,
)

__all__ = [
    "DecoderLayer",
    "EncoderLayer",
    "LayerCache",
    "Memory",
    "MultiHeadAttention",
    "causal_mask",
    "check_heads",
    "merge_schedule",
    "padding_mask",
    "point_wise_feed_forward_network",
    "record_attention",
    "scaled_dot_product_attention",
]
