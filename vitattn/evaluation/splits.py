"""Which images to score, and against what: a user's COCO caption file or ImageFolder tree, or the training
run's own split, given (``vitattn.cli.run_split.run_split`` rebuilds it: image files with ids, or ready batches).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from vitattn.bundle import LoadedModel
from vitattn.data.coco import load_coco_captions
from vitattn.data.images import EvalSplit, image_folder_split, open_image_folder

__all__ = ["caption_split", "labelled_split", "model_labels"]

log = logging.getLogger(__name__)

_NO_RUN = "the model is not inside a training run (no config.yaml beside it), so there is no split to take; give {}"


def model_labels(labels: Sequence[int], names: Sequence[str], model_names: Sequence[str], where: str) -> list[int]:
    """Labels of the data's classes ``names`` -> the model's class indices, matched by name."""
    index = {name: i for i, name in enumerate(model_names)}
    unknown = sorted({names[label] for label in labels if names[label] not in index})
    if unknown:
        raise ValueError(
            f"{where} has class folders {unknown} that are not among the model's classes {list(model_names)[:20]}"
        )
    return [index[names[label]] for label in labels]


def caption_split(
    run_split: EvalSplit | None, references: str | os.PathLike | None, image_dir: str | os.PathLike | None
) -> EvalSplit:
    """A COCO caption file's images and references, else ``run_split``, the run's own split."""
    if references is None:
        if run_split is None:
            raise ValueError(_NO_RUN.format("references=COCO_JSON (and image_dir=DIR)"))
        if run_split.references is None:
            raise ValueError(f"the run's data has no captions ({run_split.source}); give references=COCO_JSON")
        return run_split
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
    bundle: LoadedModel, split: str, run_split: EvalSplit | None, data_root: str | os.PathLike | None
) -> EvalSplit:
    """An ImageFolder tree's ``split`` (files, ids = the model's class indices), else ``run_split``, the run's own."""
    if data_root is None:
        if run_split is None:
            raise ValueError(_NO_RUN.format("data_root=DIR (holding <split>/<class>/<image>)"))
        if run_split.references is not None:
            raise ValueError(f"the run's data has no class labels ({run_split.source}); give data_root=DIR")
        return run_split
    root = Path(data_root)
    directory = image_folder_split(root, split)
    if directory != root / split:
        log.warning("%s does not exist; evaluating %s, as training tested on it", root / split, directory)
    folder = open_image_folder(directory)  # lists files; nothing is read
    files = [path for path, _ in folder.samples]
    labels = model_labels([label for _, label in folder.samples], folder.classes, bundle.class_names, str(directory))
    return EvalSplit(str(directory.resolve()), files=files, ids=labels)
