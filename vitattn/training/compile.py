"""``compile``: whether a run compiles its model with ``torch.compile``."""

from __future__ import annotations

from omegaconf import DictConfig

from vitattn.training.config import fully_sharded
from vitattn.training.resources import on_gpu

__all__ = ["should_compile"]


def should_compile(cfg: DictConfig) -> bool:
    """``compile=auto`` compiles on GPUs only: on CPUs eager is as fast (see docs/benchmarks.md); and not under
    ``trainer=fsdp``, whose sharded layers have not been tested compiled (``compile=true`` asks for it)."""
    if str(cfg.compile).lower() == "auto":
        return on_gpu(cfg) and not fully_sharded(cfg.trainer)
    return bool(cfg.compile)
