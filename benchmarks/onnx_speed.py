"""PyTorch eager in bf16 (autocast, ``precision=bf16``) and ONNX Runtime (fp32, int8) against PyTorch eager in
fp32 on the CPU: captioning with the encoder included (greedy, beam 3) and classification, in one process, at one
thread count.

    python -m benchmarks.onnx_speed [--threads 1] [--repeats 7] [--presets cpu,vit-s16]
        [--runtimes eager,eager-bf16,onnx-fp32,onnx-int8] [--work greedy,beam3,classify] [--out FILE.json]

Random weights (speed does not depend on them). Each caption runs ``max_new_tokens`` steps: the
``<eos>`` logit is pushed down, so every runtime decodes the same number of steps. Runtimes are
timed in turn within each repeat (so a slower moment of a shared machine hits them alike); a row is
the median over repeats of the wall time and of this process's CPU time (steadier on a shared
machine; at one thread both runtimes compute in the calling thread), and a ratio is fp32 eager time /
the runtime's time (above 1: faster than fp32 eager). bf16 pays on CPUs with bf16 matrix units (AMX,
AVX512-BF16; ``vitattn.precision``); elsewhere it runs, slower.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.timing import wall_and_cpu
from vitattn import Captioner, Classifier
from vitattn.bundle import load_bundle, save_bundle
from vitattn.bundle.onnx_export import export_onnx
from vitattn.data.preprocess import default_preprocess
from vitattn.data.tokenizer import Vocabulary
from vitattn.inference.captioning import generate_tokens
from vitattn.models import CaptionDecoder, ImageCaptioner, vit_preset
from vitattn.precision import precision_autocast

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


RUNTIMES = ("eager", "eager-bf16", "onnx-fp32", "onnx-int8")


def _classify(classifier: Classifier, images: torch.Tensor) -> torch.Tensor:
    with precision_autocast(classifier.precision, classifier.device):
        return classifier.model(images)


# --work name -> (row name, what runs)
WORK = {
    "greedy": (
        "generate greedy",
        lambda c, _, x: generate_tokens(c.model, x, c.precision, max_new_tokens=MAX_NEW_TOKENS),
    ),
    "beam3": (
        "generate beam 3",
        lambda c, _, x: generate_tokens(c.model, x, c.precision, max_new_tokens=MAX_NEW_TOKENS, num_beams=3),
    ),
    "classify": ("classify", lambda _, k, x: _classify(k, x)),
}


def _rows(name: str, folder: Path, repeats: int, runtimes: list[str], work: list[str]) -> list[dict]:
    preset, img_size, heads, vocab_size = PRESETS[name]
    model, vocab = _captioner(preset, img_size, heads, vocab_size)
    pre = default_preprocess(img_size)
    bundle_dir = save_bundle(folder / f"{name}-caption", model, task="caption", preprocess=pre, vocab=vocab)
    bundle = load_bundle(bundle_dir)
    classifier = vit_preset(preset, img_size=img_size, num_classes=NUM_CLASSES).eval()
    cls_dir = save_bundle(folder / f"{name}-cls", classifier, task="classification", preprocess=pre)
    loaded = {}  # runtime -> (Captioner, Classifier)
    for runtime in runtimes:
        if runtime.startswith("eager"):
            precision = "bf16" if runtime == "eager-bf16" else "fp32"
            loaded[runtime] = (
                Captioner.load(bundle_dir, precision=precision),
                Classifier.load(cls_dir, precision=precision),
            )
            continue
        quantize = None if runtime == "onnx-fp32" else "int8"
        cap = export_onnx(bundle, folder / f"{name}-caption-{runtime}", quantize=quantize)
        cls = export_onnx(load_bundle(cls_dir), folder / f"{name}-cls-{runtime}", quantize=quantize)
        loaded[runtime] = (Captioner.load(cap), Classifier.load(cls))
    images = torch.randn(BATCH, 3, img_size, img_size)
    rows = []
    for what, run in (WORK[w] for w in work):
        for models in loaded.values():  # warm-up: first calls allocate
            wall_and_cpu(run, *models, images)
        times = {r: [] for r in loaded}
        for _ in range(repeats):
            for r, models in loaded.items():
                times[r].append(wall_and_cpu(run, *models, images))
        wall = {r: statistics.median(t[0] for t in times[r]) for r in loaded}
        cpu = {r: statistics.median(t[1] for t in times[r]) for r in loaded}
        for r in loaded:
            ratios = {}
            if "eager" in loaded:
                ratios = dict(vs_eager=wall["eager"] / wall[r], cpu_vs_eager=cpu["eager"] / cpu[r])
            rows.append(dict(preset=name, work=what, runtime=r, seconds=wall[r], cpu_seconds=cpu[r], **ratios))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--presets", default="cpu,vit-s16")
    parser.add_argument("--runtimes", default=",".join(RUNTIMES), help="eager is fp32, the ratios' reference")
    parser.add_argument("--work", default=",".join(WORK))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    runtimes, work = args.runtimes.split(","), args.work.split(",")
    for given, known in ((runtimes, RUNTIMES), (work, tuple(WORK))):
        unknown = sorted(set(given) - set(known))
        if unknown:
            parser.error(f"{unknown} unknown; choose from {', '.join(known)}")
    torch.set_num_threads(args.threads)  # ONNX Runtime sessions take torch's thread count when loaded
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.presets.split(","):
            rows += _rows(name, Path(tmp), args.repeats, runtimes, work)
    print(f"threads={args.threads}, batch {BATCH}, {MAX_NEW_TOKENS} tokens per caption, median of {args.repeats}")
    print("| preset | work | runtime | wall s per batch | vs eager (wall) | CPU s per batch | vs eager (CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        vs, cpu_vs = (f"{r[k]:.2f}x" if k in r else "-" for k in ("vs_eager", "cpu_vs_eager"))
        print(
            f"| {r['preset']} | {r['work']} | {r['runtime']} | {r['seconds']:.3f} | {vs} "
            f"| {r['cpu_seconds']:.3f} | {cpu_vs} |"
        )
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
