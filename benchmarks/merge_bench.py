"""Sections ``merge`` and ``merge-quality``: token merging (ToMe, ``model.merge_tokens``) for speed and for captions.

    python -m benchmarks merge --threads 2                       # encoder, captions and training step rates
    python -m benchmarks merge --quick --sizes vit_s16_224 --merge 16
    python -m benchmarks merge-quality --threads 2 --seeds 0 1 2  # CIDEr-D off the shelf and trained with R

``merge`` times, in interleaved rounds in one process (``benchmarks.timing``): the encoder forward of our ViT
merging R tokens per layer against ours unmerged and timm eager (same weights); captions end to end (encoder and
beam-3 search with the key/value cache, ``<eos>`` unreachable so that every call makes the same tokens) merged
against unmerged and Hugging Face ``generate``; a training step merged against unmerged. ``merge-quality``
trains the built-in shapes captioner at 256 patch tokens (``data.img_size=128``, 8 px patches) without merging
and with it, per seed, and scores the test split off the shelf at each R and trained with R.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from benchmarks import workloads
from benchmarks.caption_bench import build_captioners, caption_fns
from benchmarks.machine import machine_info
from benchmarks.report import compare, format_table, row, write_json
from benchmarks.timing import Env, per_second, stopwatch

SIZES = ("vit_s16_224", "vit_b16_224")
CPU_BATCH = {"vit_s16_224": 8, "vit_b16_224": 4}  # images per call on a CPU (a GPU: ``ENCODER_BATCH``)
MERGES = (4, 8, 13, 16)
TARGET_R = 16  # the speed targets' R, as ToMe's ViT-S/16 and ViT-B/16 off-the-shelf rows
CAPTION_SIZE, CAPTION_IMAGES, CAPTION_BEAMS = "vit_s16_224", 8, 3


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Sizes, merges and timing of ``merge``."""
    p.add_argument("--sizes", nargs="+", choices=SIZES, default=list(SIZES))
    p.add_argument("--merge", nargs="+", type=int, default=list(MERGES), help="tokens merged per layer (R)")
    p.add_argument("--quick", action="store_true", help="fewer repeats, shorter samples")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=2, help="torch.set_num_threads (default 2)")
    p.add_argument("--repeats", type=int, default=None, help="timed samples per side (default 7, quick 3)")
    p.add_argument("--out", type=Path, default=Path("bench_results/merge.json"))


def merged(model: nn.Module, r: int) -> nn.Module:
    """A copy of ``model`` (a ``VisionTransformer`` or a captioner) merging ``r`` tokens per encoder layer."""
    model = copy.deepcopy(model)
    (getattr(model, "encoder", model)).set_merge_tokens(r)
    return model


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Time every part, print the table, write ``--out``."""
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    env = Env(args.device, args.quick, args.repeats)
    info = machine_info(torch.get_num_threads())
    print(f"torch {info['torch']} | threads {info['torch_threads']} | {info['cpu']} | device {args.device}", flush=True)
    rows: list[dict] = []
    details: dict[str, Any] = {}
    for name in args.sizes:
        new, details[f"encoder {name}"] = _encoder(env, name, args.merge)
        rows += new
        print(format_table(new), flush=True)
    if CAPTION_SIZE in args.sizes:
        for part in (_captions, _train_step):
            new, details[part.__name__.strip("_")] = part(env, max(args.merge))
            rows += new
            print(format_table(new), flush=True)
    result = dict(argv=args.argv, machine=info, rows=rows, details=details, created=time.strftime("%Y-%m-%d %H:%M:%S"))
    write_json(result, args.out)
    print(f"\nall rows (threads {args.threads}):\n{format_table(rows)}\nwrote {args.out}")
    return result


def _batch(env: Env, name: str) -> int:
    return workloads.ENCODER_BATCH[name] if env.cuda else CPU_BATCH[name]


def _encoder(env: Env, name: str, merges: list[int]) -> tuple[list[dict], dict[str, Any]]:
    """Forward images/s at each R against ours unmerged and timm eager, all in the same rounds."""
    cfg, B = workloads.ENCODERS[name], _batch(env, name)
    ours, ref, diff = workloads.build_pair(cfg, workloads.NUM_CLASSES, env.device)
    images = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
    fns = {"timm": workloads.forward_fn(ref, images, env), "ours": workloads.forward_fn(ours, images, env)}
    fns |= {f"R={r}": workloads.forward_fn(merged(ours, r), images, env) for r in merges}
    t = env.time(fns)
    rows = []
    for r in merges:
        kind = "merge_forward" if name == "vit_s16_224" and r == TARGET_R else None
        tag = f"forward {name} b{B} R={r}"
        rows.append(compare(f"{tag} vs timm", t[f"R={r}"], t["timm"], B, "img/s", kind, "timm eager"))
        rows.append(compare(f"{tag} vs unmerged", t[f"R={r}"], t["ours"], B, "img/s", None, "ours, R=0"))
    tokens = {r: merged(ours, r).num_tokens for r in merges}
    return rows, dict(
        config=cfg, batch=B, seconds=t, images_per_s=per_second(t, B), max_abs_diff_vs_timm=diff, tokens_out=tokens
    )


def _captions(env: Env, r: int) -> tuple[list[dict], dict[str, Any]]:
    """Captions/s from images: encoder and beam search with the cache, merged against unmerged and Hugging Face."""
    ours, hf = build_captioners(env.device, encoder=CAPTION_SIZE)
    img = workloads.ENCODERS[CAPTION_SIZE]["img_size"]
    images = torch.randn(CAPTION_IMAGES, 3, img, img, device=env.device)
    tokens = workloads.CAPTION_TOKENS
    plain = caption_fns(ours, hf, images, tokens, CAPTION_BEAMS, env, decode_only=False)
    fns = {"ours": plain["ours_cached"], "hf": plain["hf"]}
    fns[f"R={r}"] = caption_fns(merged(ours, r), hf, images, tokens, CAPTION_BEAMS, env, False)["ours_cached"]
    t = env.time(fns, repeats=max(3, env.repeats - 2))
    B, tag = CAPTION_IMAGES, f"captions {CAPTION_SIZE} beam {CAPTION_BEAMS} b{CAPTION_IMAGES} R={r}"
    rows = [
        compare(f"{tag} vs unmerged", t[f"R={r}"], t["ours"], B, "img/s", "merge_captions", "ours, R=0"),
        compare(f"{tag} vs HF", t[f"R={r}"], t["hf"], B, "img/s", None, "HF generate"),
    ]
    return rows, dict(images=B, new_tokens=tokens, num_beams=CAPTION_BEAMS, seconds=t, images_per_s=per_second(t, B))


def _train_step(env: Env, r: int) -> tuple[list[dict], dict[str, Any]]:
    """A classifier's training step (forward, cross-entropy, backward, SGD) merged against unmerged and timm."""
    cfg, B = workloads.ENCODERS[CAPTION_SIZE], _batch(env, CAPTION_SIZE)
    ours, ref, _ = workloads.build_pair(cfg, workloads.NUM_CLASSES, env.device)
    fast = merged(ours, r)
    for m in (ours, ref, fast):
        m.train()
    images = torch.randn(B, 3, cfg["img_size"], cfg["img_size"], device=env.device)
    labels = torch.randint(0, workloads.NUM_CLASSES, (B,), device=env.device)
    t = env.time(
        {
            name: workloads.train_step_fn(m, images, labels, env)
            for name, m in (("ours", ours), ("timm", ref), (f"R={r}", fast))
        }
    )
    tag = f"train step {CAPTION_SIZE} b{B} R={r}"
    rows = [
        compare(f"{tag} vs unmerged", t[f"R={r}"], t["ours"], B, "img/s", None, "ours, R=0"),
        compare(f"{tag} vs timm", t[f"R={r}"], t["timm"], B, "img/s", None, "timm eager"),
    ]
    return rows, dict(batch=B, seconds=t, images_per_s=per_second(t, B))


# --- quality ---------------------------------------------------------------------------------------------------

QUALITY_ARGS = ("data=shapes", "data.img_size=128", "model=cpu", "model.patch_size=8", "trainer.max_epochs=1")


def add_quality_arguments(p: argparse.ArgumentParser) -> None:
    """Seeds, merges and where the runs go, of ``merge-quality``."""
    p.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    p.add_argument("--merge", nargs="+", type=int, default=[16, 32, 48], help="R scored off the shelf")
    p.add_argument("--train-merge", type=int, default=48, help="R of the runs trained with merging")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--runs", type=Path, default=Path("bench_results/merge_runs"))
    p.add_argument("--out", type=Path, default=Path("bench_results/merge_quality.json"))
    p.add_argument("--train-args", nargs="*", default=list(QUALITY_ARGS), help="vitattn-train overrides of every run")


def run_quality(args: argparse.Namespace) -> dict[str, Any]:
    """Train and score every seed; print the table and write ``--out``."""
    torch.set_num_threads(args.threads)
    scores: dict[str, list[dict[str, float]]] = {}
    seconds: dict[str, list[float]] = {}
    for seed in args.seeds:
        for trained in (0, args.train_merge):
            folder = args.runs / f"seed{seed}_r{trained}"
            seconds.setdefault(f"train R={trained}", []).append(_train(folder, seed, trained, args))
            for r in sorted({0, *args.merge} if trained == 0 else {trained}):
                key = f"trained R={trained}, scored R={r}"
                scores.setdefault(key, []).append(_score(folder, r))
                print(f"seed {seed} {key}: CIDEr-D {scores[key][-1]['cider_d']:.4f}", flush=True)
    base = [s["cider_d"] for s in scores["trained R=0, scored R=0"]]
    rows = []
    for key, found in scores.items():
        cider = [s["cider_d"] for s in found]
        ratio = statistics.mean(cider) / statistics.mean(base)
        spread = f"CIDEr-D {statistics.mean(cider):.3f} ({min(cider):.3f}-{max(cider):.3f}), {len(cider)} seeds"
        exact = statistics.mean(s["exact_match"] for s in found)
        kind = None if key == "trained R=0, scored R=0" else "merge_quality"
        rows.append(
            row(
                key,
                statistics.mean(cider),
                statistics.mean(base),
                "CIDEr-D",
                ratio,
                kind,
                "R=0",
                note=f"{spread}; exact match {100 * exact:.1f} %",
            )
        )
    speed = _encoder_speed(args.runs / f"seed{args.seeds[0]}_r0", sorted({0, *args.merge, args.train_merge}))
    rows += [
        row(f"encoder forward b64 R={r}", rate, speed[0], "img/s", rate / speed[0], None, "R=0")
        for r, rate in speed.items()
        if r
    ]
    result = dict(
        argv=args.argv,
        machine=machine_info(args.threads),
        train_args=args.train_args,
        scores=scores,
        train_seconds=seconds,
        rows=rows,
        created=time.strftime("%Y-%m-%d %H:%M:%S"),
    )
    write_json(result, args.out)
    print(format_table(rows))
    return result


def _train(folder: Path, seed: int, r: int, args: argparse.Namespace) -> float:
    """Train one run into ``folder`` (kept when it finished before: its seconds are read back)."""
    done = folder / "bench_seconds.json"
    if done.exists():
        return json.loads(done.read_text())["seconds"]
    command = [
        str(Path(sys.executable).with_name("vitattn-train")),
        *args.train_args,
        f"seed={seed}",
        f"model.merge_tokens={r}",
        f"num_threads={args.threads}",
        f"hydra.run.dir={folder}",
    ]
    with stopwatch() as took:
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    done.write_text(json.dumps({"seconds": took.seconds, "command": command}))
    return took.seconds


def _encoder_speed(folder: Path, merges: list[int], batch: int = 64) -> dict[int, float]:
    """Images/s of the trained encoder in ``folder`` merging each R of ``merges``, timed in interleaved rounds."""
    from vitattn.bundle import load_model

    encoder = load_model(folder, precision="fp32").model.encoder
    size = encoder.config["img_size"]
    images = torch.randn(batch, 3, size, size)
    fns = {r: partial(merged(encoder, r).forward_features, images) for r in merges}
    with torch.inference_mode():
        seconds = Env("cpu", False).time(fns)
    return per_second(seconds, batch)


def _score(folder: Path, r: int) -> dict[str, float]:
    """The test split's caption metrics of the run in ``folder``, its encoder merging ``r`` tokens per layer."""
    from vitattn.bundle import load_model
    from vitattn.cli.run_split import run_split
    from vitattn.evaluation import evaluate_captions
    from vitattn.run_dir import RunDir

    bundle = load_model(folder, precision="fp32", merge_tokens=r)
    split = run_split(bundle, RunDir.find(folder), "test", batch_size=64, num_workers=0)
    return dict(evaluate_captions(bundle, split="test", run_split=split, batch_size=64).metrics)
