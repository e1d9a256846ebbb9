"""Learning from images without captions: a teacher's scored caption candidates (or class probabilities) for a
pool of images, written once into the run folder, a keep policy applied when they are read, and the kept pool
mixed into the student's training stream (docs/bootstrap.md).

Each module one job: ``settings`` (the ``bootstrap`` group), ``keep`` (the keep policy of both tasks),
``side_files`` (labelling the pool once and reading it back), ``child`` (the captioning child process),
``pool`` (the kept pool as datasets, and the mix), ``lineage`` (what the run learned from).
"""

from vitattn.training.bootstrap.keep import Keep
from vitattn.training.bootstrap.lineage import BOOTSTRAP_DIR
from vitattn.training.bootstrap.pool import MixedTraining, Pool, PoolCaptions, PoolLabels, image_digests
from vitattn.training.bootstrap.settings import BootstrapSettings
from vitattn.training.bootstrap.side_files import prepare_pool

__all__ = [
    "BOOTSTRAP_DIR",
    "BootstrapSettings",
    "Keep",
    "MixedTraining",
    "Pool",
    "PoolCaptions",
    "PoolLabels",
    "image_digests",
    "prepare_pool",
]
