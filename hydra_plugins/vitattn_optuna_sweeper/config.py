"""The defaults of ``hydra/sweeper=vitattn_optuna``, registered with Hydra's ConfigStore.

No ``from __future__ import annotations``: OmegaConf reads these annotations as types.
"""

from dataclasses import dataclass, field
from typing import Any

from hydra.core.config_store import ConfigStore


@dataclass
class OptunaSweeperConf:
    """``hydra.sweeper``: the study, where it lives, and how many trials this process runs."""

    _target_: str = "hydra_plugins.vitattn_optuna_sweeper.sweeper.OptunaSweeper"
    _recursive_: bool = False  # the sampler is built again for every trial (see OptunaSweeper.ask)
    direction: str = "minimize"  # or maximize
    study_name: str | None = None  # with a storage: the name a restarted search or another worker joins
    storage: str | None = None  # null (memory), an RDB URL, or a journal file path (storage.open_storage)
    n_trials: int = 20  # trials this process runs (more workers: each runs its own n_trials)
    n_jobs: int = 1  # trials sent to the launcher at once
    max_failure_rate: float = 0.0  # failed (not pruned) trials tolerated, as a fraction of this process's trials
    sampler: Any = field(default_factory=lambda: {"_target_": "optuna.samplers.TPESampler", "seed": None})
    pruner: Any = field(default_factory=lambda: {"_target_": "optuna.pruners.NopPruner"})
    params: dict[str, str] | None = None


ConfigStore.instance().store(group="hydra/sweeper", name="vitattn_optuna", node=OptunaSweeperConf, provider="vitattn")
