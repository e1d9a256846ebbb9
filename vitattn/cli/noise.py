"""Upstream output that tells a vitattn user nothing, silenced in this one place.

Each filter names the exact message, so anything else upstream prints still shows.
"""

from __future__ import annotations

import logging
import warnings

__all__ = ["quiet_upstream"]

# Lightning (2.6) adds its own stderr handler to these loggers when it is imported (``lightning`` always,
# the other two when logging is not configured yet); under Hydra's root handler every message would print twice.
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# torch 2.10+ deprecates LeafSpec, which Lightning's own _pytree still builds on each fit (not our code).
_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_ITERABLE_LEN = r"Your `IterableDataset` has `__len__` defined"


class _DropMessage(logging.Filter):
    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text

    def filter(self, record: logging.LogRecord) -> bool:
        return self.text not in record.getMessage()


def quiet_upstream() -> None:
    """Route Lightning's messages through the root logger once, and drop upstream notices we cannot act on."""
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if logging.getLogger().handlers:  # a configured root logger (Hydra's) prints them, with the run log
            logger.handlers.clear()
            logger.propagate = True
    # An advertisement printed by every Trainer (Lightning 2.6) for a cloud service.
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropMessage("litlogger"))
    warnings.filterwarnings("ignore", message=_LEAFSPEC, category=FutureWarning)
    # data=webdataset: its workers each read a planned part of the epoch, so the loader's length is exact.
    warnings.filterwarnings("ignore", message=_ITERABLE_LEN, category=UserWarning)
