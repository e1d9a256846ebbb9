"""The reward of ``finetune=scst``: CIDEr-D with document frequencies from the training references, computed
once per run by rank 0 and written into the run folder (``RunDir.cider_statistics``); the other ranks, and
every restart of the run, read that file instead of reading the training captions again."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

from lightning.pytorch.utilities import rank_zero_only

from vitattn.errors import ConfigError
from vitattn.fileio import atomic_write, read_json
from vitattn.metrics import CiderD
from vitattn.run_dir import RunDir
from vitattn.training.build import WAIT_SECONDS, wait_for_rank_zero

__all__ = ["prepare_reward", "read_statistics", "write_statistics"]

log = logging.getLogger(__name__)

FORMAT = "vitattn-cider-statistics/1"


def prepare_reward(datamodule: Any, run_dir: str | Path, resuming: bool, wait: float = WAIT_SECONDS) -> CiderD:
    """The run's CIDEr-D reward: its statistics read from the run folder (a restart, ``resuming``; a rank other
    than 0), or on rank 0's first start computed from ``datamodule.train_references()`` and written there.

    Raises:
        ConfigError: the data has no caption references, or none in its training split.
        TimeoutError: a rank other than 0 found no statistics within ``wait`` seconds.
    """
    path = RunDir(run_dir).cider_statistics
    if rank_zero_only.rank != 0:
        wait_for_rank_zero(path, wait)
    if path.is_file() and (resuming or rank_zero_only.rank != 0):
        log.info("finetune=scst: CIDEr-D statistics from this run's %s (computed once per run)", path)
        return read_statistics(path)
    references = _train_references(datamodule)
    started = time.monotonic()
    scorer = CiderD(references)
    write_statistics(scorer, path)
    log.info(
        "finetune=scst: CIDEr-D document frequencies of %d n-grams over the %d training images' references "
        "(%.1f s), written to %s",
        len(scorer.doc_freq),
        scorer.num_images,
        time.monotonic() - started,
        path,
    )
    return scorer


def _train_references(datamodule: Any) -> list[list[str]]:
    what = type(datamodule).__name__
    get = getattr(datamodule, "train_references", None)
    references = get() if get is not None else None
    if not references:
        raise ConfigError(
            f"finetune=scst: the data ({what}) gives no reference captions for its training images, and the "
            "reward is CIDEr-D against them; use caption data (data=coco, karpathy, webdataset with captions, shapes)"
        )
    return references


def write_statistics(scorer: CiderD, path: Path) -> None:
    """Save the scorer's document frequencies (n-grams as space-joined tokens) atomically."""
    frequencies = {" ".join(gram): count for gram, count in scorer.doc_freq.items()}
    payload = {"format": FORMAT, "num_images": scorer.num_images, "n": scorer.n, "document_frequency": frequencies}
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(payload, ensure_ascii=False))


def read_statistics(path: Path) -> CiderD:
    """The scorer ``write_statistics`` saved, or a one-line ``ValueError``."""
    saved = read_json(path, "CIDEr-D statistics")
    if not isinstance(saved, dict) or saved.get("format") != FORMAT:
        raise ValueError(
            f"{path} is not a vitattn CIDEr-D statistics file ({FORMAT}); move it away to compute it again"
        )
    frequencies = Counter({tuple(gram.split(" ")): count for gram, count in saved["document_frequency"].items()})
    return CiderD.from_statistics(frequencies, saved["num_images"], n=saved["n"])
