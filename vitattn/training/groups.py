"""The objects of a config group whose entries are ``_target_`` nodes (``callbacks``, ``logger``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

__all__ = ["instantiate_group"]


def instantiate_group(
    group: DictConfig | None, extra: Callable[[dict[str, Any]], dict[str, Any]] | None = None
) -> list[Any]:
    """Build each ``_target_`` entry of ``group``, in order, except one whose ``enabled`` is false, null or 0.

    ``enabled`` is a switch interpolated from the run's own keys (``enabled: ${ema.decay}``: the EMA callback
    while ``ema.decay`` is set); it is not passed on. ``callbacks=none`` or ``logger=none`` leave ``group``
    empty or null: no objects. ``extra``, given an entry, returns keyword arguments that only the run knows.
    """
    entries = OmegaConf.to_container(group, resolve=True) if group else {}
    return [
        hydra.utils.instantiate({k: v for k, v in node.items() if k != "enabled"}, **(extra(node) if extra else {}))
        for node in entries.values()
        if isinstance(node, dict) and "_target_" in node and node.get("enabled", True)
    ]
