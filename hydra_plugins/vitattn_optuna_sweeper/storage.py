"""``hydra.sweeper.storage``: where the study lives, written as one string."""

from __future__ import annotations

from pathlib import Path

import optuna
from optuna.storages import BaseStorage, JournalStorage
from optuna.storages.journal import JournalFileBackend

SQLITE = "sqlite:///"


def open_storage(spec: str | None) -> str | BaseStorage | None:
    """The Optuna storage that ``spec`` names.

    Args:
        spec: ``null`` (in memory, this process only), an RDB URL (``sqlite:///runs/optuna.db`` on one
            machine, ``postgresql://user@host/db`` for many) or the path of a journal file on a
            filesystem every worker sees (``/shared/searches/caption.journal``).

    Returns:
        What ``optuna.create_study(storage=...)`` takes.
    """
    if spec is None:
        return None
    if "://" in spec:
        if spec.startswith(SQLITE):  # SQLite creates the database file, not its folder
            Path(spec[len(SQLITE) :]).parent.mkdir(parents=True, exist_ok=True)
        return spec
    Path(spec).parent.mkdir(parents=True, exist_ok=True)
    return JournalStorage(JournalFileBackend(spec))


def trial_of(study_name: str, storage: str | None, number: int, pruner: optuna.pruners.BasePruner) -> optuna.Trial:
    """Trial ``number`` of study ``study_name``, opened again in the process that runs it."""
    if storage is None:
        raise ValueError(
            f"trial {number} of study {study_name} lives in the sweeper's memory: set hydra.sweeper.storage "
            "(sqlite:///runs/optuna.db, a journal file or an RDB URL) to report to it from the trial"
        )
    opened = optuna.storages.get_storage(open_storage(storage))
    trial_id = opened.get_trial_id_from_study_id_trial_number(opened.get_study_id_from_name(study_name), number)
    return optuna.Trial(optuna.load_study(study_name=study_name, storage=opened, pruner=pruner), trial_id)
