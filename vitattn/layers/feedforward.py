"""The document's point-wise feed-forward network."""

from __future__ import annotations

import torch
from torch import Tensor, nn

__all__ = ["point_wise_feed_forward_network", "get_activation", "ACTIVATIONS", "QuickGELU"]


class QuickGELU(nn.Module):
    """CLIP's sigmoid approximation of GELU, ``x * sigmoid(1.702 x)``: OpenAI's CLIP weights were trained with it."""

    def forward(self, x: Tensor) -> Tensor:
        return x * torch.sigmoid(1.702 * x)


ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "quick_gelu": QuickGELU}


def get_activation(name: str) -> nn.Module:
    """A new activation module by name: ``relu`` (the document), ``gelu`` (ViT) or ``quick_gelu`` (OpenAI CLIP)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


def point_wise_feed_forward_network(d_model: int, dff: int, activation: str = "relu") -> nn.Sequential:
    """Dense(dff, activation) -> Dense(d_model), applied to every position alike.

    Args:
        d_model: input and output width D.
        dff: hidden width.
        activation: ``relu`` (the document), ``gelu`` (pretrained ViTs) or ``quick_gelu`` (OpenAI CLIP).

    Returns:
        ``nn.Sequential(Linear(D, dff), activation, Linear(dff, D))``.
    """
    return nn.Sequential(nn.Linear(d_model, dff), get_activation(activation), nn.Linear(dff, d_model))
