"""Captioning image files on many devices and machines, exactly once (``vitattn.inference.processes``).

Rank 0 takes the output's lock and indexes what every earlier run wrote; the ranks share what is missing
(rank k takes the images k, k + world size, ...) and each appends its records to its own part file, one
``write`` + ``fsync`` per batch. When all ranks are done, rank 0 merges the parts into ``out`` in input
order, atomically, and removes them. A killed job, or rank, is resumed by running the same command.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vitattn.bundle.runtime import LoadedModel
from vitattn.inference.captioning import iter_caption_batches
from vitattn.inference.figures import check_figures_runtime, figure_paths, write_figures
from vitattn.inference.file_list import InputImage, InputList
from vitattn.inference.processes import Processes
from vitattn.inference.records import RecordIndex
from vitattn.inference.writers import (
    CaptionSummary,
    LineCounter,
    OutputFiles,
    append_records,
    remove_partial_files,
    write_output,
)

__all__ = ["caption_files_in_processes"]

log = logging.getLogger(__name__)


def caption_files_in_processes(
    model: LoadedModel,
    inputs: Sequence[InputImage],
    out: str | os.PathLike,
    processes: Processes,
    *,
    format: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    attention_maps: str | os.PathLike | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> CaptionSummary:
    """Caption ``inputs`` into ``out``, this process's share of them; called the same way on every rank.

    Args:
        model: a caption model on this rank's device (``load_model(path, processes.device)``).
        inputs: from ``list_inputs``; the same on every rank.
        out, format, batch_size, num_workers, progress, attention_maps: as in ``caption_to_file``.
        processes: this process among all captioning ones (``launch_processes``).
        seed: seeds sampling, ``seed + rank`` on each rank; None leaves it unseeded.
        **generate_kwargs: ``generate`` settings.

    Returns:
        The same summary on every rank (counts of all ranks).
    """
    if attention_maps is not None:
        check_figures_runtime(model)
    files = OutputFiles(Path(out), format)
    inputs = InputList.unique(inputs)
    lock, bar, refused, todo = None, None, None, None
    if processes.is_zero:  # the others write nothing before rank 0 has read every file
        try:
            lock = files.lock()
            todo = RecordIndex.read(files.sources(), repair=True).missing(inputs)
            others = [files.part(r) for r in range(1, processes.world_size)]
            bar = _GlobalProgress(len(todo), others, enabled=progress)  # counts from the parts' ends now
        except ValueError as err:
            refused = str(err)
    try:
        refused, todo = processes.broadcast((refused, todo))
        if refused is not None:
            raise ValueError(refused)
        skipped = len(inputs) - len(todo)
        if processes.is_zero and skipped:
            log.info("%d of %d images are already recorded; captioning the other %d", skipped, len(inputs), len(todo))
        if seed is not None:
            generate_kwargs["generator"] = processes.generator(seed)
        figures = figure_paths(inputs, Path(attention_maps)) if attention_maps is not None else None
        mine = todo[processes.rank :: processes.world_size]
        with open(files.part(processes.rank), "ab") as part:
            for batch in iter_caption_batches(
                model, inputs, positions=mine, batch_size=batch_size, num_workers=num_workers, **generate_kwargs
            ):
                if figures is not None:
                    write_figures(model, batch, figures)
                append_records(part, batch.records)
                if bar is not None:
                    bar.update(len(batch.records))
        processes.barrier("caption-parts-written")
        counts = None
        if processes.is_zero:
            counts = write_output(files, inputs, RecordIndex.read(files.sources()))
            remove_partial_files(files)
        captioned, failed = processes.broadcast(counts)
        return CaptionSummary(captioned, failed, skipped, files.out)
    finally:
        if bar is not None:
            bar.close()
        if lock is not None:
            lock.close()


class _GlobalProgress:
    """Rank 0's bar: its own records plus the complete lines the other ranks appended to their parts."""

    def __init__(self, total: int, others: Sequence[Path], enabled: bool, every_s: float = 0.5) -> None:
        self.counters = [LineCounter(p, p.stat().st_size if p.is_file() else 0) for p in others]
        self.bar = tqdm(total=total, unit="img", disable=not enabled, file=sys.stderr, dynamic_ncols=True)
        self.mine, self.every_s, self.last = 0, every_s, 0.0

    def update(self, n: int) -> None:
        self.mine += n
        now = time.monotonic()
        if now - self.last >= self.every_s:
            self.last = now
            self.bar.update(self.mine + sum(c() for c in self.counters) - self.bar.n)

    def close(self) -> None:
        if not self.bar.disable and self.bar.n < self.bar.total:
            self.bar.update(self.bar.total - self.bar.n)  # every rank is done
        for c in self.counters:
            c.close()
        self.bar.close()
