"""Training (Lightning + Hydra): ``train(cfg)`` runs a whole training run from a composed config.

The names below import their rooms only when used, so that importing a light room does not start the recipe.
"""

from importlib import import_module

__all__ = ["AtomicCheckpointIO", "TrainResult", "build_system", "model_config_from", "setup_data", "train"]

_OWNERS = {
    "AtomicCheckpointIO": "vitattn.training.recipe",
    "TrainResult": "vitattn.training.recipe",
    "build_system": "vitattn.training.build",
    "model_config_from": "vitattn.training.build",
    "setup_data": "vitattn.training.build",
    "train": "vitattn.training.recipe",
}


def __getattr__(name: str):
    if name in _OWNERS:
        return getattr(import_module(_OWNERS[name]), name)
    raise AttributeError(f"module 'vitattn.training' has no attribute {name!r}")
