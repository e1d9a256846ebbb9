"""The modules a config's ``_target_`` may name: a config read back from disk is not trusted further."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from vitattn.errors import ConfigError

__all__ = ["ALLOWED_TARGET_PREFIXES", "check_targets"]

ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")


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
