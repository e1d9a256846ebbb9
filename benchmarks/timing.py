"""Interleaved timing rounds, their medians and quartiles, a time limit, and the knobs every timed section shares;
``stopwatch`` for a whole run reported as its duration (a training subprocess), which nothing is compared with.

Every comparison runs both sides in the same process, interleaved in rounds (A B, B A, A B, ...)
after a warm-up; each side's figure is its median over the rounds, and the ratio is the median of
the per-round ratios, so that a noisy neighbour slowing one round slows both sides of it.
"""

from __future__ import annotations

import contextlib
import math
import resource
import signal
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from types import FrameType
from typing import Any, NoReturn

import torch


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
    sync = sync or _no_sync
    names = list(fns)

    def order(r: int) -> list[str]:
        return names if r % 2 == 0 else names[::-1]

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


@dataclass
class Took:
    """What ``stopwatch`` measured: wall-clock and CPU seconds."""

    seconds: float = 0.0
    cpu: float = 0.0


@contextlib.contextmanager
def stopwatch(cpu: Callable[[], float] = time.process_time) -> Iterator[Took]:
    """Time the block once, by the wall clock and by ``cpu`` (``children_cpu`` for a subprocess): a whole run
    reported as its duration. Two sides compared are ``interleaved``'s."""
    took, start, cpu_start = Took(), time.perf_counter(), cpu()
    try:
        yield took
    finally:
        took.seconds, took.cpu = time.perf_counter() - start, cpu() - cpu_start


def children_cpu() -> float:
    """CPU seconds, user and system, of the finished child processes."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _no_sync() -> None:
    """Nothing to wait for (a CPU)."""


def paired_speedup(ours: Sequence[float], ref: Sequence[float]) -> float:
    """Speed of ours over the reference: the median over rounds of ``ref_i / ours_i`` (seconds)."""
    if len(ours) != len(ref) or not ours:
        raise ValueError(f"need the same number (>0) of samples, got {len(ours)} and {len(ref)}")
    return statistics.median(r / o for o, r in zip(ours, ref, strict=True))


def ratio_quartiles(ours: Sequence[float], ref: Sequence[float]) -> list[float]:
    """Quartiles (Q1, median, Q3) of the per-round speed ratios ``ref_i / ours_i``: the noise of a ratio.

    One round gives its one ratio three times.
    """
    ratios = [r / o for o, r in zip(ours, ref, strict=True)]
    return statistics.quantiles(ratios, n=4, method="inclusive") if len(ratios) > 1 else [ratios[0]] * 3


def per_second(samples: Mapping[str, Sequence[float]], work: float) -> dict[str, float]:
    """Rate of each side: ``work`` units (images, tokens, FLOPs) over its median seconds per call."""
    return {name: work / statistics.median(seconds) for name, seconds in samples.items()}


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise ``TimeoutError`` in the main thread after ``seconds`` (POSIX; no limit elsewhere)."""
    if seconds <= 0 or not hasattr(signal, "SIGALRM"):
        yield
        return

    def _raise(signum: int, frame: FrameType | None) -> NoReturn:
        raise TimeoutError(f"over {seconds:.0f} s")

    old = signal.signal(signal.SIGALRM, _raise)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


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
