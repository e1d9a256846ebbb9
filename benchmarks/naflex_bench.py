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
tokens (every token valid), so that the ratio is the mask's cost alone.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import functional as F

from benchmarks.machine import machine_info
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


def _rate_row(name: str, native: list[float], square: list[float], work: tuple[float, float], unit: str) -> dict:
    """A row of native against square per second, each side its own ``work`` a call: the median of the per-round
    ratios, and their quartiles in the note."""
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
        "square",
        note=note,
    )


def _train_step(env: Env, batch: Patches, squares: Tensor, args: argparse.Namespace) -> tuple[list[dict], dict]:
    """A classifier's step on the mixed batch against the squares: valid patch tokens/s and images/s."""
    model = VisionTransformer(**ENCODER, num_classes=10).to(env.device).train()
    labels = torch.randint(0, 10, (len(squares),), device=env.device)
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step(images: Tensor | Patches) -> None:
        opt.zero_grad(set_to_none=True)
        with env.autocast():
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()

    t = env.time({"native": lambda: step(batch), "square": lambda: step(squares)})
    tokens = (int(batch.valid.sum()), squares.shape[0] * (ENCODER["img_size"] // ENCODER["patch_size"]) ** 2)
    B = len(squares)
    rows = [
        _rate_row(f"train step b{B}, patch tokens/s", t["native"], t["square"], tokens, "tok/s"),
        _rate_row(f"train step b{B}, images/s", t["native"], t["square"], (B, B), "img/s"),
    ]
    return rows, dict(seconds=t, tokens=tokens, padded_slots=int((~batch.valid).sum()))


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
    return [_rate_row(name, t["with mask"], t["without"], (B * N, B * N), "tok/s")], dict(seconds=t, max_abs_diff=diff)
