"""A training step in fp32 against ``trainer.precision=bf16-mixed`` on the CPU, same process, same threads.

    python -m benchmarks.bf16_train                       # model=cpu captioner (batch 64), ViT-S/16 224 classifier (16)
    python -m benchmarks.bf16_train --threads 2 --repeats 7
    python -m benchmarks.bf16_train --widths 128 192 256 384   # the model=cpu captioner at these widths

Each step is the training system's own (loss, backward, AdamW step) on one batch of the built-in shapes;
``bf16-mixed`` is what Lightning's ``MixedPrecision("bf16-mixed", "cpu")`` does: the forward pass under
``torch.autocast("cpu", dtype=torch.bfloat16)``, weights, gradients and the optimizer in fp32. The two take
turns within each repeat after a warm-up; reported are the medians of process CPU time per step and the
median of the per-repeat ratios (above 1: bf16-mixed is faster).

``--widths`` measures instead the ``model=cpu`` captioner (64 px, 64 tokens, batch 64) at those widths (one
head per 32 channels, the preset's depth and MLP ratio): where bf16-mixed starts to pay, which
``trainer.precision=auto`` follows (``vitattn.precision.BF16_TRAIN_MIN_WIDTH``).
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import time
from collections.abc import Sequence
from typing import Any

import hydra
import torch

from vitattn.precision import cpu_bf16_units
from vitattn.training.build import build_system
from vitattn.training.config import compose_train

MODELS = {
    "cpu caption (64 px, batch 64)": ["model=cpu", "data.batch_size=64"],
    "vit-s16 classify (224 px, batch 16)": [
        "head=classification",
        "model=small",
        "data.img_size=224",
        "data.batch_size=16",
    ],
}


def _step_fn(overrides: list[str]) -> Any:
    cfg = compose_train([*overrides, "data.num_workers=0", "data.num_train=128"])
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    system = build_system(cfg, datamodule)
    system.model.train()
    optimizer = torch.optim.AdamW(system.model.parameters(), lr=1e-5)
    batch = datamodule.ready_batch(next(iter(datamodule.train_dataloader())))  # images normalised, as in training
    caption = cfg.head.task == "caption"

    def step(bf16: bool) -> None:
        optimizer.zero_grad(set_to_none=True)
        autocast = torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
        with autocast:
            loss = (
                system._loss(batch) if caption else torch.nn.functional.cross_entropy(system.model(batch[0]), batch[1])
            )
        loss.backward()
        optimizer.step()

    return step


def width_models(widths: Sequence[int]) -> dict[str, list[str]]:
    """The ``model=cpu`` captioner at each width (one head per 32 channels)."""
    return {
        f"cpu caption, width {w} (64 px, batch 64)": [
            "model=cpu",
            "data.batch_size=64",
            f"model.embed_dim={w}",
            f"model.num_heads={max(1, w // 32)}",
        ]
        for w in widths
    }


def measure(threads: int, repeats: int, models: dict[str, list[str]] = MODELS) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    rows = []
    for name, overrides in models.items():
        torch.manual_seed(0)
        step = _step_fn(overrides)
        step(False), step(True)  # warm-up
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(repeats):
            for bf16 in (False, True):
                start = time.process_time()
                step(bf16)
                times[bf16].append(time.process_time() - start)
        ratios = [a / b for a, b in zip(times[False], times[True])]
        rows.append(
            {
                "model": name,
                "fp32_s": statistics.median(times[False]),
                "bf16_s": statistics.median(times[True]),
                "ratio": statistics.median(ratios),
                "ratio_range": (min(ratios), max(ratios)),
            }
        )
    return rows


def main(argv: Sequence[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--widths", type=int, nargs="+", help="the model=cpu captioner at these widths instead")
    args = p.parse_args(argv)
    rows = measure(args.threads, args.repeats, width_models(args.widths) if args.widths else MODELS)
    units = ", ".join(cpu_bf16_units()) or "none"
    print(f"bf16 matrix units: {units}; {args.threads} thread(s); CPU seconds per training step, medians")
    print("| model | fp32 | bf16-mixed | fp32 / bf16-mixed (range) |\n|---|---|---|---|")
    for r in rows:
        low, high = r["ratio_range"]
        print(f"| {r['model']} | {r['fp32_s']:.3f} | {r['bf16_s']:.3f} | {r['ratio']:.2f}x ({low:.2f}-{high:.2f}) |")
    return rows


if __name__ == "__main__":
    main()
