"""Which images to score, and against what: a user's COCO caption file or ImageFolder tree, or the training
run's own split (its DataModule's ``evaluation_split``: image files with ids, or ready batches).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vitattn.bundle import LoadedModel
from vitattn.data.coco import load_coco_captions
from vitattn.data.images import EvalSplit, image_folder_split, open_image_folder
from vitattn.run_dir import RunDir

__all__ = ["caption_split", "labelled_split"]

log = logging.getLogger(__name__)


def _run_split(
    bundle: LoadedModel,
    run: RunDir | str | os.PathLike | None,
    split: str,
    wanted: str,
    batch_size: int,
    num_workers: int,
    **overrides: Any,
) -> EvalSplit:
    if run is None:
        raise ValueError(
            "the model is not inside a training run (no config.yaml beside it), so there is no split to take; "
            f"give {wanted}"
        )
    run = run if isinstance(run, RunDir) else RunDir(run)
    # heavy: the run's own data is its DataModule, rebuilt by Hydra (Lightning); a user's files need neither
    from vitattn.training.run_data import datamodule_from_run

    datamodule = datamodule_from_run(
        run,
        vocab=bundle.vocab,
        preprocess=bundle.preprocess,
        batch_size=batch_size,
        num_workers=num_workers,
        **overrides,
    )
    evaluation = datamodule.evaluation_split(split)
    theirs = getattr(datamodule, "class_names", None)
    if bundle.class_names is not None and theirs is not None and evaluation.files:
        evaluation.ids = _model_labels(evaluation.ids, theirs, bundle.class_names, evaluation.source)
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


def _model_labels(labels: Sequence[int], names: Sequence[str], model_names: Sequence[str], where: str) -> list[int]:
    """Labels of the data's classes ``names`` -> the model's class indices, matched by name."""
    index = {name: i for i, name in enumerate(model_names)}
    unknown = sorted({names[label] for label in labels if names[label] not in index})
    if unknown:
        raise ValueError(
            f"{where} has class folders {unknown} that are not among the model's classes {list(model_names)[:20]}"
        )
    return [index[names[label]] for label in labels]


def caption_split(
    bundle: LoadedModel,
    split: str,
    run: RunDir | str | os.PathLike | None,
    references: str | os.PathLike | None,
    image_dir: str | os.PathLike | None,
    batch_size: int,
    num_workers: int,
) -> EvalSplit:
    """A COCO caption file's images and references, else the run's own ``split``."""
    if references is None:
        moved = {"image_dir": image_dir} if image_dir is not None else {}
        wanted = "references=COCO_JSON (and image_dir=DIR)"
        try:
            evaluation = _run_split(bundle, run, split, wanted, batch_size, num_workers, **moved)
        except KeyError:
            raise ValueError(
                f"image_dir={image_dir} goes with references=COCO_JSON; the run's data has no image files"
            ) from None
        if evaluation.references is None:
            raise ValueError(f"the run's data has no captions ({evaluation.source}); give references=COCO_JSON")
        return evaluation
    images = load_coco_captions(references)
    if not images:
        raise ValueError(f"references={references} has no captioned images")
    root = Path(image_dir) if image_dir is not None else Path(references).parent
    return EvalSplit(
        str(Path(references).resolve()),
        files=[str(root / im.file_name) for im in images],
        ids=[im.image_id for im in images],
        references={im.image_id: list(im.captions) for im in images},
    )


def labelled_split(
    bundle: LoadedModel,
    split: str,
    run: RunDir | str | os.PathLike | None,
    data_root: str | os.PathLike | None,
    batch_size: int,
    num_workers: int,
) -> EvalSplit:
    """An ImageFolder tree's ``split`` (files, ids = the model's class indices), else the run's own ``split``."""
    if data_root is None:
        wanted = "data_root=DIR (holding <split>/<class>/<image>)"
        evaluation = _run_split(bundle, run, split, wanted, batch_size, num_workers)
        if evaluation.references is not None:
            raise ValueError(f"the run's data has no class labels ({evaluation.source}); give data_root=DIR")
        return evaluation
    root = Path(data_root)
    directory = image_folder_split(root, split)
    if directory != root / split:
        log.warning("%s does not exist; evaluating %s, as training tested on it", root / split, directory)
    folder = open_image_folder(directory)  # lists files; nothing is read
    files = [path for path, _ in folder.samples]
    labels = _model_labels([label for _, label in folder.samples], folder.classes, bundle.class_names, str(directory))
    return EvalSplit(str(directory.resolve()), files=files, ids=labels)
