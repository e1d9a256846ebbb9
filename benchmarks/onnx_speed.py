"""ONNX Runtime (fp32, int8) against PyTorch eager on the CPU: captioning with the encoder included
(greedy, beam 3) and classification, in one process, at one thread count.

    python -m benchmarks.onnx_speed [--threads 1] [--repeats 7] [--presets cpu,vit-s16] [--out FILE.json]

Random weights (speed does not depend on them). Each caption runs ``max_new_tokens`` steps: the
``<eos>`` logit is pushed down, so every runtime decodes the same number of steps. Runtimes are
timed in turn within each repeat (so a slower moment of a shared machine hits them alike); a row is
the median over repeats of the wall time and of this process's CPU time (steadier on a shared
machine; at one thread both runtimes compute in the calling thread), and a ratio is eager time /
ONNX time (above 1: ONNX is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle, save_bundle
from vitattn.bundle.onnx_export import export_onnx
from vitattn.data.preprocess import default_preprocess
from vitattn.data.vocab import Vocabulary
from vitattn.inference.captioning import generate_tokens
from vitattn.models import CaptionDecoder, ImageCaptioner, vit_preset

# name -> (ViT preset, image side, decoder heads, vocabulary size): the decoder is 2 layers at the encoder's width
PRESETS = {"cpu": ("cpu", 64, 4, 1000), "vit-s16": ("small", 224, 6, 10000)}
BATCH, MAX_NEW_TOKENS, NUM_CLASSES = 8, 20, 1000


def _captioner(preset: str, img_size: int, heads: int, vocab_size: int) -> tuple[ImageCaptioner, Vocabulary]:
    torch.manual_seed(0)
    encoder = vit_preset(preset, img_size=img_size)
    vocab = Vocabulary([f"w{i}" for i in range(vocab_size - 4)])
    width = encoder.config["embed_dim"]
    decoder = CaptionDecoder(
        len(vocab), width, depth=2, num_heads=heads, mlp_ratio=2.0, max_len=24, tie_embeddings=False
    )
    with torch.no_grad():
        decoder.head.bias[vocab.eos_id] = -1e4  # never chosen: every caption runs MAX_NEW_TOKENS steps
    return ImageCaptioner(encoder, decoder).eval(), vocab


def _seconds(fn, *args) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one call."""
    wall, cpu = time.perf_counter(), time.process_time()
    with torch.inference_mode():
        fn(*args)
    return time.perf_counter() - wall, time.process_time() - cpu


def _rows(name: str, folder: Path, repeats: int) -> list[dict]:
    preset, img_size, heads, vocab_size = PRESETS[name]
    model, vocab = _captioner(preset, img_size, heads, vocab_size)
    pre = default_preprocess(img_size)
    bundle_dir = save_bundle(folder / f"{name}-caption", model, task="caption", preprocess=pre, vocab=vocab)
    bundle = load_bundle(bundle_dir)
    classifier = vit_preset(preset, img_size=img_size, num_classes=NUM_CLASSES).eval()
    cls_dir = save_bundle(folder / f"{name}-cls", classifier, task="classification", preprocess=pre)
    runtimes = {"eager": (Captioner(bundle), Classifier(load_bundle(cls_dir)))}
    for precision in ("fp32", "int8"):
        quantize = None if precision == "fp32" else "int8"
        cap = export_onnx(bundle, folder / f"{name}-caption-{precision}", quantize=quantize)
        cls = export_onnx(load_bundle(cls_dir), folder / f"{name}-cls-{precision}", quantize=quantize)
        runtimes[f"onnx-{precision}"] = (Captioner.load(cap), Classifier.load(cls))
    images = torch.randn(BATCH, 3, img_size, img_size)
    work = {
        "generate greedy": lambda c, _: generate_tokens(c.model, images, max_new_tokens=MAX_NEW_TOKENS),
        "generate beam 3": lambda c, _: generate_tokens(c.model, images, max_new_tokens=MAX_NEW_TOKENS, num_beams=3),
        "classify": lambda _, k: k.model(images),
    }
    rows = []
    for what, fn in work.items():
        for models in runtimes.values():  # warm-up: first calls allocate
            _seconds(fn, *models)
        times = {r: [] for r in runtimes}
        for _ in range(repeats):
            for r, models in runtimes.items():
                times[r].append(_seconds(fn, *models))
        wall = {r: statistics.median(t[0] for t in times[r]) for r in runtimes}
        cpu = {r: statistics.median(t[1] for t in times[r]) for r in runtimes}
        for r in runtimes:
            ratios = dict(vs_eager=wall["eager"] / wall[r], cpu_vs_eager=cpu["eager"] / cpu[r])
            rows.append(dict(preset=name, work=what, runtime=r, seconds=wall[r], cpu_seconds=cpu[r], **ratios))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--presets", default="cpu,vit-s16")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # ONNX Runtime sessions take torch's thread count when loaded
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.presets.split(","):
            rows += _rows(name, Path(tmp), args.repeats)
    print(f"threads={args.threads}, batch {BATCH}, {MAX_NEW_TOKENS} tokens per caption, median of {args.repeats}")
    print("| preset | work | runtime | wall s per batch | vs eager (wall) | CPU s per batch | vs eager (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['preset']} | {r['work']} | {r['runtime']} | {r['seconds']:.3f} | {r['vs_eager']:.2f}x "
            f"| {r['cpu_seconds']:.3f} | {r['cpu_vs_eager']:.2f}x |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
