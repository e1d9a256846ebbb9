"""The run's caption tokenizer: the ``tokenizer`` group handed to the DataModule, built once per run.

``tokenizer=words`` and ``tokenizer=bpe`` are built by rank 0 (in ``setup``, from the training captions) and
written into the run folder before training starts (``RunDir.vocab``, ``RunDir.tokenizer``); the other ranks,
and every restart of the run, read that file instead of reading the training captions again (all the shards,
for ``data=webdataset``), so that all processes and all restarts share one set of ids.
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


def prepare_tokenizer(
    cfg: DictConfig, datamodule: Any, run_dir: str | Path, resuming: bool, wait: float = WAIT_SECONDS
) -> None:
    """Give ``datamodule`` (before ``setup``) the ``tokenizer`` group, and for ``tokenizer=words`` or ``bpe`` the
    run's own ``vocab.json`` or ``tokenizer.json``: on a restart (``resuming``: a checkpoint to continue from),
    and on a rank other than 0 once rank 0 wrote it.

    Raises:
        TimeoutError: rank 0 wrote no tokenizer within ``wait`` seconds.
    """
    if cfg.head.task != "caption" or "tokenizer" not in cfg or not hasattr(datamodule, "tokenizer_config"):
        return
    datamodule.tokenizer_config = OmegaConf.to_container(cfg.tokenizer, resolve=True)
    kind = cfg.tokenizer.kind
    if kind not in ("words", "bpe") or cfg.data.get("vocab_path"):
        return  # file and vocab_path read their own path
    run = RunDir(run_dir)
    saved = run.tokenizer if kind == "bpe" else run.vocab
    if rank_zero_only.rank != 0:
        wait_for_rank_zero(saved, wait)
    elif not resuming:
        return  # a first start builds it; a file from an earlier run in this folder is not this run's
    if saved.is_file():
        log.info("tokenizer=%s: reading this run's %s (built once per run)", kind, saved)
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
