"""The run's caption tokenizer: the ``tokenizer`` group handed to the DataModule, a BPE built once per run.

``tokenizer=bpe`` is trained by rank 0 (in ``setup``) and written into the run folder before training starts
(``RunDir.tokenizer``); the other ranks, and every restart of the run, read that file instead of training
their own, so that all processes and all restarts share one set of ids.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitattn.data.tokenizer import load_tokenizer
from vitattn.run_dir import RunDir

__all__ = ["WAIT_SECONDS", "prepare_tokenizer", "wait_for_rank_zero"]

log = logging.getLogger(__name__)

WAIT_SECONDS = 3600.0  # how long a rank other than 0 waits for rank 0's tokenizer.json


def prepare_tokenizer(cfg: DictConfig, datamodule: Any, run_dir: str | Path, wait: float = WAIT_SECONDS) -> None:
    """Give ``datamodule`` (before ``setup``) the ``tokenizer`` group, and for ``tokenizer=bpe`` the run's own
    ``tokenizer.json`` when the run folder holds one (a restart), or, on a rank other than 0, once rank 0 wrote it.

    Raises:
        TimeoutError: rank 0 wrote no tokenizer within ``wait`` seconds.
    """
    if cfg.head.task != "caption" or "tokenizer" not in cfg or not hasattr(datamodule, "tokenizer_config"):
        return
    datamodule.tokenizer_config = OmegaConf.to_container(cfg.tokenizer, resolve=True)
    if cfg.tokenizer.kind != "bpe" or cfg.data.get("vocab_path"):
        return  # words is cheap and deterministic on every rank; file reads its path
    saved = RunDir(run_dir).tokenizer
    if rank_zero_only.rank != 0:
        wait_for_rank_zero(saved, wait)
    if saved.is_file():
        log.info("tokenizer=bpe: reading this run's %s (built once per run)", saved)
        datamodule.vocab = load_tokenizer(saved)


def wait_for_rank_zero(path: Path, wait: float = WAIT_SECONDS) -> None:
    """Return once ``path`` exists (a file rank 0 writes into the run folder for every rank).

    Raises:
        TimeoutError: no such file within ``wait`` seconds.
    """
    if path.is_file():
        return
    log.info("rank %d: waiting for rank 0 to write %s", rank_zero_only.rank, path)
    deadline = time.monotonic() + wait
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no {path} in {wait:.0f} s; see rank 0's log for why")
        time.sleep(1.0)
