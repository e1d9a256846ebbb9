"""Training runs for the tests: the tiny config (``TINY``), composing it, the shared shapes runs' overrides and
their test split, a console script of the venv, and a system's own metrics for given weights."""

from __future__ import annotations

import sys
from pathlib import Path

import vitattn.conf
from omegaconf import DictConfig

from vitattn.training.config import compose_train as compose

CONF_DIR = Path(vitattn.conf.__file__).parent


# A small model and data for fast runs: 32 px images, 8 px patches, width 32, 2 layers.
TINY = [
    "model.embed_dim=32",
    "model.depth=2",
    "model.num_heads=2",
    "model.patch_size=8",
    "data.img_size=32",
    "data.batch_size=8",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "logger=csv",
    "num_threads=null",  # keep the one thread tests/conftest.py pins (auto would take every core)
]


TINY_SHAPES = ["data.num_train=64", "data.num_val=16", "data.num_test=16"]


# The shared shapes runs (tests/conftest.py: shapes_caption_run, shapes_classifier_run): 256 training images, no
# test stage; their test splits (what vitattn-eval split=test scores) are this many images.
SHAPES_RUN = ["data.num_train=256", "data.num_val=16", "test=false", "trainer.max_epochs=-1"]


CAPTION_TEST_IMAGES, LABEL_TEST_IMAGES = 1000, 4000
# The six-class folder the small caption and coca runs classify zero-shot at each validation (tests/conftest.py).
ZERO_SHOT_CLASSES = ("red circle", "blue square", "green triangle", "small red square", "large blue circle", "green")


def metrics_with_weights(system, weights: dict, datamodule, stage: str) -> dict[str, float]:
    """``system``'s own val or test metrics with the model ``weights`` loaded, by a Trainer without callbacks:
    what a run's logged metrics must equal when it validated or tested those weights."""
    import lightning.pytorch as pl

    missing, unexpected = system.model.load_state_dict(weights, strict=False)
    assert not unexpected and all(name not in weights for name in missing)
    quiet = dict(logger=False, enable_progress_bar=False, enable_model_summary=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, **quiet)
    return (trainer.validate if stage == "val" else trainer.test)(system, datamodule=datamodule, verbose=False)[0]


def console_script(name: str) -> Path:
    """The venv's ``name`` console script. A missing one fails the test: the install is broken, nothing to skip."""
    path = Path(sys.executable).with_name(name)
    assert path.is_file(), f"console script {name} is missing from {path.parent}: run pip install -e . --no-deps"
    return path


def compose_train(overrides: list[str], output_dir: Path | None = None) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides``, writing into ``output_dir``."""
    extra = [f"paths.output_dir={output_dir}"] if output_dir is not None else []
    return compose([*overrides, *extra])


def shapes_split(task: str, size: int) -> tuple:
    """The first ``size`` test images of the shared shapes runs (B, 3, 32, 32), normalised as they were trained,
    and their references (captions) or labels."""
    import torch

    from vitattn.data.preprocess import normalize
    from vitattn.data.shapes import ShapesDataset

    data = ShapesDataset("test", size, img_size=32, seed=0, task=task, transform=normalize())
    images = torch.stack([data[i]["image"] if task == "caption" else data[i][0] for i in range(len(data))])
    if task == "caption":
        return images, [data.references(i) for i in range(len(data))]
    return images, [data.label(i) for i in range(len(data))]
