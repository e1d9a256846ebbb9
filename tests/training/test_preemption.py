"""Preemption: SIGTERM / SIGUSR1 stop after a whole step with a checkpoint, and ``resume=auto`` continues."""

import csv
import json
import logging
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch

from tests.helpers.processes import sample_keys
from tests.helpers.runs import TINY, TINY_SHAPES, compose_train, console_script
from vitattn.run_dir import RunDir
from vitattn.training import train

ENV_ONE_THREAD = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
ENV = {**os.environ, **ENV_ONE_THREAD}
ROOT = Path(__file__).resolve().parents[2]
# A classifier logging every step and validating every 4; with a step checkpoint interval of max_steps,
# the only checkpoints are the preemption's and the last step's.
RUN = [
    "head=classification",
    *TINY,
    *TINY_SHAPES,
    "test=false",
    "export_bundle=false",
    "trainer.max_epochs=-1",
    "trainer.log_every_n_steps=1",
    "trainer.val_check_interval=4",
    "trainer.check_val_every_n_epoch=null",
    "resume=auto",
]


def _train_steps(run_dir: Path) -> list[int]:
    """The steps with a logged training loss, in the order logged."""
    path = run_dir / "csv" / "metrics.csv"
    if not path.is_file():
        return []
    with open(path, newline="") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss")]


def _step(checkpoint: Path) -> int:
    return torch.load(checkpoint, map_location="cpu", weights_only=True)["global_step"]


# The file loggers and MLflow, for the commands below: CSV rows on disk at each step; no validation pictures
# (a matplotlib figure for each logger at each validation; tests/training/test_loggers.py keeps TensorBoard's).
LOGGERS = [
    "logger=[csv,tensorboard,mlflow]",
    "+logger.csv.flush_logs_every_n_steps=1",
    "+callbacks.validation_pictures.enabled=false",
]


def _logged(run_dir: Path, runs: Path) -> dict[str, dict[str, list[int]]]:
    """The steps of ``train/loss`` and ``val/loss`` that each logger holds, each read back with its own reader:
    the CSV file, the TensorBoard folder by ``EventAccumulator`` (which applies ``purge_step``), the MLflow store
    (whose experiment must hold the one run)."""
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(run_dir / "csv" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    (run,) = client.search_runs([client.get_experiment_by_name("classification").experiment_id])
    assert (run_dir / "mlflow_run_id.txt").read_text().strip() == run.info.run_id
    keys, history = {"train": "train/loss", "val": "val/loss"}, client.get_metric_history
    return {
        "csv": {k: [int(row["step"]) for row in rows if row.get(key)] for k, key in keys.items()},
        "tensorboard": {k: [e.step for e in events.Scalars(key)] for k, key in keys.items()},
        "mlflow": {k: sorted(m.step for m in history(run.info.run_id, key)) for k, key in keys.items()},
    }


def _assert_each_step_once(run_dir: Path, runs: Path, end: int) -> None:
    """Every training step from 0 to ``end - 1`` logged once in each logger, and each validation (every 4 steps,
    logged at the step it follows) once."""
    logged = _logged(run_dir, runs)
    for name, steps in logged.items():
        assert steps == {"train": list(range(end)), "val": list(range(3, end, 4))}, name


def _files(*roots: Path) -> dict[Path, tuple[bytes, int]]:
    """Every file under ``roots``: its bytes and modification time."""
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for root in roots for p in sorted(root.rglob("*")) if p.is_file()}


def _assert_complete_run_left_alone(command: list[str], run_dir: Path, runs: Path, cwd: Path) -> None:
    """``command`` run again on its complete run: one line, status 0, every file as it was."""
    before = _files(run_dir, runs)
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV, cwd=cwd)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.splitlines() == [
        f"run complete: {run_dir} (step 40); no bundle (export_bundle=false); nothing to train"
    ]
    assert proc.stderr == ""
    assert _files(run_dir, runs) == before  # nothing deleted, nothing written


def _preempted_train(run_dir: Path, signame: str, where: str, step: int, overrides: list[str]) -> dict:
    """tests/helpers/preempted_train.py in a subprocess: ``signame`` during training step ``step`` (``where="train"``)
    or the first test batch (``where="test"``) goes to that process, never to pytest's."""
    # os.environ as it is now (a test may have set SLURM variables), one thread, this checkout first on the path
    env = {**os.environ, **ENV_ONE_THREAD, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    command = [
        sys.executable,
        str(ROOT / "tests" / "helpers" / "preempted_train.py"),
        signame,
        where,
        str(step),
        str(run_dir),
    ]
    proc = subprocess.run([*command, *overrides], capture_output=True, text=True, timeout=240, env=env, cwd=run_dir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


STEPS_12 = [*RUN, "trainer.max_steps=12", "callbacks.step_checkpoint.every_n_train_steps=12"]


# step 3 is followed by a validation, step 5 is not (with the slow tests: test-fast keeps one)
@pytest.mark.parametrize("signalled_step", [3, pytest.param(5, marks=pytest.mark.slow)])
def test_sigusr1_stops_after_the_step_and_resume_auto_repeats_none(signalled_step, tmp_path):
    last = tmp_path / "checkpoints" / "last.ckpt"
    report = _preempted_train(tmp_path, "SIGUSR1", "train", signalled_step, STEPS_12)  # resume=auto: a fresh start
    assert re.match(
        rf"^preempted by SIGUSR1 at step {signalled_step + 1}; checkpoint .*last\.ckpt", report["preempted"]
    )
    assert report["handler_restored"]  # the SIGUSR1 handler in place before fit is back when fit ended
    assert _step(last) == signalled_step + 1  # the signalled step is whole and saved
    assert _train_steps(tmp_path) == list(range(signalled_step + 1))

    result = train(compose_train(STEPS_12, tmp_path))
    assert result.global_step == 12 and _step(last) == 12
    assert result.steps_per_second > 0  # over this start's steps, though the run rewrote last.ckpt
    assert not list(last.parent.glob("last-v*.ckpt"))  # the resumed run updates last.ckpt, not a copy beside it
    assert _train_steps(tmp_path) == list(range(12))  # the CSV logger continues the file


@pytest.mark.slow  # a training process of its own (test-fast keeps the SIGUSR1 one)
def test_sigterm_while_testing_after_training_is_a_preemption_not_a_success(tmp_path):
    # Lightning alone ends the test with a SystemExit of status 0 after the signalled batch.
    report = _preempted_train(tmp_path, "SIGTERM", "test", 0, [*STEPS_12, "test=true"])
    assert re.match(
        r"^preempted by SIGTERM after training, while testing; checkpoint .*last\.ckpt", report["preempted"]
    )
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert _step(last) == 12  # the finished training's checkpoint, not rewritten with the weights under test


@pytest.mark.slow  # a training process of its own (test-fast keeps the SIGUSR1 one)
def test_on_slurm_sigusr1_stops_then_lightning_requeues_the_job(tmp_path, monkeypatch):
    bin_dir, requeued = tmp_path / "bin", tmp_path / "scontrol.log"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(f'#!/bin/sh\necho "$@" >> {requeued}\n')
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    slurm = {"SLURM_NTASKS": "1", "SLURM_JOB_NAME": "train", "SLURM_JOB_ID": "4242", "SLURM_NODELIST": "localhost"}
    for key, value in {**slurm, "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)  # what srun sets: Lightning's SLURMEnvironment with auto-requeue
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    report = _preempted_train(run_dir, "SIGUSR1", "train", 5, STEPS_12)
    assert report["preempted"].startswith("preempted by SIGUSR1 at step 6")
    assert requeued.read_text().split() == ["requeue", "4242"]  # once, by Lightning's handler
    (hpc,) = run_dir.glob("hpc_ckpt_*.ckpt")  # Lightning's own checkpoint, at the same step boundary
    assert _step(hpc) == _step(run_dir / "checkpoints" / "last.ckpt") == 6

    result = train(compose_train(STEPS_12, run_dir))  # the requeued job: the same command, the same folder
    assert result.global_step == 12 and _train_steps(run_dir) == list(range(12))


def test_a_complete_run_resumed_is_left_as_it_is(tmp_path, caplog):
    run = [*RUN, "trainer.max_steps=2", "export_bundle=true"]  # resume=auto
    first = train(compose_train(run, tmp_path))
    files = _files(tmp_path)
    with caplog.at_level(logging.INFO, logger="vitattn.training.recipe"):
        again = train(compose_train(run, tmp_path))
    assert again.already_complete and again.system is None  # nothing built, nothing trained
    assert (again.global_step, again.metrics, again.weights) == (2, first.metrics, first.weights)
    assert again.bundle_dir == first.bundle_dir == tmp_path / "bundle"
    assert [r.getMessage() for r in caplog.records if r.name == "vitattn.training.recipe"] == [
        f"run complete: {tmp_path} (step 2); bundle {tmp_path / 'bundle'}; nothing to train"
    ]
    assert _files(tmp_path) == files  # nothing deleted, nothing written
    longer = train(compose_train([*run, "trainer.max_steps=4"], tmp_path))  # more steps: the run trains further
    assert not longer.already_complete and longer.global_step == 4
    assert _train_steps(tmp_path) == list(range(4))  # the logs continue: each step once


def test_a_run_is_complete_when_resume_continues_its_folder_from_its_own_checkpoint(tmp_path, monkeypatch):
    """``RunDir.completion``, the one answer ``vitattn-train`` (from its command line) and ``train(cfg)`` ask for."""
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    (tmp_path / "other").mkdir()
    assert run.completion("auto") is None  # no result yet
    run.save_result(40, "last", {"val/loss": 1.5}, bundle=False)
    run.save_config({"trainer": {"max_steps": 40, "max_epochs": -1}})
    line = f"run complete: {run.path} (step 40); no bundle (export_bundle=false); nothing to train"
    monkeypatch.chdir(tmp_path)
    assert run.completion("auto") == run.completion("run") == run.completion(str(run.path)) == line
    assert run.completion("auto", length={"max_steps": "40"}) == line
    for resume, ckpt_path, length in [(None, None, None), ("other", None, None), ("auto", "x.ckpt", None)]:
        assert run.completion(resume, ckpt_path, length) is None
    assert run.completion("auto", length={"max_steps": 80}) is None  # a longer run trains further


@pytest.mark.parametrize("resume", ["auto", "RUN"])
def test_vitattn_train_leaves_a_complete_run_as_it_is_before_hydra_writes_into_it(resume, tmp_path):
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    run.save_result(40, "last", {"val/loss": 1.5}, bundle=True)
    files = _files(run.path)
    # resume=auto names its folder; resume=RUN becomes the run's saved overrides and hydra.run.dir=RUN
    where = ["resume=auto", f"hydra.run.dir={run.path}"] if resume == "auto" else [f"resume={run.path}"]
    command = [sys.executable, "-m", "vitattn.cli.train", *where]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert (proc.returncode, proc.stderr) == (0, "")
    assert proc.stdout.splitlines() == [f"run complete: {run.path} (step 40); bundle {run.bundle}; nothing to train"]
    assert _files(run.path) == files  # no .hydra/, no log


def test_resume_names_a_run_result_it_cannot_read(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "result.json").write_text('{"global_step": "40"}')
    command = [sys.executable, "-m", "vitattn.cli.train", "resume=auto", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120, env=ENV, cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        f"error: {tmp_path / 'run' / 'result.json'} is not a run result (keys global_step, weights, metrics, bundle):"
        " move it away to run again"
    ]
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["result.json"]  # Hydra wrote nothing


def test_no_preemption_checkpoint_when_checkpointing_is_off(tmp_path):
    """``+trainer.enable_checkpointing=false callbacks=none`` (the learning bench's runs) must still start:
    Lightning refuses any Checkpoint callback then, and the preemption callback is one. ``callbacks=none``
    keeps it otherwise."""
    from vitattn.training.callbacks import Preemption

    run = [*RUN[:-1], "trainer.max_steps=2", "callbacks=none"]
    on = train(compose_train(run, tmp_path / "on"))
    off = train(compose_train([*run, "+trainer.enable_checkpointing=false"], tmp_path / "off"))
    assert any(isinstance(c, Preemption) for c in on.system.trainer.callbacks)
    assert not any(isinstance(c, Preemption) for c in off.system.trainer.callbacks)
    assert off.global_step == 2 and not (tmp_path / "off" / "checkpoints" / "last.ckpt").exists()


def test_resume_auto_needs_a_fixed_run_directory(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "vitattn.cli.train", "resume=auto"],
        capture_output=True,
        text=True,
        timeout=120,
        env=ENV,
        cwd=tmp_path,
    )
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "error: resume=auto continues the run in hydra.run.dir: add hydra.run.dir=DIR"
    ]
    assert not (tmp_path / "runs").exists()


# Two CPU processes that Lightning starts itself: the signal goes to the first (rank 0) only.
DDP_CPU = [
    "trainer=ddp",
    "trainer.accelerator=cpu",
    "trainer.devices=2",
    "trainer.precision=32-true",
    "trainer.benchmark=false",
]


def _held(keys: Path, step: int, stop: str) -> list[str]:
    """The samples of the steps to ``step`` in the ``SampleKeys`` files of ``keys`` (one run's), which are then
    renamed after ``stop`` for the next run to start its own."""
    held = [k for _, s, ks in sample_keys(keys) if s <= step for k in ks]
    for f in keys.glob("keys.rank*.txt"):
        f.rename(f.with_suffix(f".{stop}"))
    return held


@pytest.mark.slow
@pytest.mark.parametrize(
    ("processes", "ranks"),
    [([], 1), ([*DDP_CPU, "data.num_workers=1"], 2)],  # DDP: a loader worker a rank, started by the fork server
    ids=["one-process", "ddp-two-processes"],
)
def test_sigterm_then_kill_9_each_resumed_by_resume_auto_repeat_no_step_and_keep_every_log(processes, ranks, tmp_path):
    """One run stopped twice: SIGTERM (a preemption: its checkpoint, status 75), resumed; then the resumed run
    killed by ``kill -9`` past a step checkpoint of its own (steps logged that no checkpoint holds), resumed again
    to the end; then the same command once more finds the run complete. Its 40 steps are one epoch, so each stop
    lands mid-epoch: over the three runs every sample is trained once (``SampleKeys``; the shapes' DDP case of
    test_data_resume_ddp.py)."""
    run_dir, runs, keys = tmp_path / "run", tmp_path / "runs", tmp_path / "keys"
    num_train = 40 * 8 * ranks  # 40 steps of 8 samples a rank: one epoch
    command = [
        str(console_script("vitattn-train")),
        *processes,
        *RUN,
        "trainer.max_steps=40",
        "callbacks.step_checkpoint.every_n_train_steps=5",
        f"data.num_train={num_train}",
        "+callbacks.sample_keys._target_=vitattn.training.callbacks.SampleKeys",
        f"+callbacks.sample_keys.folder={keys}",
        *LOGGERS,
        f"paths.runs_dir={runs}",
        f"hydra.run.dir={run_dir}",
    ]
    last = run_dir / "checkpoints" / "last.ckpt"
    with open(tmp_path / "first.log", "w") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.PIPE, text=True, env=ENV, cwd=tmp_path)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline and len(_train_steps(run_dir)) < 6:
            time.sleep(0.05)
        assert proc.poll() is None and len(_train_steps(run_dir)) >= 6, (tmp_path / "first.log").read_text()[-3000:]
        proc.send_signal(signal.SIGTERM)  # mid-run: steps logged past the step checkpoint (step 5)
        _, stderr = proc.communicate(timeout=300)  # until every process has closed stderr: rank 1 ends too
    assert proc.returncode == 75, stderr[-3000:]
    assert "Traceback" not in stderr
    lines = [line for line in stderr.splitlines() if "preempted" in line]
    saved = _step(last)
    assert lines == [f"preempted by SIGTERM at step {saved}; checkpoint {last}; continue with resume={run_dir}"]
    before = _train_steps(run_dir)
    assert before == list(range(saved)) and 6 <= saved < 40  # every step logged is in the preemption's checkpoint
    trained = [_held(keys, saved, "sigterm")]

    with open(tmp_path / "resumed.log", "w") as log:
        # its own process group: kill -9 takes every process of the run, as a lost machine would
        proc = subprocess.Popen(command, stdout=log, stderr=log, env=ENV, cwd=tmp_path, start_new_session=True)
        deadline = time.monotonic() + 300
        while proc.poll() is None and time.monotonic() < deadline:
            # a step checkpoint of this run's, and steps logged past it
            if _step(last) > saved and len(_train_steps(run_dir)) >= _step(last) + 2:
                os.killpg(proc.pid, signal.SIGSTOP)  # frozen, so a checkpoint cannot land between look and kill
                if len(_train_steps(run_dir)) >= _step(last) + 2:
                    break
                os.killpg(proc.pid, signal.SIGCONT)
            time.sleep(0.05)
        assert proc.poll() is None, (tmp_path / "resumed.log").read_text()[-3000:]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    assert f"resume=auto: continuing from {last} (step {saved})" in (tmp_path / "resumed.log").read_text()
    killed_at = _step(last)
    assert saved < killed_at < 40
    trained.append(_held(keys, killed_at, "kill-9"))
    killed = _logged(run_dir, runs)
    for name, steps in killed.items():  # each logger holds steps that the resumed run logs again
        assert max(steps["train"]) >= killed_at, (name, killed_at, steps)

    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=ENV, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resume=auto: continuing from {last} (step {killed_at})" in proc.stdout
    _assert_each_step_once(run_dir, runs, 40)  # the steps of both stops once each; what was logged before kept
    trained.append(_held(keys, 40, "end"))
    assert [len(run) for run in trained] == [8 * ranks * n for n in (saved, killed_at - saved, 40 - killed_at)]
    every = [k for run in trained for k in run]
    repeated = [k for k, n in Counter(every).items() if n > 1]
    assert not repeated, f"{len(repeated)} samples trained twice: {repeated[:5]}"
    assert sorted(every, key=int) == [str(i) for i in range(num_train)]  # none skipped
    assert _step(last) == 40
    speed = re.search(r"^speed: +([0-9.]+) steps/s \(training with its validations\)$", proc.stdout, re.MULTILINE)
    assert speed and float(speed.group(1)) > 0, proc.stdout[-2000:]  # the summary's rate, of this start's steps
    print(f"SIGTERM after {len(before)} steps, resumed at {saved}; kill -9 after {len(killed['csv']['train'])} steps")
    print(f"resumed at {killed_at}; logged:", _logged(run_dir, runs))

    _assert_complete_run_left_alone(command, run_dir, runs, tmp_path)  # the same command once more: nothing to do


def _workers(launcher: int) -> dict[int, int]:
    """The launcher's child processes by their ``RANK``."""
    workers = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            environ = (stat.parent / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue  # ended meanwhile
        rank = next((int(e[5:]) for e in environ if e.startswith(b"RANK=")), None)
        if ppid == launcher and rank is not None:
            workers[rank] = int(stat.parent.name)
    return workers


@pytest.mark.slow
def test_torchrun_restarts_the_group_after_a_rank_is_killed_and_training_continues(tmp_path):

    run_dir = tmp_path / "run"
    command = [
        *[sys.executable, "-m", "torch.distributed.run", "--standalone", "--max-restarts=1", "--nproc-per-node=2"],
        *["-m", "vitattn.cli.train", "trainer=ddp", "trainer.accelerator=cpu", "trainer.devices=2"],
        *["trainer.precision=32-true", "trainer.benchmark=false", *RUN, "trainer.max_steps=40"],
        "callbacks.step_checkpoint.every_n_train_steps=5",
        *LOGGERS,
        f"paths.runs_dir={tmp_path / 'runs'}",
        f"hydra.run.dir={run_dir}",
    ]
    last = run_dir / "checkpoints" / "last.ckpt"
    # torchrun starts both ranks at once, each with an MLFlowLogger on the same new SQLite store (made by one)
    with open(tmp_path / "torchrun.log", "w") as log:
        # torch 2.14's torchrun hands each restarted group the store of the first one, whose gloo addresses
        # (now dead) the new ranks then try to connect to: a store per group instead
        env = {**ENV, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=tmp_path)
        deadline = time.monotonic() + 400
        while proc.poll() is None and time.monotonic() < deadline:
            if last.is_file() and len(_train_steps(run_dir)) >= 12:  # a step checkpoint, and steps past it
                break
            time.sleep(0.05)
        workers = _workers(proc.pid)
        assert proc.poll() is None and sorted(workers) == [0, 1], (tmp_path / "torchrun.log").read_text()[-3000:]
        done = len(_train_steps(run_dir))
        os.kill(workers[1], signal.SIGKILL)
        proc.wait(timeout=600)
    output = (tmp_path / "torchrun.log").read_text()
    assert proc.returncode == 0, output[-3000:]
    assert _step(last) == 40
    (resumed,) = {int(step) for step in re.findall(r"resume=auto: continuing from \S+ \(step (\d+)\)", output)}
    assert 5 <= resumed <= done and resumed % 5 == 0  # the restarted group, from a step checkpoint
    _assert_each_step_once(run_dir, tmp_path / "runs", 40)  # the first group's steps before it kept
    assert output.count("run directory:") == 1  # one summary: the restarted group's rank 0
    print(f"rank 1 killed after {done} steps; the restarted group resumed at step {resumed}")


def test_ranks_agree_on_a_signal_over_host_tensors_and_never_read_the_device(tmp_path, monkeypatch):
    """Under NCCL the agreement after each step runs over a gloo group with a host tensor: no device tensor is
    reduced and read back (a host sync every step)."""
    from types import SimpleNamespace

    from vitattn.training.callbacks.preemption import Preemption, _host_group

    class DeviceStrategy:
        root_device = torch.device("cuda")

        def reduce(self, *args, **kwargs):
            raise AssertionError("a device tensor reduced: the host waits for the device")

    dist = torch.distributed
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        made = []
        monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")  # as on GPUs
        monkeypatch.setattr(dist, "new_group", lambda **kwargs: made.append(kwargs))  # None: the default gloo group
        trainer = SimpleNamespace(world_size=2, strategy=DeviceStrategy())
        callback = Preemption(tmp_path / "run")
        callback._group = _host_group(trainer)
        assert made == [{"backend": "gloo"}]
        assert callback._agreed_signal(trainer) == 0
        callback.received = signal.SIGUSR1
        assert callback._agreed_signal(trainer) == signal.SIGUSR1
    finally:
        dist.destroy_process_group()


def test_a_stop_without_the_preemption_callback_names_its_missing_checkpoint_in_one_line(tmp_path):
    # callbacks=none keeps no Preemption callback: the stop is still a Preempted, with no checkpoint to resume from
    import lightning.pytorch as pl

    from vitattn.training.callbacks import Preemption
    from vitattn.training.recipe import _preempted

    bare = pl.Trainer(callbacks=[], logger=False, enable_checkpointing=False, enable_progress_bar=False)
    stop = _preempted(bare)
    assert str(stop) == "preempted by SIGTERM at step 0; no checkpoint: callbacks=none keeps none"
    assert stop.checkpoint is None
    kept = pl.Trainer(callbacks=[Preemption(tmp_path)], logger=False, enable_progress_bar=False)
    assert _preempted(kept).checkpoint == RunDir(tmp_path).last_checkpoint  # the callback's own stop
