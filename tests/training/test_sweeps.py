"""Multiruns through Hydra's plugins: the submitit launchers and our Optuna sweeper (hparams_search)."""

import csv
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import hydra
import optuna
import pytest
from hydra import compose, initialize_config_module
from omegaconf import OmegaConf
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.storages import JournalStorage
from optuna.trial import TrialState

from hydra_plugins.vitattn_optuna_sweeper.search_space import search_space
from hydra_plugins.vitattn_optuna_sweeper.storage import open_storage
from hydra_plugins.vitattn_optuna_sweeper.sweeper import OptunaSweeper
from tests.helpers.runs import TINY, TINY_SHAPES
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


def _env(warnings: str = "ignore") -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": warnings, "HYDRA_FULL_ERROR": "1"}


def _train(overrides: list[str], cwd: Path, warnings: str = "ignore") -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [sys.executable, "-m", "vitattn.cli.train", *overrides],
        capture_output=True,
        text=True,
        timeout=900,
        env=_env(warnings),
        cwd=cwd,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _search(cwd: Path, storage: str, *overrides: str) -> list[str]:
    """A search of the SHORT runs in study "s" of ``storage`` (pruning only from the tenth trial on)."""
    return [
        "hparams_search=optuna",
        "hydra.sweeper.study_name=s",
        f"hydra.sweeper.storage={storage}",
        "hydra.sweeper.pruner.n_startup_trials=10",
        *SHORT,
        "export_bundle=false",
        f"paths.runs_dir={cwd / 'runs'}",
        *overrides,
    ]


def _trial_dirs(runs: Path) -> list[Path]:
    return [p for p in (runs / "caption-multirun").glob("*/*") if p.name.isdigit()]


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
        assert cfg.callbacks.optuna_pruning.monitor == metric  # the pruner watches what the search optimises
        assert cfg.hydra.sweeper.storage  # a study on disk: it outlives the command, and trials report to it
    assert "optuna_pruning" not in _hydra_compose(["hparams_search=optuna", "~callbacks.optuna_pruning"]).callbacks


def test_search_space_reads_hydras_sweep_grammar():
    space, fixed = search_space(
        [
            "optim.lr=tag(log, interval(1e-4, 1e-2))",
            "optim.weight_decay=interval(0.0, 0.1)",
            "head.decoder.depth=choice(1, 2, 4)",
            "model.depth=range(2, 8, 2)",
            "model.depth=range(2, 10, 2)",  # the later override of a key wins (the command line over params)
            "data.batch_size=16",
        ]
    )
    assert space == {
        "optim.lr": FloatDistribution(1e-4, 1e-2, log=True),
        "optim.weight_decay": FloatDistribution(0.0, 0.1),
        "head.decoder.depth": CategoricalDistribution([1, 2, 4]),
        "model.depth": IntDistribution(2, 8, step=2),  # range's stop is exclusive, as in Hydra's basic sweeper
    }
    assert fixed == {"data.batch_size": "16"}


def test_storage_spec_names_sqlite_journal_or_memory(tmp_path):
    assert open_storage(None) is None
    url = f"sqlite:///{tmp_path}/a/optuna.db"
    assert open_storage(url) == url and (tmp_path / "a").is_dir()  # SQLite makes the file, not its folder
    journal = open_storage(str(tmp_path / "b" / "s.journal"))
    assert isinstance(journal, JournalStorage)
    optuna.create_study(study_name="s", storage=journal).ask()
    assert (tmp_path / "b" / "s.journal").stat().st_size > 0


def test_sweeper_seeds_each_trial_with_its_number(tmp_path):
    """Workers that share a study with one seed draw different points; a trial number's point repeats."""
    space, _ = search_space(["optim.lr=tag(log, interval(1e-4, 1e-2))", "head.decoder.depth=choice(1, 2, 3, 4)"])
    sampler = OmegaConf.create({"_target_": "optuna.samplers.TPESampler", "seed": 42})
    sweeper = OptunaSweeper("minimize", "s", None, 2, 1, 0.0, sampler, OmegaConf.create({}), None)

    def draws(storage) -> list[dict]:
        studies = [optuna.create_study(study_name="s", storage=storage, load_if_exists=True) for _ in range(2)]
        return [sweeper.ask(study, space).params for _ in range(2) for study in studies]  # workers take turns

    first = draws(open_storage(str(tmp_path / "a.journal")))
    assert len({p["optim.lr"] for p in first}) == 4
    assert draws(open_storage(str(tmp_path / "b.journal"))) == first


def _study(storage: str) -> optuna.Study:
    return optuna.load_study(study_name="s", storage=open_storage(storage))


@pytest.mark.slow
def test_two_workers_on_one_journal_run_six_different_trials(tmp_path):
    journal = str(tmp_path / "shared" / "s.journal")
    workers = [
        subprocess.Popen(
            [sys.executable, "-m", "vitattn.cli.train", *_search(tmp_path, journal, "hydra.sweeper.n_trials=3")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=_env(),
            cwd=tmp_path,
        )
        for _ in range(2)
    ]
    for worker in workers:
        _, err = worker.communicate(timeout=900)
        assert worker.returncode == 0, err[-4000:]
    trials = _study(journal).trials
    assert sorted(t.number for t in trials) == list(range(6))
    assert [t.state for t in trials] == [TrialState.COMPLETE] * 6
    assert len({t.params["optim.lr"] for t in trials}) == 6  # one seed, yet no point drawn twice
    runs = _trial_dirs(tmp_path / "runs")
    assert sorted(int(p.name) for p in runs) == list(range(6))  # each trial ran once, in the folder of its number
    for run in runs:
        assert RunDir(run).load_config().optim.lr == trials[int(run.name)].params["optim.lr"]


def _completed(storage: str) -> int:
    try:
        return sum(t.state == TrialState.COMPLETE for t in _study(storage).trials)
    except KeyError:  # the search has not created its study yet
        return 0


@pytest.mark.slow
def test_killed_search_continues_its_study(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    search = subprocess.Popen(
        [sys.executable, "-m", "vitattn.cli.train", *_search(tmp_path, storage, "hydra.sweeper.n_trials=20")],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=_env(),
        cwd=tmp_path,
    )
    try:
        deadline = time.monotonic() + 600
        while _completed(storage) < 2:
            assert search.poll() is None and time.monotonic() < deadline, "the search ended before two trials"
            time.sleep(0.5)
    finally:
        search.kill()  # as a lost machine would: no clean-up
        search.wait()
    before = {t.number: t for t in _study(storage).trials}
    completed = {n: t for n, t in before.items() if t.state == TrialState.COMPLETE}

    _train(_search(tmp_path, storage, "hydra.sweeper.n_trials=2"), tmp_path)
    after = {t.number: t for t in _study(storage).trials}
    for n, trial in completed.items():  # the killed search's trials are kept as they were
        assert after[n].state == TrialState.COMPLETE and after[n].params == trial.params
        assert after[n].value == trial.value
    new = sorted(set(after) - set(before))
    assert new == [max(before) + 1, max(before) + 2]  # numbering continues after the killed search's trials
    assert all(after[n].state == TrialState.COMPLETE for n in new)


@pytest.mark.slow
def test_trial_with_a_bad_validation_metric_is_pruned_early(tmp_path):
    storage = f"sqlite:///{tmp_path}/optuna.db"
    max_steps = 8  # four epochs of two steps, a validation after each
    common = [
        "hydra.sweeper.n_trials=1",
        "hydra.sweeper.pruner.n_startup_trials=1",  # the second trial may be pruned
        "trainer.max_epochs=4",
        "optim.weight_decay=0.0",
        "head.decoder.depth=1",
    ]
    _train(_search(tmp_path, storage, *common, "optim.lr=3e-3"), tmp_path)  # learns: the median to beat
    proc = _train(_search(tmp_path, storage, *common, "optim.lr=1e-8"), tmp_path, warnings="default")
    good, bad = _study(storage).trials
    assert good.state == TrialState.COMPLETE and sorted(good.intermediate_values) == [2, 4, 6, 8]
    assert bad.state == TrialState.PRUNED
    assert max(bad.intermediate_values) < max_steps  # stopped at its first validation, not at the end
    assert bad.intermediate_values[2] > good.intermediate_values[2]
    (run,) = [p for p in _trial_dirs(tmp_path / "runs") if p.name == "1"]
    with open(run / "csv" / "metrics.csv", newline="") as f:
        steps = [int(row["step"]) for row in csv.DictReader(f)]
    assert max(steps) < max_steps
    output = proc.stdout + proc.stderr
    assert "Trial 1 pruned" in output and "Error executing job" not in output
    assert not re.search(r"(optuna|sqlalchemy|alembic)\S*:\d+: \w*Warning", output, re.I), output[-4000:]
