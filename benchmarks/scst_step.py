"""Self-critical (``finetune=scst``) training step time over a cross-entropy step's, and where the time goes.

    python -m benchmarks.scst_step                          # model=cpu on the built-in shapes, batch 64, K = 5
    python -m benchmarks.scst_step --threads 2 --baseline greedy

Both steps are the training system's own (``CaptionSystem``: its cross-entropy loss, or its
``SelfCritical`` objective), on one batch of the built-in shapes, each with the backward pass and an
AdamW step, ``--repeats`` times after a warm-up; the medians are reported. Where the SCST step's time
goes is read from one more profiled step: the objective marks its parts as ``torch.profiler`` ranges
(encode, sample the B x K captions, reward, greedy baseline, log-probabilities); the rest is the backward
pass and the optimizer.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import hydra
import torch
from torch.profiler import ProfilerActivity, profile

from vitattn.metrics import CiderD
from vitattn.training.build import build_system
from vitattn.training.config import compose_train


def _median_seconds(fn: Callable[[], Any], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(threads: int, batch_size: int, samples: int, baseline: str, repeats: int) -> dict[str, Any]:
    """Median seconds of a cross-entropy step and of an SCST step, and the SCST step's parts (one profiled step)."""
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    scst = [f"+finetune.scst={{samples: {samples}, baseline: {baseline}}}"]
    cfg = compose_train(
        ["model=cpu", f"data.batch_size={batch_size}", "data.num_workers=0", "data.num_train=512", *scst]
    )
    datamodule = hydra.utils.instantiate(cfg.data)
    datamodule.setup("fit")
    system = build_system(cfg, datamodule)
    system.use_reward(CiderD(datamodule.train_references(), eos_word=True))
    model = system.model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    batch = datamodule.ready_batch(next(iter(datamodule.train_dataloader())))  # images normalised, as in training

    def step(loss_of: Callable[[], torch.Tensor]) -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of().backward()
        optimizer.step()

    xe = _median_seconds(lambda: step(lambda: system._loss(batch)), repeats)
    scst_loss = lambda: system._self_critical_loss(batch, len(batch["images"]))  # noqa: E731
    scst_seconds = _median_seconds(lambda: step(scst_loss), repeats)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        step(scst_loss)
        profiled = time.perf_counter() - start
    parts = {
        e.key.removeprefix("scst/"): e.cpu_time_total / 1e6 for e in prof.key_averages() if e.key.startswith("scst/")
    }
    parts["backward + optimizer"] = max(0.0, profiled - sum(parts.values()))
    return {
        "xe": xe,
        "scst": scst_seconds,
        "parts": {k: v / profiled for k, v in parts.items()},
        "batch": len(batch["images"]),
        "samples": samples,
        "threads": threads,
    }


def report(result: dict[str, Any], baseline: str) -> str:
    lines = [
        f"model=cpu, batch {result['batch']}, K = {result['samples']} samples, baseline {baseline}, "
        f"{result['threads']} thread(s); medians of the steps, shares of one profiled step",
        f"cross-entropy step {1000 * result['xe']:8.1f} ms",
        f"SCST step          {1000 * result['scst']:8.1f} ms   ({result['scst'] / result['xe']:.1f}x)",
    ]
    for name, share in result["parts"].items():
        lines.append(f"  {name:<22} {100 * share:5.1f} %")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--baseline", choices=("mean", "greedy"), default="mean")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    result = measure(args.threads, args.batch_size, args.samples, args.baseline, args.repeats)
    print(report(result, args.baseline))
    return result


if __name__ == "__main__":
    main()
