"""Captioning on many devices and machines: Lightning's ``Trainer.predict`` with DDP, exactly once.

Every rank captions its share of the images not yet recorded (predict's unrepeated distributed
sampler: no padding duplicates) and appends its records to its own part file, one ``write`` +
``fsync`` per batch (``PartFileWriter``). When all ranks are done, rank 0 merges the parts into
``out`` in input order, atomically, and removes them. A killed job, or rank, is resumed by running
the same command: rank 0 indexes what every earlier run wrote and the ranks share what is missing.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from vitattn.bundle import Bundle
from vitattn.inference.captioning import CaptionBatch, caption_batch, caption_loader
from vitattn.inference.figures import figure_paths, write_figures
from vitattn.inference.file_list import InputImage, InputList
from vitattn.inference.records import RecordIndex
from vitattn.inference.writers import (
    CaptionSummary,
    LineCounter,
    OutputFiles,
    append_records,
    remove_partial_files,
    write_output,
)

__all__ = ["CaptionPredictor", "PartFileWriter", "caption_with_trainer"]

log = logging.getLogger(__name__)


class CaptionPredictor(pl.LightningModule):
    """A caption bundle as a LightningModule for ``Trainer.predict``: one ``CaptionBatch`` per batch.

    Args:
        bundle: a caption bundle.
        inputs: every image of the run; ``positions`` (set before ``predict``) says which to caption.
        batch_size, num_workers: of the DataLoader.
        seed: seeds sampling, ``seed + global rank`` on each rank; None leaves it unseeded.
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """

    def __init__(
        self,
        bundle: Bundle,
        inputs: InputList,
        *,
        batch_size: int = 32,
        num_workers: int = 2,
        seed: int | None = None,
        **generate_kwargs: Any,
    ) -> None:
        super().__init__()
        self.model = bundle.model
        self.bundle, self.inputs = bundle, inputs
        self.positions: np.ndarray = np.arange(len(inputs))
        self.batch_size, self.num_workers, self.seed = batch_size, num_workers, seed
        self.generate_kwargs = generate_kwargs

    def on_predict_start(self) -> None:
        if self.seed is not None:
            self.generate_kwargs["generator"] = torch.Generator(self.device).manual_seed(self.seed + self.global_rank)

    def predict_dataloader(self) -> DataLoader:
        positions, world = self.positions, self.trainer.world_size
        if 0 < len(positions) < world:  # Lightning's unrepeated sampler needs an item for every rank
            positions = np.concatenate([positions, np.full(world - len(positions), -1)])
        return caption_loader(
            self.bundle,
            self.inputs,
            positions,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            pin_memory=self.device.type == "cuda",
        )

    def predict_step(self, batch: tuple[list[int], torch.Tensor | None, list[tuple[int, str]]]) -> CaptionBatch:
        ok, images, errors = batch
        return caption_batch(self.model, self.bundle.vocab, self.inputs, ok, images, errors, **self.generate_kwargs)


class PartFileWriter(BasePredictionWriter):
    """Appends each rank's records to its part file; rank 0 holds the job's lock, decides what is
    left to caption, shows one progress bar for all ranks and merges the parts at the end.

    Args:
        files: the run's output files.
        progress: show the progress bar (rank 0, stderr).
        attention_maps: a folder for one attention figure per captioned image; each rank draws its own.
    """

    def __init__(self, files: OutputFiles, progress: bool = True, attention_maps: str | os.PathLike | None = None):
        super().__init__("batch")
        self.files, self.progress, self.attention_maps = files, progress, attention_maps
        self._lock: IO[bytes] | None = None
        self._part: IO[bytes] | None = None
        self._bar: _GlobalProgress | None = None
        self._figures: dict[str, Path] | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        assert isinstance(pl_module, CaptionPredictor)
        inputs, refused, todo = pl_module.inputs, None, None
        if trainer.is_global_zero:  # the others write nothing before rank 0 has read every file
            try:
                self._lock = self.files.lock()
                todo = RecordIndex.read(self.files.sources(), repair=True).missing(inputs)
                others = [self.files.part(r) for r in range(1, trainer.world_size)]
                self._bar = _GlobalProgress(len(todo), others, enabled=self.progress)  # counts from the parts' ends now
            except ValueError as err:
                refused = str(err)
        refused, todo = trainer.strategy.broadcast((refused, todo), src=0)
        if refused is not None:
            raise ValueError(refused)
        pl_module.positions = todo  # the unrepeated sampler gives rank k the items k, k + world size, ...
        self.skipped = len(inputs) - len(todo)
        if trainer.is_global_zero and self.skipped:
            log.info(
                "%d of %d images are already recorded; captioning the other %d", self.skipped, len(inputs), len(todo)
            )
        part = self.files.part(trainer.global_rank)
        self._part = open(part, "ab")  # noqa: SIM115 - closed in teardown
        if self.attention_maps is not None:
            self._figures = figure_paths(inputs, Path(self.attention_maps))

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: CaptionBatch,
        batch_indices: Sequence[int] | None,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._figures is not None:
            write_figures(pl_module.bundle, prediction, self._figures)
        if prediction.records:  # a batch of placeholders has none
            append_records(self._part, prediction.records)
        if self._bar is not None:
            self._bar.update(len(prediction.records))

    def finish(self, trainer: pl.Trainer, inputs: InputList) -> CaptionSummary:
        """After ``predict`` (which skips its end hooks on a rank with nothing to do): once every rank
        is done, rank 0 merges the parts into ``out``; every rank gets the counts."""
        self._part.close()
        trainer.strategy.barrier("caption-parts-written")
        counts = None
        if trainer.is_global_zero:
            self._bar.close()
            counts = write_output(self.files, inputs, RecordIndex.read(self.files.sources()))
            remove_partial_files(self.files)
        captioned, failed = trainer.strategy.broadcast(counts, src=0)
        return CaptionSummary(captioned, failed, self.skipped, self.files.out)

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if self._part is not None:
            self._part.close()
        if self._bar is not None:
            self._bar.close()

    def release(self) -> None:
        """Let go of the output lock (rank 0)."""
        if self._lock is not None:
            self._lock.close()


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


def caption_with_trainer(
    bundle: Bundle,
    inputs: Sequence[InputImage],
    out: str | os.PathLike,
    *,
    devices: int,
    num_nodes: int = 1,
    accelerator: str = "auto",
    format: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    attention_maps: str | os.PathLike | None = None,
    seed: int | None = None,
    **generate_kwargs: Any,
) -> CaptionSummary:
    """Caption ``inputs`` into ``out`` with ``Trainer.predict`` on ``devices`` x ``num_nodes`` processes.

    Called the same way on every rank (Lightning starts the other local ranks by running the command
    again; torchrun and SLURM start them all). Returns the same summary on every rank.

    Args:
        bundle: a caption bundle (on the CPU; Lightning moves it to each rank's device).
        inputs: from ``list_inputs``; the same on every rank.
        out, format, batch_size, num_workers, progress, attention_maps: as in ``caption_to_file``.
        devices, num_nodes, accelerator: as in ``lightning.pytorch.Trainer``.
        seed: seeds sampling (``seed + global rank`` on each rank).
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """
    files = OutputFiles(Path(out), format)
    module = CaptionPredictor(
        bundle,
        InputList.unique(inputs),
        batch_size=batch_size,
        num_workers=num_workers,
        seed=seed,
        **generate_kwargs,
    )
    writer = PartFileWriter(files, progress=progress, attention_maps=attention_maps)
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        num_nodes=num_nodes,
        strategy="ddp" if devices * num_nodes > 1 else "auto",
        precision="32-true",  # caption_batch autocasts to bf16 on GPUs itself
        callbacks=[writer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=True,
    )
    try:
        trainer.predict(module, return_predictions=False)
        return writer.finish(trainer, module.inputs)
    finally:
        writer.release()
