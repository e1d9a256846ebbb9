"""The modules a config's ``_target_`` may name: a config read back from disk is not trusted further."""

from __future__ import annotations

from typing import Any

from omegaconf import DictConfig

from vitattn.errors import ConfigError

__all__ = ["ALLOWED_TARGET_PREFIXES", "MOVED_MODULES", "check_targets"]

ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")

# Modules that moved; a user's config naming a class by its old module gets one line naming the new one.
MOVED_MODULES = {
    "vitattn.data.tar_reader": "vitattn.data.shards.reading",
    "vitattn.data.shard_plan": "vitattn.data.shards.epoch_split",
    "vitattn.data.shard_stream": "vitattn.data.shards.stream",
    "vitattn.data.shard_writer": "vitattn.data.shards.writer",
    "vitattn.inference.shards": "vitattn.inference.captioning",
    "vitattn.inference.inputs": "vitattn.inference.file_list",
    "vitattn.inference.image_inputs": "vitattn.inference.api",
    "vitattn.inference.reading": "vitattn.inference.captioning",
}


def check_targets(cfg: DictConfig) -> None:
    """Refuse a ``_target_`` outside vitattn, torch, torchvision, timm and lightning."""

    def walk(node: Any, path: str) -> None:
        if isinstance(node, DictConfig):
            target = node.get("_target_") if "_target_" in node else None
            if target is not None and not str(target).startswith(ALLOWED_TARGET_PREFIXES):
                allowed = ", ".join(p.rstrip(".") for p in ALLOWED_TARGET_PREFIXES)
                raise ConfigError(f"{path}._target_={target} is not allowed; targets must be in {allowed}")
            if target is not None:
                _check_moved(str(target), path)
            for key, child in node.items_ex(resolve=False):  # a child unresolved: a `???` elsewhere is no error here
                walk(child, f"{path}.{key}" if path else str(key))

    walk(cfg, "")


def _check_moved(target: str, path: str) -> None:
    module, _, name = target.rpartition(".")
    if module in MOVED_MODULES:
        new = MOVED_MODULES[module]
        raise ConfigError(f"{path}._target_={target}: {module} moved to {new}; use _target_={new}.{name}")
