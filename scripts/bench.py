"""Speed of vitattn against timm and Hugging Face, on the same machine, in the same process.

    python scripts/bench.py                 # full run (3 min on a quiet core, < 10 min shared), as in docs/benchmarks.md
    python scripts/bench.py --quick         # a short version (about a minute)
    python scripts/bench.py --no-compile --sections encoder caption
    python scripts/bench.py --device cuda   # bf16 autocast on a GPU: UNTESTED (no GPU where this was written)

Writes a table to stdout, ``--out`` (default ``bench_results/bench.json``) and ``scaling.png`` beside it.

Every comparison runs both sides in the same process, interleaved in rounds (A B, B A, A B, ...)
after a warm-up; each side's figure is its median over the rounds, and the ratio is the median of
the per-round ratios, so that a noisy neighbour slowing one round slows both sides of it. Ratios
are speeds, ours / reference (> 1: ours is faster). The note gives the quartiles of the per-round
ratios. See docs/benchmarks.md for what each row means.

Dimension letters: B batch, N tokens, D width, P patch side, V vocabulary.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import signal
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

SCHEMA = "vitattn-bench/1"
SECTIONS = ("encoder", "compile", "caption", "scaling", "e2e")
STATUSES = ("PASS", "MISS", "info", "pending", "error")

# Targets: row kind -> threshold on its ratio (a speed ratio ours / reference, or a fraction).
TARGETS = {
    "forward": 1.0,  # encoder forward >= timm eager
    "train": 1.0,  # training step >= timm
    "compiled": 1.15,  # our compiled forward >= 1.15x timm eager
    "mfu": 0.80,  # forward GFLOP/s >= 80 % of the measured matmul rate (224 px only)
    "cache_vs_recompute": 3.0,
    "cache_vs_hf": 2.0,
    "e2e": 0.80,  # files -> captions >= 80 % of model-only images/s
}

# The two encoder shapes of the comparison: ViT-Ti/16 at 224 px and a small-image ViT.
ENCODERS = {
    "vit_ti16_224": dict(img_size=224, patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_ratio=4.0),
    "vit_192d6_32px": dict(img_size=32, patch_size=4, embed_dim=192, depth=6, num_heads=3, mlp_ratio=4.0),
    "vit_b16_224": dict(img_size=224, patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_ratio=4.0),
}
ENCODER_BATCH = {"vit_ti16_224": 8, "vit_192d6_32px": 64, "vit_b16_224": 128}
GPU_ONLY = ("vit_b16_224",)  # ViT-B/16 at batch 128 is minutes per step on a 2-core CPU
NUM_CLASSES = 10  # classifier head of the training step

# Captioner: the small-image encoder and the decoder that conf/experiment/coco_vit_small.yaml builds
# on it (width and heads of the encoder, mlp_ratio 2, depth 4, max_len 32), with a vocabulary of
# COCO's size (min_word_freq 5 gives about 10k words).
CAPTION_DECODER = dict(vocab_size=10_000, embed_dim=192, depth=4, num_heads=3, mlp_ratio=2.0, max_len=32)
CAPTION_BATCH, CAPTION_TOKENS = 32, 20


# ------------------------------------------------------------------------------ measurement helpers


def interleaved(
    fns: Mapping[str, Callable[[], Any]],
    repeats: int = 5,
    warmup: int = 1,
    min_time: float = 0.0,
    sync: Callable[[], None] | None = None,
) -> dict[str, list[float]]:
    """Seconds per call of each function, measured in interleaved rounds: A B, B A, A B, ...

    Every round calls each function once (or once per inner-loop pass); the order is reversed every
    other round, so that neither side always runs first (we saw ~1 % from position alone). Each
    function is called ``warmup`` times first, in the same pattern; the last warm-up call sizes an
    inner loop so that one sample lasts at least ``min_time`` seconds.

    Args:
        fns: name -> zero-argument function.
        repeats: samples per function.
        warmup: untimed calls per function before the samples (at least 1).
        min_time: shortest sample, in seconds (0: one call per sample).
        sync: called after each timed block (``torch.cuda.synchronize`` on a GPU).

    Returns:
        name -> ``repeats`` samples, seconds per call, in round order.
    """
    if warmup < 1 or repeats < 1:
        raise ValueError(f"warmup={warmup} and repeats={repeats} must be at least 1")
    sync = sync or (lambda: None)
    names = list(fns)
    order = lambda r: names if r % 2 == 0 else names[::-1]  # noqa: E731
    last = {}
    for r in range(warmup):
        for name in order(r):
            t0 = time.perf_counter()
            fns[name]()
            sync()
            last[name] = time.perf_counter() - t0
    inner = {name: max(1, math.ceil(min_time / max(dt, 1e-9))) for name, dt in last.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for r in range(warmup, warmup + repeats):
        for name in order(r):
            fn = fns[name]
            t0 = time.perf_counter()
            for _ in range(inner[name]):
                fn()
            sync()
            samples[name].append((time.perf_counter() - t0) / inner[name])
    return samples


def paired_speedup(ours: Sequence[float], ref: Sequence[float]) -> float:
    """Speed of ours over the reference: the median over rounds of ``ref_i / ours_i`` (seconds)."""
    if len(ours) != len(ref) or not ours:
        raise ValueError(f"need the same number (>0) of samples, got {len(ours)} and {len(ref)}")
    return statistics.median(r / o for o, r in zip(ours, ref))


def status(value: float | None, target: float | None) -> str:
    """``PASS`` / ``MISS`` against a target (None target: ``info``; None value: ``error``)."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "error"
    if target is None:
        return "info"
    return "PASS" if value >= target else "MISS"


def row(
    name: str,
    ours: float | None,
    ref: float | None,
    unit: str,
    ratio: float | None,
    kind: str | None,
    ref_name: str = "",
    note: str = "",
    percent: bool = False,
) -> dict[str, Any]:
    """One table row; ``kind`` names its target in ``TARGETS`` (None: informational)."""
    target = TARGETS[kind] if kind else None
    return dict(
        name=name,
        ours=ours,
        ref=ref,
        unit=unit,
        ref_name=ref_name,
        ratio=ratio,
        percent=percent,
        target=target,
        kind=kind,
        status=status(ratio, target),
        note=note,
    )


def compare(
    name: str,
    ours: Sequence[float],
    ref: Sequence[float],
    work: float,
    unit: str,
    kind: str | None,
    ref_name: str,
    note: str = "",
    percent: bool = False,
) -> dict[str, Any]:
    """A row from interleaved samples (seconds per call) of one call doing ``work`` units (images, tokens).

    ``ours`` and ``ref`` are ``work / median seconds``; the ratio is ``paired_speedup``; the note
    adds the quartiles of the per-round ratios, a measure of the noise.
    """
    ratios = [r / o for o, r in zip(ours, ref)]
    q = statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3
    fmt = (lambda x: f"{100 * x:.0f}%") if percent else (lambda x: f"{x:.3f}")
    spread = f"IQR {fmt(q[0])}-{fmt(q[2])}"
    if kind and q[0] <= TARGETS[kind] <= q[2]:
        spread += ", target inside: within noise"
    return row(
        name,
        work / statistics.median(ours),
        work / statistics.median(ref),
        unit,
        paired_speedup(ours, ref),
        kind,
        ref_name,
        note=f"{spread}; {note}" if note else spread,
        percent=percent,
    )


def pending_row(name: str, kind: str, note: str, state: str = "pending") -> dict[str, Any]:
    r = row(name, None, None, "", None, kind, note=note)
    r["status"] = state
    return r


def matmul_fn(n: int, device: str = "cpu", dtype: torch.dtype = torch.float32) -> Callable[[], Tensor]:
    """One ``torch.mm`` of two (n, n) matrices (2n³ FLOPs), the reference for the achieved rate."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def matmul_gflops(
    n: int = 2048, repeats: int = 5, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> dict[str, Any]:
    """The machine's dense matmul rate: ``torch.mm`` of two (n, n) matrices, median GFLOP/s."""
    sync = torch.cuda.synchronize if device.startswith("cuda") else None
    seconds = interleaved({"mm": matmul_fn(n, device, dtype)}, repeats=repeats, warmup=2, sync=sync)["mm"]
    return dict(n=n, seconds=seconds, gflops=2 * n**3 / statistics.median(seconds) / 1e9)


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


@contextlib.contextmanager
def forced_length(decoder: nn.Module) -> Iterator[None]:
    """Make ``<eos>`` unreachable, so that ``generate`` always emits ``max_new_tokens`` tokens.

    ``eos_id`` is set to ``vocab_size``, an id that argmax / top-k over V logits never returns; the
    decoder's weights and the tokens it picks are unchanged. Restored on exit.
    """
    saved = decoder.eos_id
    decoder.eos_id = decoder.vocab_size
    try:
        yield
    finally:
        decoder.eos_id = saved


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (POSIX; no limit elsewhere)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum, frame):  # noqa: ANN001
        raise TimeoutError(f"over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


# ------------------------------------------------------------------------------------ environment


class Env:
    """Device, precision and timing knobs shared by every section."""

    def __init__(self, device: str, quick: bool, repeats: int | None = None, min_time: float | None = None) -> None:
        self.device = device
        self.cuda = device.startswith("cuda")
        self.quick = quick
        self.repeats = repeats or (3 if quick else 7)
        self.min_time = min_time if min_time is not None else (0.05 if quick else 0.2)
        self.sync = torch.cuda.synchronize if self.cuda else None

    def autocast(self) -> contextlib.AbstractContextManager:
        # UNTESTED on a GPU here: bf16 autocast on CUDA; fp32 on CPU (bf16 matmul is very slow on CPUs
        # without AMX).
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def time(
        self, fns: Mapping[str, Callable[[], Any]], repeats: int | None = None, warmup: int = 1
    ) -> dict[str, list[float]]:
        return interleaved(fns, repeats or self.repeats, warmup, self.min_time, self.sync)


def machine_info(threads: int) -> dict[str, Any]:
    cpu, isa = platform.processor() or "unknown", []
    with contextlib.suppress(OSError):
        fields = dict(
            line.split(":", 1)
            for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
            if ":" in line
        )
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu = f"{fields.get('model name', cpu)} (family {fields.get('cpu family', '?')}, model {fields.get('model', '?')})"
        isa = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in fields.get("flags", "").split()]
    info = dict(
        cpu=cpu,
        isa=isa,
        logical_cpus=os.cpu_count(),
        torch_threads=threads,
        torch=torch.__version__,
        python=platform.python_version(),
        platform=platform.platform(),
        loadavg_start=os.getloadavg() if hasattr(os, "getloadavg") else None,
        mkldnn=torch.backends.mkldnn.is_available(),
    )
    for name in ("timm", "transformers"):
        with contextlib.suppress(ImportError):
            info[name] = __import__(name).__version__
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
    return info


# ---------------------------------------------------------------------------------------- encoder


def build_pair(cfg: Mapping[str, Any], num_classes: int, device: str) -> tuple[nn.Module, nn.Module, float]:
    """Our ``VisionTransformer`` and timm's, same configuration, ours holding timm's weights.

    Returns:
        ``(ours, timm_model, max_abs_diff)`` where the difference is of their eval outputs on noise.
    """
    from timm.models.vision_transformer import VisionTransformer as TimmViT

    from vitattn.models import VisionTransformer, load_timm_weights

    ref = TimmViT(num_classes=num_classes, global_pool="token", class_token=True, qkv_bias=True, **cfg)
    ours = VisionTransformer(num_classes=num_classes, norm_first=True, activation="gelu", global_pool="cls", **cfg)
    load_timm_weights(ours, ref)
    ours, ref = ours.to(device).eval(), ref.to(device).eval()
    x = torch.randn(2, 3, cfg["img_size"], cfg["img_size"], device=device)
    with torch.inference_mode():
        diff = (ours(x) - ref(x)).abs().max().item()
    return ours, ref, diff


def train_step_fn(model: nn.Module, images: Tensor, labels: Tensor, env: Env) -> Callable[[], None]:
    """One SGD step: forward, cross-entropy, backward, update (both sides use the same optimizer)."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        with env.autocast():
            loss = F.cross_entropy(model(images), labels)
        loss.backward()
        opt.step()

    return step


def forward_fn(model: nn.Module, images: Tensor, env: Env) -> Callable[[], None]:
    def forward() -> None:
        with torch.inference_mode(), env.autocast():
            model(images)

    return forward


def bench_encoder(env: Env, matmul_n: int, names: Sequence[str] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Rows (a) forward and training step vs timm and (b) achieved GFLOP/s vs the matmul rate.

    The (matmul_n, matmul_n) ``torch.mm`` runs in the same rounds as the forwards, so that the
    percentage compares rates measured under the same load.
    """
    rows, details = [], {}
    mm = matmul_fn(matmul_n, env.device, torch.bfloat16 if env.cuda else torch.float32)
    for name in names or [n for n in ENCODERS if env.cuda or n not in GPU_ONLY]:
        cfg, B = ENCODERS[name], ENCODER_BATCH[name]
        ours, ref, diff = build_pair(cfg, NUM_CLASSES, env.device)
        images = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
        labels = torch.randint(0, NUM_CLASSES, (B,), device=env.device)
        fwd = env.time({"ours": forward_fn(ours, images, env), "timm": forward_fn(ref, images, env), "matmul": mm})
        mm_seconds = fwd.pop("matmul")
        ours.train(), ref.train()
        train = env.time(
            {"ours": train_step_fn(ours, images, labels, env), "timm": train_step_fn(ref, images, labels, env)}
        )
        ours.eval(), ref.eval()
        flops, mm_flops = vit_flops(**cfg, num_classes=NUM_CLASSES) * B, 2 * matmul_n**3
        ips = {k: B / statistics.median(v) for k, v in fwd.items()}
        tips = {k: B / statistics.median(v) for k, v in train.items()}
        gflops = {k: flops / statistics.median(v) / 1e9 for k, v in fwd.items()}
        mm_gflops = mm_flops / statistics.median(mm_seconds) / 1e9
        # Per round: (flops / t_forward) / (mm_flops / t_mm); the median over rounds.
        share = {k: flops / mm_flops * paired_speedup(v, mm_seconds) for k, v in fwd.items()}
        details[name] = dict(
            config=cfg,
            batch=B,
            max_abs_diff_vs_timm=diff,
            forward_seconds=fwd,
            train_seconds=train,
            matmul_n=matmul_n,
            matmul_seconds=mm_seconds,
            matmul_gflops=mm_gflops,
            forward_share_of_matmul=share,
            forward_images_per_s=ips,
            train_images_per_s=tips,
            forward_gflop=flops / 1e9,
            forward_gflops=gflops,
            train_gflops_3x={k: 3 * flops / statistics.median(v) / 1e9 for k, v in train.items()},
        )
        tag = f"{name} b{B}"
        rows.append(compare(f"forward {tag}", fwd["ours"], fwd["timm"], B, "img/s", "forward", "timm eager"))
        rows.append(compare(f"train step {tag}", train["ours"], train["timm"], B, "img/s", "train", "timm eager"))
        rows.append(
            row(
                f"forward GFLOP/s {tag}",
                gflops["ours"],
                mm_gflops,
                "GFLOP/s",
                share["ours"],
                "mfu" if cfg["img_size"] == 224 else None,
                f"{matmul_n}² matmul",
                percent=True,
                note=f"timm {100 * share['timm']:.0f} %",
            )
        )
        # Training step model-FLOP utilisation: 3x the forward FLOPs (forward + backward) per step,
        # against the matmul rate measured in this run (bf16 on a GPU, fp32 on a CPU).
        train_share = {k: 3 * flops / mm_flops * paired_speedup(v, mm_seconds) for k, v in train.items()}
        details[name]["train_share_of_matmul"] = train_share
        rows.append(
            row(
                f"train step MFU {tag}",
                3 * flops / statistics.median(train["ours"]) / 1e9,
                mm_gflops,
                "GFLOP/s",
                train_share["ours"],
                None,
                f"{matmul_n}² matmul",
                percent=True,
                note=f"timm {100 * train_share['timm']:.0f} %",
            )
        )
        del ours, ref
    return rows, details


def bench_compile(env: Env, timeout_s: float, names: Sequence[str] | None = None) -> tuple[list[dict], dict[str, Any]]:
    """Row (c): our ``torch.compile``d forward (inductor, weights frozen on CPU) vs timm eager."""
    import torch._inductor.config as inductor_config

    rows, details = [], {}
    for name in names or [n for n in ENCODERS if env.cuda or n not in GPU_ONLY]:
        cfg, B = ENCODERS[name], ENCODER_BATCH[name]
        ours, ref, _ = build_pair(cfg, NUM_CLASSES, env.device)
        images = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
        tag = f"compiled forward {name} b{B}"
        torch._dynamo.reset()
        # Freezing folds the weights into the graph as constants (inductor's CPU inference mode).
        with inductor_config.patch(freezing=not env.cuda):
            compiled = torch.compile(ours)
            t0 = time.perf_counter()
            try:
                with time_limit(timeout_s):
                    forward_fn(compiled, images, env)()
                    if env.sync:
                        env.sync()
            except Exception as err:  # noqa: BLE001 - any compile failure is reported, not fatal
                msg = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
                details[name] = dict(error=msg, traceback=traceback.format_exc(limit=3))
                rows.append(pending_row(tag, "compiled", f"compile failed: {msg}", state="error"))
                continue
            compile_s = time.perf_counter() - t0
            t = env.time({"ours_compiled": forward_fn(compiled, images, env), "timm": forward_fn(ref, images, env)})
        ips = {k: B / statistics.median(v) for k, v in t.items()}
        details[name] = dict(compile_seconds=compile_s, seconds=t, images_per_s=ips, freezing=not env.cuda)
        rows.append(
            compare(
                tag,
                t["ours_compiled"],
                t["timm"],
                B,
                "img/s",
                "compiled",
                "timm eager",
                note=f"compile {compile_s:.0f} s",
            )
        )
        torch._dynamo.reset()
    return rows, details


# ---------------------------------------------------------------------------------------- caption


def build_ours(device: str, max_len: int | None = None) -> nn.Module:
    """Our ``ImageCaptioner`` of the bench size, randomly initialised."""
    from vitattn.models import CaptionDecoder, ImageCaptioner, VisionTransformer

    enc, dec = ENCODERS["vit_192d6_32px"], dict(CAPTION_DECODER)
    if max_len is not None:
        dec["max_len"] = max_len
    ours = ImageCaptioner(
        VisionTransformer(num_classes=0, **enc),
        CaptionDecoder(memory_dim=enc["embed_dim"], drop_rate=0.0, norm_first=True, activation="gelu", **dec),
    )
    return ours.to(device).eval()


def build_captioners(device: str, max_len: int | None = None) -> tuple[nn.Module, nn.Module]:
    """Our ``ImageCaptioner`` and a Hugging Face ``VisionEncoderDecoderModel`` (ViT + GPT-2 with
    cross-attention) of matching sizes, both randomly initialised from configs (nothing downloaded)."""
    from transformers import (
        GenerationConfig,
        GPT2Config,
        VisionEncoderDecoderConfig,
        VisionEncoderDecoderModel,
        ViTConfig,
    )

    enc, dec = ENCODERS["vit_192d6_32px"], dict(CAPTION_DECODER)
    if max_len is not None:
        dec["max_len"] = max_len
    ours = build_ours(device, max_len)
    vit = ViTConfig(
        image_size=enc["img_size"],
        patch_size=enc["patch_size"],
        hidden_size=enc["embed_dim"],
        num_hidden_layers=enc["depth"],
        num_attention_heads=enc["num_heads"],
        intermediate_size=int(enc["embed_dim"] * enc["mlp_ratio"]),
        hidden_act="gelu",
        layer_norm_eps=1e-6,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        qkv_bias=True,
    )
    gpt2 = GPT2Config(
        vocab_size=dec["vocab_size"],
        n_positions=dec["max_len"],
        n_embd=dec["embed_dim"],
        n_layer=dec["depth"],
        n_head=dec["num_heads"],
        n_inner=int(dec["embed_dim"] * dec["mlp_ratio"]),
        activation_function="gelu",
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        layer_norm_epsilon=1e-6,
        add_cross_attention=True,
        is_decoder=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    config = VisionEncoderDecoderConfig.from_encoder_decoder_configs(vit, gpt2)
    config.decoder_start_token_id, config.pad_token_id, config.eos_token_id = 1, 0, 2
    hf = VisionEncoderDecoderModel(config=config)
    hf.generation_config = GenerationConfig(decoder_start_token_id=1, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return ours, hf.to(device).eval()


@contextlib.contextmanager
def given_memory(captioner: nn.Module, memory: Tensor) -> Iterator[None]:
    """Decode-only timing: ``captioner.generate`` skips the encoder and uses ``memory`` (B, N, D).

    ``generate`` encodes the images once through ``self.encode``; an instance attribute shadows it.
    """
    captioner.encode = lambda images: memory
    try:
        yield
    finally:
        del captioner.encode


def caption_fns(
    ours: nn.Module, hf: nn.Module, images: Tensor, tokens: int, beams: int, env: Env, decode_only: bool
) -> dict[str, Callable[[], Tensor]]:
    """Generation of exactly ``tokens`` new tokens per image: ours cached, ours recomputed, Hugging Face.

    Ours: ``<eos>`` made unreachable (``forced_length``). Hugging Face: ``min_new_tokens =
    max_new_tokens`` (its logits processor masks ``<eos>`` until then). With ``decode_only`` both get
    the encoder's output precomputed, so that only the decoding loop is timed.
    """
    from transformers.modeling_outputs import BaseModelOutput

    with torch.inference_mode(), env.autocast():
        memory = ours.encode(images) if decode_only else None
        hf_memory = hf.encoder(pixel_values=images).last_hidden_state if decode_only else None

    def ours_gen(use_cache: bool) -> Callable[[], Tensor]:
        def gen() -> Tensor:
            given = given_memory(ours, memory) if decode_only else contextlib.nullcontext()
            with given, forced_length(ours.decoder), env.autocast():
                return ours.generate(images, max_new_tokens=tokens, num_beams=beams, use_cache=use_cache)

        return gen

    def hf_gen() -> Tensor:
        # A new BaseModelOutput each call: beam search expands the one it is given in place.
        inputs = (
            dict(encoder_outputs=BaseModelOutput(last_hidden_state=hf_memory))
            if decode_only
            else dict(pixel_values=images)
        )
        with torch.inference_mode(), env.autocast():
            out = hf.generate(
                **inputs,
                max_new_tokens=tokens,
                min_new_tokens=tokens,
                num_beams=beams,
                do_sample=False,
                use_cache=True,
                early_stopping=False,
            )
        return out[:, 1:]  # drop the decoder start token

    def checked(fn: Callable[[], Tensor]) -> Callable[[], Tensor]:
        def call() -> Tensor:  # every timed call must emit exactly `tokens` tokens per image
            out = fn()
            if tuple(out.shape) != (images.shape[0], tokens):
                raise RuntimeError(
                    f"generation length not forced: got {tuple(out.shape)}, want {(images.shape[0], tokens)}"
                )
            return out

        return call

    return {"ours_cached": checked(ours_gen(True)), "ours_recompute": checked(ours_gen(False)), "hf": checked(hf_gen)}


def bench_caption(
    env: Env, batch: int | None = None, tokens: int | None = None, beams_list: Sequence[int] = (1, 3)
) -> tuple[list[dict], dict[str, Any]]:
    """Row (d): caption tokens/s, ours cached vs ours recompute vs Hugging Face ``generate``.

    Target rows time the decoding loop alone (the encoder's output given; the encoders are the same
    network on both sides); the info rows time ``generate`` from images, encoder included.
    """
    batch, tokens = batch or CAPTION_BATCH, tokens or CAPTION_TOKENS
    ours, hf = build_captioners(env.device)
    img = ENCODERS["vit_192d6_32px"]["img_size"]
    images = torch.randn(batch, 3, img, img, device=env.device)
    rows, details = [], {}
    for decode_only in (True, False):
        for beams in beams_list:
            fns = caption_fns(ours, hf, images, tokens, beams, env, decode_only)
            if not decode_only:  # the cache's effect is shown decode-only; here: ours vs HF as a user sees it
                del fns["ours_recompute"]
            t = env.time(fns, repeats=max(3, env.repeats - 2))  # each call checks its output's shape
            tps = {k: batch * tokens / statistics.median(v) for k, v in t.items()}
            mode = "greedy" if beams == 1 else f"beam {beams}"
            part = "decode only" if decode_only else "generate incl. encoder"
            details[f"{part}, {mode}"] = dict(
                batch=batch, new_tokens=tokens, num_beams=beams, seconds=t, tokens_per_s=tps
            )
            tag = f"caption {part} {mode} b{batch}"
            if decode_only:
                rows.append(
                    compare(
                        f"{tag}: cached vs recompute",
                        t["ours_cached"],
                        t["ours_recompute"],
                        batch * tokens,
                        "tok/s",
                        "cache_vs_recompute",
                        "ours, no cache",
                    )
                )
            rows.append(
                compare(
                    f"{tag}: cached vs HF",
                    t["ours_cached"],
                    t["hf"],
                    batch * tokens,
                    "tok/s",
                    "cache_vs_hf" if decode_only else None,
                    "HF generate",
                )
            )
    details["models"] = dict(
        encoder=ENCODERS["vit_192d6_32px"],
        decoder=CAPTION_DECODER,
        new_tokens=tokens,
        hf="VisionEncoderDecoderModel(ViTModel, GPT2LMHeadModel with cross-attention)",
    )
    return rows, details


# ---------------------------------------------------------------------------------------- scaling


def bench_scaling(env: Env, out_png: Path) -> tuple[list[dict], dict[str, Any]]:
    """Row (e): forward time vs image size (tokens) and vs batch, ours and timm (ViT-Ti/16), plotted."""
    cfg = dict(ENCODERS["vit_ti16_224"])
    sizes = (64, 128, 224) if env.quick else (64, 128, 224, 320)
    batches = (1, 4, 8) if env.quick else (1, 2, 4, 8, 16)
    repeats = 3 if env.quick else 5
    by_size, by_batch = [], []
    for img in sizes:
        ours, ref, _ = build_pair({**cfg, "img_size": img}, 0, env.device)
        x = torch.randn(8, 3, img, img, device=env.device)
        t = env.time({"ours": forward_fn(ours, x, env), "timm": forward_fn(ref, x, env)}, repeats=repeats)
        by_size.append(
            dict(
                img_size=img,
                tokens=(img // cfg["patch_size"]) ** 2 + 1,
                batch=8,
                ours_ms=1e3 * statistics.median(t["ours"]),
                timm_ms=1e3 * statistics.median(t["timm"]),
                speedup=paired_speedup(t["ours"], t["timm"]),
            )
        )
    ours, ref, _ = build_pair(cfg, 0, env.device)
    for B in batches:
        x = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
        t = env.time({"ours": forward_fn(ours, x, env), "timm": forward_fn(ref, x, env)}, repeats=repeats)
        by_batch.append(
            dict(
                img_size=cfg["img_size"],
                batch=B,
                ours_ms=1e3 * statistics.median(t["ours"]),
                timm_ms=1e3 * statistics.median(t["timm"]),
                speedup=paired_speedup(t["ours"], t["timm"]),
            )
        )
    plot_scaling(by_size, by_batch, out_png)
    rows = [
        row(
            f"scaling: forward vs tokens ({by_size[0]['tokens']}..{by_size[-1]['tokens']})",
            None,
            None,
            "",
            statistics.median(r["speedup"] for r in by_size),
            None,
            "timm eager",
            note="median speedup, see plot",
        ),
        row(
            f"scaling: forward vs batch ({batches[0]}..{batches[-1]})",
            None,
            None,
            "",
            statistics.median(r["speedup"] for r in by_batch),
            None,
            "timm eager",
            note="median speedup, see plot",
        ),
    ]
    return rows, dict(model=cfg, by_image_size=by_size, by_batch=by_batch, plot=str(out_png))


def plot_scaling(by_size: Sequence[Mapping], by_batch: Sequence[Mapping], path: Path) -> None:
    """Two panels: ms per image vs tokens (batch 8), images/s vs batch (224 px)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, NullLocator, ScalarFormatter

    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    for key, label, style in (("ours_ms", "vitattn", "o-"), ("timm_ms", "timm", "s--")):
        a.plot([r["tokens"] for r in by_size], [r[key] / r["batch"] for r in by_size], style, label=label)
        b.plot([r["batch"] for r in by_batch], [1e3 * r["batch"] / r[key] for r in by_batch], style, label=label)
    sizes = ", ".join(str(r["img_size"]) for r in by_size)
    a.set(
        xscale="log",
        yscale="log",
        xlabel=f"tokens per image (ViT-Ti/16 at {sizes} px)",
        ylabel="ms per image",
        title="forward time vs tokens, batch 8",
    )
    b.set(xscale="log", xlabel="batch", ylabel="images / s", title="forward throughput vs batch, 224 px")
    b.set_ylim(bottom=0)
    for ax, ticks in ((a, [r["tokens"] for r in by_size]), (b, [r["batch"] for r in by_batch])):
        ax.xaxis.set_major_locator(FixedLocator(ticks))
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    a.yaxis.set_major_formatter(ScalarFormatter())
    n = torch.get_num_threads()
    fig.suptitle(f"fp32 forward, torch {torch.__version__}, {n} thread{'s' if n != 1 else ''}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)


# ------------------------------------------------------------------------------------- end to end


def bench_end_to_end(
    env: Env, n_images: int = 256, batch: int | None = None, tokens: int | None = None
) -> tuple[list[dict], dict[str, Any]]:
    """Row (f): JPEG files -> captions (``caption_images`` on a saved bundle) vs model-only images/s.

    Reports ``pending`` while ``vitattn.inference.captioner`` or ``vitattn.bundle`` is missing.
    """
    batch, tokens = batch or CAPTION_BATCH, tokens or CAPTION_TOKENS
    name = f"end-to-end {n_images} JPEGs b{batch} greedy"
    try:
        from vitattn.bundle import load_bundle, save_bundle
        from vitattn.data.vocab import SPECIALS, Vocabulary
        from vitattn.inference.captioner import caption_images
    except ImportError as err:
        return [pending_row(name, "e2e", f"pending: {err}")], dict(status="pending", reason=str(err))
    import numpy as np
    from PIL import Image

    ours = build_ours(env.device)
    img = ENCODERS["vit_192d6_32px"]["img_size"]
    vocab = Vocabulary([f"w{i}" for i in range(CAPTION_DECODER["vocab_size"] - len(SPECIALS))])
    preprocess = dict(
        img_size=img, crop_pct=1.0, mean=[0.485, 0.456, 0.406], std=[0.229, 0.224, 0.225], interpolation="bicubic"
    )
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory(prefix="vitattn-bench-") as tmp:
        paths = []
        for i in range(n_images):  # small noisy photos, twice the model's side so that resizing is real
            pixels = rng.integers(0, 256, (2 * img, 2 * img, 3), dtype=np.uint8)
            paths.append(os.path.join(tmp, f"img{i:04d}.jpg"))
            Image.fromarray(pixels).save(paths[-1], quality=90)
        bundle = load_bundle(
            save_bundle(os.path.join(tmp, "bundle"), ours.cpu(), task="caption", preprocess=preprocess, vocab=vocab),
            device=env.device,
        )
        model = bundle.model
        images = torch.stack([bundle.transform(_read_rgb(p)) for p in paths[:batch]]).to(env.device)
        n_batches = math.ceil(n_images / batch)

        def model_only() -> None:  # the same number of generate calls on tensors already in memory
            with forced_length(model.decoder), env.autocast():
                for _ in range(n_batches):
                    model.generate(images, max_new_tokens=tokens)

        def files() -> None:
            with forced_length(model.decoder), env.autocast():
                records = caption_images(bundle, paths, batch_size=batch, max_new_tokens=tokens)
            if len(records) != n_images or any("error" in r for r in records):
                raise RuntimeError(f"caption_images failed: {[r for r in records if 'error' in r][:3]}")

        t = env.time({"files": files, "model_only": model_only}, repeats=3)
    ips = {k: n_images / statistics.median(v) for k, v in t.items()}
    r = compare(
        name,
        t["files"],
        t["model_only"],
        n_images,
        "img/s",
        "e2e",
        "model only",
        note="caption_images, num_workers=0",
        percent=True,
    )
    return [r], dict(status="measured", n_images=n_images, batch=batch, seconds=t, images_per_s=ips)


def _read_rgb(path: str) -> Any:
    from PIL import Image

    with Image.open(path) as image:
        return image.convert("RGB")


# ------------------------------------------------------------------------------------------ report


def format_table(rows: Sequence[Mapping[str, Any]]) -> str:
    """The rows as a Markdown table."""

    def num(x: float | None) -> str:
        if x is None:
            return "-"
        return f"{x:,.0f}" if abs(x) >= 100 else f"{x:.1f}"

    lines = ["| row | ours | reference | ratio | target | status | note |", "|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        unit = f" {r['unit']}" if r["unit"] else ""
        ref = f"{num(r['ref'])}{unit} ({r['ref_name']})" if r["ref"] is not None else (r["ref_name"] or "-")
        if r["ratio"] is None:
            ratio = "-"
        else:
            ratio = f"{100 * r['ratio']:.0f} %" if r["percent"] else f"{r['ratio']:.3f}x"
        if r["target"] is None:
            target = "-"
        else:
            target = f">= {100 * r['target']:.0f} %" if r["percent"] else f">= {r['target']:.2f}x"
        ours = f"{num(r['ours'])}{unit}" if r["ours"] is not None else "-"
        lines.append(f"| {r['name']} | {ours} | {ref} | {ratio} | {target} | {r['status']} | {r['note']} |")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer repeats and sizes (about two minutes)")
    p.add_argument(
        "--out", type=Path, default=Path("bench_results/bench.json"), help="JSON results; scaling.png goes beside it"
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, or cuda (bf16 autocast; untested on this project's CPU machines)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch.set_num_threads (default 1: repeatable on a shared machine; see docs/benchmarks.md)",
    )
    p.add_argument("--repeats", type=int, default=None, help="timed samples per side (default 7, quick 3)")
    p.add_argument(
        "--min-time", type=float, default=None, help="shortest timed sample in seconds (default 0.2, quick 0.05)"
    )
    p.add_argument(
        "--compile", action=argparse.BooleanOptionalAction, default=True, help="benchmark torch.compile (default on)"
    )
    p.add_argument("--compile-timeout", type=float, default=300.0, help="seconds allowed for each compilation")
    p.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device here")
    threads = args.threads
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    env = Env(args.device, args.quick, args.repeats, args.min_time)
    info = machine_info(torch.get_num_threads())
    print(
        f"torch {info['torch']} | threads {info['torch_threads']} | {info['cpu']} | device {args.device}"
        f" | {'quick' if args.quick else 'full'} | load {info['loadavg_start']}",
        flush=True,
    )
    started = time.perf_counter()
    mm = matmul_gflops(
        1024 if args.quick else 2048,
        repeats=env.repeats,
        device=args.device,
        dtype=torch.bfloat16 if env.cuda else torch.float32,
    )
    print(f"matmul rate: {mm['gflops']:.1f} GFLOP/s ({mm['n']}x{mm['n']} torch.mm)", flush=True)
    rows: list[dict] = []
    details: dict[str, Any] = {}
    scaling: dict[str, Any] = {}
    sections = [s for s in SECTIONS if s in args.sections and (s != "compile" or args.compile)]
    for section in sections:
        t0 = time.perf_counter()
        try:
            if section == "encoder":
                new, details["encoder"] = bench_encoder(env, mm["n"])
            elif section == "compile":
                new, details["compile"] = bench_compile(env, args.compile_timeout)
            elif section == "caption":
                new, details["caption"] = bench_caption(env)
            elif section == "scaling":
                new, scaling = bench_scaling(env, args.out.parent / "scaling.png")
            else:
                new, details["end_to_end"] = bench_end_to_end(env, n_images=64 if args.quick else 256)
        except Exception as err:  # noqa: BLE001 - one broken section must not lose the others
            msg = f"{type(err).__name__}: {' '.join(str(err).split())[:200]}"
            new = [pending_row(section, None, msg, state="error")]
            details[section] = dict(error=msg, traceback=traceback.format_exc(limit=5))
        rows += new
        print(f"\n[{section}: {time.perf_counter() - t0:.0f} s]\n{format_table(new)}", flush=True)
    if not args.compile:
        rows.append(pending_row("compiled forward", "compiled", "skipped (--no-compile)", state="info"))
    result = dict(
        schema=SCHEMA,
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
        argv=list(argv if argv is not None else sys.argv[1:]),
        quick=args.quick,
        device=args.device,
        machine=info,
        matmul=mm,
        targets=TARGETS,
        rows=rows,
        details=details,
        scaling=scaling,
        total_seconds=time.perf_counter() - started,
    )
    result["machine"]["loadavg_end"] = os.getloadavg() if hasattr(os, "getloadavg") else None
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, default=str) + "\n")
    print(f"\nall rows ({result['total_seconds']:.0f} s, threads {threads}, matmul {mm['gflops']:.1f} GFLOP/s):")
    print(format_table(rows))
    counts = {s: sum(r["status"] == s for r in rows) for s in STATUSES}
    print("targets: " + ", ".join(f"{n} {s}" for s, n in counts.items() if n))
    print(f"wrote {args.out}" + (f" and {scaling['plot']}" if scaling else ""))
    return result


if __name__ == "__main__":
    main()
