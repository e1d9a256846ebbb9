"""A Hydra Sweeper that asks an Optuna study for trials and runs them through Hydra's launcher.

Each trial is one Hydra job whose ``hydra.job.num`` is the trial's number, so that a trial's run folder
is named after it and the trial can report to its study from its own process (the pruning callback).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import optuna
from hydra.core.plugins import Plugins
from hydra.core.utils import JobReturn, JobStatus
from hydra.plugins.sweeper import Sweeper
from hydra.types import HydraContext, TaskFunction
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from optuna.distributions import BaseDistribution
from optuna.trial import TrialState

from hydra_plugins.vitattn_optuna_sweeper.search_space import search_space, suggest
from hydra_plugins.vitattn_optuna_sweeper.storage import open_storage

log = logging.getLogger(__name__)


class OptunaSweeper(Sweeper):
    """Run ``n_trials`` trials of the study ``study_name`` in ``storage``, ``n_jobs`` at a time."""

    def __init__(
        self,
        direction: str,
        study_name: str | None,
        storage: str | None,
        n_trials: int,
        n_jobs: int,
        max_failure_rate: float,
        sampler: DictConfig,
        pruner: DictConfig,
        params: DictConfig | None,
    ) -> None:
        if not 0.0 <= max_failure_rate <= 1.0:
            raise ValueError(f"hydra.sweeper.max_failure_rate={max_failure_rate} must be within [0, 1]")
        self.direction = direction
        self.study_name = study_name
        self.storage = storage
        self.n_trials = n_trials
        self.n_jobs = n_jobs
        self.max_failure_rate = max_failure_rate
        self.sampler = sampler
        self.pruner = pruner
        self.params = params or {}

    def setup(self, *, hydra_context: HydraContext, task_function: TaskFunction, config: DictConfig) -> None:
        self.config = config
        self.launcher = Plugins.instance().instantiate_launcher(
            config=config, hydra_context=hydra_context, task_function=task_function
        )

    def sweep(self, arguments: list[str]) -> None:
        space, fixed = search_space([*(f"{k}={v}" for k, v in self.params.items()), *arguments])
        # Optuna's "A new study created" line, in its own format: the line logged below says it in Hydra's
        optuna.logging.set_verbosity(optuna.logging.WARNING)
        study = optuna.create_study(
            study_name=self.study_name,
            storage=open_storage(self.storage),
            sampler=instantiate(self.sampler),
            pruner=instantiate(self.pruner),
            direction=self.direction,
            load_if_exists=True,  # a restarted search, or another worker, continues the study
        )
        where = self.storage or "in memory"
        log.info(f"Study {study.study_name} in {where}: {len(study.trials)} trials so far, {self.n_trials} to run")
        failures: list[str] = []
        done = 0
        while done < self.n_trials:
            trials = [self.ask(study, space) for _ in range(min(self.n_jobs, self.n_trials - done))]
            overrides = [
                [*(f"{k}={v}" for k, v in trial.params.items()), *(f"{k}={v}" for k, v in fixed.items())]
                for trial in trials
            ]
            for trial, job in zip(trials, self._launch(trials, overrides)):
                failure = _tell(study, trial, job)
                if failure:
                    failures.append(failure)
            done += len(trials)
            if len(failures) > self.max_failure_rate * done:
                raise RuntimeError(
                    f"{len(failures)} of {done} trials failed (hydra.sweeper.max_failure_rate="
                    f"{self.max_failure_rate}); the first: {failures[0]}"
                )
        self._write_results(study)

    def ask(self, study: optuna.Study, space: dict[str, BaseDistribution]) -> optuna.Trial:
        """A new trial with a value for every searched key.

        The sampler is seeded with ``seed + trial number``: a search on one machine repeats itself, and
        workers that share a study draw different points even though they start with the same seed.
        """
        trial = study.ask()
        seed = self.sampler.get("seed")
        study.sampler = instantiate(self.sampler, **({} if seed is None else {"seed": seed + trial.number}))
        suggest(trial, space)
        return trial

    def _launch(self, trials: list[optuna.Trial], overrides: list[list[str]]) -> list[JobReturn]:
        # hydra.job.num counts up from initial_job_idx: a run of consecutive trial numbers goes in one call
        # (other workers take numbers in between when they share the study).
        jobs: list[JobReturn] = []
        start = 0
        for end in range(1, len(trials) + 1):
            if end == len(trials) or trials[end].number != trials[end - 1].number + 1:
                jobs += self.launcher.launch(overrides[start:end], initial_job_idx=trials[start].number)
                start = end
        return jobs

    def _write_results(self, study: optuna.Study) -> None:
        finished = [t for t in study.trials if t.state == TrialState.COMPLETE]
        if not finished:
            log.warning(f"Study {study.study_name} has no completed trial yet")
            return
        best = study.best_trial
        results = {"name": "optuna", "best_trial": best.number, "best_params": best.params, "best_value": best.value}
        sweep_dir = Path(self.config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        OmegaConf.save(OmegaConf.create(results), sweep_dir / "optimization_results.yaml")
        log.info(f"Best trial {best.number} of {len(study.trials)}: {best.value} with {best.params}")


def _tell(study: optuna.Study, trial: optuna.Trial, job: JobReturn) -> str | None:
    """Record the job's outcome in the study; the failure's message when the job failed."""
    # JobReturn.return_value re-raises a failed job's exception after printing an error line: a pruned
    # trial is not an error, so its exception is read from the field the property reads.
    outcome: Any = job._return_value
    if job.status == JobStatus.FAILED:
        if isinstance(outcome, optuna.TrialPruned):
            study.tell(trial, state=TrialState.PRUNED)
            log.info(f"Trial {trial.number} pruned: {outcome}")
            return None
        study.tell(trial, state=TrialState.FAIL)
        log.warning(f"Trial {trial.number} failed: {outcome!r}")
        return f"trial {trial.number}: {outcome!r}"
    try:
        value = float(outcome)
    except (TypeError, ValueError):
        study.tell(trial, state=TrialState.FAIL)
        return f"trial {trial.number} returned {outcome!r}, not a number (optimized_metric)"
    study.tell(trial, value)
    return None
