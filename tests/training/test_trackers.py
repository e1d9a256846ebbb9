"""logger=many: one short run logged to csv, TensorBoard, MLflow and Weights & Biases (offline) at once,
each read back with its own library and checked against the csv log."""

import csv
import json
import struct
from pathlib import Path

import pytest

from tests.helpers.runs import TINY, TINY_SHAPES, compose_train
from vitattn.training import train

pytestmark = pytest.mark.slow

LR = 0.0025
RUN = [
    *(o for o in TINY if not o.startswith("logger=")),
    *TINY_SHAPES,
    "logger=many",
    "head.decoder.depth=1",
    f"optim.lr={LR}",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=4",
    "trainer.limit_val_batches=1",
    "trainer.log_every_n_steps=1",
    "callbacks=none",
    "test=false",
    "export_bundle=false",
]


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """One run with logger=many; its folder, the runs folder (MLflow's store) and the final metrics."""
    root = tmp_path_factory.mktemp("trackers")
    with pytest.MonkeyPatch.context() as env:
        for var in ("WANDB_CONFIG_DIR", "WANDB_CACHE_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
            env.setenv(var, str(root / "wandb-home"))  # nothing written to the home folder
        env.setenv("WANDB_MODE", "offline")  # restored after the run (WandbLogger sets it process-wide)
        env.setenv("WANDB_SILENT", "true")
        result = train(compose_train([*RUN, f"paths.runs_dir={root / 'runs'}"], root / "run"))
    return root / "run", root / "runs", result.metrics


def _csv_history(run: Path, metric: str) -> list[tuple[int, float]]:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        return [(int(row["step"]), float(row[metric])) for row in csv.DictReader(f) if row.get(metric)]


def _assert_same_history(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [value for _, value in got] == pytest.approx([value for _, value in expected], rel=1e-6)


def test_mlflow_run_reads_back_with_mlflows_client(logged):
    from mlflow.tracking import MlflowClient

    run_dir, runs, metrics = logged
    client = MlflowClient(f"sqlite:///{runs}/mlflow.db")
    experiment = client.get_experiment_by_name("caption")  # experiment_name: ${task_name}
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.status == "FINISHED"
    assert float(run.data.params["optim/lr"]) == LR
    assert run.data.params["model_config/decoder/depth"] == "1"
    assert run.data.tags["run_dir"] == str(run_dir)
    train_loss = [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, "train/loss")]
    _assert_same_history(train_loss, _csv_history(run_dir, "train/loss"))
    assert len(train_loss) == 4  # every step
    assert run.data.metrics["val/loss"] == pytest.approx(metrics["val/loss"])


def _wandb_records(path: Path):
    """The records of a ``.wandb`` run file: LevelDB-log framing (32 KiB blocks, a 7-byte header per chunk)
    around W&B's protobuf ``Record`` messages."""
    from wandb.proto.wandb_internal_pb2 import Record

    data, block, pos, chunk = path.read_bytes(), 32768, 7, b""
    assert struct.unpack("<4sHB", data[:7])[:2] == (b":W&B", 0xBEE1), f"{path} is not a W&B run file"
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        chunk += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = Record()
            record.ParseFromString(chunk)
            chunk = b""
            yield record


def test_wandb_offline_run_holds_the_metrics(logged):
    import wandb

    run_dir, _, metrics = logged
    assert wandb.run is None  # the run was finished, so a sweep's next trial starts its own
    (offline,) = (run_dir / "wandb").glob("offline-run-*")
    (run_file,) = offline.glob("run-*.wandb")
    records = list(_wandb_records(run_file))
    history = [
        {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
        for r in records
        if r.WhichOneof("record_type") == "history"
    ]
    train_loss = [(row["trainer/global_step"], row["train/loss"]) for row in history if "train/loss" in row]
    _assert_same_history(train_loss, _csv_history(run_dir, "train/loss"))
    assert [row["val/loss"] for row in history if "val/loss" in row] == pytest.approx([metrics["val/loss"]])
    config = {
        item.key or "/".join(item.nested_key): json.loads(item.value_json)
        for r in records
        if r.WhichOneof("record_type") == "config"
        for item in r.config.update
    }
    assert config["optim"]["lr"] == LR, config["optim"]


def test_tensorboard_logs_the_same_steps(logged):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run_dir, _, _ = logged
    events = EventAccumulator(str(run_dir / "tensorboard")).Reload()
    train_loss = [(e.step, e.value) for e in events.Scalars("train/loss")]
    _assert_same_history(train_loss, _csv_history(run_dir, "train/loss"))
