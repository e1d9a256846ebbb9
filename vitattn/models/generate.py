"""Greedy, sampled and beam search over a ``DecodeStep``: one search for every runtime (PyTorch, ONNX).

Dimension letters: B images, K beams, t positions so far, T' generated tokens, V vocabulary. A caption's
length counts ``<eos>``, not ``<bos>`` (Hugging Face's).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

__all__ = [
    "SEARCH_KEYS",
    "CaptionSearch",
    "Candidates",
    "Controls",
    "DecodeStep",
    "SpecialIds",
    "beam_search",
    "beams_of",
    "check_early_stopping",
    "greedy_search",
    "key_uniforms",
    "sample_token",
    "sampling_logits",
    "sequence_log_prob",
    "token_log_probs",
]

# ``generate``'s settings but sampling's (greedy or beam search; ``rerank``), as entry points and reports name them
SEARCH_KEYS = (
    "num_beams",
    "max_new_tokens",
    "length_penalty",
    "early_stopping",
    "min_new_tokens",
    "no_repeat_ngram_size",
    "repetition_penalty",
    "rerank",
)


class Controls(NamedTuple):
    """Hugging Face's logits processors of the same names: ``<eos>`` banned until ``min_new_tokens`` are made; no
    n-gram of ``no_repeat_ngram_size`` twice; each score of a token already in the row (``<bos>`` included)
    divided by ``repetition_penalty`` when positive, multiplied when negative. 0, 0, 1.0: off."""

    min_new_tokens: int = 0
    no_repeat_ngram_size: int = 0
    repetition_penalty: float = 1.0

    def __call__(self, scores: Tensor, tokens: Tensor, eos_id: int) -> Tensor:
        """``scores`` (R, V) of the next token after ``tokens`` (R, 1 + i), ``<bos>`` first, changed in place."""
        if self.repetition_penalty != 1.0:
            seen = scores.gather(1, tokens)  # (R, 1 + i)
            penalised = torch.where(seen < 0, seen * self.repetition_penalty, seen / self.repetition_penalty)
            scores.scatter_(1, tokens, penalised)
        n = self.no_repeat_ngram_size
        if n > 0 and tokens.shape[1] + 1 >= n:
            for row, banned in enumerate(_ngram_bans(tokens.tolist(), n)):
                scores[row, banned] = float("-inf")
        if tokens.shape[1] - 1 < self.min_new_tokens:
            scores[:, eos_id] = float("-inf")
        return scores


NO_CONTROLS = Controls()


def _ngram_bans(rows: list[list[int]], n: int) -> list[list[int]]:
    """For each row, the tokens that would end an n-gram the row already holds (after its last n - 1 tokens)."""
    bans = []
    for row in rows:
        follows: dict[tuple[int, ...], list[int]] = {}
        for i in range(len(row) - n + 1):
            follows.setdefault(tuple(row[i : i + n - 1]), []).append(row[i + n - 1])
        bans.append(follows.get(tuple(row[len(row) - n + 1 :]), []))
    return bans


class DecodeStep(Protocol):
    """The next token's logits after a caption so far, with whatever cache the runtime keeps."""

    def __call__(self, tokens: Tensor) -> Tensor:
        """(B, t) tokens so far (``<bos>`` first; one more than at the previous call) -> (B, V) logits."""

    def reorder(self, index: Tensor) -> None:
        """Keep the cached rows ``index`` (B,), in that order (beam search)."""


class SpecialIds(NamedTuple):
    """The vocabulary's ``<pad>``, ``<bos>``, ``<eos>`` and ``<unk>`` ids (``unk_id`` None: no unknown token) and
    its other special tokens: the search generates ``<eos>`` and no other special token."""

    pad_id: int
    bos_id: int
    eos_id: int
    unk_id: int | None = None
    other_ids: tuple[int, ...] = ()

    @property
    def banned(self) -> list[int]:
        """Every special id but ``<eos>``: never generated."""
        return [self.pad_id, self.bos_id, *([] if self.unk_id is None else [self.unk_id]), *self.other_ids]


class Candidates(NamedTuple):
    """``CaptionSearch.candidates`` of B images, R rows each: ``tokens`` (B, R, T') (no ``<bos>``, ``<pad>`` after
    ``<eos>``), ``log_prob`` (B, R) the sum of each token's log-probability under the plain model (no temperature,
    top-k, top-p, controls or bans), ``length`` (B, R) its tokens, ``<eos>`` included; with the greedy caption,
    row 0 of every image is it."""

    tokens: Tensor
    log_prob: Tensor
    length: Tensor
    greedy: bool = False


def key_uniforms(seed: int, keys: Sequence[str], rows: int, steps: int) -> Tensor:
    """(B, rows, steps) uniforms in [0, 1), image b's drawn from a generator seeded by (``seed``, ``keys[b]``)
    alone: what sampling draws each token with, so an image's candidates never depend on its batch or process."""
    out = torch.empty(len(keys), rows, steps)
    for b, key in enumerate(keys):
        digest = hashlib.blake2b(f"{seed}\0{key}".encode("utf-8", "surrogatepass"), digest_size=8).digest()
        generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))
        out[b] = torch.rand(rows, steps, generator=generator)
    return out


def check_early_stopping(early_stopping: bool | str) -> bool | str:
    """Hugging Face's ``early_stopping``: True, False or ``"never"`` (a command line's ``true`` and ``false``
    read as the booleans), or a one-line ``ValueError``."""
    if isinstance(early_stopping, bool):
        return early_stopping
    value = early_stopping.lower() if isinstance(early_stopping, str) else None
    if value not in ("true", "false", "never"):
        raise ValueError(f"early_stopping={early_stopping!r} must be true, false or never")
    return "never" if value == "never" else value == "true"


class CaptionSearch:
    """``generate`` and ``check_generate`` of a caption model, the same for every runtime: the runtime gives
    ``max_len``, ``special_ids``, ``start_search``, ``encode`` and ``decode_step``; a model that embeds images and
    texts (``embeds`` True) also ``choose`` (``coca.Embedder``'s), which ``rerank`` needs."""

    max_len: int
    special_ids: SpecialIds
    embeds = False

    def start_search(
        self, images: Tensor, max_new_tokens: int, num_beams: int, use_cache: bool
    ) -> tuple[DecodeStep, int, torch.device | str]:
        """Encode (B, C, height, width) images once; the ``DecodeStep`` over them for B * K rows (an image's K
        beams consecutive), B and the device of the search's tokens."""
        raise NotImplementedError

    def encode(self, images: Tensor) -> Any:
        """(B, C, height, width) -> the runtime's encoding of the images, what ``decode_step`` reads."""
        raise NotImplementedError

    def decode_step(self, memory: Any, max_new_tokens: int, use_cache: bool = True) -> DecodeStep:
        """The ``DecodeStep`` over ``encode``'s output for B images; its rows may be R = B * P, an image's P
        consecutive (its beams, or its prompts), with room for ``max_new_tokens`` positions."""
        raise NotImplementedError

    def check_generate(
        self,
        max_new_tokens: int | None = None,
        num_beams: int | None = None,
        do_sample: bool = False,
        temperature: float = 1.0,
        early_stopping: bool | str = False,
        min_new_tokens: int = 0,
        no_repeat_ngram_size: int = 0,
        repetition_penalty: float = 1.0,
        rerank: int = 1,
    ) -> int:
        """Refuse ``generate`` settings it cannot decode with (a one-line ``ValueError``); returns
        ``max_new_tokens`` with None replaced by ``max_len - 1``."""
        check_early_stopping(early_stopping)
        if min_new_tokens < 0 or no_repeat_ngram_size < 0:
            raise ValueError(
                f"min_new_tokens={min_new_tokens} and no_repeat_ngram_size={no_repeat_ngram_size} must be at least 0"
            )
        if not repetition_penalty > 0:
            raise ValueError(f"repetition_penalty={repetition_penalty} must be positive (1.0: off)")
        if max_new_tokens is None:
            max_new_tokens = self.max_len - 1
        if max_new_tokens + 1 > self.max_len:
            raise ValueError(f"max_new_tokens={max_new_tokens} exceeds the decoder's max_len={self.max_len} - 1")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be at least 1")
        num_beams = beams_of(num_beams, rerank, do_sample)
        if num_beams < 1:
            raise ValueError(f"num_beams={num_beams} must be at least 1")
        if do_sample and num_beams > 1:
            raise ValueError("do_sample=True needs num_beams=1 (beam sampling is not supported)")
        if do_sample and temperature <= 0:
            raise ValueError(f"temperature={temperature} must be positive")
        if rerank < 1:
            raise ValueError(f"rerank={rerank} must be at least 1 (1: off)")
        if rerank > 1 and not self.embeds:
            raise ValueError(
                f"rerank={rerank} chooses among captions by image and text embeddings, which only a head=coca model "
                "(its bundle or run folder) has"
            )
        if rerank > num_beams and not do_sample:
            raise ValueError(
                f"rerank={rerank} chooses among the beam's best captions and needs num_beams >= {rerank} "
                f"(num_beams={num_beams}; leave num_beams out for {rerank}), or do_sample=true to choose among "
                f"{rerank} samples"
            )
        return max_new_tokens

    @torch.no_grad()
    def generate(
        self,
        images: Tensor,
        max_new_tokens: int | None = None,
        num_beams: int | None = None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
        min_new_tokens: int = 0,
        no_repeat_ngram_size: int = 0,
        repetition_penalty: float = 1.0,
        rerank: int = 1,
    ) -> Tensor:
        """(B, T') token ids of the images' captions, without ``<bos>``, ending in ``<eos>``, ``<pad>`` after.

        Args:
            images: (B, C, height, width), or ``Patches`` (images at their own grids, padded).
            max_new_tokens: most tokens per caption, ``<eos>`` included; None: ``max_len - 1``.
            num_beams, length_penalty, early_stopping: Hugging Face's beam search (``beam_search``); 1 beam: greedy;
                None: ``rerank`` beams (1 without it, or when sampling).
            do_sample, temperature, top_k, top_p, generator: sampling instead (``top_k=0``, ``top_p=1`` keep all).
            use_cache: decode with the key/value cache; False recomputes every step.
            min_new_tokens, no_repeat_ngram_size, repetition_penalty: Hugging Face's (``Controls``).
            rerank: N > 1 makes N candidates, the beam's N best (``num_beams >= N``) or N samples, and keeps the
                one ``choose`` finds nearest the image (a ``head=coca`` model's, cosine); 1: off.
        """
        controls = Controls(min_new_tokens, no_repeat_ngram_size, repetition_penalty)
        max_new_tokens = self.check_generate(
            max_new_tokens, num_beams, do_sample, temperature, early_stopping, *controls, rerank
        )
        num_beams = beams_of(num_beams, rerank, do_sample)
        rows = rerank if do_sample else num_beams  # caption rows per image: its beams or its samples
        step, B, device = self.start_search(images, max_new_tokens, rows, use_cache)
        if num_beams > 1:
            candidates = beam_search(
                step,
                B,
                max_new_tokens,
                num_beams,
                self.special_ids,
                length_penalty,
                early_stopping,
                device,
                controls,
                num_return_sequences=rerank,
            )
        else:
            sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, generator=generator) if do_sample else None
            candidates = greedy_search(step, B * rows, max_new_tokens, self.special_ids, device, sample, controls)
        if rerank == 1:
            return candidates
        return _trim(self.choose(images, candidates), self.special_ids.pad_id)

    @torch.no_grad()
    def candidates(
        self,
        images: Tensor,
        num_return_sequences: int,
        keys: Sequence[str] | None = None,
        seed: int = 0,
        include_greedy: bool = False,
        max_new_tokens: int | None = None,
        num_beams: int | None = None,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        use_cache: bool = True,
        min_new_tokens: int = 0,
        no_repeat_ngram_size: int = 0,
        repetition_penalty: float = 1.0,
        rerank: int = 1,
    ) -> Candidates:
        """K = ``num_return_sequences`` captions of each image, all from one encoding whose cross-attention keys
        its K rows share: K samples (``do_sample``; image b's drawn with ``key_uniforms(seed, keys)``, so they
        depend on (seed, key) alone; default keys: positions) or the beam's K best (``num_beams >= K``; default K).
        ``include_greedy``: the greedy caption too, as row 0. Other settings are ``generate``'s; ``rerank``, which
        keeps one caption of N, is refused."""
        K = num_return_sequences
        if rerank != 1:
            raise ValueError(
                f"num_return_sequences={K} keeps every candidate and rerank={rerank} keeps one of them; choose one"
            )
        if K < 1:
            raise ValueError(f"num_return_sequences={K} must be at least 1")
        if not do_sample:
            num_beams = K if num_beams is None else num_beams
            if num_beams < K:
                raise ValueError(
                    f"num_return_sequences={K} takes the beam's {K} best captions and needs num_beams >= {K} "
                    f"(num_beams={num_beams}), or do_sample=true for {K} samples"
                )
        controls = Controls(min_new_tokens, no_repeat_ngram_size, repetition_penalty)
        T = self.check_generate(max_new_tokens, num_beams, do_sample, temperature, early_stopping, *controls)
        B = images.shape[0] if isinstance(images, Tensor) else images.valid.shape[0]  # square images, or ``Patches``
        ids, device = self.special_ids, images.device
        memory = self.encode(images)  # once, whatever K
        if do_sample:
            rows = K + include_greedy  # an image's rows consecutive, its greedy one first
            uniform = key_uniforms(seed, keys or [str(b) for b in range(B)], K, T)  # (B, K, T'): the same K samples
            uniform = torch.cat([uniform.new_zeros(B, rows - K, T), uniform], dim=1).to(device)  # (B, rows, T')
            greedy = (torch.arange(rows, device=device) < int(include_greedy)).repeat(B)  # (B * rows,)
            sample = dict(temperature=temperature, top_k=top_k, top_p=top_p, uniform=uniform.view(B * rows, T))
            step = self.decode_step(memory, T, use_cache)
            tokens, log_prob = greedy_search(step, B * rows, T, ids, device, sample, controls, greedy, log_probs=True)
        else:
            step = self.decode_step(memory, T, use_cache)
            beams = beam_search(
                step, B, T, num_beams, ids, length_penalty, early_stopping, device, controls, num_return_sequences=K
            )  # (B * K, T')
            rows = K + include_greedy
            found = [beams.view(B, K, -1)]
            if include_greedy:
                found.insert(
                    0, greedy_search(self.decode_step(memory, T, use_cache), B, T, ids, device, None, controls)
                )
            width = max(t.shape[-1] for t in found)
            padded = [_pad_to(t.reshape(B, -1, t.shape[-1]), width, ids.pad_id) for t in found]
            tokens = torch.cat(padded, dim=1).reshape(B * rows, width)  # (B * rows, T')
            framed = torch.cat([tokens.new_full((B * rows, 1), ids.bos_id), tokens], dim=1)
            log_prob = token_log_probs(self.decode_step(memory, width, use_cache), framed, ids.pad_id).sum(1)
        length = (tokens != ids.pad_id).sum(1)
        return Candidates(tokens.view(B, rows, -1), log_prob.view(B, rows), length.view(B, rows), include_greedy)


def _pad_to(tokens: Tensor, width: int, pad_id: int) -> Tensor:
    """(..., t) tokens right-padded with ``pad_id`` to (..., width)."""
    return torch.nn.functional.pad(tokens, (0, width - tokens.shape[-1]), value=pad_id)


def beams_of(num_beams: int | None, rerank: int = 1, do_sample: bool = False) -> int:
    """``generate``'s beams: ``num_beams`` as given; not given, the ``rerank`` candidates' (1 when sampling)."""
    if num_beams is not None:
        return num_beams
    return 1 if do_sample else max(rerank, 1)


def sequence_log_prob(step: DecodeStep, generated: Tensor, ids: SpecialIds, controls: Controls = NO_CONTROLS) -> Tensor:
    """Total log-probability of generated captions (B, T') (``<bos>`` excluded, padded after ``<eos>``),
    fed to a fresh ``step`` one position at a time, as the beam search scores tokens: the banned tokens masked
    before ``log_softmax``, the ``controls`` after. Returns (B,) sums over the non-pad tokens."""
    B, T = generated.shape
    tokens = torch.cat([generated.new_full((B, 1), ids.bos_id), generated], dim=1)  # (B, 1 + T')
    total = torch.zeros(B, dtype=torch.float, device=generated.device)
    for i in range(T):
        logp = controls(_next_logits(step, tokens[:, : i + 1], ids).log_softmax(-1), tokens[:, : i + 1], ids.eos_id)
        token = generated[:, i]
        total += logp.gather(1, token[:, None]).squeeze(1).masked_fill(token == ids.pad_id, 0.0)  # banned <pad>: -inf
    return total


def token_log_probs(step: DecodeStep, tokens: Tensor, pad_id: int) -> Tensor:
    """(R, T) rows ``<bos> ... <eos>``, right-padded -> (R, T - 1) fp32 log-probability of each token after
    ``<bos>`` given the ones before it, as the model gives it (nothing banned: a prompt may hold ``<unk>``); 0 at
    padding. Fed to a fresh ``step`` (``decode_step(memory, T - 1)``) one position at a time, so every runtime
    scores through its own key/value cache: what caption-likelihood zero-shot classification sums."""
    R, T = tokens.shape
    columns = []
    for i in range(T - 1):
        logp = step(tokens[:, : i + 1]).float().log_softmax(-1)  # (R, V)
        columns.append(logp.gather(1, tokens[:, i + 1, None]))  # (R, 1)
    return torch.cat(columns, dim=1).masked_fill(tokens[:, 1:] == pad_id, 0.0)  # (R, T - 1)


def _next_logits(step: DecodeStep, tokens: Tensor, ids: SpecialIds) -> Tensor:
    """(B, V) fp32 logits of the next token, ``ids.banned`` (every special but ``<eos>``) never generated."""
    return _ban(step(tokens).float(), ids)  # a no-op (no copy) when already fp32


def _ban(logits: Tensor, ids: SpecialIds) -> Tensor:
    """``logits`` (B, V) with ``ids.banned`` at -inf, in place."""
    for banned in ids.banned:  # scalar indices: no index tensor is built (and copied to the GPU) per step
        logits[:, banned] = float("-inf")
    return logits


def greedy_search(
    step: DecodeStep,
    batch_size: int,
    max_new_tokens: int,
    ids: SpecialIds,
    device: torch.device | str = "cpu",
    sample: dict | None = None,
    controls: Controls = NO_CONTROLS,
    greedy_rows: Tensor | None = None,
    log_probs: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """(B, T') the most likely token at each step, or one sampled with ``sample``'s settings (``sample_token``'s;
    its ``uniform``, if any, (B, T'): step i draws with column i); the ``controls`` change the banned logits first
    (Hugging Face's processors, then its temperature, top-k and top-p). ``greedy_rows`` (B,) bool: rows that take
    the most likely token even when sampling. ``log_probs``: also (B,) each row's total log-probability under the
    plain model (the step's logits, nothing banned or controlled), ``<eos>`` included."""
    B = batch_size
    # every column allocated once; step i reads columns 0..i and writes column i + 1
    tokens = torch.full((B, max_new_tokens + 1), ids.pad_id, dtype=torch.long, device=device)  # (B, 1 + T')
    tokens[:, 0] = ids.bos_id
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    total = torch.zeros(B, device=device)
    uniform = None if sample is None else sample.get("uniform")
    for i in range(max_new_tokens):
        if log_probs:
            raw = step(tokens[:, : i + 1]).float()  # (B, V)
            plain = raw.log_softmax(-1)  # before the bans change ``raw`` in place
            logits = controls(_ban(raw, ids), tokens[:, : i + 1], ids.eos_id)
        else:
            logits = controls(_next_logits(step, tokens[:, : i + 1], ids), tokens[:, : i + 1], ids.eos_id)  # (B, V)
        if sample is None:
            nxt = logits.argmax(-1)  # (B,)
        else:
            nxt = sample_token(logits, **{**sample, "uniform": None if uniform is None else uniform[:, i]})
            if greedy_rows is not None:
                nxt = torch.where(greedy_rows, logits.argmax(-1), nxt)
        nxt.masked_fill_(finished, ids.pad_id)
        if log_probs:
            total += plain.gather(1, nxt[:, None]).squeeze(1).masked_fill(finished, 0.0)
        tokens[:, i + 1] = nxt
        finished |= nxt == ids.eos_id
        if bool(finished.all()):
            tokens = tokens[:, : i + 2]
            break
    return (tokens[:, 1:], total) if log_probs else tokens[:, 1:]


def beam_search(
    step: DecodeStep,
    batch_size: int,
    max_new_tokens: int,
    num_beams: int,
    ids: SpecialIds,
    length_penalty: float = 1.0,
    early_stopping: bool | str = False,
    device: torch.device | str = "cpu",
    controls: Controls = NO_CONTROLS,
    num_return_sequences: int = 1,
) -> Tensor:
    """Hugging Face's beam search (``generate(num_beams=K)``, docs/captioning.md#decoding) over B * K rows:
    (B * R, T') each image's R = ``num_return_sequences`` <= K best finished captions, best first, consecutive,
    by ``log p / length ** length_penalty`` (banned tokens masked before ``log_softmax``, ``controls`` after); one
    host sync a step.
    """
    early_stopping = check_early_stopping(early_stopping)
    B, K, T = batch_size, num_beams, max_new_tokens
    if not 1 <= num_return_sequences <= K:
        raise ValueError(f"num_return_sequences={num_return_sequences} must be between 1 and num_beams={K}")
    inf = float("-inf")
    # every column allocated once; step i writes column i + 1 of the candidates
    live = torch.full((B, K, 1 + T), ids.pad_id, dtype=torch.long, device=device)  # (B, K, 1 + T')
    live[:, :, 0] = ids.bos_id
    live_scores = torch.full((B, K), inf, device=device)
    live_scores[:, 0] = 0.0  # all beams start identical: expand only the first
    done = live.clone()  # (B, K, 1 + T') finished captions, best first
    done_scores = torch.full((B, K), inf, device=device)  # -inf: an empty slot
    closed = torch.zeros(B, dtype=torch.bool, device=device)  # images that take no more finished captions
    offsets = torch.arange(B, device=device)[:, None] * K  # (B, 1)
    first_k = torch.arange(2 * K, device=device) < K  # (2K,) only the first K candidates may finish
    for i in range(T):
        rows = live.view(B * K, 1 + T)[:, : i + 1]  # (B*K, 1 + i)
        logp = controls(_next_logits(step, rows, ids).log_softmax(-1), rows, ids.eos_id)  # (B*K, V)
        V = logp.shape[-1]
        cand = (live_scores.view(B * K, 1) + logp).view(B, K * V)
        cand_scores, cand_idx = cand.topk(2 * K, dim=1)  # (B, 2K), best first
        beam = cand_idx // V  # (B, 2K) the live beam each candidate extends
        cand_tokens = live.gather(1, beam[:, :, None].expand(B, 2 * K, 1 + T))  # (B, 2K, 1 + T')
        cand_tokens[:, :, i + 1] = cand_idx % V
        last = i == T - 1
        ends = cand_tokens[:, :, i + 1] == ids.eos_id if not last else torch.ones_like(first_k)  # (B, 2K)
        finished = ends & first_k & ~closed[:, None]  # (B, 2K)
        scored = (cand_scores / (i + 1) ** length_penalty).masked_fill(~finished, inf)
        done_scores, pick = torch.cat([done_scores, scored], dim=1).topk(K, dim=1)  # (B, K) of 3K
        done = torch.cat([done, cand_tokens], dim=1).gather(1, pick[:, :, None].expand(B, K, 1 + T))
        if last:
            break
        live_scores, keep = cand_scores.masked_fill(ends, inf).topk(K, dim=1)  # (B, K) of 2K
        live = cand_tokens.gather(1, keep[:, :, None].expand(B, K, 1 + T))
        step.reorder((offsets + beam.gather(1, keep)).view(-1))  # (B*K,) the rows the live beams extend
        closed |= _closed(live_scores, done_scores, early_stopping, length_penalty, i + 1, T)
        if bool(closed.all()):
            break
    return _trim(done[:, :num_return_sequences, 1:].reshape(-1, T), ids.pad_id)  # (B * R, T')


def _closed(
    live_scores: Tensor, done_scores: Tensor, early_stopping: bool | str, length_penalty: float, length: int, T: int
) -> Tensor:
    """(B,) images whose K finished captions (B, K) no live beam (B, K) can beat, as ``early_stopping`` judges
    (Hugging Face's ``_check_early_stop_heuristic``), ``length`` tokens generated of at most T."""
    full = done_scores[:, -1] > float("-inf")  # K finished: the worst of them is finite
    if early_stopping is True:
        return full
    longest = T if early_stopping == "never" and length_penalty > 0 else length
    return full & (live_scores[:, 0] / longest**length_penalty <= done_scores[:, -1])


def sample_token(
    logits: Tensor,
    temperature: float,
    top_k: int,
    top_p: float,
    generator: torch.Generator | None = None,
    uniform: Tensor | None = None,
) -> Tensor:
    """One token per row from temperature-scaled logits (B, V), after top-k and top-p filtering; ``uniform`` (B,)
    in [0, 1): each row's draw given (inverse transform of its distribution), instead of ``generator``'s."""
    probs = sampling_logits(logits, temperature, top_k, top_p).softmax(-1)
    if uniform is None:
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    cdf = probs.cumsum(-1)  # (B, V)
    drawn = torch.searchsorted(cdf, (uniform.to(cdf) * cdf[:, -1])[:, None], right=True)  # (B, 1): first cdf > u
    return drawn.squeeze(1).clamp_(max=probs.shape[-1] - 1)


def sampling_logits(logits: Tensor, temperature: float, top_k: int, top_p: float, keep: Tensor | None = None) -> Tensor:
    """The logits (..., V) of the policy ``sample_token`` draws from: divided by ``temperature``, then every token
    outside the ``top_k`` and outside the smallest set whose mass reaches ``top_p`` at -inf; ``keep`` (..., V) bool:
    tokens never dropped (SCST's scoring keeps the tokens it sampled)."""
    if temperature <= 0:
        raise ValueError(f"temperature={temperature} must be positive")
    logits = logits / temperature
    drop = torch.zeros_like(logits, dtype=torch.bool)
    if top_k > 0:
        kth = logits.topk(min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]  # (..., 1)
        drop |= logits < kth
    if top_p < 1.0:
        sorted_logits, order = logits.masked_fill(drop, float("-inf")).sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        beyond = probs.cumsum(-1) - probs > top_p  # keep the smallest set whose mass reaches top_p
        drop |= beyond.scatter(-1, order, beyond)
    if keep is not None:
        drop &= ~keep
    return logits.masked_fill(drop, float("-inf"))


def _trim(tokens: Tensor, pad_id: int) -> Tensor:
    """Drop trailing columns that are padding in every row."""
    keep = int((tokens != pad_id).any(dim=0).nonzero().max().item()) + 1 if (tokens != pad_id).any() else 1
    return tokens[:, :keep]
