"""The document's TensorFlow code, transcribed line by line into NumPy (test oracle).

Weights use Keras conventions: a Dense layer is ``x @ kernel + bias`` with kernel (in, out).
"""

from __future__ import annotations

import numpy as np


def softmax(x: np.ndarray, axis: int = -1) -> np.ndarray:
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def dense(x, kernel, bias):
    return x @ kernel + bias


def scaled_dot_product_attention(q, k, v, mask):
    matmul_qk = np.matmul(q, np.swapaxes(k, -1, -2))
    dk = np.float32(k.shape[-1])
    scaled_attention_logits = matmul_qk / np.sqrt(dk)
    if mask is not None:
        scaled_attention_logits += mask * -1e9
    attention_weights = softmax(scaled_attention_logits, axis=-1)
    output = np.matmul(attention_weights, v)
    return output, attention_weights


class MultiHeadAttention:
    def __init__(self, d_model, num_heads, weights):
        self.num_heads = num_heads
        self.d_model = d_model
        assert d_model % self.num_heads == 0
        self.depth = d_model // self.num_heads
        self.w = weights  # {"wq": (kernel, bias), "wk": ..., "wv": ..., "dense": ...}

    def split_heads(self, x, batch_size):
        x = np.reshape(x, (batch_size, -1, self.num_heads, self.depth))
        return np.transpose(x, (0, 2, 1, 3))

    def call(self, v, k, q, mask):
        batch_size = q.shape[0]
        q = dense(q, *self.w["wq"])
        k = dense(k, *self.w["wk"])
        v = dense(v, *self.w["wv"])
        q = self.split_heads(q, batch_size)
        k = self.split_heads(k, batch_size)
        v = self.split_heads(v, batch_size)
        scaled_attention, attention_weights = scaled_dot_product_attention(q, k, v, mask)
        scaled_attention = np.transpose(scaled_attention, (0, 2, 1, 3))
        concat_attention = np.reshape(scaled_attention, (batch_size, -1, self.d_model))
        output = dense(concat_attention, *self.w["dense"])
        return output, attention_weights


def layer_normalization(x, gamma, beta, epsilon=1e-6):
    mean = x.mean(axis=-1, keepdims=True)
    var = x.var(axis=-1, keepdims=True)
    return (x - mean) / np.sqrt(var + epsilon) * gamma + beta


def point_wise_feed_forward_network(x, w):
    return dense(np.maximum(dense(x, *w["ffn1"]), 0.0), *w["ffn2"])


def encoder_layer(x, mask, d_model, num_heads, w):
    """``EncoderLayer.call(x, training=False, mask)``: dropout is the identity at inference."""
    mha = MultiHeadAttention(d_model, num_heads, w["mha"])
    attn_output, _ = mha.call(x, x, x, mask)
    out1 = layer_normalization(x + attn_output, *w["layernorm1"])
    ffn_output = point_wise_feed_forward_network(out1, w)
    return layer_normalization(out1 + ffn_output, *w["layernorm2"])
