"""Every data path resumes a DDP epoch stopped by SIGTERM, then by ``kill -9``, with every sample trained once:
two ranks, one loader worker each (apart from test_data_resume.py, so that the two files run side by side). The
shapes' epoch: test_preemption.py's DDP chain, whose 40 steps are one epoch (the same three runs)."""

import sys
from collections import Counter

import pytest

from tests.helpers.processes import stop_twice_then_finish
from tests.training.test_data_resume import ENV, _overrides

DDP_CPU = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


@pytest.mark.slow
@pytest.mark.parametrize("name", ["coco", "imagefolder"])
def test_a_ddp_epoch_stopped_by_sigterm_then_by_kill_9_resumes_with_every_sample_once(name, tmp_path):
    overrides, expected = _overrides(name, 96, tmp_path / "data")
    overrides.append(f"+callbacks.sample_keys.folder={tmp_path / 'keys'}")
    command = [
        *[sys.executable, "-m", "vitattn.cli.train", *DDP_CPU, "trainer.benchmark=false", *overrides],
        *["data.num_workers=1", "callbacks.step_checkpoint.every_n_train_steps=2", "resume=auto"],
        f"hydra.run.dir={tmp_path / 'run'}",
    ]
    steps = len(expected) // (2 * 4)  # 12: two ranks of 4 samples a step, every sample once (no padding)
    runs = stop_twice_then_finish(command, tmp_path, tmp_path / "keys", first=3, every=2, steps=steps, batch=4, env=ENV)
    trained = [k for run in runs for k in run]
    repeated = [k for k, n in Counter(trained).items() if n > 1]
    assert not repeated, f"{len(repeated)} samples trained twice: {repeated[:5]}"
    assert sorted(trained) == sorted(expected)  # none skipped
