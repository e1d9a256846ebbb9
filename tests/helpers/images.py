"""Image files on disk: random image folders, one file of every mode the reader converts, one of every kind it
refuses (corrupt, truncated, empty, decompression bombs)."""

from __future__ import annotations

import random
import struct
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def noisy_image(rng: np.random.Generator, size: int) -> Image.Image:
    colour = rng.integers(0, 256, 3, dtype=np.uint8)
    pixels = np.clip(colour + rng.integers(-20, 20, (size, size, 3)), 0, 255).astype(np.uint8)
    return Image.fromarray(pixels)


def two_colour_images(sizes: list[tuple[int, int]], seed: int) -> list[Image.Image]:
    """An image of each (width, height) in ``sizes``, a random colour on each half: images of mixed aspects whose
    captions differ."""
    rng, images = np.random.default_rng(seed), []
    for w, h in sizes:
        pixels = np.zeros((h, w, 3), dtype=np.uint8)
        pixels[:, : w // 2], pixels[:, w // 2 :] = rng.integers(0, 256, 3), rng.integers(0, 256, 3)
        images.append(Image.fromarray(pixels))
    return images


def make_image_folder(root: Path, classes=("cat", "dog"), per_class: int = 6, size: int = 40) -> Path:
    """``root/{train,val}/<class>/<n>.png`` with random images."""
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for name in classes:
            (root / split / name).mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                noisy_image(rng, size).save(root / split / name / f"{i}.png")
    return root


def png_header(path: Path, width: int, height: int) -> None:
    """A PNG that declares ``width x height`` 1-bit pixels and holds none: a decompression bomb's header."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IEND", b""))


def write_good_images(folder: Path) -> dict[str, tuple]:
    """One image of every mode the reader must convert; name -> (expected size, expected pixel (x, y) -> RGB)."""
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (40, 30), (200, 30, 30)).save(folder / "rgb.jpg", quality=95)
    Image.new("L", (30, 30), 128).save(folder / "gray.png")
    rgba = Image.new("RGBA", (30, 30), (0, 0, 255, 255))
    rgba.paste((0, 0, 0, 0), (0, 0, 15, 30))  # left half fully transparent
    rgba.save(folder / "rgba.png")
    Image.new("RGB", (30, 30), (0, 200, 0)).convert("P", palette=Image.Palette.ADAPTIVE).save(folder / "palette.png")
    Image.new("CMYK", (30, 30), (0, 255, 255, 0)).save(folder / "cmyk.jpg", quality=95)
    Image.fromarray(np.array([[0, 32896, 65535] * 10] * 30, dtype=np.uint16)).save(folder / "gray16.png")
    rotated = Image.new("RGB", (40, 20), (10, 10, 200))
    exif = rotated.getexif()
    exif[0x0112] = 6  # orientation: rotate 90 degrees to display
    rotated.save(folder / "exif_rotated.jpg", exif=exif, quality=95)
    frames = [Image.new("RGB", (30, 30), c) for c in ((255, 0, 0), (0, 0, 255))]
    frames[0].save(folder / "animated.gif", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return {
        "rgb.jpg": ((40, 30), {(5, 5): (200, 30, 30)}),
        "gray.png": ((30, 30), {(5, 5): (128, 128, 128)}),
        "rgba.png": ((30, 30), {(2, 2): (255, 255, 255), (25, 2): (0, 0, 255)}),
        "palette.png": ((30, 30), {(5, 5): (0, 200, 0)}),
        "cmyk.jpg": ((30, 30), {(5, 5): (255, 0, 0)}),
        "gray16.png": ((30, 30), {(0, 0): (0, 0, 0), (1, 0): (128, 128, 128), (2, 0): (255, 255, 255)}),
        "exif_rotated.jpg": ((20, 40), {(5, 5): (10, 10, 200)}),
        "animated.gif": ((30, 30), {(5, 5): (255, 0, 0)}),
    }


def write_bad_images(folder: Path) -> dict[str, str]:
    """One file of every kind that cannot be captioned; name -> a word the error must contain."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "corrupt.jpg").write_bytes(b"\xff\xd8\xff\xe0" + random.Random(0).randbytes(300))
    Image.effect_noise((64, 64), 50).convert("RGB").save(folder / "truncated.png")
    whole = (folder / "truncated.png").read_bytes()
    (folder / "truncated.png").write_bytes(whole[: len(whole) // 2])
    (folder / "empty.png").write_bytes(b"")
    (folder / "notes.jpg").write_text("this is not an image\n")
    png_header(folder / "bomb.png", 30_000, 30_000)  # over twice the limit: DecompressionBombError
    png_header(folder / "bomb_warning.png", 10_000, 10_000)  # over the limit: a warning PIL would let pass
    (folder / "folder.png").mkdir()
    return {
        "corrupt.jpg": "",
        "truncated.png": "truncated",
        "empty.png": "empty",
        "notes.jpg": "not an image",
        "bomb.png": "decompression",
        "bomb_warning.png": "decompression",
        "folder.png": "directory",
    }
