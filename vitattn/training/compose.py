"""The training config as ``vitattn-train`` composes it, for code that runs a training without the command line."""

from __future__ import annotations

from hydra import compose, initialize_config_module
from omegaconf import DictConfig

from vitattn.training.moved_keys import check_moved_keys

__all__ = ["compose_train"]


def compose_train(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with Hydra ``overrides`` as ``vitattn-train`` composes it, without a run
    directory (``paths.output_dir`` stays unresolved unless an override sets it)."""
    check_moved_keys(overrides)
    with initialize_config_module("vitattn.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))
