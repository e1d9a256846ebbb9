"""A run's checkpoints are whole or absent whatever kills the process (``AtomicCheckpointIO``; why Lightning's
own save is not: docs/reliability.md), and a run killed with SIGKILL resumes with at most one checkpoint
interval trained again."""

import csv
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import TINY, TINY_SHAPES, console_script
from vitattn.training import AtomicCheckpointIO

CLS = ["head=classification", *TINY, *TINY_SHAPES]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}


def _train_steps(metrics_csv: Path) -> list[int]:
    if not metrics_csv.is_file():
        return []
    with open(metrics_csv, newline="") as f:
        rows = [row for row in csv.DictReader(f) if row.get("train/loss") and (row.get("step") or "").isdigit()]
    return sorted({int(row["step"]) for row in rows})


def _assert_checkpoints_whole(run_dir: Path) -> None:
    ckpts = sorted((run_dir / "checkpoints").glob("*.ckpt"))
    assert ckpts
    for path in ckpts:
        assert "global_step" in torch.load(path, map_location="cpu", weights_only=True), path


def test_atomic_checkpoint_io_replaces_whole_file(tmp_path, monkeypatch):
    path = tmp_path / "ckpts" / "last.ckpt"
    io = AtomicCheckpointIO()
    io.save_checkpoint({"global_step": 1}, path)

    def killed(obj, f):  # the process dies halfway through writing the new checkpoint
        f.write(b"partial")
        raise KeyboardInterrupt("killed while writing")

    monkeypatch.setattr(torch, "save", killed)
    with pytest.raises(KeyboardInterrupt, match="killed while writing"):
        io.save_checkpoint({"global_step": 2}, path)
    assert torch.load(path, weights_only=True) == {"global_step": 1}


@pytest.mark.slow
def test_killed_training_resumes_with_at_most_one_interval_repeated(tmp_path):
    runs = tmp_path / "runs"
    args = [
        *CLS,
        "callbacks.step_checkpoint.every_n_train_steps=5",
        "trainer.max_steps=40",
        "trainer.max_epochs=-1",
        "logger=csv",
        "trainer.log_every_n_steps=1",
        "+logger.csv.flush_logs_every_n_steps=1",  # rows on disk at each step
        "test=false",
        "export_bundle=false",
        f"paths.runs_dir={runs}",
    ]
    train_cli = [str(console_script("vitattn-train"))]
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen([*train_cli, *args], stdout=log, stderr=subprocess.STDOUT, env=ENV, cwd=tmp_path)
        deadline = time.monotonic() + 180
        last = None
        while proc.poll() is None and time.monotonic() < deadline:
            found = list(runs.glob("classification/*/checkpoints/last.ckpt"))
            # kill once a step checkpoint exists and training is past the first validation (which
            # rewrites metrics.csv with new columns) and past the step-10 checkpoint
            if found and max(_train_steps(found[0].parents[1] / "csv" / "metrics.csv"), default=0) >= 11:
                last = found[0]
                break
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    assert last is not None and proc.returncode == -signal.SIGKILL, (tmp_path / "first.log").read_text()[-3000:]
    run_dir = last.parents[1]
    _assert_checkpoints_whole(run_dir)  # none partial after the kill
    done_before_kill = max(_train_steps(run_dir / "csv" / "metrics.csv")) + 1
    resumed_from = torch.load(last, weights_only=True)["global_step"]
    assert done_before_kill > resumed_from  # rows past the checkpoint, which the resumed run logs again

    proc = subprocess.run(
        [*train_cli, f"resume={run_dir}"], capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert torch.load(run_dir / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 40
    _assert_checkpoints_whole(run_dir)
    # the file continued: the steps before the checkpoint kept, those the killed process logged after it
    # replaced by the resumed run's, each step once
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        assert [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")] == list(range(40))
    repeated = done_before_kill - resumed_from
    print(f"killed after {done_before_kill} steps, resumed at step {resumed_from}: {repeated} steps repeated")
    assert 0 < repeated <= 5
    assert len(list(runs.glob("classification/*"))) == 1  # the run directory was reused
