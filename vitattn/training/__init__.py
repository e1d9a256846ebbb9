"""Training: ``train(cfg)`` runs a whole training run from a composed config, without the command line."""

from vitattn.training.assemble import build_system, model_config_from
from vitattn.training.checkpoint_io import AtomicCheckpointIO
from vitattn.training.data import setup_data
from vitattn.training.run import TrainResult, train

__all__ = ["AtomicCheckpointIO", "TrainResult", "build_system", "model_config_from", "setup_data", "train"]
