"""An image file becomes pixels here (``read_image``, for training and inference alike, so a model sees at
inference exactly what it saw in training); image folders, the image cache (``data.cache``) and ``EvalSplit``."""

from __future__ import annotations

import logging
import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, overload

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError
from torch.utils.data import DataLoader
from torchvision.datasets import ImageFolder

from vitattn.errors import first_line

__all__ = [
    "AUTO_LIMIT_BYTES",
    "BadImageError",
    "CACHE_MODES",
    "EvalSplit",
    "IMAGE_EXTENSIONS",
    "image_folder_split",
    "ImageCache",
    "open_image_folder",
    "read_image",
    "read_many",
    "should_cache",
    "SPLITS",
    "check_split",
    "unreadable_reason",
    "upright_rgb",
]

log = logging.getLogger(__name__)

ImageSource = str | os.PathLike | IO[bytes]

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jfif", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"}
)


class BadImageError(ValueError):
    """An image file that cannot be used: ``<path>: <reason>`` (from the message alone too, as PyTorch re-raises
    a DataLoader worker's error)."""

    def __init__(self, message: str, path: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.path, self.reason = path, reason


@overload
def read_image(source: ImageSource, on_error: Literal["raise"] = "raise") -> Image.Image: ...


@overload
def read_image(source: ImageSource, on_error: Literal["skip"]) -> Image.Image | BadImageError: ...


def read_image(source: ImageSource, on_error: Literal["raise", "skip"] = "raise") -> Image.Image | BadImageError:
    """A path or open binary file as an upright 8-bit RGB image: EXIF orientation applied, transparency on white,
    16- and 32-bit grey scaled to 8 bits, an animation's first frame; over PIL's bomb limit refused.

    Raises:
        BadImageError: the file cannot be used; ``on_error="skip"`` returns it instead (a caller that goes on).
    """
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            warnings.filterwarnings("ignore", category=UserWarning, module="PIL")
            with Image.open(source) as image:
                image.load()  # first frame; raises here for truncated or corrupt data
                ImageOps.exif_transpose(image, in_place=True)  # the image is this function's own: no copy
                return _to_rgb(image)
    except Exception as err:  # noqa: BLE001 - any unreadable file (bomb warnings too) becomes the one-line reason
        reason = unreadable_reason(source, err)
        name = str(source) if isinstance(source, (str, os.PathLike)) else str(getattr(source, "name", "image"))
        error = BadImageError(f"{name}: {reason}", name, reason)
    if on_error == "skip":
        return error
    raise error


def upright_rgb(image: Image.Image) -> Image.Image:
    """An image already in memory as ``read_image`` makes a file's: EXIF orientation applied, 8-bit RGB."""
    return _to_rgb(ImageOps.exif_transpose(image))  # a copy; the caller's image is left as it is


def read_many(
    paths: Sequence[str | os.PathLike], read: Callable[[str], Any] = read_image, threads: int = 0
) -> tuple[dict[str, Any], dict[str, str]]:
    """``(results, bad)``: ``read(path)`` of each distinct path by ``threads`` threads (default: the cores, at most
    16; PIL decodes without the GIL), and path -> reason for the files ``read`` refused (``BadImageError``)."""
    unique = list(dict.fromkeys(str(p) for p in paths))
    threads = threads or max(1, min(16, len(os.sched_getaffinity(0))))

    def attempt(path: str) -> tuple[Any, str | None]:
        try:
            return read(path), None
        except BadImageError as err:
            return None, err.reason or str(err)

    with ThreadPoolExecutor(threads) as pool:
        outcomes = dict(zip(unique, pool.map(attempt, unique)))
    bad = {path: reason for path, (_, reason) in outcomes.items() if reason is not None}
    return {path: result for path, (result, reason) in outcomes.items() if reason is None}, bad


def _to_rgb(image: Image.Image) -> Image.Image:
    mode = image.mode
    if mode.startswith("I;16") or mode in ("I", "F"):
        a = np.asarray(image, dtype=np.float64)
        if mode.startswith("I;16"):
            a = a / 257.0  # 65535 -> 255
        elif mode == "F" and a.size and a.max() <= 1.0:
            a = a * 255.0
        elif a.size and a.max() > 255:
            a = a / 257.0 if a.max() <= 65535 else a * (255.0 / a.max())
        return Image.fromarray(np.clip(np.rint(a), 0, 255).astype(np.uint8), "L").convert("RGB")
    if mode in ("RGBA", "LA", "La", "RGBa", "PA") or (mode == "P" and "transparency" in image.info):
        rgba = image.convert("RGBA")
        white = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, rgba).convert("RGB")
    return image if mode == "RGB" else image.convert("RGB")


def unreadable_reason(path: str | os.PathLike | IO[bytes], err: BaseException) -> str:
    """A short one-line reason why ``path`` (a path, or an open binary file) could not be read."""
    if isinstance(err, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb refused: {first_line(err, limit=200)}"
    on_disk = isinstance(path, (str, os.PathLike))
    if on_disk and (isinstance(err, IsADirectoryError) or os.path.isdir(path)):
        return "is a directory, not an image file"
    if isinstance(err, FileNotFoundError):
        return "file not found"
    if isinstance(err, PermissionError):
        return "permission denied"
    if isinstance(err, UnidentifiedImageError):
        try:
            size = os.path.getsize(path) if on_disk else path.seek(0, os.SEEK_END)
        except OSError:
            return "file not found"
        return "empty file (0 bytes)" if size == 0 else "not an image (unrecognised file format)"
    return f"unreadable image: {first_line(err, limit=200)}"


def image_folder_split(root: str | os.PathLike, split: str) -> Path:
    """The folder of ``split`` under an ImageFolder ``root``: ``root/<split>``; ``test`` falls back to
    ``root/val`` when ``root/test`` does not exist (training then tests on val)."""
    root = Path(root)
    if split == "test" and not (root / "test").exists():
        return root / "val"
    return root / split


def _is_image_file(path: str) -> bool:
    name = os.path.basename(path)
    return not name.startswith(".") and os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def open_image_folder(directory: str | os.PathLike, transform: Callable[[Any], Any] | None = None) -> ImageFolder:
    """``directory/<class>/<image>`` as a torchvision ``ImageFolder`` read with ``read_image``, the captioner's
    ``IMAGE_EXTENSIONS``, hidden files skipped; listing reads no image."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"image folder not found: {directory} (expected {directory}/<class>/<image>)")
    try:
        return ImageFolder(directory, transform=transform, loader=read_image, is_valid_file=_is_image_file)
    except FileNotFoundError as err:  # torchvision's word for "no class folders" or "no images"
        raise ValueError(f"image folder {directory} is empty: {err}") from None


CACHE_MODES = ("auto", "ram", "none")
AUTO_LIMIT_BYTES = 4 << 30


def _available_memory() -> int:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not on this platform
        return AUTO_LIMIT_BYTES * 4


def should_cache(mode: str, num_images: int, side: int) -> bool:
    """Whether ``num_images`` images of about ``side`` x ``side`` pixels are cached under ``mode``."""
    if mode not in CACHE_MODES:
        raise ValueError(f"data.cache={mode!r} is unknown; choose one of {list(CACHE_MODES)}")
    if mode != "auto":
        return mode == "ram"
    need = num_images * 3 * side * side
    return need <= min(AUTO_LIMIT_BYTES, _available_memory() // 4)


class ImageCache:
    """uint8 (height, width, 3) arrays of ``paths`` after the evaluation ``resize``, read once by ``threads``; those
    that cannot be read are kept in ``bad`` (path -> reason). ``load(path)`` gives a PIL image."""

    def __init__(self, paths: Sequence[str], resize: Callable[[Image.Image], Image.Image], threads: int = 0) -> None:
        self.resize = resize
        self.images, self.bad = read_many(paths, self._read, threads or max(1, min(8, os.cpu_count() or 1)))
        nbytes = sum(a.nbytes for a in self.images.values())
        log.info("cached %d images in memory (%.1f MiB)", len(self.images), nbytes / 2**20)

    def _read(self, path: str) -> np.ndarray:
        return np.asarray(self.resize(read_image(path)), dtype=np.uint8).copy()

    def __len__(self) -> int:
        return len(self.images)

    def load(self, path: Any) -> Image.Image:
        """The cached image of ``path`` as a PIL view; raises the ``BadImageError`` of a file that could not be read."""
        key = str(path)
        if key in self.bad:
            raise BadImageError(f"{key}: {self.bad[key]}", key, self.bad[key])
        return Image.fromarray(self.images[key])


SPLITS = ("val", "test")  # the splits evaluation scores; training data never is


def check_split(split: str) -> None:
    """Refuse a split other than ``val`` and ``test`` (training data is never scored)."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is unknown; choose one of {list(SPLITS)}")


@dataclass
class EvalSplit:
    """One split as evaluation sees it: image ``files`` with their ``ids`` (image ids or labels; the caller reads
    them, so an unreadable one is counted), or a ``loader`` of ready batches; ``references`` (image id -> captions)
    for captions, ``synthetic`` when they list every correct caption (exact match is meaningful); ``source``
    names it in reports."""

    source: str
    files: list[str] = field(default_factory=list)
    ids: list[Any] = field(default_factory=list)
    loader: DataLoader | None = None
    references: dict[Any, list[str]] | None = None
    synthetic: bool = False
