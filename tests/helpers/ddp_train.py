"""``vitattn-train`` that records every bundle export: which rank wrote a bundle, and where.

    VITATTN_EXPORT_LOG=FILE python -m tests.helpers.ddp_train OVERRIDES...

Started as a module, as ``python -m vitattn.cli.train`` is; with ``trainer=ddp`` Lightning starts this module again
once per extra rank (``python -m`` again), so every rank runs the recording ``bundle_from_system``; each call
appends ``<global rank> <bundle folder>`` to FILE. Used by tests/training/test_training.py.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import vitattn.training.recipe
from vitattn.cli.train import main

_bundle_from_system = vitattn.training.recipe.bundle_from_system  # what train() calls to export the bundle


def recording_bundle_from_system(system: Any, directory: str | os.PathLike) -> Path:
    with open(os.environ["VITATTN_EXPORT_LOG"], "a") as log:
        log.write(f"{system.global_rank} {directory}\n")
    return _bundle_from_system(system, directory)


if __name__ == "__main__":
    vitattn.training.recipe.bundle_from_system = recording_bundle_from_system
    main()
