"""Non-finite losses (``head.nonfinite``): ``raise`` stops naming the step and keeps the last good checkpoint,
``skip`` skips the step and counts it, on every DDP rank together; a rank with no readable image trains on."""

import csv
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.errors import NonFiniteLossError
from vitattn.training import train
from vitattn.training.systems import ClassificationSystem

CLS = ["head=classification", *TINY, *TINY_SHAPES]
QUIET = ["test=false", "export_bundle=false", "trainer.max_epochs=-1", "trainer.check_val_every_n_epoch=1000"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
TRAIN_CLI = [sys.executable, "-m", "vitattn.cli.train"]
ROOT = Path(__file__).resolve().parents[2]


def _cli(args: list[str], cwd: Path, timeout: int = 180) -> subprocess.CompletedProcess:
    return subprocess.run([*TRAIN_CLI, *args], capture_output=True, text=True, timeout=timeout, env=ENV, cwd=cwd)


def _poison(monkeypatch, steps) -> None:
    """NaN images (so a NaN loss) in the training steps whose global_step is in ``steps``."""
    original = ClassificationSystem.training_step

    def training_step(self, batch, batch_idx):
        images, labels = batch
        if self.global_step in steps:
            images = images * float("nan")
        return original(self, (images, labels), batch_idx)

    monkeypatch.setattr(ClassificationSystem, "training_step", training_step)


STEP_CKPT = ["callbacks.step_checkpoint.every_n_train_steps=5", "logger=csv", "trainer.log_every_n_steps=1"]


def test_nan_loss_stops_naming_the_step_and_keeps_last_checkpoint(tmp_path, monkeypatch):
    train(compose_train([*CLS, *QUIET, *STEP_CKPT, "trainer.max_steps=5"], tmp_path))
    last = tmp_path / "checkpoints" / "last.ckpt"
    before = last.read_bytes()
    assert torch.load(last, weights_only=True)["global_step"] == 5
    _poison(monkeypatch, steps=range(9, 10**6))  # step 9 would complete the step-10 checkpoint
    with pytest.raises(NonFiniteLossError, match=r"^non-finite training loss nan at step 9 \(epoch 1\)"):
        train(compose_train([*CLS, *QUIET, *STEP_CKPT, "trainer.max_steps=20", f"resume={tmp_path}"], tmp_path))
    assert last.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step000005.ckpt"]


def test_inf_loss_is_non_finite_too():
    system = ClassificationSystem(
        {"embed_dim": 32, "depth": 1, "num_heads": 2, "patch_size": 8, "img_size": 32, "num_classes": 2},
        class_names=["a", "b"],
    )
    loss = torch.tensor(float("inf"))
    assert system.guard(loss) is loss  # noted on the loss's device: no host sync in the step
    with pytest.raises(NonFiniteLossError, match=r"^non-finite training loss inf at step 0 \(epoch 0\); "):
        system.check_finite()
    system.check_finite()  # the note is read once


def test_nan_loss_between_logging_steps_stops_before_the_next_checkpoint(tmp_path, monkeypatch):
    # Logging every 50 steps: step 8 (the first of epoch 1) is not looked at when it runs; the step-10
    # checkpoint looks first, and is not written.
    _poison(monkeypatch, steps={8})
    run = [*CLS, *QUIET, *STEP_CKPT, "trainer.log_every_n_steps=50", "trainer.max_steps=20"]
    with pytest.raises(NonFiniteLossError, match=r"^non-finite training loss nan at step 8 \(epoch 1\); "):
        train(compose_train(run, tmp_path))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["last.ckpt", "step000005.ckpt"]
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == 5


def test_nan_loss_from_the_cli_is_one_line_and_keeps_the_good_checkpoint(tmp_path):
    runs = tmp_path / "runs"
    # a learning rate that overflows the weights: the loss turns NaN after the first update or two
    proc = _cli(
        [
            *CLS,
            *QUIET,
            "optim.lr=1e38",
            "optim.warmup_steps=0",
            "trainer.max_steps=10",
            "callbacks.step_checkpoint.every_n_train_steps=1",
            f"paths.runs_dir={runs}",
        ],
        tmp_path,
    )
    assert proc.returncode == 2, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "Traceback" not in proc.stderr
    step = int(re.match(r"error: non-finite training loss nan at step (\d+) ", last).group(1))
    ckpt = torch.load(next(runs.glob("classification/*/checkpoints/last.ckpt")), weights_only=True)
    assert ckpt["global_step"] == step  # the last step whose loss was finite
    assert all(torch.isfinite(v).all() for v in ckpt["state_dict"].values() if v.is_floating_point())


def test_nan_loss_skipped_and_counted_with_nonfinite_skip(tmp_path, monkeypatch):
    _poison(monkeypatch, steps={3, 4})
    with pytest.warns(UserWarning) as warned:
        result = train(
            compose_train([*CLS, *QUIET, *STEP_CKPT, "trainer.max_steps=8", "head.nonfinite=skip"], tmp_path)
        )
    messages = [str(w.message) for w in warned]
    assert [m for m in messages if m.startswith("non-finite training loss")] == [
        "non-finite training loss nan at step 3 (epoch 0); batch skipped (1 so far)",
        "non-finite training loss nan at step 4 (epoch 0); batch skipped (2 so far)",
    ]
    assert result.global_step == 8
    assert result.system.skipped_batches == 2
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        counts = [float(r["train/skipped_batches"]) for r in csv.DictReader(f) if r.get("train/skipped_batches")]
    assert counts[0] == 1.0 and max(counts) == 2.0  # Lightning repeats the last value on later rows
    assert all(torch.isfinite(p).all() for p in result.system.parameters())


# Two CPU processes that Lightning starts itself (gloo).
DDP_CPU = ["trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2", "trainer.precision=32-true"]


def _run_group(command: list[str], cwd: Path, timeout: int, **env: str) -> subprocess.CompletedProcess:
    """``command`` in its own process group; past ``timeout`` every process of the group is killed (a rank
    left waiting in a collective would otherwise outlive the test) and the test fails."""
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    env.pop("PYTHONWARNINGS")  # the warnings are under test
    proc = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd, start_new_session=True
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"still running after {timeout} s (a rank waiting for the others?): {stderr[-2000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr)


@pytest.mark.slow
def test_ddp_nonfinite_skip_skips_the_step_on_every_rank_and_counts_it_once(tmp_path):
    run_dir, reports = tmp_path / "run", tmp_path / "ranks"
    reports.mkdir()
    script = ROOT / "tests" / "helpers" / "ddp_nonfinite_train.py"  # rank 1's loss at step 3 is NaN, rank 0's is not
    overrides = [*DDP_CPU, *CLS, *QUIET, "trainer.max_steps=6", "head.nonfinite=skip", "trainer.log_every_n_steps=1"]
    overrides += ["+logger.csv.flush_logs_every_n_steps=1", f"hydra.run.dir={run_dir}"]
    proc = _run_group(
        [sys.executable, str(script), *overrides], tmp_path, 240, VITATTN_NAN_STEP="3", VITATTN_RANK_REPORT=str(reports)
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (torch.load(reports / f"{rank}.pt", weights_only=True) for rank in (0, 1))
    assert rank0["skipped"] == rank1["skipped"] == 1
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [5]  # 6 steps; the same one skipped on both
    for key, value in rank0["weights"].items():  # the ranks still hold the same weights
        assert torch.equal(value, rank1["weights"][key]), key
    warned = [line for line in proc.stderr.splitlines() if "non-finite training loss" in line]
    assert len(warned) == 1, warned  # rank 0 warns for both
    assert warned[0].endswith(
        "non-finite training loss nan at step 3 (epoch 0) on rank 1; step skipped on every rank (1 so far)"
    )
    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        counts = [
            (int(r["step"]), float(r["train/skipped_batches"])) for r in csv.DictReader(f) if r["train/skipped_batches"]
        ]
    assert counts[0] == (3, 1.0) and max(count for _, count in counts) == 1.0


@pytest.mark.slow
def test_ddp_batch_of_unreadable_images_on_one_rank_trains_on_with_the_others(tmp_path):
    """Rank 1's batch at step 2 holds no readable image (None): the ranks still step together, no hang."""
    reports = tmp_path / "ranks"
    reports.mkdir()
    script = ROOT / "tests" / "helpers" / "ddp_nonfinite_train.py"
    overrides = [*DDP_CPU, *CLS, *QUIET, "trainer.max_steps=4", f"hydra.run.dir={tmp_path / 'run'}"]
    command = [sys.executable, str(script), *overrides]
    proc = _run_group(command, tmp_path, 240, VITATTN_EMPTY_STEP="2", VITATTN_RANK_REPORT=str(reports))
    assert proc.returncode == 0, proc.stderr[-3000:]
    rank0, rank1 = (torch.load(reports / f"{rank}.pt", weights_only=True) for rank in (0, 1))
    assert rank0["optimizer_steps"] == rank1["optimizer_steps"] == [4]  # every step updated, on both ranks
    for key, value in rank0["weights"].items():  # the same update on both: the all-reduce ran at step 2
        assert torch.equal(value, rank1["weights"][key]), key
