"""What a command line shows its user, shared by every entry point: user mistakes as one-line errors (full
tracebacks only with ``debug=true``), and no upstream notice the user cannot act on."""

from __future__ import annotations

import logging
import sys
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf.errors import OmegaConfBaseException

from vitattn.errors import MissingDependencyError, NonFiniteLossError, first_line

__all__ = ["USER_ERRORS", "quiet_upstream", "report_user_error", "user_errors"]

# What a config, a path, a file or the data can cause; anything else is a bug and keeps its traceback.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    FileExistsError,
    OmegaConfBaseException,
    NonFiniteLossError,
    MissingDependencyError,
)


def report_user_error(err: BaseException, hint: str = "") -> int:
    """Print ``error: <first line>`` on stderr; returns the exit status of a user error (2)."""
    print(f"error: {first_line(err, limit=1000)}{hint}", file=sys.stderr, flush=True)
    return 2


@contextmanager
def user_errors(debug: bool = False) -> Iterator[None]:
    """Turn user errors into ``error: <message>`` on stderr and exit status 2 (``debug`` re-raises)."""
    try:
        yield
    except USER_ERRORS as err:
        if debug:
            raise
        sys.exit(report_user_error(err, " (debug=true shows the traceback)"))


# Lightning (2.6) adds its own stderr handler to these loggers when it is imported (``lightning`` always,
# the other two when logging is not configured yet); under Hydra's root handler every message would print twice.
_LIGHTNING_LOGGERS = ("lightning", "lightning.pytorch", "lightning.fabric")
# torch 2.10+ deprecates LeafSpec, which Lightning's own _pytree still builds on each fit (not our code).
_LEAFSPEC = r"`isinstance\(treespec, LeafSpec\)` is deprecated"
_ITERABLE_LEN = r"Your `IterableDataset` has `__len__` defined"


def _no_litlogger(record: logging.LogRecord) -> bool:
    """Drop the advertisement every Trainer (Lightning 2.6) prints for a cloud service."""
    return "litlogger" not in record.getMessage()


def quiet_upstream() -> None:
    """Route Lightning's messages through the root logger once, and drop upstream notices we cannot act on."""
    for name in _LIGHTNING_LOGGERS:
        logger = logging.getLogger(name)
        if logging.getLogger().handlers:  # a configured root logger (Hydra's) prints them, with the run log
            logger.handlers.clear()
            logger.propagate = True
    logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_no_litlogger)
    warnings.filterwarnings("ignore", message=_LEAFSPEC, category=FutureWarning)
    # data=webdataset: its workers each read a planned part of the epoch, so the loader's length is exact.
    warnings.filterwarnings("ignore", message=_ITERABLE_LEN, category=UserWarning)
