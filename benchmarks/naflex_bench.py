"""Section ``naflex``: images at their own aspect ratio (``data.max_patches``, issue 69) against squares, at an equal
budget of patches, timed in interleaved rounds in one process (``benchmarks.timing``).

    python -m benchmarks naflex --threads 2             # tokens per image, training, captions, the mask's cost
    python -m benchmarks naflex --quick --budget 64

A mixed-aspect set (``--images`` aspects drawn from 1:4 to 4:1, seeded) is cut at each image's grid within
``--budget`` patches (``patch_grid``), the square's own count (``img_size / patch_size`` squared), so both arms
see at most as many patches an image. Rows: the valid patches per image and the padded share of batches of
``--batch`` images (in the set's order, and sorted by length as buckets batch them); a classifier's training step
(forward, cross-entropy, backward, SGD) and greedy captions (``<eos>`` unreachable: every call makes the same
tokens) on a batch of mixed-aspect ``Patches`` against the same number of squares, in valid patch tokens per
second; and the encoder layers on the fused attention path with the padding mask against without one, the same
tokens (every token valid), so that the ratio is the mask's cost alone. The training step also runs packed
(NaViT): each image's tokens placed several to a row of ``--pack-row`` tokens, first-fit decreasing, with a
block-diagonal mask (``packing``); each image's logits there equal its logits alone (``max_abs_diff`` in the JSON).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.nn import functional as F

from benchmarks.machine import machine_info
from benchmarks.padding import first_fit
from benchmarks.report import format_table, row, write_json
from benchmarks.timing import Env, paired_speedup, ratio_quartiles
from benchmarks.workloads import forced_length
from vitattn.data.preprocess import pad_patches, patch_grid, patchify
from vitattn.layers import Memory
from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer
from vitattn.models.vit import Patches

ENCODER = dict(img_size=128, patch_size=16, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0)  # an 8 x 8 table
DECODER = dict(vocab_size=1000, embed_dim=192, depth=2, num_heads=3, mlp_ratio=2.0, max_len=24, drop_rate=0.0)
ASPECTS = (1 / 4, 1 / 3, 1 / 2, 9 / 16, 3 / 4, 1.0, 4 / 3, 16 / 9, 2.0, 3.0, 4.0)  # width / height
LONG_SIDE = 640  # pixels of each image's long side, as a photo's


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Budget, batch, set size and timing of ``naflex``."""
    p.add_argument("--budget", type=int, default=64, help="patches per image (default: the square's 8 x 8)")
    p.add_argument("--batch", type=int, default=16, help="images per training step and per caption call")
    p.add_argument("--images", type=int, default=512, help="images of the mixed-aspect set")
    p.add_argument("--tokens", type=int, default=16, help="caption tokens generated per image")
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter samples")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per side (default 7, quick 3)")
    p.add_argument("--min-time", type=float, default=None, help="shortest timed sample in seconds (default 0.2)")
    p.add_argument("--pack-row", type=int, default=None, help="tokens a packed row holds (default 4 images' worth)")
    p.add_argument("--out", type=Path, default=Path("bench_results/naflex.json"))


def mixed_grids(count: int, budget: int, seed: int = 0) -> list[tuple[int, int]]:
    """The (rows, columns) of ``count`` images of aspects drawn from ``ASPECTS`` (long side ``LONG_SIDE``) at their
    own grid within ``budget`` patches."""
    rng = random.Random(seed)
    grids = []
    for _ in range(count):
        aspect = rng.choice(ASPECTS)
        width, height = (
            (LONG_SIDE, round(LONG_SIDE / aspect)) if aspect >= 1 else (round(LONG_SIDE * aspect), LONG_SIDE)
        )
        grids.append(patch_grid(height, width, budget))
    return grids


def padded_share(lengths: list[int]) -> float:
    """The share of a batch's patch slots that are padding, the batch padded to its longest."""
    return 1 - sum(lengths) / (max(lengths) * len(lengths))


class Packing(NamedTuple):
    """Where a padded batch's valid tokens go when packed several images to a row (NaViT): ``source`` (R * row,)
    the flat (B * N) index of each packed slot's token, B * N for an empty slot; ``mask`` (R, 1, row, row) True
    where a query and key belong to different images or to none (the document's ``mask * -1e9``: block-diagonal);
    ``cls`` (B,) the packed slot of each image's class token."""

    source: Tensor
    mask: Tensor
    cls: Tensor


def packing(valid: Tensor, row: int) -> Packing:
    """The ``Packing`` of a batch's (B, N) valid tokens (class token first, then its patches) into rows of ``row``
    tokens, first-fit decreasing (``benchmarks.padding.first_fit``): computed once for a batch, as a loader would."""
    B, N = valid.shape
    lengths = valid.sum(1).tolist()
    places = first_fit(lengths, row)
    R = 1 + max(r for r, _ in places)
    source = torch.full((R * row,), B * N, dtype=torch.long)
    segment = torch.full((R * row,), -1, dtype=torch.long)  # the image of each slot; -1 empty
    for i, ((r, offset), n) in enumerate(zip(places, lengths, strict=True)):
        start = r * row + offset
        source[start : start + n] = i * N + valid[i].cpu().nonzero().squeeze(1)
        segment[start : start + n] = i
    segment = segment.view(R, row)
    mask = (segment[:, :, None] != segment[:, None, :]).unsqueeze(1)  # (R, 1, row, row)
    cls = torch.tensor([r * row + offset for r, offset in places])
    return Packing(*(t.to(valid.device) for t in (source, mask, cls)))


def packed_logits(model: VisionTransformer, batch: Patches, pack: Packing) -> Tensor:
    """(B, classes) logits of ``batch`` run packed: its embedded tokens gathered into ``pack``'s rows, the encoder
    layers with the block-diagonal mask, each image's class token pooled (``global_pool="cls"``)."""
    if model.global_pool != "cls":
        raise ValueError(f"packed rows pool each image's class token, not global_pool={model.global_pool!r}")
    memory = model.embed(batch)
    B, N, D = memory.tokens.shape
    flat = torch.cat([memory.tokens.reshape(B * N, D), memory.tokens.new_zeros(1, D)])
    x = flat[pack.source].view(-1, pack.mask.shape[-1], D)  # (R, row, D)
    for block in model.blocks:
        x = block(x, pack.mask)
    cls = model.norm(x).flatten(0, 1)[pack.cls]  # (B, D)
    return model.forward_head(Memory(cls.unsqueeze(1)))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Every part, the table printed, ``--out`` written."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = Env(args.device, args.quick, args.repeats, args.min_time)
    side = ENCODER["img_size"] // ENCODER["patch_size"]
    if args.budget != side * side:
        print(f"note: --budget {args.budget} differs from the square's {side * side} patches: budgets unequal")
    info = machine_info(torch.get_num_threads())
    print(f"torch {info['torch']} | threads {info['torch_threads']} | {info['cpu']} | load {info['loadavg_start']}")
    grids = mixed_grids(args.images, args.budget)
    batch = _patches(grids[: args.batch], env.device)
    squares = torch.randn(args.batch, 3, ENCODER["img_size"], ENCODER["img_size"], device=env.device)
    rows, details = _tokens(grids, args.batch, side * side)
    for part in (_train_step, _captions):
        new, details[part.__name__.strip("_")] = part(env, batch, squares, args)
        rows += new
    new, details["mask"] = _mask(env, args.batch)
    rows += new
    result = dict(argv=args.argv, machine=info, rows=rows, details=details, created=time.strftime("%Y-%m-%d %H:%M:%S"))
    write_json(result, args.out)
    print(f"\n{format_table(rows)}\nwrote {args.out}")
    return result


def _patches(grids: list[tuple[int, int]], device: str) -> Patches:
    """Noise images at ``grids`` as one padded ``Patches`` batch."""
    P = ENCODER["patch_size"]
    images = [torch.randn(3, r * P, c * P) for r, c in grids]
    return pad_patches([patchify(image, P) for image in images]).to(device)


def _tokens(grids: list[tuple[int, int]], B: int, square: int) -> tuple[list[dict], dict[str, Any]]:
    """Valid patches per image against the square's, and the padded share of batches in order and sorted."""
    lengths = [r * c for r, c in grids]
    batches = [lengths[i : i + B] for i in range(0, len(lengths) - B + 1, B)]
    ordered = sorted(lengths)
    buckets = [ordered[i : i + B] for i in range(0, len(ordered) - B + 1, B)]
    mean = statistics.mean(lengths)
    in_order = statistics.mean(map(padded_share, batches))
    sorted_share = statistics.mean(map(padded_share, buckets))
    rows = [
        row(
            "valid patches per image",
            mean,
            square,
            "patches",
            mean / square,
            None,
            "square",
            note=f"{min(lengths)}-{max(lengths)}",
        ),
        row(
            f"padded share, batches of {B} in order",
            None,
            None,
            "",
            in_order,
            None,
            percent=True,
            note=f"max {100 * max(map(padded_share, batches)):.1f}%",
        ),
        row(f"padded share, batches of {B} sorted by length", None, None, "", sorted_share, None, percent=True),
    ]
    details = dict(lengths_histogram={n: lengths.count(n) for n in sorted(set(lengths))}, square=square)
    return rows, details


def _rate_row(
    name: str, native: list[float], square: list[float], work: tuple[float, float], unit: str, ref_name: str = "square"
) -> dict:
    """A row of native (or another arm) against square (or ``ref_name``) per second, each side its own ``work`` a
    call: the median of the per-round ratios, and their quartiles in the note."""
    scale = work[0] / work[1]
    q = [scale * x for x in ratio_quartiles(native, square)]
    note = f"IQR {q[0]:.3f}-{q[2]:.3f}"
    ratio = scale * paired_speedup(native, square)
    return row(
        name,
        work[0] / statistics.median(native),
        work[1] / statistics.median(square),
        unit,
        ratio,
        None,
        ref_name,
        note=note,
    )


def _train_step(env: Env, batch: Patches, squares: Tensor, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """A classifier's step on the mixed batch padded, packed and against the squares: valid patch tokens/s and
    images/s; the packed logits against each image's alone."""
    model = VisionTransformer(**ENCODER, num_classes=10).to(env.device).train()
    labels = torch.randint(0, 10, (len(squares),), device=env.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    pack_row = args.pack_row or 4 * (1 + args.budget)
    pack = packing(F.pad(batch.valid, (1, 0), value=True), pack_row)  # each image's class token first
    with torch.no_grad():
        model.eval()
        alone = torch.cat(
            [model(Patches(*(t[i : i + 1, : int(batch.valid[i].sum())] for t in batch))) for i in range(len(squares))]
        )
        diff = (packed_logits(model, batch, pack) - alone).abs().max().item()
        model.train()

    def step(images: Tensor | Patches, packed: bool = False) -> None:
        opt.zero_grad(set_to_none=True)
        with env.autocast():
            logits = packed_logits(model, images, pack) if packed else model(images)
            loss = F.cross_entropy(logits, labels)
        loss.backward()
        opt.step()

    t = env.time(
        {"native": lambda: step(batch), "square": lambda: step(squares), "packed": lambda: step(batch, packed=True)}
    )
    tokens = (int(batch.valid.sum()), squares.shape[0] * (ENCODER["img_size"] // ENCODER["patch_size"]) ** 2)
    B, R = len(squares), pack.mask.shape[0]
    slots = {"native": batch.valid.numel() + B, "packed": R * pack_row}  # class tokens included
    packed_name = f"train step b{B} packed in rows of {pack_row}, images/s"
    rows = [
        _rate_row(f"train step b{B}, patch tokens/s", t["native"], t["square"], tokens, "tok/s"),
        _rate_row(f"train step b{B}, images/s", t["native"], t["square"], (B, B), "img/s"),
        _rate_row(packed_name, t["packed"], t["native"], (B, B), "img/s", ref_name="native"),
        row(
            f"padded share, b{B} packed in {R} rows of {pack_row}",
            None,
            None,
            "",
            1 - (tokens[0] + B) / slots["packed"],
            None,
            percent=True,
            note=f"padded {100 * (1 - (tokens[0] + B) / slots['native']):.1f}% (class tokens counted); "
            f"logits packed vs alone max abs diff {diff:.1e}",
        ),
    ]
    return rows, dict(
        seconds=t,
        tokens=tokens,
        padded_slots=int((~batch.valid).sum()),
        pack_row=pack_row,
        packed_rows=R,
        slots=slots,
        max_abs_diff=diff,
    )


def _captions(env: Env, batch: Patches, squares: Tensor, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """Greedy captions of ``args.tokens`` tokens, the mixed batch against the squares: image tokens/s, images/s."""
    model = ImageCaptioner(VisionTransformer(**ENCODER), CaptionDecoder(**DECODER)).to(env.device).eval()

    def caption(images: Tensor | Patches) -> None:
        with torch.inference_mode(), forced_length(model.decoder), env.autocast():
            model.generate(images, max_new_tokens=args.tokens)

    t = env.time(
        {"native": lambda: caption(batch), "square": lambda: caption(squares)}, repeats=max(3, env.repeats - 2)
    )
    tokens = (int(batch.valid.sum()), squares.shape[0] * (ENCODER["img_size"] // ENCODER["patch_size"]) ** 2)
    B = len(squares)
    rows = [
        _rate_row(
            f"captions b{B} greedy {args.tokens} tokens, patch tokens/s", t["native"], t["square"], tokens, "tok/s"
        ),
        _rate_row(f"captions b{B} greedy {args.tokens} tokens, images/s", t["native"], t["square"], (B, B), "img/s"),
    ]
    return rows, dict(seconds=t, tokens=tokens)


def _mask(env: Env, B: int) -> tuple[list[dict], dict]:
    """The encoder layers (fused attention) on B x (1 + the table's patches) tokens with the padding mask (every
    token valid) against without one: the same tokens and the same outputs, the mask's cost alone."""
    model = VisionTransformer(**ENCODER).to(env.device).eval()
    N = 1 + (ENCODER["img_size"] // ENCODER["patch_size"]) ** 2
    tokens = torch.randn(B, N, ENCODER["embed_dim"], device=env.device)
    valid = torch.ones(B, N, dtype=torch.bool, device=env.device)

    def layers(memory: Memory) -> Tensor:
        with torch.inference_mode(), env.autocast():
            for block in model.blocks:
                memory = block(memory)
            return memory.tokens

    unmasked, masked = Memory(tokens), Memory(tokens, valid=valid)
    diff = (layers(unmasked) - layers(masked)).abs().max().item()
    t = env.time({"with mask": lambda: layers(masked), "without": lambda: layers(unmasked)})
    name = f"encoder layers b{B} x {N} tokens, fused: with the mask vs without"
    rows = [_rate_row(name, t["with mask"], t["without"], (B * N, B * N), "tok/s", ref_name="without")]
    return rows, dict(seconds=t, max_abs_diff=diff)
