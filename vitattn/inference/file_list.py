"""What to caption: a folder, a glob, a text list, a COCO file or paths, listed as ``InputImage``s held as one
``str`` per image (``InputList``): a million files cost one list of paths, not several.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

from vitattn.data.coco import _require_id, _require_name
from vitattn.data.images import IMAGE_EXTENSIONS
from vitattn.errors import printable
from vitattn.fileio import read_json

__all__ = ["InputImage", "InputList", "list_inputs"]


@dataclass(frozen=True)
class InputImage:
    """One image to caption: its path as listed (the output key) and its id."""

    path: str
    image_id: int


class InputList(Sequence[InputImage]):
    """``InputImage``s stored as a list of paths and, unless they are 0, 1, ..., a list of ids."""

    def __init__(self, paths: list[str], ids: list[int] | None = None) -> None:
        if ids is not None and len(ids) != len(paths):
            raise ValueError(f"{len(ids)} ids for {len(paths)} paths")
        self.paths = paths
        self.ids = ids

    def __len__(self) -> int:
        return len(self.paths)

    @overload
    def __getitem__(self, i: int) -> InputImage: ...
    @overload
    def __getitem__(self, i: slice) -> InputList: ...
    def __getitem__(self, i: int | slice) -> InputImage | InputList:
        if isinstance(i, slice):
            return InputList(self.paths[i], None if self.ids is None else self.ids[i])
        return InputImage(self.paths[i], i if self.ids is None else self.ids[i])

    @classmethod
    def unique(cls, inputs: Sequence[InputImage]) -> InputList:
        """``inputs`` with each path once (the first kept); an ``InputList`` from ``list_inputs`` is already."""
        if isinstance(inputs, InputList):
            return inputs
        first: dict[str, int] = {}
        for x in inputs:
            first.setdefault(x.path, x.image_id)
        return cls(list(first), list(first.values()))


def list_inputs(
    images: str | os.PathLike | Sequence[str | os.PathLike], image_dir: str | os.PathLike | None = None
) -> InputList:
    """The images named by ``images``, each once: a folder (searched recursively, hidden names skipped), a glob, a
    text file of paths (``#`` comments), a COCO JSON file (``images[].file_name`` and ``.id``), one image, or a
    sequence of paths. ``image_dir``: what COCO and relative text-list paths are relative to (default: the COCO
    file's folder, the current one). COCO files keep their order and ids; the rest is sorted, numbered from 0.
    """
    if not isinstance(images, (str, os.PathLike)):
        return InputList(list(dict.fromkeys(str(p) for p in images)))  # each once, in order
    spec = str(images)
    path, shown = Path(spec), printable(spec)
    if path.is_dir():
        found = _walk_images(path, shown)
        if not found:
            raise ValueError(
                f"images={shown}: no files with an image extension ({', '.join(sorted(IMAGE_EXTENSIONS))})"
            )
        found.sort()
        return InputList(found)  # a walk lists each path once
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".json":
            return _coco_inputs(path, image_dir)
        if suffix in IMAGE_EXTENSIONS:
            return InputList([spec])
        return InputList(sorted(set(_text_list(path, image_dir))))
    if set("*?[") & set(spec):  # a glob
        found = glob.glob(spec, recursive=True)
        if not found:
            raise ValueError(f"images={shown}: the glob matches no files")
        return InputList(sorted(set(found)))
    raise FileNotFoundError(f"images={shown}: no such folder, file or glob")


def _walk_images(root: Path, shown: str) -> list[str]:
    """Image paths under ``root``, hidden names skipped, links to folders not followed; a folder that cannot be
    read is a ``ValueError`` (its images would be missing from the list)."""

    def refuse(err: OSError) -> None:
        raise ValueError(
            f"images={shown}: cannot read the folder {printable(str(err.filename))} ({err.strerror or err}); "
            "fix its permissions or name the images another way"
        ) from None

    found: list[str] = []
    for folder, dirs, files in os.walk(root, onerror=refuse):
        names = [name for name in dirs + files if not name.startswith(".")]
        images = {name for name in names if os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS}
        found += [os.path.join(folder, name) for name in images]  # a folder named like an image too: an error record
        dirs[:] = [name for name in dirs if name in names and name not in images]
    return found


def _text_list(path: Path, image_dir: str | os.PathLike | None) -> list[str]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError:
        raise ValueError(
            f"images={path} is neither an image, a folder, a COCO .json nor a UTF-8 text list of paths"
        ) from None
    paths = []
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        paths.append(str(Path(image_dir) / line) if image_dir is not None and not os.path.isabs(line) else line)
    if not paths:
        raise ValueError(f"images={path}: the list names no images")
    return paths


def _coco_inputs(path: Path, image_dir: str | os.PathLike | None) -> InputList:
    data = read_json(path, "images file")
    entries = data.get("images") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"images={path}: a COCO file needs an 'images' list of {{'id', 'file_name'}}")
    root = Path(image_dir) if image_dir is not None else path.parent
    first: dict[str, int] = {}
    ids: set[int] = set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "file_name" not in entry or "id" not in entry:
            raise ValueError(f"images={path}: images[{i}] needs 'id' and 'file_name'")
        p = str(root / _require_name(entry["file_name"], f"images={path}: images[{i}] has file_name"))
        if p in first:  # the same image listed again is captioned once
            continue
        image_id = _require_id(entry["id"], f"images={path}: images[{i}] has id")
        if image_id in ids:
            raise ValueError(f"images={path}: images[{i}] repeats id={image_id} for another file")
        ids.add(image_id)
        first[p] = image_id
    if not first:
        raise ValueError(f"images={path}: the COCO file lists no images")
    return InputList(list(first), list(first.values()))
