"""An image file becomes pixels here, for training and for inference alike.

``read_image`` is the one reader: the COCO, Karpathy and ImageFolder datasets, the batch captioner, shard
captioning and the server all call it, so a model sees at inference exactly what it saw in training. It
raises a ``BadImageError`` for a file it cannot use, or returns it (``on_error="skip"``) to a caller that
records the reason and goes on.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Literal, overload

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from vitattn.errors import first_line

__all__ = [
    "IMAGE_EXTENSIONS",
    "BadImageError",
    "read_image",
    "read_many",
    "unreadable_reason",
    "upright_rgb",
]

ImageSource = str | os.PathLike | IO[bytes]

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jfif", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"}
)


class BadImageError(ValueError):
    """An image file that cannot be used; the message is ``<path>: <reason>``.

    Constructed from the message alone too, as PyTorch re-raises a DataLoader worker's error.
    """

    def __init__(self, message: str, path: str | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.path, self.reason = path, reason


@overload
def read_image(source: ImageSource, on_error: Literal["raise"] = "raise") -> Image.Image: ...


@overload
def read_image(source: ImageSource, on_error: Literal["skip"]) -> Image.Image | BadImageError: ...


def read_image(source: ImageSource, on_error: Literal["raise", "skip"] = "raise") -> Image.Image | BadImageError:
    """Read an image file (a path, or an open binary file such as ``io.BytesIO``) as an upright 8-bit RGB image.

    EXIF orientation is applied; transparency is composited on white; 16-bit and 32-bit grey is
    scaled (not clipped) to 8 bits; animations give their first frame. An image over PIL's
    decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is refused, warning or not.

    Args:
        source: the file.
        on_error: what a file that cannot be used gives: ``raise`` raises a ``BadImageError`` naming the file
            and the reason (datasets, the Python API); ``skip`` returns that error instead, for a caller that
            records it and goes on with the rest (a batch of files, a server request).

    Raises:
        BadImageError: the file cannot be used (``on_error="raise"``).
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
    """``read(path)`` of each distinct path, by a pool of ``threads`` (default: the cores, at most 16);
    PIL decodes without the GIL.

    Returns:
        ``(results, bad)``: path -> what ``read`` returned, and path -> why the file cannot be read (a
        ``BadImageError`` from ``read``), both in the order of ``paths``.
    """
    unique = list(dict.fromkeys(str(p) for p in paths))
    threads = threads or max(1, min(16, len(os.sched_getaffinity(0))))

    def attempt(path: str) -> tuple[Any, str | None]:
        try:
            return read(path), None
        except BadImageError as err:
            return None, err.reason or str(err)

    results: dict[str, Any] = {}
    bad: dict[str, str] = {}
    with ThreadPoolExecutor(threads) as pool:
        for path, (result, reason) in zip(unique, pool.map(attempt, unique)):
            if reason is None:
                results[path] = result
            else:
                bad[path] = reason
    return results, bad


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
