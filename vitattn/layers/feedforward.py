"""The document's point-wise feed-forward network."""

from __future__ import annotations

from torch import nn

__all__ = ["point_wise_feed_forward_network", "get_activation", "ACTIVATIONS"]

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU}


def get_activation(name: str) -> nn.Module:
    """A new activation module by name (``relu`` as in the document, or ``gelu`` as in ViT)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"activation={name!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]()


def point_wise_feed_forward_network(d_model: int, dff: int, activation: str = "relu") -> nn.Sequential:
    """Dense(dff, activation) -> Dense(d_model), applied to every position alike.

    Args:
        d_model: input and output width D.
        dff: hidden width.
        activation: ``relu`` (the document) or ``gelu`` (pretrained ViTs).

    Returns:
        ``nn.Sequential(Linear(D, dff), activation, Linear(dff, D))``.
    """
    return nn.Sequential(nn.Linear(d_model, dff), get_activation(activation), nn.Linear(dff, d_model))
