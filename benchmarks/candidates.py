"""Section ``candidates``: K caption candidates per image (``vitattn-caption num_return_sequences=K``) against
greedy captions, in one process, interleaved rounds (``benchmarks.timing``).

    python -m benchmarks candidates --threads 2            # model=cpu's captioner and ViT-S/16's, K=5
    python -m benchmarks candidates --quick --sizes model_cpu

For each captioner (``model=cpu``'s encoder, 64 px; ViT-S/16 at 224; both with the bench decoder,
``workloads.CAPTION_DECODER``) it times the encoder alone, greedy captions (encoder + decode) and K sampled
candidates with the plain model's log-probabilities (``CaptionSearch.candidates``), every row making the same
``max_new_tokens`` (``<eos>`` unreachable). The split is greedy's decode = greedy - encoder; the target: K
candidates take at most greedy + K x greedy's decode x 1.1 (the encoder runs once, whatever K).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks import workloads
from benchmarks.machine import machine_info
from benchmarks.report import format_table, row, write_json
from benchmarks.timing import Env

# conf/model/cpu.yaml's encoder at data=shapes' 64 px
MODEL_CPU = dict(img_size=64, patch_size=8, embed_dim=128, depth=4, num_heads=4, mlp_ratio=2.0)
SIZES = {"model_cpu": (MODEL_CPU, 32), "vit_s16_224": (workloads.ENCODERS["vit_s16_224"], 8)}  # encoder, images
SLACK = 1.1  # the decode's allowance per candidate


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Sizes, K and timing of ``candidates``."""
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    p.add_argument("-k", type=int, default=5, help="candidates per image (num_return_sequences)")
    p.add_argument("--tokens", type=int, default=workloads.CAPTION_TOKENS, help="tokens per caption")
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter samples")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per side (default 7, quick 3)")
    p.add_argument("--out", type=Path, default=Path("bench_results/candidates.json"))


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every size, print the table, write ``--out``."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = Env(args.device, args.quick, args.repeats)
    info = machine_info(torch.get_num_threads())
    print(f"torch {info['torch']} | threads {info['torch_threads']} | {info['cpu']} | device {args.device}", flush=True)
    rows, details = [], {}
    for name in args.sizes:
        new, details[name] = _size(env, name, args.k, args.tokens)
        rows += new
        print(format_table(new), flush=True)
    result = dict(argv=args.argv, machine=info, rows=rows, details=details, created=time.strftime("%Y-%m-%d %H:%M:%S"))
    write_json(result, args.out)
    print(f"\nall rows (threads {args.threads}):\n{format_table(rows)}\nwrote {args.out}")
    return result


def _size(env: Env, name: str, K: int, tokens: int) -> tuple[list[dict], dict[str, Any]]:
    """One captioner: encoder, greedy and K candidates in the same rounds; the bound and the split."""
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    enc, B = SIZES[name]
    decoder = CaptionDecoder(
        memory_dim=enc["embed_dim"], norm_first=True, activation="gelu", **workloads.CAPTION_DECODER
    )
    model = ImageCaptioner(VisionTransformer(num_classes=0, **enc), decoder).to(env.device).eval()
    images = torch.randn(B, 3, enc["img_size"], enc["img_size"], device=env.device)
    keys = [str(i) for i in range(B)]

    def candidates() -> Any:
        return model.candidates(images, K, keys, do_sample=True, max_new_tokens=tokens)

    fns = {
        "encoder": lambda: model.encode(images),
        "greedy": lambda: model.generate(images, max_new_tokens=tokens),
        f"K={K}": candidates,
    }
    with torch.inference_mode(), workloads.forced_length(model.decoder):
        t = env.time(fns, repeats=max(3, env.repeats - 2))
        made = candidates().tokens.shape[-1]
    assert made == tokens, f"{made} tokens made, not {tokens}: <eos> was reachable"
    encoder, greedy, many = (statistics.median(t[k]) for k in fns)
    decode = greedy - encoder
    bound = greedy + K * decode * SLACK
    tag = f"{name} b{B} {tokens} tokens"
    rows = [
        row(
            f"candidates K={K} {tag}: greedy + {K} x decode x {SLACK} over K={K}",
            B / many,
            B / bound,
            "img/s",
            bound / many,
            "candidates",
            f"greedy + {K} decodes",
            note=f"encoder {encoder * 1e3:.1f} ms, greedy decode {decode * 1e3:.1f} ms, K={K} {many * 1e3:.1f} ms",
        )
    ]
    split = dict(encoder_s=encoder, greedy_s=greedy, greedy_decode_s=decode, candidates_s=many, bound_s=bound)
    return rows, dict(encoder=enc, images=B, k=K, tokens=tokens, seconds=t, **split)
