"""Beam search: vitattn's (Hugging Face's rules) against the search it replaced and ``transformers``' ``generate``.

    python -m benchmarks.beam_search [--threads 1] [--repeats 7] [--batch 8] [--beams 3] [--tokens 20] [--out FILE.json]

Random weights at the bench's caption size (``workloads.build_ours``: the 32 px ViT, a 4-layer decoder of
width 192, vocabulary 10,000); Hugging Face's side is ``caption.build_captioners``' VisionEncoderDecoder of the
same sizes. Each caption runs exactly ``--tokens`` steps (``<eos>`` unreachable for ours, ``min_new_tokens`` for
Hugging Face), so all sides do the same number of decoder steps. Two rows:

- *decode only*: the encoder's output given (``caption.given_memory``); decoder steps and search, ours now
  (``generate``), ours before (``previous_beam_search`` over the same ``DecoderStep``) and Hugging Face
  ``generate(encoder_outputs=...)``.
- *search only*: a step that returns fixed random logits (B * K, V), so that only the search's own work
  (top-k, gathers, finished captions) is timed: ours now against ours before.

Sides run interleaved in rounds (A B C, C B A, ...) after a warm-up call each; a figure is the median over rounds
in ms per batch, of wall time and of this process's CPU time (at one thread, the steadier of the two on a
shared machine), a ratio the median of per-round CPU-time ratios.

Dimension letters: B images, K beams, V vocabulary, T' generated tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor

from benchmarks import workloads
from benchmarks.caption import build_captioners, given_memory
from benchmarks.timing import paired_speedup, ratio_quartiles
from benchmarks.workloads import forced_length
from vitattn.models.generate import DecodeStep, SpecialIds, beam_search


def previous_beam_search(
    step: DecodeStep,
    batch_size: int,
    max_new_tokens: int,
    num_beams: int,
    ids: SpecialIds,
    length_penalty: float = 1.0,
    device: torch.device | str = "cpu",
) -> Tensor:
    """vitattn's beam search before Hugging Face's rules (commit 1acdf23), kept to time against: finished
    beams keep their slots (continued with ``<pad>`` at no cost), the K best of K * V candidates live on, and
    the length penalty ranks the survivors at the end."""
    B, K = batch_size, num_beams
    tokens = torch.full((B * K, 1), ids.bos_id, dtype=torch.long, device=device)
    scores = torch.zeros(B, K, dtype=torch.float, device=device)
    scores[:, 1:] = float("-inf")
    scores = scores.view(-1)  # (B*K,)
    finished = torch.zeros(B * K, dtype=torch.bool, device=device)
    offsets = torch.arange(B, device=device)[:, None] * K  # (B, 1)
    for _ in range(max_new_tokens):
        logits = step(tokens).float()
        logits[:, ids.pad_id] = float("-inf")
        logits[:, ids.bos_id] = float("-inf")
        logp = logits.log_softmax(-1)  # (B*K, V)
        V = logp.shape[-1]
        cand = scores.masked_fill(finished, float("-inf"))[:, None] + logp  # (B*K, V)
        cand[:, ids.pad_id] = torch.where(finished, scores, cand[:, ids.pad_id])
        cand = cand.view(B, K * V)
        top_scores, top_idx = cand.topk(K, dim=1)  # (B, K)
        src = (offsets + top_idx // V).view(-1)
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
    return generated.index_select(0, best)


class FixedLogits:
    """A ``DecodeStep`` whose logits are one random (B * K, V) tensor: the search's own cost, no decoder."""

    def __init__(self, rows: int, vocab_size: int) -> None:
        self.logits = torch.randn(rows, vocab_size, generator=torch.Generator().manual_seed(0))

    def __call__(self, tokens: Tensor) -> Tensor:
        return self.logits

    def reorder(self, index: Tensor) -> None:
        pass


def _rounds(fns: Mapping[str, Callable[[], object]], repeats: int, min_time: float = 0.0) -> dict[str, dict]:
    """``{"wall": {name: seconds}, "cpu": {name: seconds}}``: per call, ``repeats`` samples each, in interleaved
    rounds (the order reversed every other round) after one warm-up call each that sizes an inner loop of at
    least ``min_time`` seconds."""
    inner = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        inner[name] = max(1, math.ceil(min_time / max(time.perf_counter() - t0, 1e-9)))
    samples: dict[str, dict] = {"wall": {name: [] for name in fns}, "cpu": {name: [] for name in fns}}
    for r in range(repeats):
        for name in list(fns)[:: 1 if r % 2 == 0 else -1]:
            wall, cpu = time.perf_counter(), time.process_time()
            for _ in range(inner[name]):
                fns[name]()
            samples["wall"][name].append((time.perf_counter() - wall) / inner[name])
            samples["cpu"][name].append((time.process_time() - cpu) / inner[name])
    return samples


def _row(name: str, samples: dict[str, dict]) -> dict:
    cpu, others = samples["cpu"], [side for side in samples["cpu"] if side != "now"]
    return dict(
        row=name,
        ms_per_batch={side: 1e3 * statistics.median(s) for side, s in cpu.items()},
        wall_ms_per_batch={side: 1e3 * statistics.median(s) for side, s in samples["wall"].items()},
        **{f"{side}_over_now": paired_speedup(cpu["now"], cpu[side]) for side in others},  # above 1: now is faster
        **{f"{side}_over_now_iqr": ratio_quartiles(cpu["now"], cpu[side]) for side in others},
        seconds=samples,
    )


def bench(batch: int, beams: int, tokens: int, repeats: int) -> list[dict]:
    """The two rows (see the module docstring), each ``{"row", "ms_per_batch": {"now", "before"[, "hf"]},
    "before_over_now"[, "hf_over_now"], ...}``; each side's output shape is checked first."""
    torch.manual_seed(0)
    ours, hf = build_captioners("cpu")
    img = workloads.ENCODERS["vit_192d6_32px"]["img_size"]
    images = torch.randn(batch, 3, img, img)
    with torch.inference_mode():
        memory = ours.encode(images)  # (B, N, D)
        hf_memory = hf.encoder(pixel_values=images).last_hidden_state
    ids = ours.special_ids

    def now() -> Tensor:
        with torch.inference_mode(), given_memory(ours, memory), forced_length(ours.decoder):
            return ours.generate(images, max_new_tokens=tokens, num_beams=beams)

    def before() -> Tensor:
        with torch.inference_mode(), given_memory(ours, memory), forced_length(ours.decoder):
            step, B, device = ours.start_search(images, tokens, beams, True)
            return previous_beam_search(step, B, tokens, beams, ours.special_ids, 1.0, device)

    def hugging_face() -> Tensor:
        from transformers.modeling_outputs import BaseModelOutput

        with torch.inference_mode():  # a new BaseModelOutput each call: beam search expands it in place
            out = hf.generate(
                encoder_outputs=BaseModelOutput(last_hidden_state=hf_memory),
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                num_beams=beams,
                do_sample=False,
                early_stopping=False,
            )
        return out[:, 1:]

    fixed = FixedLogits(batch * beams, ours.decoder.vocab_size)
    never = SpecialIds(ids.pad_id, ids.bos_id, ours.decoder.vocab_size, ids.unk_id)  # <eos> unreachable

    def search_now() -> Tensor:
        return beam_search(fixed, batch, tokens, beams, never)

    def search_before() -> Tensor:
        return previous_beam_search(fixed, batch, tokens, beams, never)

    decode = {"now": now, "before": before, "hf": hugging_face}
    search = {"now": search_now, "before": search_before}
    for fn in (*decode.values(), *search.values()):
        shape = tuple(fn().shape)
        if shape != (batch, tokens):
            raise RuntimeError(f"{fn.__name__} gave {shape}, not {(batch, tokens)}: the length is not forced")
    return [_row("decode only", _rounds(decode, repeats)), _row("search only", _rounds(search, repeats, 0.2))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--beams", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=20)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rows = bench(args.batch, args.beams, args.tokens, args.repeats)
    print(
        f"threads={args.threads}, batch {args.batch} x {args.beams} beams, {args.tokens} tokens per caption, "
        f"vocabulary {workloads.CAPTION_DECODER['vocab_size']:,}, median of {args.repeats} rounds; "
        "CPU ms per batch (wall ms)"
    )
    print("| row | now | before | HF generate | before / now (CPU) | HF / now (CPU) |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        ms, wall = r["ms_per_batch"], r["wall_ms_per_batch"]
        cells = [f"{ms[side]:.1f} ({wall[side]:.1f})" if side in ms else "-" for side in ("now", "before", "hf")]
        hf_ratio = f"{r['hf_over_now']:.2f}x" if "hf" in ms else "-"
        print(f"| {r['row']} | {' | '.join(cells)} | {r['before_over_now']:.2f}x | {hf_ratio} |")
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
