"""A polite stop (SIGTERM, SIGUSR1) ends training after the current step, with a checkpoint to continue from
(why Lightning's own stop does not serve as it is: docs/reliability.md)."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Checkpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import SIGTERMException

from vitattn.errors import Preempted
from vitattn.run_dir import RunDir
from vitattn.upstream import request_sigterm_stop

__all__ = ["STOP_SIGNALS", "Preemption"]

STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class Preemption(Checkpoint):
    """On SIGTERM or SIGUSR1: finish the current step (and a validation that follows it), write the run's
    ``last_checkpoint`` (through the trainer's atomic checkpoint IO), stop; ``preempted()`` describes the stop."""

    def __init__(self, run_dir: str | Path) -> None:
        self.checkpoint = RunDir(run_dir).last_checkpoint
        self.received: int = 0  # the signal this process received (0: none)
        self.stopped_by: int = 0  # the signal that stopped training, on any rank
        self.saved_step: int | None = None
        # the SIGUSR1 handler found installed (Lightning's SLURM requeue), run after the save
        self.on_sigusr1: Any = None
        self._group: Any = None  # the process group the ranks agree over (None: the default one)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Lightning installed its handlers just before this hook and restores the ones before them when fit ends.
        self.received, self.stopped_by, self.saved_step = 0, 0, None
        self._group = _host_group(trainer)
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers
        previous = signal.getsignal(signal.SIGUSR1)
        self.on_sigusr1 = previous if callable(previous) else None
        for signum in STOP_SIGNALS:
            signal.signal(signum, self._note)

    def _note(self, signum: int, frame: FrameType | None) -> None:
        self.received = signum  # all a handler should do: it runs between any two bytecodes

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._agreed_signal(trainer):
            # Lightning's own flag: the training loop stops at the end of the step, the evaluation loop after a batch.
            request_sigterm_stop(trainer, True)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.stopped_by:  # let the validation due after this step run whole
            request_sigterm_stop(trainer, False)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Stop here, after the ModelCheckpoints (Lightning runs Checkpoint callbacks last) have saved: a run
        # restarted from this point skips the validation and counts the step for its loggers once.
        if not trainer.sanity_checking and self._agreed_signal(trainer):
            raise SIGTERMException

    def _agreed_signal(self, trainer: pl.Trainer) -> int:
        """The signal any rank received (0: none), the same on every rank: all stop after the same step."""
        signum = self.received
        if trainer.world_size > 1:
            # A host tensor over a gloo group: agreeing after every step never waits for the device's queue.
            flag = torch.tensor(signum)
            torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=self._group)
            signum = int(flag)
        self.stopped_by = self.stopped_by or signum
        return self.stopped_by

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException) -> None:
        if not isinstance(exception, SIGTERMException):
            return
        self.stopped_by = self.stopped_by or signal.SIGTERM  # Lightning's own handler: before training, or testing
        if trainer.state.fn != TrainerFn.FITTING:
            return  # the test after training: the weights in the system may be the best ones, not the last
        trainer.save_checkpoint(self.checkpoint)
        self.saved_step = trainer.global_step
        if self.stopped_by == signal.SIGUSR1 and self.on_sigusr1 is not None:
            # Lightning's SLURM auto-requeue (its own checkpoint, then `scontrol requeue`) here, where every
            # rank is, rather than inside the signal handler, wherever each rank was: its save waits for all.
            self.on_sigusr1(signal.SIGUSR1, None)

    def preempted(self) -> Preempted:
        """The error that ``train()`` raises for the stop."""
        name = signal.Signals(self.stopped_by or signal.SIGTERM).name
        return Preempted(name, self.saved_step, self.checkpoint)


def _host_group(trainer: pl.Trainer) -> Any:
    """The gloo group to agree over with host tensors (NCCL reduces device tensors, whose reading waits for the
    device), made where every rank is; None for the default group where it is gloo, or in one process."""
    dist = torch.distributed
    if trainer.world_size <= 1 or not dist.is_available() or not dist.is_initialized() or dist.get_backend() == "gloo":
        return None
    return dist.new_group(backend="gloo")
