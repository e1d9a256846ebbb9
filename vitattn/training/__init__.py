"""Training (Lightning + Hydra): ``train(cfg)`` runs a whole training run from a composed config.

Its rooms (systems, datamodules, callbacks, evaluation, the recipe) import only when named, so that
``vitattn.training.config`` or ``vitattn.training.evaluation`` does not start the whole recipe.
"""

from importlib import import_module

__all__ = ["AtomicCheckpointIO", "TrainResult", "build_system", "model_config_from", "setup_data", "train"]

_OWNERS = {
    "AtomicCheckpointIO": "vitattn.training.run",
    "TrainResult": "vitattn.training.run",
    "build_system": "vitattn.training.build",
    "model_config_from": "vitattn.training.build",
    "setup_data": "vitattn.training.build",
    "train": "vitattn.training.run",
}


def __getattr__(name: str):
    if name in _OWNERS:
        return getattr(import_module(_OWNERS[name]), name)
    raise AttributeError(f"module 'vitattn.training' has no attribute {name!r}")
