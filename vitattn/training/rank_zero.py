"""The files rank 0 writes once into the run folder for every rank (the tokenizer, the CIDEr-D reward's statistics,
the bootstrap pool's side files): the other ranks wait here until they are there."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only

__all__ = ["WAIT_SECONDS", "wait_for_rank_zero"]

log = logging.getLogger(__name__)

WAIT_SECONDS = 3600.0  # how long a rank other than 0 waits for a file rank 0 writes (the tokenizer, the reward)


def wait_for_rank_zero(path: Path, wait: float = WAIT_SECONDS, read: Any = None) -> Any:
    """Return once rank 0 has written ``path`` for every rank, looking once a second: ``read(path)`` when given (None:
    not yet, an older file rank 0 is replacing), else True; ``TimeoutError`` once more than ``wait`` seconds passed."""
    deadline = time.monotonic() + wait
    if not path.is_file():
        log.info("rank %d: waiting for rank 0 to write %s", rank_zero_only.rank, path)
    while not path.is_file() or (found := read(path) if read else True) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no {path} in {wait:.0f} s; see rank 0's log for why")
        time.sleep(1.0)
    return found
