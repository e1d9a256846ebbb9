"""Small public datasets for ``benchmarks/learning_bench.py``, prepared from Debian packages without root.

    python -m benchmarks learning-data                        # both datasets at 32 px into bench_data/
    python -m benchmarks learning-data --datasets emoji --img-size 48

Packages are fetched with ``apt-get download`` and unpacked with ``dpkg-deb -x`` into
``CACHE/debs`` and ``CACHE/root`` (no root needed, nothing installed). Each dataset is written as

    ROOT/train/<class>/<name>.png, ROOT/val/<class>/<name>.png   a torchvision ImageFolder tree
    ROOT/captions_train.json, ROOT/captions_val.json             COCO captions, file_name relative to ROOT
    ROOT/dataset.json                                            source, licence, counts, parameters

with ``ROOT = CACHE/<dataset>-<img_size>px-seed<seed>``. Images are the drawing cropped to its
visible pixels, padded to a square and flattened on white (``--keep-aspect``: not padded, the longer side
``img_size``, in ``<dataset>-<img_size>px-aspect-seed<seed>``); the split is stratified by class and
fixed by the seed. A dataset whose ``dataset.json`` records the same parameters is reused as it is.

Datasets:
    tuxpaint  Tux Paint's stamps (tuxpaint-stamps-default, GPL-2): ~950 clip-art drawings in 16
              folders (the class), each with a one-sentence English description (the caption).
    emoji     Noto Color Emoji (fonts-noto-color-emoji, OFL-1.1 / Apache-2.0) rendered with Pillow,
              named and grouped by Unicode's emoji-test.txt (unicode-data, Unicode licence): ~3,600
              emoji in 9 groups (the class), their CLDR names ("waving hand: medium skin tone") as captions.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import subprocess
import tempfile
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image, ImageDraw, ImageFont, features

FORMAT = "vitattn-learning-data/1"
DEFAULT_CACHE = Path(__file__).resolve().parents[1] / "bench_data"
VAL_FRACTION = 0.2

TUXPAINT_PACKAGES = ("tuxpaint-stamps-default",)
EMOJI_PACKAGES = ("fonts-noto-color-emoji", "unicode-data")
SVG_PACKAGES = ("librsvg2-bin", "librsvg2-2")  # rsvg-convert, only when it is not on PATH

_TUXPAINT_DIR = "usr/share/tuxpaint/stamps"
_EMOJI_FONT = "usr/share/fonts/truetype/noto/NotoColorEmoji.ttf"
_EMOJI_TEST = "usr/share/unicode/emoji/emoji-test.txt"
_EMOJI_STRIKE = 109  # the only bitmap size in Noto Color Emoji
_TRANSLATION = re.compile(r"^[a-z]{2,3}(_[A-Z]{2})?(@\w+)?\.utf8=")
_SOURCE_PIXELS = 128  # SVGs are rendered this large before the common downscale


class DataError(RuntimeError):
    """A dataset cannot be fetched or prepared; the message says what to do."""


@dataclass(frozen=True)
class Item:
    """One image of a dataset: a unique file stem, its class, its captions, how to draw it (RGBA)."""

    name: str
    label: str
    captions: tuple[str, ...]
    load: Callable[[], Image.Image]


@dataclass
class PreparedDataset:
    """A dataset written by ``write_dataset``: where it is and what it holds."""

    name: str
    root: Path
    classes: list[str]
    num_train: int
    num_val: int
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def train_annotations(self) -> Path:
        return self.root / "captions_train.json"

    @property
    def val_annotations(self) -> Path:
        return self.root / "captions_val.json"

    @classmethod
    def load(cls, root: Path) -> PreparedDataset:
        """Read ``root/dataset.json``."""
        info = json.loads((root / "dataset.json").read_text(encoding="utf-8"))
        return cls(info["name"], root, info["classes"], info["num_train"], info["num_val"], info)


def fetch_packages(packages: Sequence[str], cache: Path) -> Path:
    """Download ``packages`` (``apt-get download``) and unpack them (``dpkg-deb -x``) under ``cache``.

    Returns:
        ``cache/root``, the folder the packages' files are unpacked into (``usr/share/...``).

    Raises:
        DataError: a package cannot be downloaded or unpacked; the message says how to pre-fetch it.
    """
    debs, root = cache / "debs", cache / "root"
    debs.mkdir(parents=True, exist_ok=True)
    root.mkdir(parents=True, exist_ok=True)
    for package in packages:
        marker = root / f".{package}.unpacked"
        if marker.is_file():
            continue
        deb = _find_deb(debs, package) or _download(package, debs)
        _run(["dpkg-deb", "-x", str(deb), str(root)], f"cannot unpack {deb.name}")
        marker.write_text(deb.name + "\n")
    return root


def _find_deb(debs: Path, package: str) -> Path | None:
    found = sorted(debs.glob(f"{package}_*.deb"))
    return found[-1] if found else None


def _download(package: str, debs: Path) -> Path:
    hint = f"fetch it where Debian's archive is reachable (apt-get download {package}) and put the .deb in {debs}/"
    if shutil.which("apt-get") is None:
        raise DataError(f"cannot download Debian package {package}: apt-get is not installed; {hint}")
    try:
        _run(["apt-get", "download", package], f"apt-get download {package} failed", cwd=debs)
    except DataError as err:
        raise DataError(f"cannot download Debian package {package} ({err}); {hint}") from None
    deb = _find_deb(debs, package)
    if deb is None:
        raise DataError(f"apt-get download {package} left no {package}_*.deb in {debs}; {hint}")
    return deb


def _run(cmd: list[str], what: str, cwd: Path | None = None, env: dict[str, str] | None = None) -> str:
    """Run ``cmd``; a non-zero exit or a missing program is a one-line ``DataError``."""
    try:
        done = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, check=False)
    except OSError as err:
        raise DataError(f"{what}: {err.strerror}: {cmd[0]}") from None
    if done.returncode != 0:
        lines = [ln for ln in (done.stderr + done.stdout).splitlines() if ln.strip() and not ln.startswith("W: ")]
        raise DataError(f"{what}: {lines[-1].strip() if lines else f'exit status {done.returncode}'}")
    return done.stdout


def package_version(cache: Path, package: str) -> str:
    """The version of the cached ``.deb`` of ``package`` (from its file name), or "?"."""
    deb = _find_deb(cache / "debs", package)
    return deb.name.split("_")[1] if deb else "?"


def square_on_white(image: Image.Image, size: int) -> Image.Image:
    """Crop an image to its visible pixels, pad it to a centred square, flatten it on white, resize.

    Returns:
        A ``size`` x ``size`` RGB image.
    """
    rgba = image.convert("RGBA")
    box = rgba.getchannel("A").getbbox() or (0, 0, *rgba.size)
    rgba = rgba.crop(box)
    side = max(rgba.size)
    canvas = Image.new("RGBA", (side, side), (255, 255, 255, 255))
    canvas.alpha_composite(rgba, ((side - rgba.width) // 2, (side - rgba.height) // 2))
    return canvas.convert("RGB").resize((size, size), Image.Resampling.LANCZOS)


def aspect_on_white(image: Image.Image, size: int) -> Image.Image:
    """Crop an image to its visible pixels, flatten it on white and resize it, its aspect ratio kept, so that its
    longer side is ``size`` (the other at least 1): ``square_on_white`` without the padding (issue 69's sets).

    Returns:
        An RGB image whose longer side is ``size``.
    """
    rgba = image.convert("RGBA")
    box = rgba.getchannel("A").getbbox() or (0, 0, *rgba.size)
    rgba = rgba.crop(box)
    canvas = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
    canvas.alpha_composite(rgba)
    scale = size / max(rgba.size)
    width, height = max(1, round(rgba.width * scale)), max(1, round(rgba.height * scale))
    return canvas.convert("RGB").resize((width, height), Image.Resampling.LANCZOS)


def _open_rgba(path: Path) -> Image.Image:
    with Image.open(path) as image:
        return image.convert("RGBA")


def svg_renderer(cache: Path) -> Callable[[Path], Image.Image] | None:
    """A function drawing an SVG file as an RGBA image with ``rsvg-convert``, or None.

    ``rsvg-convert`` is taken from PATH, else from Debian's ``librsvg2-bin`` unpacked into the cache
    (with its library on ``LD_LIBRARY_PATH``). None when neither runs.
    """
    env = dict(os.environ)
    program = shutil.which("rsvg-convert")
    if program is None:
        try:
            root = fetch_packages(SVG_PACKAGES, cache)
        except DataError:
            return None
        program = str(root / "usr/bin/rsvg-convert")
        libs = [str(p) for p in (root / "usr/lib").glob("*-linux-gnu")]
        env["LD_LIBRARY_PATH"] = os.pathsep.join([*libs, env.get("LD_LIBRARY_PATH", "")]).rstrip(os.pathsep)
    try:
        _run([program, "--version"], "rsvg-convert", env=env)
    except DataError:
        return None

    def render(path: Path) -> Image.Image:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "image.png"
            size = str(_SOURCE_PIXELS)
            _run([program, "-w", size, "-h", size, "-a", "-o", str(out), str(path)], f"cannot render {path}", env=env)
            return _open_rgba(out)

    return render


def tuxpaint_descriptions(text: str) -> tuple[str, ...]:
    """The English captions of a Tux Paint stamp ``.txt``: its first line, then distinct ``en_*`` lines."""
    captions: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line:
            continue
        if not _TRANSLATION.match(line):
            if not captions:
                captions.append(line)
        elif line.startswith("en_"):
            captions.append(line.split("=", 1)[1].strip())
    return tuple(dict.fromkeys(c for c in captions if c))


def tuxpaint_items(root: Path, render_svg: Callable[[Path], Image.Image] | None) -> tuple[list[Item], dict[str, int]]:
    """Every stamp with a description: class = top folder, captions from its ``.txt``.

    A stamp is its ``.png`` (or ``.svg`` when there is no PNG); ``*_mirror`` images are the stamps'
    flipped copies and have no description. SVG-only stamps are skipped when ``render_svg`` is None.

    Returns:
        The items and counts of what was left out.
    """
    stamps = root / _TUXPAINT_DIR
    if not stamps.is_dir():
        raise DataError(f"{stamps} is missing: the tuxpaint-stamps-default package did not unpack there")
    items, skipped = [], defaultdict(int)
    for txt in sorted(stamps.rglob("*.txt")):
        png, svg = txt.with_suffix(".png"), txt.with_suffix(".svg")
        captions = tuxpaint_descriptions(txt.read_text(encoding="utf-8", errors="replace"))
        if not captions:
            skipped["no English description"] += 1
            continue
        if png.is_file():
            load = lambda p=png: _open_rgba(p)  # noqa: E731
        elif svg.is_file() and render_svg is not None:
            load = lambda p=svg: render_svg(p)  # noqa: E731
        elif svg.is_file():
            skipped["SVG only, no rsvg-convert"] += 1
            continue
        else:
            skipped["description without an image"] += 1
            continue
        rel = txt.relative_to(stamps).with_suffix("")
        name = "_".join(rel.parts[1:]) or rel.parts[0]
        items.append(Item(_slug(name), rel.parts[0], captions, load))
    return items, dict(skipped)


def parse_emoji_test(text: str) -> list[tuple[str, str, str]]:
    """``(emoji, group, name)`` of every fully-qualified emoji in Unicode's ``emoji-test.txt``."""
    group, out = "", []
    for line in text.splitlines():
        if line.startswith("# group:"):
            group = line.split(":", 1)[1].strip()
        elif "; fully-qualified" in line and "#" in line:
            comment = line.split("#", 1)[1].strip()  # "😀 E1.0 grinning face"
            parts = comment.split(" ", 2)
            if len(parts) == 3:
                out.append((parts[0], group, parts[2]))
    return out


def emoji_items(root: Path) -> tuple[list[Item], dict[str, int]]:
    """Noto Color Emoji glyphs: class = Unicode emoji group (Component left out), caption = CLDR name.

    Sequences (skin tones, ZWJ families, flags) need Pillow's raqm layout; without it, and for any
    sequence the font draws as more than one glyph, the emoji is skipped.
    """
    font_path, test_path = root / _EMOJI_FONT, root / _EMOJI_TEST
    for path in (font_path, test_path):
        if not path.is_file():
            raise DataError(f"{path} is missing: the emoji packages {EMOJI_PACKAGES} did not unpack there")
    raqm = features.check("raqm")
    layout = ImageFont.Layout.RAQM if raqm else ImageFont.Layout.BASIC
    font = ImageFont.truetype(str(font_path), _EMOJI_STRIKE, layout_engine=layout)
    one_glyph = font.getlength("\U0001f600") * 1.5
    items, skipped = [], defaultdict(int)
    for text, group, name in parse_emoji_test(test_path.read_text(encoding="utf-8")):
        if group == "Component":
            skipped["Component group (bare skin tones, hair styles)"] += 1
            continue
        single = len(text.replace("\ufe0f", "")) == 1
        if not (raqm or single) or font.getlength(text) > one_glyph:
            skipped["not one glyph in this font or layout"] += 1
            continue
        file_stem = "-".join(f"{ord(c):x}" for c in text if c != "\ufe0f")
        items.append(Item(file_stem, _slug(group), (name,), lambda t=text: _draw_emoji(font, t)))
    return items, dict(skipped)


def _draw_emoji(font: ImageFont.FreeTypeFont, text: str) -> Image.Image:
    left, top, right, bottom = font.getbbox(text)
    image = Image.new("RGBA", (right - left + 8, bottom - top + 8), (0, 0, 0, 0))
    ImageDraw.Draw(image).text((4 - left, 4 - top), text, font=font, embedded_color=True)
    return image


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "x"


def split_items(items: Sequence[Item], val_fraction: float, seed: int) -> dict[str, list[Item]]:
    """Stratified, seeded train/val split: each class keeps at least one image on both sides.

    Classes with a single image are left out (ImageFolder needs the same classes in both splits).
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction={val_fraction} must be between 0 and 1")
    by_class: dict[str, list[Item]] = defaultdict(list)
    for item in items:
        by_class[item.label].append(item)
    splits: dict[str, list[Item]] = {"train": [], "val": []}
    for label in sorted(by_class):
        members = sorted(by_class[label], key=lambda it: it.name)
        if len(members) < 2:
            continue
        random.Random(f"{seed}/{label}").shuffle(members)
        n_val = min(len(members) - 1, max(1, round(val_fraction * len(members))))
        splits["val"] += members[:n_val]
        splits["train"] += members[n_val:]
    return splits


def write_dataset(
    out: Path,
    name: str,
    items: Sequence[Item],
    img_size: int,
    seed: int = 0,
    val_fraction: float = VAL_FRACTION,
    info: dict[str, Any] | None = None,
    keep_aspect: bool = False,
) -> PreparedDataset:
    """Write ``items`` as an ImageFolder tree plus COCO caption files under ``out`` (see the module doc);
    ``keep_aspect``: each image not padded square, its longer side ``img_size`` (``aspect_on_white``).

    ``dataset.json`` is written last, so a folder that has one is complete.
    """
    draw = aspect_on_white if keep_aspect else square_on_white
    names = [(it.label, it.name) for it in items]
    if len(set(names)) != len(names):
        raise ValueError(f"{name}: two items share a class and a name")
    if out.exists():
        shutil.rmtree(out)
    splits = split_items(items, val_fraction, seed)
    next_id = 1
    for split, members in splits.items():
        images, annotations = [], []
        for item in members:
            rel = Path(split) / item.label / f"{item.name}.png"
            (out / rel).parent.mkdir(parents=True, exist_ok=True)
            draw(item.load(), img_size).save(out / rel)
            images.append({"id": next_id, "file_name": rel.as_posix()})
            for caption in item.captions:
                annotations.append({"id": len(annotations) + 1, "image_id": next_id, "caption": caption})
            next_id += 1
        coco = {"info": {"description": f"{name} {split}"}, "images": images, "annotations": annotations}
        (out / f"captions_{split}.json").write_text(json.dumps(coco, ensure_ascii=False, indent=0) + "\n")
    classes = sorted({it.label for it in splits["train"]})
    record = {
        "format": FORMAT,
        "name": name,
        **(info or {}),
        "img_size": img_size,
        "keep_aspect": keep_aspect,
        "seed": seed,
        "val_fraction": val_fraction,
        "classes": classes,
        "num_train": len(splits["train"]),
        "num_val": len(splits["val"]),
        "per_class": {c: sum(it.label == c for it in splits["train"] + splits["val"]) for c in classes},
    }
    (out / "dataset.json").write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n")
    return PreparedDataset(name, out, classes, record["num_train"], record["num_val"], record)


DATASETS: dict[str, dict[str, Any]] = {
    "tuxpaint": {
        "packages": TUXPAINT_PACKAGES,
        "licence": "GPL-2.0-or-later (Tux Paint stamps, Bill Kendrick and contributors)",
        "source": "Debian package tuxpaint-stamps-default: PNG/SVG stamps and their .txt descriptions",
    },
    "emoji": {
        "packages": EMOJI_PACKAGES,
        "licence": "Noto Color Emoji: OFL-1.1 (font), Apache-2.0 (images); emoji-test.txt: Unicode licence",
        "source": "Debian packages fonts-noto-color-emoji (rendered with Pillow) and unicode-data (emoji-test.txt)",
    },
}


def prepare(
    name: str, img_size: int = 32, seed: int = 0, cache: Path = DEFAULT_CACHE, keep_aspect: bool = False
) -> PreparedDataset:
    """Fetch, unpack and write dataset ``name`` (reusing a finished one with the same parameters); ``keep_aspect``:
    not padded square, the longer side ``img_size`` (a folder of its own, ``NAME-SIZEpx-aspect-seedS``).

    Raises:
        DataError: a package cannot be fetched or does not hold what the dataset needs.
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose from {sorted(DATASETS)}")
    spec = DATASETS[name]
    out = cache / f"{name}-{img_size}px{'-aspect' if keep_aspect else ''}-seed{seed}"
    if (out / "dataset.json").is_file():
        done = PreparedDataset.load(out)
        if done.info.get("format") == FORMAT and done.info.get("val_fraction") == VAL_FRACTION:
            return done
    root = fetch_packages(spec["packages"], cache)
    if name == "tuxpaint":
        items, skipped = tuxpaint_items(root, svg_renderer(cache))
    else:
        items, skipped = emoji_items(root)
    info = {
        "packages": {p: package_version(cache, p) for p in spec["packages"]},
        "licence": spec["licence"],
        "source": spec["source"],
        "skipped": skipped,
    }
    return write_dataset(out, name, items, img_size, seed, VAL_FRACTION, info, keep_aspect)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--datasets", nargs="+", choices=sorted(DATASETS), default=sorted(DATASETS))
    p.add_argument("--img-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="download and output folder (bench_data/)")
    p.add_argument("--keep-aspect", action="store_true", help="not padded square: the longer side --img-size")


def run(args: argparse.Namespace) -> None:
    for name in args.datasets:
        ds = prepare(name, args.img_size, args.seed, args.cache, args.keep_aspect)
        print(f"{name}: {ds.root} ({len(ds.classes)} classes, {ds.num_train} train, {ds.num_val} val)")
