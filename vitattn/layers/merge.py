"""Token merging (ToMe: Bolya et al., "Token Merging: Your ViT but Faster", ICLR 2023) for the encoder layers.

Dimension letters: B batch, N tokens (class token first), C channels, N0 the tokens before any merge.
Tokens travel as a ``Memory``, with their sizes and, when tracked, their sources. Inside a layer, after its
attention, the ``r`` most similar pairs of tokens are merged: bipartite soft matching on the attention keys (mean
over heads), the class token never merged, each merged token the size-weighted mean of what it holds. A token's
size is the number of input tokens it holds; attention adds ``log size`` to the logits (proportional attention), so
a token of size s weighs as its s copies would. docs/captioning.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = ["Matching", "Memory", "bipartite_soft_matching", "merge_schedule", "most_merged", "spread"]


class Memory(NamedTuple):
    """Tokens and what rides beside them, from layer to layer and on to the decoder, the pooling and the
    attention maps: ``tokens`` (B, N, C); ``sizes`` (B, N) the input tokens each holds (None: all 1, nothing
    merged); ``sources`` (B, N, N0) which input tokens each holds, when tracked (attention maps); ``valid`` (B, N)
    bool, False where a row is padding (images of fewer patches than the batch's longest; None: none padded):
    padded tokens are never attended to, pooled or merged."""

    tokens: Tensor
    sizes: Tensor | None = None
    sources: Tensor | None = None
    valid: Tensor | None = None

    def detach(self) -> Memory:
        return Memory(*(None if t is None else t.detach() for t in self))

    def index_select(self, index: Tensor) -> Memory:
        """The rows ``index`` (M,) of each part: (M, N, C) tokens, (M, N) sizes, (M, N, N0) sources, (M, N) valid."""
        return Memory(*(None if t is None else t.index_select(0, index) for t in self))


class Matching(NamedTuple):
    """One layer's merge, indices into the even tokens (A, class token first) and the odd ones (B):
    ``kept`` (B, Na - r) A tokens left alone, in their order; ``src`` (B, r) A tokens merged away, each into the B
    token ``dst`` (B, r)."""

    kept: Tensor
    src: Tensor
    dst: Tensor

    def merge(self, x: Tensor) -> Tensor:
        """(B, N, C) -> (B, N - r, C): the kept A tokens, then every B token plus the A tokens merged into it (sums;
        the caller weights by size)."""
        a, b = x[:, ::2], x[:, 1::2]  # (B, Na, C), (B, Nb, C)
        C = x.shape[-1]
        kept = a.gather(1, self.kept.unsqueeze(-1).expand(-1, -1, C))
        src = a.gather(1, self.src.unsqueeze(-1).expand(-1, -1, C))
        b = b.scatter_add(1, self.dst.unsqueeze(-1).expand(-1, -1, C), src)
        return torch.cat([kept, b], dim=1)

    def merge_tokens(self, memory: Memory) -> Memory:
        """The ``Memory`` of (B, N, C) tokens -> that of (B, N - r, C), each merged token the size-weighted mean of
        its parts, with their sizes and sources. Padded tokens (``memory.valid``) are refused: merged as any other,
        they would be averaged into real ones."""
        if memory.valid is not None:
            raise ValueError(
                "token merging (model.merge_tokens) takes no padded patches (data.max_patches): set one of them off"
            )
        x = memory.tokens
        size = memory.sizes if memory.sizes is not None else x.new_ones(x.shape[:2])  # (B, N)
        summed = self.merge(torch.cat([x * size.unsqueeze(-1).to(x.dtype), size.unsqueeze(-1).to(x.dtype)], -1))
        new_size = summed[..., -1]  # (B, N - r): whole numbers, exact in any float dtype up to 256
        x = summed[..., :-1] / new_size.unsqueeze(-1)
        sources = None if memory.sources is None else self.merge(memory.sources)
        return Memory(x, new_size.to(size.dtype), sources)


def bipartite_soft_matching(metric: Tensor, r: int) -> Matching:
    """ToMe's matching of (B, N, C) ``metric`` (the keys, mean over heads): the even tokens (A) each find their
    most similar odd token (B, cosine), and the ``r`` A tokens with the best match are merged into it. Token 0,
    the class token, is in A and never merged."""
    with torch.no_grad():  # indices only: nothing to keep for the backward pass
        metric = metric / metric.norm(dim=-1, keepdim=True)
        a, b = metric[:, ::2], metric[:, 1::2]
        scores = a @ b.transpose(-1, -2)  # (B, Na, Nb)
        best, dst = scores.max(dim=-1)  # (B, Na): each A token's best B token
        best[:, 0] = -math.inf  # the class token merges last, i.e. never (r < Na)
        order = best.argsort(dim=-1, descending=True, stable=True)  # (B, Na)
    kept = order[:, r:].sort(dim=-1).values  # left alone, in their order: the class token first
    src = order[:, :r]
    return Matching(kept, src, dst.gather(1, src))


def most_merged(tokens: int) -> int:
    """The most tokens one layer can merge from ``tokens`` (class token included): all of A but the class token."""
    return (tokens - 1) // 2


def merge_schedule(merge_tokens: int | Sequence[int], tokens: int, depth: int) -> list[int]:
    """Tokens each of ``depth`` layers merges from ``tokens`` input tokens. An int R is ToMe's constant schedule,
    each layer merging R or, deep in the stack where fewer are left, as many as it can; a list is taken as
    written. Raises a one-line ``ValueError`` for a negative count, a list of another length, or a count larger
    than its layer allows."""
    if isinstance(merge_tokens, int):
        if merge_tokens < 0:
            raise ValueError(f"merge_tokens={merge_tokens} must be at least 0 (0: off)")
        if merge_tokens > most_merged(tokens):
            raise ValueError(
                f"merge_tokens={merge_tokens} is too large for {tokens} tokens: at most {most_merged(tokens)}"
            )
        schedule = []
        for _ in range(depth):
            schedule.append(min(merge_tokens, most_merged(tokens)))
            tokens -= schedule[-1]
        return schedule
    schedule = [int(r) for r in merge_tokens]
    if len(schedule) != depth:
        raise ValueError(f"merge_tokens={schedule} has {len(schedule)} entries; the encoder has {depth} layers")
    for layer, r in enumerate(schedule):
        if not 0 <= r <= most_merged(tokens):
            raise ValueError(
                f"merge_tokens[{layer}]={r} is out of range for the {tokens} tokens layer {layer} receives: "
                f"0 to {most_merged(tokens)}"
            )
        tokens -= r
    return schedule


def spread(weights: Tensor, memory: Memory) -> Tensor:
    """(B, ..., N) weights over ``memory``'s merged tokens -> (B, ..., N0) over the input tokens: each merged token's
    weight shared equally among the tokens it holds (``memory.sources``), as attention over their copies would share
    it; unchanged without sources (nothing merged)."""
    if memory.sources is None:
        return weights
    B, N = weights.shape[0], weights.shape[-1]
    share = weights.reshape(B, -1, N) / memory.sizes.unsqueeze(1).to(weights.dtype)  # (B, M, N)
    return (share @ memory.sources.to(weights.dtype)).reshape(*weights.shape[:-1], -1)  # (B, ..., N0)
