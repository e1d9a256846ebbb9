"""Image and text embeddings of the default ``head=coca`` model (``model=cpu``, random weights) on the CPU: PyTorch
eager fp32 and bf16 (autocast, ``precision=bf16``) and ONNX Runtime fp32 and int8, in one process, at one thread
count; and each runtime's embeddings against eager fp32's.

    python -m benchmarks.embed_bench [--threads 1] [--repeats 3] [--images 64] [--out FILE.json]
    python -m benchmarks.embed_bench --zero-shot 100 1000 [--threads 1] [--images 16]

The model is ``head=coca``'s defaults over ``model=cpu``: a 64 px ViT of width 128, 4 layers, 8 px patches; a
2-layer decoder and 2-layer text tower of width 128, 4 heads, ``max_len`` 24; embeddings of width 128. Work: one
batch of ``--images`` random images and one of as many texts (8 to 24 tokens), through
``vitattn.inference.embeddings`` (what zero-shot, retrieval and ``/embed`` call). Runtimes are timed in turn within
each repeat; a row is the median over the repeats of the wall time and of this process's CPU time (steadier on a
shared machine), and a ratio is eager fp32's over the runtime's (above 1: faster).

``--zero-shot K ...``: instead, the zero-shot scorers' cost on the same model in eager fp32 (and on its ONNX
folder), per scorer and class count K (class names of two words, the template ``{}``): the seconds to build the
classifier (once: the class embeddings, the prompts' tokens) and the images per second of classifying a batch of
``--images`` images with it built (``likelihood`` scores K prompts per image through the decoder).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.timing import wall_and_cpu
from vitattn.bundle import load_bundle, load_model, save_bundle
from vitattn.bundle.onnx_export import export_onnx
from vitattn.data.preprocess import default_preprocess
from vitattn.data.tokenizer import Vocabulary
from vitattn.inference.embeddings import embed_pixels, embed_texts
from vitattn.inference.zero_shot import SCORERS, zero_shot_classifier
from vitattn.models import CaptionDecoder, CocaCaptioner, vit_preset

RUNTIMES = ("eager", "eager-bf16", "onnx-fp32", "onnx-int8")
EMBED_TABLE = (
    "| work | runtime | wall s | per s (wall) | vs eager | CPU s | vs eager (CPU) | max abs diff | min cosine |",
    "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    "| {work} | {runtime} | {seconds:.3f} | {per_second:,.0f} | {vs_eager:.2f}x | {cpu_seconds:.3f} "
    "| {cpu_vs_eager:.2f}x | {max_abs_diff:.1e} | {min_cosine:.5f} |",
)
ZERO_SHOT_TABLE = (
    "| classes | runtime | scorer | build s (once) | images/s (wall) | images/s (CPU) |",
    "|---:|---|---|---:|---:|---:|",
    "| {classes} | {runtime} | {scorer} | {build_seconds:.3f} | {per_second:,.1f} | {cpu_per_second:,.1f} |",
)
IMG_SIZE, WIDTH, HEADS, MAX_LEN, VOCAB = 64, 128, 4, 24, 1000


WORDS = [f"w{i}" for i in range(VOCAB - 4)]


def _coca() -> tuple[CocaCaptioner, Vocabulary]:
    torch.manual_seed(0)
    vocab = Vocabulary(WORDS)
    encoder = vit_preset("cpu", img_size=IMG_SIZE)
    decoder = CaptionDecoder(len(vocab), WIDTH, depth=2, num_heads=HEADS, mlp_ratio=2.0, max_len=MAX_LEN)
    model = CocaCaptioner(encoder, decoder, embed_dim=WIDTH, text_depth=2, text_num_heads=HEADS, text_mlp_ratio=2.0)
    return model.eval(), vocab


def load_runtimes(model: CocaCaptioner, vocab: Vocabulary, tmp: Path, runtimes: tuple[str, ...]) -> dict:
    """``model`` saved as a bundle under ``tmp`` and loaded in each of ``runtimes`` (``RUNTIMES``' names)."""
    bundle_dir = save_bundle(tmp / "coca", model, task="caption", preprocess=default_preprocess(IMG_SIZE), vocab=vocab)
    precision = {"eager": "fp32", "eager-bf16": "bf16"}
    quantize = {"onnx-fp32": None, "onnx-int8": "int8"}
    return {
        r: load_model(bundle_dir, precision=precision[r])
        if r in precision
        else load_model(export_onnx(load_bundle(bundle_dir), tmp / r, quantize=quantize[r]))
        for r in runtimes
    }


def zero_shot_costs(loaded: dict, pixels: torch.Tensor, classes: list[int], repeats: int) -> list[dict]:
    """Per runtime, scorer and class count: build seconds (median) and images per second (wall, median)."""
    rows = []
    for count in classes:
        names = [f"{WORDS[i // len(WORDS)]} {WORDS[i % len(WORDS)]}" for i in range(count)]  # distinct pairs
        for runtime, bundle in loaded.items():
            for scorer in (s for s in SCORERS if s != "auto"):
                args = (bundle.model, bundle.vocab, names, ["{}"], scorer)
                classifier = zero_shot_classifier(*args)
                classifier(pixels)  # warm-up
                build = [wall_and_cpu(zero_shot_classifier, *args) for _ in range(repeats)]
                times = [wall_and_cpu(classifier, pixels) for _ in range(repeats)]
                wall = statistics.median(t[0] for t in times)
                rows.append(
                    dict(
                        work="zero_shot",
                        runtime=runtime,
                        scorer=scorer,
                        classes=count,
                        build_seconds=statistics.median(b[0] for b in build),
                        seconds=wall,
                        per_second=len(pixels) / wall,
                        cpu_per_second=len(pixels) / statistics.median(t[1] for t in times),
                    )
                )
    return rows


def zero_shot_main(args: argparse.Namespace) -> None:
    model, vocab = _coca()
    pixels = torch.randn(args.images, 3, IMG_SIZE, IMG_SIZE, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_runtimes(model, vocab, Path(tmp), ("eager", "onnx-fp32"))
        rows = zero_shot_costs(loaded, pixels, args.zero_shot, args.repeats)
    title = f"threads={args.threads}, {args.images} images a batch, template '{{}}', median of {args.repeats}"
    report(args, title, ZERO_SHOT_TABLE, rows)


def report(args: argparse.Namespace, title: str, table: tuple[str, str, str], rows: list[dict]) -> None:
    """Print ``title`` and ``rows`` as a markdown table (its head, alignment row, and a row's ``str.format``
    template); write ``rows`` to ``--out`` as JSON when given."""
    head, align, row = table
    print(title, head, align, *(row.format(**r) for r in rows), sep="\n")
    if args.out is not None:
        args.out.write_text(json.dumps({"threads": args.threads, "rows": rows}, indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--images", type=int, default=64, help="images (and texts) per batch")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--zero-shot", type=int, nargs="+", default=None, metavar="K", help="class counts")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # ONNX Runtime sessions take torch's thread count when loaded
    if args.zero_shot:
        return zero_shot_main(args)
    model, vocab = _coca()
    pick = random.Random(0)
    texts = [" ".join(pick.choices(WORDS, k=pick.randint(6, MAX_LEN - 2))) for _ in range(args.images)]
    pixels = torch.randn(args.images, 3, IMG_SIZE, IMG_SIZE, generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as tmp:
        loaded = load_runtimes(model, vocab, Path(tmp), RUNTIMES)
        work = {"images": lambda b: embed_pixels(b, pixels), "texts": lambda b: embed_texts(b, texts)}
        rows = []
        for what, run in work.items():
            outputs = {r: run(b) for r, b in loaded.items()}  # warm-up; the outputs compared
            times = {r: [] for r in loaded}
            for _ in range(args.repeats):
                for r, b in loaded.items():
                    times[r].append(wall_and_cpu(run, b))
            wall = {r: statistics.median(t[0] for t in times[r]) for r in loaded}
            cpu = {r: statistics.median(t[1] for t in times[r]) for r in loaded}
            for r in loaded:
                cosine = (outputs[r] * outputs["eager"]).sum(-1)  # (B,): unit-length rows
                rows.append(
                    dict(
                        work=what,
                        runtime=r,
                        seconds=wall[r],
                        per_second=args.images / wall[r],
                        vs_eager=wall["eager"] / wall[r],
                        cpu_seconds=cpu[r],
                        cpu_vs_eager=cpu["eager"] / cpu[r],
                        max_abs_diff=(outputs[r] - outputs["eager"]).abs().max().item(),
                        min_cosine=cosine.min().item(),
                    )
                )
    title = f"threads={args.threads}, {args.images} {'/'.join(work)} a batch, median of {args.repeats}"
    report(args, title, EMBED_TABLE, rows)


if __name__ == "__main__":
    main()
