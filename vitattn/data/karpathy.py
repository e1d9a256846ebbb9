"""Karpathy-split caption files (``dataset_coco.json``, ``dataset_flickr8k.json``, ``dataset_flickr30k.json``).

One JSON object with ``images``: each entry has ``filename``, ``split`` (``train``, ``restval``,
``val`` or ``test``) and ``sentences`` (each with ``raw`` and ``tokens``); COCO entries add
``filepath`` (``val2014``) and ``cocoid``, every entry has ``imgid``. Captions are the stripped
``raw`` sentences: the vocabulary and the metrics tokenize them alike, so ``tokens`` is not read.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from vitattn.data.coco import CocoImage, _require, _require_id, _require_list, _require_name
from vitattn.errors import brief
from vitattn.fileio import read_json

__all__ = ["KARPATHY_SPLITS", "load_karpathy"]

log = logging.getLogger(__name__)

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
    """Parse a Karpathy-split JSON file into its splits' images with their captions.

    The image id is the entry's ``cocoid``, else its ``imgid``, else its index in ``images``; the file
    name is ``filepath/filename`` when the entry has a ``filepath`` (COCO), else ``filename``
    (Flickr). Images without sentences are left out with a warning.

    Returns:
        ``{"train": [...], "restval": [...], "val": [...], "test": [...]}`` in file order.

    Raises:
        ValueError: the file is missing or not JSON, or an entry lacks a field or has a wrong one; the
            one-line message names the file, the entry (``images[3]``) and the field.
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
