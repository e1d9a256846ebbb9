"""FLOPs of a ViT forward: counted by formula, and as ``torch.utils.flop_counter`` sees them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def vit_flops(
    img_size: int,
    patch_size: int,
    embed_dim: int,
    depth: int,
    mlp_ratio: float = 4.0,
    num_classes: int = 0,
    in_chans: int = 3,
    **_: Any,
) -> int:
    """Forward FLOPs of one image through a ViT (2 per multiply-add; matmuls and the patch conv only).

    Per layer with N tokens and width D: q/k/v 6ND², attention scores and values 4N²D, output
    projection 2ND², MLP 4·N·D·hidden. LayerNorm, GELU, softmax and adds are not counted.
    """
    P, D = patch_size, embed_dim
    patches = (img_size // P) ** 2
    N = patches + 1
    hidden = int(D * mlp_ratio)
    per_layer = 6 * N * D * D + 4 * N * N * D + 2 * N * D * D + 4 * N * D * hidden
    return 2 * patches * in_chans * P * P * D + depth * per_layer + 2 * D * num_classes


def counted_flops(fn: Callable[[], Any]) -> int:
    """FLOPs that ``torch.utils.flop_counter`` sees in one call (it does not count CPU fused attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()
