"""The run's loggers: given ``start_step`` (the resumed checkpoint's global step) each keeps what was logged before
it and drops what was logged at it and after; ``None`` is a new run. How each does it: docs/training.md#resume.
"""

from __future__ import annotations

import contextlib
import csv
import fcntl  # POSIX, as training is (``plan_cores`` reads the process's CPU affinity)
import inspect
import logging
import secrets
import string
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.fabric.utilities.logger import _convert_params, _flatten_dict
from lightning.pytorch.loggers import CSVLogger, Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities import rank_zero_only

from vitattn.errors import ConfigError, first_line
from vitattn.fileio import atomic_open, atomic_write
from vitattn.run_dir import RunDir

__all__ = [
    "ResumableCSVLogger",
    "ResumableMLFlowLogger",
    "ResumableTensorBoardLogger",
    "ResumableWandbLogger",
    "check_loggers",
    "logger_arguments",
]

log = logging.getLogger(__name__)


def logger_arguments(run_dir: str | Path, start_step: int | None) -> Callable[[type], dict[str, Any]]:
    """What each ``Resumable*`` logger of the ``logger`` group takes besides its config, given its class: the first
    step of a continued run (``start_step``; None for a new run) and where ``run_dir`` keeps the MLflow and W&B
    run ids."""
    run = RunDir(run_dir)
    run_id_files = {ResumableMLFlowLogger: run.mlflow_run_id, ResumableWandbLogger: run.wandb_run_id}

    def continuation(kind: type) -> dict[str, Any]:
        if not issubclass(kind, (_ContinuedFiles, *run_id_files)):
            return {}
        files = [str(path) for base, path in run_id_files.items() if issubclass(kind, base)]
        return {"start_step": start_step, **({"run_id_file": files[0]} if files else {})}

    return continuation


def check_loggers(loggers: list[Logger]) -> None:
    """A continued MLflow run the store lacks: one line now, before other processes start."""
    for logger in loggers:
        if isinstance(logger, ResumableMLFlowLogger) and logger.continued:
            _ = logger.experiment


class _ContinuedFiles:
    """A file logger's ``start_step``, and what it holds written out whenever a checkpoint is saved."""

    def __init__(self, *args: Any, start_step: int | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.start_step = start_step

    def after_save_checkpoint(self, checkpoint_callback: Any) -> None:
        self.save()  # what was logged before the checkpoint on disk, however the process ends


class ResumableCSVLogger(_ContinuedFiles, CSVLogger):
    """Lightning's ``CSVLogger`` that keeps the rows of ``metrics.csv`` before ``start_step`` (None: a new file) and
    appends, writing its rows out whenever a checkpoint is saved."""

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._experiment is None:
            self._fs.makedirs(self.root_dir, exist_ok=True)
            self._experiment = _ContinuedWriter(self.log_dir, self.start_step)
        return self._experiment


class _ContinuedWriter(ExperimentWriter):
    """Lightning's writer, continuing ``metrics.csv`` from ``start_step``; a new metric rewrites the file whole."""

    def __init__(self, log_dir: str, start_step: int | None) -> None:
        self.start_step = start_step
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        # called by __init__, where Lightning deletes metrics.csv
        if self.start_step is None or not self._fs.isfile(self.metrics_file_path):
            return super()._check_log_dir_exists()
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            rows = list(reader)
            header = list(reader.fieldnames or [])
        kept = [row for line, row in enumerate(rows, start=2) if self._step(row, line) < self.start_step]
        self.metrics_keys = header  # appended rows keep the file's columns
        if len(kept) < len(rows):
            self._write(header, kept)
            dropped = len(rows) - len(kept)
            log.info("%s: %d rows from step %d on dropped", self.metrics_file_path, dropped, self.start_step)

    def _step(self, row: dict[str, str], line: int) -> int:
        try:
            return int(row["step"])
        except (KeyError, TypeError, ValueError):
            raise ConfigError(
                f"{self.metrics_file_path} line {line}: step {row.get('step')!r} is not a whole number; move the file"
                " away to start the log afresh"
            ) from None

    def _rewrite_with_new_header(self, fieldnames: list[str]) -> None:
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            self._write(fieldnames, list(csv.DictReader(file)))

    def _write(self, fieldnames: list[str], rows: list[dict[str, str]]) -> None:
        path = self.metrics_file_path
        remote = "://" in path  # fsspec's storage: its own way
        with self._fs.open(path, "w", newline="") if remote else atomic_open(path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=fieldnames)
            writer.writeheader()
            writer.writerows(rows)


class ResumableTensorBoardLogger(_ContinuedFiles, TensorBoardLogger):
    """Lightning's ``TensorBoardLogger`` whose new event file discards the steps from ``start_step`` on when the
    folder holds some (``SummaryWriter``'s ``purge_step``), and which flushes whenever a checkpoint is saved."""

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        if self._experiment is None and self.start_step is not None and "purge_step" not in self._kwargs:
            if _logged_from(Path(self.log_dir), self.start_step):
                self._kwargs["purge_step"] = self.start_step
                log.info("%s: events from step %d on discarded", self.log_dir, self.start_step)
        return super().experiment


def _logged_from(log_dir: Path, step: int) -> bool:
    """Whether the newest event file in ``log_dir`` holds a scalar at ``step`` or later, or any event after it."""
    # optional: tensorboard is read back only when a killed run resumes
    from tensorboard.backend.event_processing.event_file_loader import LegacyEventFileLoader

    files = sorted(log_dir.glob("events.out.tfevents.*"))  # the order TensorBoard reads them in
    if not files:
        return False
    for event in LegacyEventFileLoader(str(files[-1])).Load():
        if event.step > step or (event.step == step and any(map(_is_scalar, event.summary.value))):
            return True
    return False


def _is_scalar(value: Any) -> bool:
    return value.HasField("simple_value") or value.metadata.plugin_data.plugin_name == "scalars"


class ResumableMLFlowLogger(MLFlowLogger):
    """Lightning's ``MLFlowLogger`` that keeps its run's id in ``run_id_file`` (None: nowhere) and, given
    ``start_step``, continues the run named there: its metric values from that step on are deleted first (from an
    SQL store), and the parameters it holds are not logged again (MLflow refuses a changed value)."""

    def __init__(
        self, *args: Any, start_step: int | None = None, run_id_file: str | None = None, **kwargs: Any
    ) -> None:
        saved = _read_id(run_id_file) if start_step is not None and not kwargs.get("run_id") else None
        with _store_lock(kwargs.get("tracking_uri")):  # Lightning opens (and makes) the store on every rank
            super().__init__(*args, **{**kwargs, "run_id": saved or kwargs.get("run_id")})
        self.start_step, self.run_id_file = start_step, run_id_file
        self.continued = saved is not None

    @property
    @rank_zero_experiment
    def experiment(self) -> Any:
        # optional: the trackers extra, only with logger=mlflow
        from mlflow.exceptions import MlflowException

        opening = not self._initialized
        try:
            client = super().experiment
        except MlflowException as err:
            if opening and self.continued and err.error_code == "RESOURCE_DOES_NOT_EXIST":
                raise ConfigError(
                    f"the MLflow run {self._run_id} named in {self.run_id_file} is not in {self._tracking_uri}"
                    f" ({first_line(err, 120)}): delete {self.run_id_file} to log to a new MLflow run"
                ) from None
            raise
        if opening and self.continued:
            if not _drop_metrics_from(client, self._run_id, self.start_step):
                log.warning(
                    "MLflow run %s continues at step %d; its tracking server keeps any values that a killed process"
                    " logged from that step on",
                    self._run_id,
                    self.start_step,
                )
            client.update_run(self._run_id, status="RUNNING")  # not FAILED, as the stopped process left it
        elif opening and self.run_id_file:
            _write_id(self.run_id_file, self._run_id)
        return client

    @rank_zero_only
    def log_hyperparams(self, params: Any) -> None:
        if not self.continued:
            return super().log_hyperparams(params)
        params = _flatten_dict(_convert_params(params))
        logged = self.experiment.get_run(self._run_id).data.params
        changed = sorted(k for k, v in params.items() if k in logged and logged[k] != str(v)[:250])
        if changed:
            log.warning("MLflow run %s keeps its first values of %s", self._run_id, ", ".join(changed))
        super().log_hyperparams({k: v for k, v in params.items() if k not in logged})


@contextlib.contextmanager
def _store_lock(tracking_uri: str | None) -> Iterator[None]:
    """Held while a local SQLite store is opened: processes started together (torchrun) would each create and
    migrate the same new file, and all but one fail; in turn, the first makes it and the others find it made."""
    if not str(tracking_uri).startswith("sqlite:///"):
        yield
        return
    path = Path(str(tracking_uri).removeprefix("sqlite:///"))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _drop_metrics_from(client: Any, run_id: str, step: int) -> bool:
    """Delete the run's metric values from ``step`` on in an SQL store (MLflow's client cannot); False elsewhere."""
    # optional: the trackers extra (logger=mlflow); MLflow's SQL store internals, see the docstring
    from mlflow.store.tracking.dbmodels.models import SqlLatestMetric, SqlMetric
    from mlflow.store.tracking.sqlalchemy_store import SqlAlchemyStore

    store = client._tracking_client.store
    if not isinstance(store, SqlAlchemyStore):
        return False
    writes = {"read_only": False} if "read_only" in inspect.signature(store.ManagedSessionMaker).parameters else {}
    with store.ManagedSessionMaker(**writes) as session:  # MLflow 3 opens read-only sessions unless told
        session.query(SqlMetric).filter(SqlMetric.run_uuid == run_id, SqlMetric.step >= step).delete()
        stale = session.query(SqlLatestMetric).filter(SqlLatestMetric.run_uuid == run_id, SqlLatestMetric.step >= step)
        for latest in stale.all():
            newest = (
                session.query(SqlMetric)
                .filter(SqlMetric.run_uuid == run_id, SqlMetric.key == latest.key)
                .order_by(SqlMetric.step.desc(), SqlMetric.timestamp.desc(), SqlMetric.value.desc())
                .first()
            )
            if newest is None:
                session.delete(latest)
            else:
                latest.value, latest.timestamp, latest.step = newest.value, newest.timestamp, newest.step
                latest.is_nan = newest.is_nan
    return True


class ResumableWandbLogger(WandbLogger):
    """Lightning's ``WandbLogger`` with a run id kept in ``run_id_file`` (None: W&B picks one): given ``start_step``,
    the run continues the W&B run named there (Lightning's ``resume="allow"``)."""

    def __init__(
        self, *args: Any, start_step: int | None = None, run_id_file: str | None = None, **kwargs: Any
    ) -> None:
        if run_id_file and not kwargs.get("id") and not kwargs.get("version"):
            saved = _read_id(run_id_file) if start_step is not None else None
            kwargs["id"] = saved or "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
            if saved is None and rank_zero_only.rank == 0:
                _write_id(run_id_file, kwargs["id"])
        super().__init__(*args, **kwargs)


def _write_id(path: str, run_id: str) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)  # train() builds the loggers before it writes the folder
    atomic_write(path, f"{run_id}\n")


def _read_id(path: str | None) -> str | None:
    if not path or not Path(path).is_file():
        return None
    text = Path(path).read_text(encoding="utf-8", errors="replace").strip()
    if not text or not text.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"{path} holds {text[:40]!r}, not a run id: delete it to log to a new run")
    return text
