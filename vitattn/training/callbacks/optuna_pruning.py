"""Stop a search's trial early when its validation metric is worse than the study's other trials: ``fit``
ends with ``optuna.TrialPruned``, which the sweeper records as a pruned trial (why not optuna-integration's
callback: docs/experiments.md).
"""

from __future__ import annotations

import lightning.pytorch as pl
import optuna
from lightning.pytorch.trainer.states import TrainerFn

from hydra_plugins.vitattn_optuna_sweeper.storage import trial_of

__all__ = ["OptunaPruning"]


class OptunaPruning(pl.Callback):
    """Report ``monitor`` (``optimized_metric``) after each validation to trial ``trial_number``
    (``hydra.job.num``) of the sweeper's study; ``study_name``, ``storage`` (not null: the trial runs in another
    process) and ``pruner`` are the ``hydra.sweeper`` settings."""

    def __init__(
        self, monitor: str, study_name: str, storage: str | None, trial_number: int, pruner: optuna.pruners.BasePruner
    ) -> None:
        self.monitor = monitor
        self._where = (study_name, storage, trial_number, pruner)
        self._trial: optuna.Trial | None = None

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit" and trainer.is_global_zero:  # only rank 0 talks to the study
            self._trial = trial_of(*self._where)

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        prune = False
        if trainer.is_global_zero:
            value = trainer.callback_metrics.get(self.monitor)
            if value is None:
                logged = ", ".join(sorted(trainer.callback_metrics)) or "none"
                raise ValueError(f"optimized_metric={self.monitor} was not logged by validation; logged: {logged}")
            assert self._trial is not None  # opened in setup(stage="fit")
            self._trial.report(float(value), step=trainer.global_step)
            prune = self._trial.should_prune()
        if trainer.strategy.broadcast(prune):
            raise optuna.TrialPruned(f"{self.monitor} at step {trainer.global_step} is worse than the pruner allows")
