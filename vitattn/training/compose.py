"""The training config as ``vitattn-train`` composes it, the modules its ``_target_`` nodes may name, and the
objects of its groups of ``_target_`` nodes (``callbacks``, ``logger``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hydra
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, OmegaConf

from vitattn.errors import ConfigError

__all__ = ["ALLOWED_TARGET_PREFIXES", "check_targets", "compose_train", "instantiate_group"]

# A config read back from disk (a run folder) is input: its targets may name these packages only.
ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")


def compose_train(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with Hydra ``overrides`` as ``vitattn-train`` composes it, without a run
    directory (``paths.output_dir`` stays unresolved unless an override sets it)."""
    with initialize_config_module("vitattn.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def check_targets(cfg: DictConfig) -> None:
    """Refuse a ``_target_`` outside vitattn, torch, torchvision, timm and lightning."""

    def walk(node: Any, path: str) -> None:
        if isinstance(node, DictConfig):
            target = node.get("_target_") if "_target_" in node else None
            if target is not None and not str(target).startswith(ALLOWED_TARGET_PREFIXES):
                allowed = ", ".join(p.rstrip(".") for p in ALLOWED_TARGET_PREFIXES)
                raise ConfigError(f"{path}._target_={target} is not allowed; targets must be in {allowed}")
            for key, child in node.items_ex(resolve=False):  # a child unresolved: a `???` elsewhere is no error here
                walk(child, f"{path}.{key}" if path else str(key))

    walk(cfg, "")


def instantiate_group(
    group: DictConfig | None, extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> list[Any]:
    """Build each ``_target_`` entry of ``group``, in order, except one whose ``enabled`` is false, null or 0.

    ``enabled`` is interpolated from the run's own keys (``enabled: ${ema.decay}``) and not passed on;
    ``extra``, given an entry, returns keyword arguments that only the run knows.
    """
    entries = OmegaConf.to_container(group, resolve=True) if group else {}
    return [
        hydra.utils.instantiate({k: v for k, v in node.items() if k != "enabled"}, **(extra(node) if extra else {}))
        for node in entries.values()
        if isinstance(node, dict) and "_target_" in node and node.get("enabled", True)
    ]
