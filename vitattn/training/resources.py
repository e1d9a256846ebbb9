"""The cores of a training run's machine, shared between loader workers and torch threads."""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import Any

import torch
from omegaconf import DictConfig

from vitattn.precision import native_bf16

__all__ = ["BF16_TRAIN_MIN_WIDTH", "on_gpu", "plan_cores", "processes_per_node", "resolve_train_precision"]

log = logging.getLogger(__name__)

# The width from which a bf16-mixed training step beats fp32 on a CPU with bf16 matrix units: the model=cpu
# captioner at 64 px, batch 64 was 1.0x at width 128 and 1.2x at 192 (benchmarks/bf16_train.py --widths,
# docs/benchmarks.md); smaller products gain less than autocast's casts cost.
BF16_TRAIN_MIN_WIDTH = 192


def on_gpu(cfg: DictConfig) -> bool:
    """The run trains on GPUs: ``trainer.accelerator`` is gpu or cuda, or auto with CUDA available."""
    return cfg.trainer.accelerator in ("gpu", "cuda") or (
        cfg.trainer.accelerator == "auto" and torch.cuda.is_available()
    )


def plan_cores(cfg: DictConfig, datamodule: Any) -> tuple[int, int]:
    """Loader workers and torch threads that do not fight over the cores; returns ``(workers, threads)``.

    Each of the node's training processes (``trainer.devices`` of them, or torchrun's
    ``LOCAL_WORLD_SIZE``) plans with its share of the cores. ``data.num_workers=auto`` is resolved
    by the DataModule (``plan_workers``); ``num_threads=auto`` gives torch the share the workers
    leave on a CPU run (at least one), so that on a CPU threads + workers of all processes stay
    within the cores, and keeps torch's default on GPUs. A number set by the user is kept as it is.
    """
    cores, processes = len(os.sched_getaffinity(0)), processes_per_node(cfg)
    share = max(1, cores // processes)
    plan = getattr(datamodule, "plan_workers", None)
    workers = plan(on_gpu(cfg), share) if plan is not None else int(getattr(datamodule, "num_workers", 0))
    threads = cfg.get("num_threads")
    if threads == "auto":
        threads = torch.get_num_threads() if on_gpu(cfg) else max(1, share - workers)
    if threads:
        torch.set_num_threads(int(threads))
    log.info(
        "cores: %d for %d process(es); loader workers: %d; torch threads: %d",
        cores,
        processes,
        workers,
        torch.get_num_threads(),
    )
    return workers, torch.get_num_threads()


def processes_per_node(cfg: DictConfig) -> int:
    """The training processes on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else ``trainer.devices``
    (a count, or device ids: a list or ``"0,1"``); 1 for ``auto`` and ``-1``."""
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, str):
        ids = [d for d in devices.split(",") if d.strip()]
        devices = int(devices) if devices.strip().isdigit() else len(ids) if "," in devices else 1
    if isinstance(devices, int):
        return max(1, devices)
    return len(devices) if isinstance(devices, Sequence) and not isinstance(devices, str) else 1


def resolve_train_precision(cfg: DictConfig) -> str:
    """``trainer.precision=auto`` made concrete, in place, with one log line; other values are left as they are.

    ``auto`` is ``bf16-mixed`` on GPUs, and on a CPU with native bf16 matrix instructions
    (``vitattn.precision.native_bf16``) for a model of width ``BF16_TRAIN_MIN_WIDTH`` or more; ``32-true``
    elsewhere (small models, CPUs without the units: nothing changes there).
    """
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision != "auto":
        return precision
    width = int(cfg.model.embed_dim)
    if on_gpu(cfg):
        chosen, why = "bf16-mixed", "a GPU"
    elif width < BF16_TRAIN_MIN_WIDTH:
        chosen, why = "32-true", f"model.embed_dim={width} is below {BF16_TRAIN_MIN_WIDTH}, where bf16 stops paying"
    elif native_bf16():
        chosen, why = "bf16-mixed", f"bf16 matrix units on this CPU and model.embed_dim={width}"
    else:
        chosen, why = "32-true", "this CPU has no bf16 matrix units"
    cfg.trainer.precision = chosen
    log.info("trainer.precision=auto: %s (%s)", chosen, why)
    return chosen
