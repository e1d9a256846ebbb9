"""``train()`` that signals its own process in the middle of the run: the preemption tests run it as a
subprocess, so that no signal reaches the pytest process.

    python tests/helpers/preempted_train.py SIGNAL WHERE STEP RUN_DIR OVERRIDES...

WHERE is ``train`` (the signal during training step STEP) or ``test`` (during the first test batch).
Prints one JSON line: the Preempted message (or null), whether the SIGNAL handler in place before the run
is back after it, and the step the run reached. Used by tests/training/test_preemption.py.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

from tests.helpers.runs import compose_train
from vitattn.errors import Preempted
from vitattn.training import train
from vitattn.training.systems import CaptionSystem, ClassificationSystem


def _signal_during(signum: int, where: str, step: int) -> None:
    name = "training_step" if where == "train" else "test_step"
    for system in (ClassificationSystem, CaptionSystem):
        setattr(system, name, _signalling(getattr(system, name), signum, where, step))


def _signalling(original, signum: int, where: str, step: int):
    def signalled(self, batch, batch_idx):
        due = self.global_step == step if where == "train" else batch_idx == 0
        if due and not getattr(self, "signalled", False):
            self.signalled = True
            os.kill(os.getpid(), signum)
        return original(self, batch, batch_idx)

    return signalled


if __name__ == "__main__":
    signame, where, step, run_dir, *overrides = sys.argv[1:]
    signum = getattr(signal, signame)
    _signal_during(signum, where, int(step))
    handler = signal.getsignal(signum)
    report = {"preempted": None, "global_step": None}
    try:
        report["global_step"] = train(compose_train(overrides, Path(run_dir))).global_step
    except Preempted as err:
        report["preempted"] = str(err)
    report["handler_restored"] = signal.getsignal(signum) is handler
    print(json.dumps(report))
