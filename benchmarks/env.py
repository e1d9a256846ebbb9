"""The device, precision and timing knobs that every section shares."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from typing import Any

import torch

from benchmarks.timing import interleaved


class Env:
    """Device, precision and timing knobs shared by every section.

    Args:
        device: ``cpu`` or ``cuda``.
        quick: fewer repeats, shorter samples and fewer sizes.
        repeats: timed samples per side (default 7, quick 3).
        min_time: shortest timed sample in seconds (default 0.2, quick 0.05).
    """

    def __init__(self, device: str, quick: bool, repeats: int | None = None, min_time: float | None = None) -> None:
        self.device = device
        self.cuda = device.startswith("cuda")
        self.quick = quick
        self.repeats = repeats or (3 if quick else 7)
        self.min_time = min_time if min_time is not None else (0.05 if quick else 0.2)
        self.sync = torch.cuda.synchronize if self.cuda else None

    def autocast(self) -> contextlib.AbstractContextManager:
        """bf16 autocast on CUDA (UNTESTED on a GPU here); fp32 on CPU (bf16 matmul is slow without AMX)."""
        if self.cuda:
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def time(
        self, fns: Mapping[str, Callable[[], Any]], repeats: int | None = None, warmup: int = 1
    ) -> dict[str, list[float]]:
        """``interleaved`` with this run's repeats, shortest sample and device sync.

        Args:
            fns: name -> zero-argument function.
            repeats: samples per function (default: ``self.repeats``).
            warmup: untimed calls per function first.

        Returns:
            name -> samples, seconds per call, in round order.
        """
        return interleaved(fns, repeats or self.repeats, warmup, self.min_time, self.sync)
