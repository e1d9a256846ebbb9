"""Multiruns through Hydra's plugins: the submitit launchers and the Optuna sweeper (hparams_search)."""

import csv
import os
import subprocess
import sys
from pathlib import Path

import hydra
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf

from tests.helpers import TINY, TINY_SHAPES
from vitattn.cli.train import optimized_value
from vitattn.run_dir import RunDir

# A run of two training steps and one validation batch. The decoder depth is left to the search: an override
# given on the command line fixes that parameter for every trial.
SHORT = [
    *TINY,
    *TINY_SHAPES,
    "num_threads=1",
    "trainer.max_epochs=1",
    "trainer.limit_train_batches=2",
    "trainer.limit_val_batches=1",
    "callbacks=none",
    "test=false",
]


def _train(overrides: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "HYDRA_FULL_ERROR": "1"}
    proc = subprocess.run(
        [sys.executable, "-m", "vitattn.cli.train", *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env=env,
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _sweep_dir(runs: Path) -> Path:
    (sweep,) = (runs / "caption-multirun").iterdir()  # one multirun, named by its start time
    return sweep


def _hydra_compose(overrides: list[str]):
    with initialize_config_module("vitattn.conf", version_base="1.3"):
        return compose("train", overrides=overrides, return_hydra_config=True)


def test_slurm_launcher_starts_one_task_per_gpu(tmp_path, monkeypatch):
    """The sbatch script that hydra/launcher=slurm would submit asks for one task per GPU; no SLURM needed."""
    import submitit
    from submitit.slurm.slurm import SlurmExecutor

    class Submitted(Exception):
        pass

    scripts = []

    def submit(executor, fn, *args):  # stands in for sbatch: keep the script, submit nothing
        scripts.append(executor._executor._make_submission_file_text("COMMAND", "uid"))
        raise Submitted

    monkeypatch.setattr(SlurmExecutor, "affinity", classmethod(lambda cls: 2))  # as if srun were on PATH
    monkeypatch.setattr(submitit.AutoExecutor, "map_array", submit)
    overrides = ["trainer=ddp", "trainer.devices=4", "trainer.num_nodes=2", "hydra.launcher.partition=gpu"]
    cfg = _hydra_compose(["hydra/launcher=slurm", *overrides, f"paths.runs_dir={tmp_path}"])
    launcher = hydra.utils.instantiate(cfg.hydra.launcher)
    launcher.config = cfg
    with pytest.raises(Submitted):
        launcher.launch([["optim.lr=0.001"]], initial_job_idx=0)
    (script,) = scripts
    for line in ("--nodes=2", "--ntasks-per-node=4", "--gpus-per-node=4", "--partition=gpu", "--time=1440"):
        assert f"#SBATCH {line}\n" in script, script
    assert "\nsrun " in script  # SLURM starts the tasks; Lightning reads their ranks from SLURM's environment


@pytest.mark.slow
def test_submitit_local_multirun_writes_both_runs(tmp_path):
    runs = tmp_path / "runs"
    lrs = ("0.001", "0.002")
    _train(
        [
            "-m",
            "hydra/launcher=submitit_local",
            "hydra.launcher.timeout_min=15",
            *TINY,
            *TINY_SHAPES,
            "num_threads=1",
            "head.decoder.depth=1",
            "trainer.fast_dev_run=true",
            f"optim.lr={','.join(lrs)}",
            f"paths.runs_dir={runs}",
        ],
        tmp_path,
    )
    sweep = _sweep_dir(runs)
    for job, lr in enumerate(lrs):
        run = RunDir(sweep / str(job))
        assert run.load_config().optim.lr == float(lr)  # each job trained with its own value
        assert f"optim.lr={lr}" in run.saved_overrides()
        assert (run.bundle / "model.safetensors").is_file() and run.vocab.is_file()
    submitit_logs = list((sweep / ".submitit").rglob("*_result.pkl"))
    assert len(submitit_logs) == 2, submitit_logs  # both jobs went through submitit


def _last_logged(run: Path, metric: str) -> float:
    with open(run / "csv" / "metrics.csv", newline="") as f:
        values = [row[metric] for row in csv.DictReader(f) if row.get(metric)]
    assert values, f"{metric} was not logged in {run}"
    return float(values[-1])


@pytest.mark.slow
@pytest.mark.parametrize("search,metric,best", [("optuna", "val/loss", min), ("optuna_cider", "val/cider_d", max)])
def test_optuna_search_names_the_best_trial(search, metric, best, tmp_path):
    runs = tmp_path / "runs"
    _train(
        [
            f"hparams_search={search}",
            "hydra.sweeper.n_trials=3",
            "hydra.sweeper.sampler.n_startup_trials=2",
            *SHORT,
            "export_bundle=false",
            f"paths.runs_dir={runs}",
        ],
        tmp_path,
    )
    sweep = _sweep_dir(runs)
    trials = sorted((p for p in sweep.iterdir() if p.name.isdigit()), key=lambda p: int(p.name))
    assert [p.name for p in trials] == ["0", "1", "2"]
    values = [_last_logged(trial, metric) for trial in trials]
    params = []
    for trial in trials:
        cfg = RunDir(trial).load_config()
        params.append(
            {
                "optim.lr": cfg.optim.lr,
                "optim.weight_decay": cfg.optim.weight_decay,
                "head.decoder.depth": cfg.head.decoder.depth,
            }
        )
    assert len({p["optim.lr"] for p in params}) == 3  # three different points of the search space

    results = OmegaConf.to_container(OmegaConf.load(sweep / "optimization_results.yaml"))
    assert set(results["best_params"]) == {"optim.lr", "optim.weight_decay", "head.decoder.depth"}
    assert results["best_value"] == pytest.approx(best(values), rel=1e-6)
    (winner,) = [i for i, p in enumerate(params) if results["best_params"] == pytest.approx(p)]
    assert values[winner] == pytest.approx(results["best_value"], rel=1e-6)  # the named trial scored it
    assert 1e-4 <= results["best_params"]["optim.lr"] <= 1e-2
    assert results["best_params"]["head.decoder.depth"] in (1, 2, 3, 4)


def test_optimized_value_picks_the_chosen_metric():
    metrics = {"val/loss": 2.5, "val/cider_d": 0.25}
    assert optimized_value(metrics, None) == 2.5
    assert optimized_value(metrics, "val/cider_d") == 0.25
    with pytest.raises(ValueError, match=r"optimized_metric=val/acc was not logged .*val/cider_d, val/loss"):
        optimized_value(metrics, "val/acc")


def test_optuna_configs_name_metric_and_direction():
    for search, metric, direction in (("optuna", "val/loss", "minimize"), ("optuna_cider", "val/cider_d", "maximize")):
        cfg = _hydra_compose([f"hparams_search={search}"])
        assert cfg.optimized_metric == metric and cfg.hydra.sweeper.direction == direction
        assert set(cfg.hydra.sweeper.params) == {"optim.lr", "optim.weight_decay", "head.decoder.depth"}
