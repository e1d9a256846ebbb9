"""Greedy, sampled and beam search over a decoding step, whichever runtime computes the step.

Dimension letters: B images, K beams, t positions so far, T' generated tokens, V vocabulary.

A ``DecodeStep`` turns the caption so far into the next token's logits and keeps its own key/value
cache; ``ImageCaptioner`` gives one that runs its PyTorch decoder, and the ONNX runtime one that runs
an exported decoder step. The search loops here are the only ones, so both runtimes decode alike;
``CaptionSearch`` gives both caption models the same ``generate``, each saying only how it encodes
images and builds its step (``start_search``).
"""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "CaptionSearch",
    "DecodeStep",
    "SpecialIds",
    "beam_search",
    "check_search",
    "greedy_search",
    "sample_token",
    "sequence_log_prob",
]


class DecodeStep(Protocol):
    """The next token's logits after a caption so far, with whatever cache the runtime keeps."""

    def __call__(self, tokens: Tensor) -> Tensor:
        """(B, t) tokens so far (``<bos>`` first; one more than at the previous call) -> (B, V) logits."""
        ...

    def reorder(self, index: Tensor) -> None:
        """Keep the cached rows ``index`` (B,), in that order (beam search)."""
        ...


class SpecialIds(NamedTuple):
    """The vocabulary's ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>`` ids; ``unk_id`` None: a vocabulary
    without an unknown token. The search never generates ``<pad>``, ``<bos>`` or ``<unk>``."""

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int | None = None


def check_search(
    max_len: int,
    max_new_tokens: int | None = None,
    num_beams: int = 1,
    do_sample: bool = False,
    temperature: float = 1.0,
) -> int:
    """Refuse settings a decoder of ``max_len`` positions cannot decode with (a one-line ``ValueError``);
    returns ``max_new_tokens`` with None replaced by ``max_len - 1``."""
    if max_new_tokens is None:
        max_new_tokens = max_len - 1
    if max_new_tokens + 1 > max_len:
        raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the decoder's max_len={max_len} - 1")
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if num_beams < 1:
        raise ValueError(f"num_beams={num_beams} must be at least 1")
    if do_sample and num_beams > 1:
        raise ValueError("do_sample=True needs num_beams=1 (beam sampling is not supported)")
    if do_sample and temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    return max_new_tokens


class CaptionSearch:
    """``generate`` and ``check_generate`` of a caption model, the same for every runtime: a runtime
    gives its ``max_len`` and ``special_ids`` and says how it encodes images and runs a step
    (``start_search``)."""

    max_len: int
    special_ids: SpecialIds

    def start_search(
        self, images: Tensor, max_new_tokens: int, num_beams: int, use_cache: bool
    ) -> tuple[DecodeStep, int, torch.device | str]:
        """Encode images (B, C, height, width), once per image, and return the ``DecodeStep`` over them for B * K
        rows (the K beams of an image consecutive), B (the images encoded) and the device the search's
        tokens live on."""
        raise NotImplementedError

    def check_generate(
        self, max_new_tokens: int | None = None, num_beams: int = 1, do_sample: bool = False, temperature: float = 1.0
    ) -> int:
        """Refuse ``generate`` settings it cannot decode with (a one-line ``ValueError``); returns
        ``max_new_tokens`` with None replaced by ``max_len - 1``."""
        return check_search(self.max_len, max_new_tokens, num_beams, do_sample, temperature)

    @torch.no_grad()
    def generate(
        self,
        images: Tensor,
        max_new_tokens: int | None = None,
        num_beams: int = 1,
        length_penalty: float = 1.0,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Caption images.

        Args:
            images: (B, C, height, width).
            max_new_tokens: most tokens per caption, ``<eos>`` included; None: ``max_len - 1``.
            num_beams: beam width; 1 is greedy (or sampling with ``do_sample``).
            length_penalty: beams are ranked by ``log p / length ** length_penalty``.
            do_sample: sample instead of taking the most likely token (``num_beams`` must be 1).
            temperature, top_k, top_p: sampling filters (``top_k=0`` and ``top_p=1`` keep all).
            use_cache: incremental decoding with the key/value cache; False recomputes every step.
            generator: random generator for sampling.

        Returns:
            (B, T') token ids without ``<bos>``, ending in ``<eos>`` and padded with ``<pad>``;
            T' ≤ ``max_new_tokens``.
        """
        max_new_tokens = self.check_generate(max_new_tokens, num_beams, do_sample, temperature)
        step, B, device = self.start_search(images, max_new_tokens, num_beams, use_cache)
        if num_beams > 1:
            return beam_search(step, B, max_new_tokens, num_beams, self.special_ids, length_penalty, device)
        sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator) if do_sample else None
        return greedy_search(step, B, max_new_tokens, self.special_ids, device, sample)


def sequence_log_prob(step: DecodeStep, generated: Tensor, ids: SpecialIds) -> Tensor:
    """Total log-probability of generated captions (B, T') (``<bos>`` excluded, padded after ``<eos>``),
    fed to a fresh ``step`` one position at a time. Returns (B,) sums over the non-pad tokens."""
    B, T = generated.shape
    tokens = torch.cat([generated.new_full((B, 1), ids.bos_id), generated], dim=1)  # (B, 1 + T')
    total = torch.zeros(B, dtype=torch.float, device=generated.device)
    for i in range(T):
        logp = step(tokens[:, : i + 1]).float().log_softmax(-1)  # (B, V)
        token = generated[:, i]
        total += logp.gather(1, token[:, None]).squeeze(1) * (token != ids.pad_id)
    return total


def _next_logits(step: DecodeStep, tokens: Tensor, ids: SpecialIds) -> Tensor:
    """(B, V) fp32 logits of the next token, ``<pad>``, ``<bos>`` and ``<unk>`` banned (never generated)."""
    logits = step(tokens).float()  # a no-op (no copy) when already fp32
    # scalar indices: no index tensor is built (and copied to the GPU) per step
    logits[:, ids.pad_id] = float("-inf")
    logits[:, ids.bos_id] = float("-inf")
    if ids.unk_id is not None:
        logits[:, ids.unk_id] = float("-inf")
    return logits


def greedy_search(
    step: DecodeStep,
    batch_size: int,
    max_new_tokens: int,
    ids: SpecialIds,
    device: torch.device | str = "cpu",
    sample: dict | None = None,
) -> Tensor:
    """The most likely token at each step (or a sampled one, with ``sample``: ``sample_token``'s settings).

    Returns:
        (B, T') token ids without ``<bos>``, ending in ``<eos>`` and padded with ``<pad>``.
    """
    B = batch_size
    # every column allocated once; step i reads columns 0..i and writes column i + 1
    tokens = torch.full((B, max_new_tokens + 1), ids.pad_id, dtype=torch.long, device=device)  # (B, 1 + T')
    tokens[:, 0] = ids.bos_id
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    for i in range(max_new_tokens):
        logits = _next_logits(step, tokens[:, : i + 1], ids)  # (B, V)
        nxt = logits.argmax(-1) if sample is None else sample_token(logits, **sample)  # (B,)
        nxt.masked_fill_(finished, ids.pad_id)
        tokens[:, i + 1] = nxt
        finished |= nxt == ids.eos_id
        if bool(finished.all()):
            return tokens[:, 1 : i + 2]
    return tokens[:, 1:]


def beam_search(
    step: DecodeStep,
    batch_size: int,
    max_new_tokens: int,
    num_beams: int,
    ids: SpecialIds,
    length_penalty: float = 1.0,
    device: torch.device | str = "cpu",
) -> Tensor:
    """Beam search; ``step`` sees B * K rows, the K beams of each image consecutive.

    Returns:
        (B, T') the best beam of each image, ranked by ``log p / length ** length_penalty``.
    """
    B, K = batch_size, num_beams
    tokens = torch.full((B * K, 1), ids.bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(B, K, dtype=torch.float, device=device)
    scores[:, 1:] = float("-inf")  # all beams start identical: expand only the first
    scores = scores.view(-1)  # (B*K,)
    finished = torch.zeros(B * K, dtype=torch.bool, device=device)
    offsets = torch.arange(B, device=device)[:, None] * K  # (B, 1)
    for _ in range(max_new_tokens):
        logp = _next_logits(step, tokens, ids).log_softmax(-1)  # (B*K, V)
        V = logp.shape[-1]
        # A finished beam continues only with <pad>, at no cost, so its score stays as it was: its
        # row starts from -inf (one pass over the (B*K, V) candidates, the same pass that adds the
        # scores) and its <pad> column is set back. (No boolean indexing: it finds rows with a device sync.)
        cand = scores.masked_fill(finished, float("-inf"))[:, None] + logp  # (B*K, V)
        cand[:, ids.pad_id] = torch.where(finished, scores, cand[:, ids.pad_id])
        cand = cand.view(B, K * V)
        top_scores, top_idx = cand.topk(K, dim=1)  # (B, K)
        src = (offsets + top_idx // V).view(-1)  # (B*K,) beam each new one extends
        nxt = (top_idx % V).view(-1)
        tokens = torch.cat([tokens.index_select(0, src), nxt[:, None]], dim=1)
        finished = finished.index_select(0, src) | (nxt == ids.eos_id)
        scores = top_scores.view(-1)
        step.reorder(src)
        if bool(finished.all()):
            break
    generated = tokens[:, 1:]  # (B*K, T')
    lengths = (generated != ids.pad_id).sum(dim=1).clamp(min=1).float()
    ranked = (scores / lengths**length_penalty).view(B, K)
    best = offsets.squeeze(1) + ranked.argmax(dim=1)  # (B,)
    return _trim(generated.index_select(0, best), ids.pad_id)


def sample_token(
    logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None
) -> Tensor:
    """One token per row from temperature-scaled logits (B, V), after top-k and top-p filtering."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    logits = logits / temperature
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) > top_p  # keep the smallest set whose mass reaches top_p
        logits = logits.masked_fill(drop.scatter(1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(1)


def _trim(tokens: Tensor, pad_id: int) -> Tensor:
    """Drop trailing columns that are padding in every row."""
    keep = int((tokens != pad_id).any(dim=0).nonzero().max().item()) + 1 if (tokens != pad_id).any() else 1
    return tokens[:, :keep]
