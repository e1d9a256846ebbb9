"""COCO-style caption files and Karpathy splits, parsed with one-line errors, and a dataset of (image, captions)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from vitattn.data.images import read_image
from vitattn.errors import brief
from vitattn.fileio import read_json

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CocoImage:
    """One image of a caption file with all of its captions, in file order."""

    image_id: int
    file_name: str
    captions: tuple[str, ...]


def _require(entry: Any, keys: tuple[str, ...], where: str) -> None:
    if not isinstance(entry, dict):
        raise ValueError(f"{where} must be an object with keys {list(keys)}, got {brief(entry)}")
    missing = [key for key in keys if key not in entry]
    if missing:
        raise ValueError(f"{where} has no {missing}; it needs {list(keys)}")


def _require_list(value: Any, where: str) -> list:
    if not isinstance(value, list):
        raise ValueError(f"{where}={brief(value)}; it must be a list")
    return value


def _require_id(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{where}={brief(value)}; ids must be integers")
    return value


def _require_name(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}={brief(value)}; it must be a non-empty string (a path)")
    return value


def load_coco_captions(path: str | os.PathLike) -> list[CocoImage]:
    """The images of a COCO caption file (``images``: ``id``, ``file_name``; ``annotations``: ``image_id``,
    ``caption``) with their captions; images without one are left out with a warning.

    Raises:
        ValueError: a missing or non-JSON file, a missing key, an annotation of an image not listed.
    """
    path = Path(path)
    if not path.is_file():  # a ValueError, as every other problem with the annotations
        raise ValueError(f"COCO caption file not found: {path}")
    data = read_json(path, "COCO caption file")
    _require(data, ("images", "annotations"), f"COCO caption file {path}")

    captions: dict[int, list[str]] = {}
    file_names: dict[int, str] = {}
    for i, image in enumerate(_require_list(data["images"], f"{path}: images")):
        _require(image, ("id", "file_name"), f"{path}: images[{i}]")
        image_id = _require_id(image["id"], f"{path}: images[{i}] has id")
        if image_id in file_names:
            raise ValueError(f"{path}: images[{i}] repeats id={image_id}")
        file_names[image_id] = _require_name(image["file_name"], f"{path}: images[{i}] has file_name")
        captions[image_id] = []
    for i, annotation in enumerate(_require_list(data["annotations"], f"{path}: annotations")):
        _require(annotation, ("image_id", "caption"), f"{path}: annotations[{i}]")
        image_id = _require_id(annotation["image_id"], f"{path}: annotations[{i}] has image_id")
        caption = annotation["caption"]
        if image_id not in captions:
            raise ValueError(f"{path}: annotations[{i}] has image_id={image_id}, which is not in 'images'")
        if not isinstance(caption, str):
            raise ValueError(f"{path}: annotations[{i}] has caption={brief(caption)}; it must be a string")
        captions[image_id].append(caption.strip())

    uncaptioned = [image_id for image_id, texts in captions.items() if not texts]
    if uncaptioned:
        log.warning("%s: leaving out %d images without captions", path, len(uncaptioned))
    return [CocoImage(image_id, file_names[image_id], tuple(texts)) for image_id, texts in captions.items() if texts]


class CocoCaptionDataset(Dataset):
    """Items ``{"image", "caption", "references", "image_id"}`` of a COCO caption file (or parsed images) under
    ``image_dir``: the PIL image from ``loader`` (``read_image``, or an ``ImageCache``'s ``load``) after ``transform``
    (a ``CaptionAugment`` also gets the captions), the first caption, all of them."""

    def __init__(
        self,
        image_dir: str | os.PathLike,
        annotations: str | os.PathLike | Sequence[CocoImage],
        transform: Callable[..., Any] | None = None,
    ) -> None:
        self.image_dir = Path(image_dir)
        if not self.image_dir.is_dir():
            raise ValueError(f"COCO image folder not found: {self.image_dir}")
        if isinstance(annotations, (str, os.PathLike)):
            annotations = load_coco_captions(annotations)
        self.images: list[CocoImage] = list(annotations)
        self.transform = transform
        self.loader: Callable[[str | os.PathLike], Image.Image] = read_image  # or an ImageCache's load

    def __len__(self) -> int:
        return len(self.images)

    @property
    def captions(self) -> list[str]:
        """Every caption of every image."""
        return [caption for image in self.images for caption in image.captions]

    def __getitem__(self, index: int) -> dict[str, Any]:
        entry = self.images[index]
        image = self.loader(self.image_dir / entry.file_name)
        if getattr(self.transform, "reads_captions", False):  # CaptionAugment: flips and colours the captions allow
            image = self.transform(image, entry.captions)
        elif self.transform is not None:
            image = self.transform(image)
        return {
            "image": image,
            "caption": entry.captions[0],
            "references": list(entry.captions),
            "image_id": entry.image_id,
        }


KARPATHY_SPLITS = ("train", "restval", "val", "test")
_IMAGE_KEYS = ("filename", "split", "sentences")


def _image_id(entry: dict[str, Any], index: int, where: str) -> int:
    key = next((key for key in ("cocoid", "imgid") if key in entry), None)
    return _require_id(entry[key], f"{where} has {key}") if key is not None else index


def _captions(entry: dict[str, Any], where: str) -> tuple[str, ...]:
    captions = []
    for j, sentence in enumerate(_require_list(entry["sentences"], f"{where} has sentences")):
        _require(sentence, ("raw",), f"{where}.sentences[{j}]")
        if not isinstance(sentence["raw"], str):
            raise ValueError(f"{where}.sentences[{j}] has raw={brief(sentence['raw'])}; it must be a string")
        captions.append(sentence["raw"].strip())
    return tuple(captions)


def load_karpathy(path: str | os.PathLike) -> dict[str, list[CocoImage]]:
    """The ``train``, ``restval``, ``val`` and ``test`` images of a Karpathy split file, in file order; ids are
    ``cocoid``, else ``imgid``, else the index, names ``filepath/filename``; images without sentences left out.

    Raises:
        ValueError: a missing or non-JSON file, an entry lacking a field or with a wrong one (naming it).
    """
    path = Path(path)
    if not path.is_file():  # a ValueError, as every other problem with the file
        raise ValueError(f"Karpathy split file not found: {path}")
    data = read_json(path, "Karpathy split file")
    _require(data, ("images",), f"Karpathy split file {path}")

    splits: dict[str, list[CocoImage]] = {split: [] for split in KARPATHY_SPLITS}
    seen: set[int] = set()
    uncaptioned = 0
    for i, entry in enumerate(_require_list(data["images"], f"Karpathy split file {path} has images")):
        where = f"{path}: images[{i}]"
        _require(entry, _IMAGE_KEYS, where)
        split = entry["split"]
        if not isinstance(split, str) or split not in splits:
            raise ValueError(f"{where} has split={brief(split)}; it must be one of {list(KARPATHY_SPLITS)}")
        image_id = _image_id(entry, i, where)
        if image_id in seen:
            raise ValueError(f"{where} repeats image id {image_id}")
        seen.add(image_id)
        file_name = _require_name(entry["filename"], f"{where} has filename")
        if entry.get("filepath"):
            file_name = f"{_require_name(entry['filepath'], f'{where} has filepath')}/{file_name}"
        captions = _captions(entry, where)
        if not captions:
            uncaptioned += 1
            continue
        splits[split].append(CocoImage(image_id, file_name, captions))
    if uncaptioned:
        log.warning("%s: leaving out %d images without sentences", path, uncaptioned)
    return splits
