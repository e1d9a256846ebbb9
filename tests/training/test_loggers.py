"""Resumable loggers: a run resumed from a checkpoint at step s keeps every value logged before s, and drops what a
process killed after that checkpoint logged from s on (the resumed run logs those steps again)."""

import csv
import logging
import subprocess
import sys
import time

import numpy as np
import pytest

from vitattn.errors import ConfigError
from vitattn.training.loggers import (
    ResumableCSVLogger,
    ResumableMLFlowLogger,
    ResumableTensorBoardLogger,
    ResumableWandbLogger,
)

KILLED_AT, RESUMED_AT, END = 8, 5, 10  # a process killed after logging steps 0-7, its last checkpoint at step 5


def _log_run(logger, steps, value: float) -> None:
    for step in steps:
        logger.log_metrics({"train/loss": value + step}, step)
        if step % 4 == 3:  # a validation after steps 3 and 7, logged at their steps
            logger.log_metrics({"val/loss": value - step}, step)


def _csv_logger(tmp_path, start_step, **kwargs):
    return ResumableCSVLogger(save_dir=tmp_path, name="csv", version="", start_step=start_step, **kwargs)


def _csv_rows(tmp_path) -> list[dict[str, str]]:
    with open(tmp_path / "csv" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def _steps(rows, key: str) -> list[tuple[int, float]]:
    return [(int(row["step"]), float(row[key])) for row in rows if row.get(key)]


def test_csv_logger_continues_the_file_without_the_rows_logged_after_the_checkpoint(tmp_path):
    killed = _csv_logger(tmp_path, None)
    _log_run(killed, range(KILLED_AT), 100.0)
    killed.save()  # on disk, then the process dies: no finalize
    resumed = _csv_logger(tmp_path, RESUMED_AT)
    _log_run(resumed, range(RESUMED_AT, END), 200.0)
    resumed.log_metrics({"lr": 0.1}, END - 1)  # a new column: the file is rewritten with it, rows kept
    resumed.finalize("success")
    rows = _csv_rows(tmp_path)
    train = [(s, 100.0 + s) for s in range(RESUMED_AT)] + [(s, 200.0 + s) for s in range(RESUMED_AT, END)]
    assert _steps(rows, "train/loss") == train  # every step once: the killed process's 5-7 dropped
    assert _steps(rows, "val/loss") == [(3, 97.0), (7, 193.0)]
    assert _steps(rows, "lr") == [(END - 1, 0.1)]


def test_csv_logger_of_a_new_run_starts_the_file_afresh(tmp_path):
    _log_run(first := _csv_logger(tmp_path, None), range(4), 100.0)
    first.finalize("success")
    _log_run(second := _csv_logger(tmp_path, None), range(2), 200.0)
    second.finalize("success")
    assert _steps(_csv_rows(tmp_path), "train/loss") == [(0, 200.0), (1, 201.0)]  # as Lightning's CSVLogger


def test_csv_logger_writes_its_rows_when_a_checkpoint_is_saved(tmp_path):
    logger = _csv_logger(tmp_path, None, flush_logs_every_n_steps=100)
    _log_run(logger, range(3), 100.0)
    logger.after_save_checkpoint(None)  # what ModelCheckpoint calls after writing a checkpoint
    assert [s for s, _ in _steps(_csv_rows(tmp_path), "train/loss")] == [0, 1, 2]


def test_csv_logger_names_a_metrics_file_it_cannot_continue(tmp_path):
    (tmp_path / "csv").mkdir()
    (tmp_path / "csv" / "metrics.csv").write_text("step,train/loss\n0,1.0\nten,2.0\n")
    with pytest.raises(ConfigError) as caught:
        _ = _csv_logger(tmp_path, RESUMED_AT).experiment
    assert str(caught.value) == (
        f"{tmp_path / 'csv' / 'metrics.csv'} line 3: step 'ten' is not a whole number; move the file away to start"
        " the log afresh"
    )


def _tb_logger(tmp_path, start_step, **kwargs):
    return ResumableTensorBoardLogger(
        save_dir=tmp_path, name="tensorboard", version="", default_hp_metric=False, start_step=start_step, **kwargs
    )


def _tb_events(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    return EventAccumulator(str(tmp_path / "tensorboard")).Reload()


def test_tensorboard_logger_discards_what_a_killed_run_logged_after_the_checkpoint(tmp_path):
    killed = _tb_logger(tmp_path, None)
    _log_run(killed, range(KILLED_AT), 100.0)
    killed.save()  # flushed, then the process dies
    resumed = _tb_logger(tmp_path, RESUMED_AT)
    _log_run(resumed, range(RESUMED_AT, END), 200.0)
    resumed.finalize("success")
    events = _tb_events(tmp_path)
    train = [(s, 100.0 + s) for s in range(RESUMED_AT)] + [(s, 200.0 + s) for s in range(RESUMED_AT, END)]
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == train
    assert [(e.step, e.value) for e in events.Scalars("val/loss")] == [(3, 97.0), (7, 193.0)]


def test_tensorboard_logger_keeps_the_pictures_of_a_run_stopped_at_the_checkpoint(tmp_path):
    stopped = _tb_logger(tmp_path, None)
    _log_run(stopped, range(RESUMED_AT), 100.0)
    picture = np.zeros((3, 4, 4), dtype=np.uint8)
    stopped.experiment.add_image("val/confusion_matrix", picture, RESUMED_AT)  # pictures: at trainer.global_step
    stopped.finalize("failed")  # a signal: the process stops after the step, its checkpoint at step 5
    resumed = _tb_logger(tmp_path, RESUMED_AT)
    _log_run(resumed, range(RESUMED_AT, END), 200.0)
    resumed.finalize("success")
    events = _tb_events(tmp_path)
    assert [e.step for e in events.Scalars("train/loss")] == list(range(END))
    assert [e.step for e in events.Images("val/confusion_matrix")] == [RESUMED_AT]  # no purge needed: kept


def _mlflow_logger(tmp_path, start_step):
    return ResumableMLFlowLogger(
        experiment_name="resume",
        tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}",
        artifact_location=str(tmp_path / "artifacts"),
        start_step=start_step,
        run_id_file=str(tmp_path / "mlflow_run_id.txt"),
    )


@pytest.mark.slow  # MLflow creates its SQLite store in seconds
def test_mlflow_logger_continues_its_run_without_what_was_logged_after_the_checkpoint(tmp_path, caplog):
    killed = _mlflow_logger(tmp_path, None)
    killed.log_hyperparams({"optim": {"lr": 0.001}})
    _log_run(killed, range(KILLED_AT), 100.0)
    run_id = killed.run_id
    assert (tmp_path / "mlflow_run_id.txt").read_text() == f"{run_id}\n"

    resumed = _mlflow_logger(tmp_path, RESUMED_AT)
    client = resumed.experiment  # opened: the values from step 5 on deleted, the latest ones those of step 4
    assert resumed.run_id == run_id
    assert client.get_run(run_id).data.metrics == {"train/loss": 104.0, "val/loss": 97.0}
    with caplog.at_level(logging.WARNING, logger="vitattn.training.loggers"):
        resumed.log_hyperparams({"optim": {"lr": 0.002}, "seed": 1})  # MLflow refuses a changed value: kept
    ours = [r.getMessage() for r in caplog.records if r.name == "vitattn.training.loggers"]
    assert ours == [f"MLflow run {run_id} keeps its first values of optim/lr"]
    _log_run(resumed, range(RESUMED_AT, END), 200.0)
    resumed.finalize("success")

    (run,) = client.search_runs([client.get_run(run_id).info.experiment_id])  # one run in the experiment
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/loss"))
    assert history == [(s, 100.0 + s) for s in range(RESUMED_AT)] + [(s, 200.0 + s) for s in range(RESUMED_AT, END)]
    assert sorted(m.step for m in client.get_metric_history(run_id, "val/loss")) == [3, 7]
    assert run.info.status == "FINISHED" and run.data.params == {"optim/lr": "0.001", "seed": "1"}


@pytest.mark.slow
def test_mlflow_logger_names_a_saved_run_that_the_store_lacks(tmp_path):
    _ = _mlflow_logger(tmp_path, None).experiment  # the store exists
    (tmp_path / "mlflow_run_id.txt").write_text("0123456789abcdef0123456789abcdef\n")
    with pytest.raises(ConfigError, match=r"^the MLflow run 0123456789abcdef0123456789abcdef named in .*"):
        _ = _mlflow_logger(tmp_path, RESUMED_AT).experiment


OPEN_STORE = """
import sys, time
from vitattn.training.loggers import ResumableMLFlowLogger
while time.time() < float(sys.argv[2]):
    pass
ResumableMLFlowLogger(experiment_name="x", tracking_uri=f"sqlite:///{sys.argv[1]}/mlflow.db")
"""


@pytest.mark.slow
def test_mlflow_loggers_started_together_on_a_new_store_all_open_it(tmp_path):
    # as torchrun starts the ranks: each makes its MLFlowLogger, whose client opens (and would migrate) the store;
    # without the lock, one of two failed in each of 3 tries
    start = str(time.time() + 8)  # after every process has imported what it needs
    procs = [
        subprocess.Popen([sys.executable, "-c", OPEN_STORE, str(tmp_path), start], stderr=subprocess.PIPE, text=True)
        for _ in range(3)
    ]
    errors = [proc.communicate(timeout=120)[1] for proc in procs]
    assert [proc.returncode for proc in procs] == [0, 0, 0], errors
    assert (tmp_path / "mlflow.db").is_file()


def test_wandb_logger_keeps_its_run_id_in_the_run_folder(tmp_path):
    path = tmp_path / "run" / "wandb_run_id.txt"  # in a folder that train() creates after the loggers

    def logger(start_step):  # W&B starts its run at the first log: none here
        return ResumableWandbLogger(save_dir=tmp_path, offline=True, start_step=start_step, run_id_file=str(path))

    first = logger(None).version
    assert path.read_text() == f"{first}\n" and len(first) == 8
    assert logger(RESUMED_AT).version == first  # resumed: the same run, with Lightning's resume="allow"
    assert logger(None).version != first  # a new run
