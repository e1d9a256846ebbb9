"""``compile``: whether a run compiles its model with ``torch.compile``."""

from __future__ import annotations

from omegaconf import DictConfig

from vitattn.training.resources import on_gpu

__all__ = ["should_compile"]


def should_compile(cfg: DictConfig) -> bool:
    """``compile=auto`` compiles on GPUs only: on CPUs eager is as fast (see docs/benchmarks.md)."""
    if str(cfg.compile).lower() == "auto":
        return on_gpu(cfg)
    return bool(cfg.compile)
