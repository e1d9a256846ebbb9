"""Training images/s with K captions per image: encoded once (``data.captions_per_image=K``) against the image
repeated for each caption (K draws of one caption each), and one caption per image.

    python -m benchmarks.captions_per_image                 # model=cpu, 64 images of the built-in shapes, K = 5
    python -m benchmarks.captions_per_image --threads 2 --k 2

Each step is the caption system's own (``CaptionSystem._loss``: teacher-forced cross-entropy), with the backward
pass and an AdamW step, timed in interleaved rounds (``benchmarks.timing``). The captions are the same in the
two K-caption steps; only the encoder's work differs.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import hydra
import torch

from benchmarks.timing import interleaved
from vitattn.training.build import build_system
from vitattn.training.config import compose_train


def measure(threads: int, batch_size: int, k: int, repeats: int) -> dict[str, Any]:
    """Seconds per step and images/s of the three steps."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    cfg = compose_train(["model=cpu", f"data.batch_size={batch_size}", "data.num_workers=0", "data.num_train=512"])
    cfg.data.captions_per_image = k
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    system = build_system(cfg, datamodule)
    model = system.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    once = datamodule.ready_batch(next(iter(datamodule.train_dataloader())))  # B images, K x B captions
    repeated = {**once, "images": once["images"][once["caption_image"]], "caption_image": None}
    single = {**once, "tokens": once["tokens"][::k], "caption_image": None}  # the first caption of each image

    def step(batch: dict[str, Any]) -> None:
        optimizer.zero_grad(set_to_none=True)
        system._loss(batch).backward()
        optimizer.step()

    steps = {"once": lambda: step(once), "repeated": lambda: step(repeated), "one caption": lambda: step(single)}
    seconds = {name: sorted(samples)[len(samples) // 2] for name, samples in interleaved(steps, repeats).items()}
    images = len(once["images"])
    return {"seconds": seconds, "images": images, "k": k, "threads": threads}


def report(result: dict[str, Any]) -> str:
    k, images, seconds = result["k"], result["images"], result["seconds"]
    lines = [f"model=cpu, {images} images of the built-in shapes, K = {k}, {result['threads']} thread(s); medians"]
    for name, what in (
        ("one caption", "1 caption per image"),
        ("once", f"{k} captions, image encoded once"),
        ("repeated", f"{k} captions, image repeated"),
    ):
        s = seconds[name]
        lines.append(f"{what:<32} {1000 * s:8.1f} ms   {images / s:7.1f} images/s")
    lines.append(f"encoded once over repeated: {seconds['repeated'] / seconds['once']:.2f}x the images/s")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--k", type=int, default=5, help="captions per image")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    result = measure(args.threads, args.batch_size, args.k, args.repeats)
    print(report(result))
    return result


if __name__ == "__main__":
    main()
