"""A training run's own data, rebuilt resolved from its saved config (Hydra) into the split that evaluation
(``vitattn.evaluation``) scores: what ``vitattn-eval`` and ``vitattn-check-data`` read, without importing training."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import hydra
from omegaconf import DictConfig

from vitattn.bundle import LoadedModel
from vitattn.data.images import EvalSplit
from vitattn.data.preprocess import preprocess_taken
from vitattn.data.tokenizer import Tokenizer
from vitattn.evaluation.splits import model_labels
from vitattn.run_dir import RunDir, check_targets

__all__ = ["datamodule_from_run", "read_once", "run_split"]


def read_once(data: DictConfig) -> dict[str, Any]:
    """The settings of a DataModule for a pass that reads each file once itself (evaluation, ``vitattn-check-data``):
    no cache, no verification, where ``data`` has those keys."""
    return {key: value for key, value in (("cache", "none"), ("verify", False)) if key in data}


def datamodule_from_run(
    run: RunDir,
    *,
    vocab: Tokenizer | None = None,
    preprocess: Mapping[str, Any] | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    **overrides: Any,
) -> Any:
    """The run's DataModule, built resolved and set up for evaluation (``val`` and ``test``; ``read_once``), with
    the model's ``vocab`` rather than one built from the training captions, its ``preprocess`` for the ``data.*``
    keys the saved config leaves null, and ``overrides`` of other data settings (``image_dir`` when the images
    have moved). ``ValueError``: no data section names a DataModule; ``KeyError``: an override the data lacks."""
    data = run.saved().data
    if data is None or "_target_" not in data:
        raise ValueError(f"{run.config} has no data config with a _target_; give the images and references directly")
    check_targets(data)
    unknown = [key for key in overrides if key not in data]
    if unknown:
        raise KeyError(f"the run's data ({data._target_}) has no {', '.join(unknown)}")
    settings: dict[str, Any] = {"batch_size": batch_size, "num_workers": num_workers, **read_once(data)}
    settings |= preprocess_taken(data, preprocess)
    if vocab is not None:
        settings["vocab"] = vocab
    try:
        datamodule = hydra.utils.instantiate(data, **settings, **overrides)
    except Exception as err:  # noqa: BLE001 - a key this version's DataModule does not take, a bad path, ...
        raise ValueError(f"the data of {run.config} cannot be rebuilt: {' '.join(str(err).split())[:200]}") from None
    datamodule.setup("validate")
    return datamodule


def run_split(
    bundle: LoadedModel,
    run: RunDir | str | os.PathLike,
    split: str,
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    image_dir: str | os.PathLike | None = None,
) -> EvalSplit:
    """The run's own ``split`` as ``bundle`` sees it (its DataModule's ``evaluation_split``, rebuilt with the
    model's tokenizer and preprocessing; the classes mapped to the model's by name), for ``vitattn.evaluation``.
    ``image_dir``: where the run's images are now, when they have moved."""
    run = run if isinstance(run, RunDir) else RunDir(run)
    moved = {"image_dir": image_dir} if image_dir is not None else {}
    try:
        datamodule = datamodule_from_run(
            run,
            vocab=bundle.vocab,
            preprocess=bundle.preprocess,
            batch_size=batch_size,
            num_workers=num_workers,
            **moved,
        )
    except KeyError:
        raise ValueError(
            f"image_dir={image_dir} goes with references=COCO_JSON; the run's data has no image files"
        ) from None
    evaluation = datamodule.evaluation_split(split)
    theirs = getattr(datamodule, "class_names", None)
    if bundle.class_names is not None and theirs is not None and evaluation.files:
        evaluation.ids = model_labels(evaluation.ids, theirs, bundle.class_names, evaluation.source)
    elif bundle.class_names is not None and theirs is not None and list(theirs) != list(bundle.class_names):
        raise ValueError(f"the model's classes {bundle.class_names[:5]}... are not the run's data's {theirs[:5]}...")
    if evaluation.loader is not None:  # images made by the data, not files read with the model's transform
        if int(bundle.preprocess["img_size"]) != int(datamodule.img_size):
            raise ValueError(
                f"the run's data (data.img_size={datamodule.img_size}) renders {datamodule.img_size} px images "
                f"but the model takes {bundle.preprocess['img_size']} px"
            )
        evaluation.source = f"{evaluation.source} of {run.config.resolve()}"
    return evaluation
