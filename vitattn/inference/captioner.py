"""Caption many image files: listing inputs, robust image reading, batched decoding, resumable output.

Dimension letters: B batch, C channels, H/W image side, T' generated tokens.

A bad file never stops a batch: the dataset returns an error string in place of the image, and the
file gets an output record ``{"image", "image_id", "error"}`` instead of a caption. Output is JSON
Lines written whole lines at a time, one ``write`` + ``fsync`` per batch, so a killed run leaves only
complete records; running the same command again captions only the images not yet in the file.
"""

from __future__ import annotations

import csv
import io
import json
import logging
import os
import sys
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError
from torch import Tensor
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm

from vitattn.bundle import Bundle
from vitattn.fileio import atomic_write, read_json

__all__ = [
    "IMAGE_EXTENSIONS",
    "OUTPUT_FORMATS",
    "CaptionBatch",
    "CaptionSummary",
    "ImageFileDataset",
    "InputImage",
    "caption_images",
    "caption_to_file",
    "iter_caption_batches",
    "list_inputs",
    "load_rgb",
    "read_records",
]

log = logging.getLogger(__name__)

IMAGE_EXTENSIONS = frozenset(
    {".jpg", ".jpeg", ".jfif", ".png", ".gif", ".bmp", ".webp", ".tif", ".tiff", ".ppm", ".pgm", ".pbm", ".pnm"}
)
OUTPUT_FORMATS = ("jsonl", "coco", "csv")
_GLOB_CHARS = set("*?[")


@dataclass(frozen=True)
class InputImage:
    """One image to caption: its path as listed (the output key) and its id."""

    path: str
    image_id: int


# ---------------------------------------------------------------------------------------- inputs


def list_inputs(
    images: str | os.PathLike | Sequence[str | os.PathLike], image_dir: str | os.PathLike | None = None
) -> list[InputImage]:
    """The images named by ``images``, each once.

    Args:
        images: a folder (searched recursively for image extensions, hidden names skipped), a glob
            (``photos/**/*.jpg``), a text file with one path per line (``#`` comments allowed), a COCO
            JSON file (``images[].file_name`` and ``images[].id``), a single image, or a sequence of paths.
        image_dir: the folder that COCO ``file_name``s and relative text-list paths are relative to;
            default: the COCO file's folder, and the current folder for text lists.

    Returns:
        ``InputImage``s; COCO files keep their order and ids, other inputs are sorted by path and
        numbered from 0 in that order.
    """
    if not isinstance(images, (str, os.PathLike)):
        return _numbered([str(p) for p in images], sort=False)
    spec = str(images)
    path = Path(spec)
    if path.is_dir():
        found = _walk_images(path)
        if not found:
            raise ValueError(f"images={spec}: no files with an image extension ({', '.join(sorted(IMAGE_EXTENSIONS))})")
        return _numbered(found, sort=True)
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix == ".json":
            return _coco_inputs(path, image_dir)
        if suffix in IMAGE_EXTENSIONS:
            return _numbered([spec], sort=False)
        return _numbered(_text_list(path, image_dir), sort=True)
    if _GLOB_CHARS & set(spec):
        import glob

        found = glob.glob(spec, recursive=True)
        if not found:
            raise ValueError(f"images={spec}: the glob matches no files")
        return _numbered(found, sort=True)
    raise FileNotFoundError(f"images={spec}: no such folder, file or glob")


def _numbered(paths: Sequence[str], sort: bool) -> list[InputImage]:
    unique = list(dict.fromkeys(paths))
    if sort:
        unique.sort()
    return [InputImage(p, i) for i, p in enumerate(unique)]


def _walk_images(root: Path) -> list[str]:
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        # A folder named like an image is listed (it becomes an error record), not searched.
        as_images = [d for d in dirnames if Path(d).suffix.lower() in IMAGE_EXTENSIONS]
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in as_images]
        names = [n for n in filenames if not n.startswith(".") and Path(n).suffix.lower() in IMAGE_EXTENSIONS]
        found += [os.path.join(dirpath, n) for n in names + [d for d in as_images if not d.startswith(".")]]
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


def _coco_inputs(path: Path, image_dir: str | os.PathLike | None) -> list[InputImage]:
    data = read_json(path, "images file")
    entries = data.get("images") if isinstance(data, dict) else None
    if not isinstance(entries, list):
        raise ValueError(f"images={path}: a COCO file needs an 'images' list of {{'id', 'file_name'}}")
    root = Path(image_dir) if image_dir is not None else path.parent
    inputs, seen = [], set()
    for i, entry in enumerate(entries):
        if not isinstance(entry, dict) or "file_name" not in entry or "id" not in entry:
            raise ValueError(f"images={path}: images[{i}] needs 'id' and 'file_name'")
        p = str(root / str(entry["file_name"]))
        if p not in seen:
            seen.add(p)
            inputs.append(InputImage(p, entry["id"]))
    if not inputs:
        raise ValueError(f"images={path}: the COCO file lists no images")
    return inputs


# ---------------------------------------------------------------------------------------- reading


def load_rgb(path: str | os.PathLike) -> Image.Image:
    """Read an image file as an upright 8-bit RGB image.

    EXIF orientation is applied; transparency is composited on white; 16-bit and 32-bit grey is
    scaled (not clipped) to 8 bits; animations give their first frame. An image over PIL's
    decompression-bomb limit (``Image.MAX_IMAGE_PIXELS``) is refused, warning or not.

    Raises:
        OSError, PIL errors, ``Image.DecompressionBombWarning``: the file cannot be used.
    """
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        warnings.filterwarnings("ignore", category=UserWarning, module="PIL")
        with Image.open(path) as image:
            image.load()  # first frame; raises here for truncated or corrupt data
            upright = ImageOps.exif_transpose(image)  # a loaded copy
    return _to_rgb(upright)


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


def _reason(path: str, err: BaseException) -> str:
    """A short one-line reason why ``path`` could not be read."""
    if isinstance(err, (Image.DecompressionBombError, Image.DecompressionBombWarning)):
        return f"decompression bomb refused: {_first_line(err)}"
    if isinstance(err, IsADirectoryError) or os.path.isdir(path):
        return "is a directory, not an image file"
    if isinstance(err, FileNotFoundError):
        return "file not found"
    if isinstance(err, PermissionError):
        return "permission denied"
    if isinstance(err, UnidentifiedImageError):
        try:
            if os.path.getsize(path) == 0:
                return "empty file (0 bytes)"
        except OSError:
            return "file not found"
        return "not an image (unrecognised file format)"
    return f"unreadable image: {_first_line(err)}"


def _first_line(err: BaseException) -> str:
    text = " ".join(str(err).split()) or type(err).__name__
    return text[:200]


class ImageFileDataset(Dataset):
    """Image files as model inputs; ``__getitem__`` never raises.

    Items are ``(index, image)``: ``image`` is the transformed (C, H, W) tensor, or a one-line error
    string when the file could not be read.
    """

    def __init__(self, paths: Sequence[str], transform: Any) -> None:
        self.paths = list(paths)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[int, Tensor | str]:
        path = self.paths[index]
        try:
            return index, self.transform(load_rgb(path))
        except Exception as err:  # noqa: BLE001 - any failure (bomb warnings too) becomes an error record
            return index, _reason(path, err)


def collate_images(batch: Sequence[tuple[int, Tensor | str]]) -> tuple[list[int], Tensor | None, list[tuple[int, str]]]:
    """``(indices of the images read, (b, C, H, W) images or None, [(index, error)])``."""
    ok = [(i, x) for i, x in batch if isinstance(x, Tensor)]
    errors = [(i, x) for i, x in batch if not isinstance(x, Tensor)]
    images = torch.stack([x for _, x in ok]) if ok else None
    return [i for i, _ in ok], images, errors


# ---------------------------------------------------------------------------------------- captioning


@dataclass
class CaptionBatch:
    """One batch of results.

    Attributes:
        records: one dict per input of the batch, in input order: ``image``, ``image_id`` and
            ``caption`` or ``error``.
        images: (b, C, H, W) the images that were read, on the model's device; None if none were.
        tokens: (b, T') their generated ids (``generate``'s output); None if none were read.
        captioned: for each row of ``images``, its position in ``records``.
    """

    records: list[dict[str, Any]]
    images: Tensor | None
    tokens: Tensor | None
    captioned: list[int]


def iter_caption_batches(
    bundle: Bundle,
    inputs: Sequence[InputImage],
    *,
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
    **generate_kwargs: Any,
) -> Iterator[CaptionBatch]:
    """Read, caption and decode ``inputs`` batch by batch (a ``DataLoader`` with worker processes).

    Args:
        bundle: a caption bundle from ``load_bundle``.
        inputs: the images, e.g. from ``list_inputs``.
        batch_size: images per ``generate`` call.
        num_workers: image-reading processes (0 reads in this process).
        progress: show a tqdm progress bar on stderr.
        **generate_kwargs: passed to ``ImageCaptioner.generate`` (``num_beams``, ``max_new_tokens``,
            ``do_sample``, ``generator``, ...).
    """
    if bundle.task != "caption" or bundle.vocab is None:
        raise ValueError(f"this model is a {bundle.task} bundle; captioning needs a caption bundle")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be non-negative")
    model = bundle.model
    device = next(model.parameters()).device
    loader = DataLoader(
        ImageFileDataset([x.path for x in inputs], bundle.transform),
        batch_size=batch_size,
        shuffle=False,
        num_workers=num_workers,
        collate_fn=collate_images,
        pin_memory=device.type == "cuda",
    )
    with tqdm(total=len(inputs), unit="img", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        for ok, images, errors in loader:
            index = sorted([*ok, *(i for i, _ in errors)])
            pos = {i: p for p, i in enumerate(index)}
            records = [{"image": inputs[i].path, "image_id": inputs[i].image_id} for i in index]
            for i, reason in errors:
                records[pos[i]]["error"] = reason
            tokens = None
            if images is not None:
                images = images.to(device, non_blocking=True)
                # bf16 autocast on GPUs (as the GPU training configs); fp32 on CPUs, where bf16 is slow
                with torch.inference_mode(), torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda"):
                    tokens = model.generate(images, **generate_kwargs)  # (b, T')
                for i, caption in zip(ok, bundle.vocab.decode_batch(tokens)):
                    records[pos[i]]["caption"] = caption
            bar.update(len(records))
            yield CaptionBatch(records, images, tokens, [pos[i] for i in ok])


def caption_images(
    bundle: Bundle,
    paths: Sequence[str | os.PathLike] | Sequence[InputImage],
    batch_size: int = 32,
    num_workers: int = 0,
    progress: bool = False,
    **generate_kwargs: Any,
) -> list[dict[str, Any]]:
    """Caption image files.

    Args:
        bundle: a caption bundle from ``load_bundle``.
        paths: image paths (``image_id`` is the position in this list) or ``InputImage``s.
        batch_size, num_workers, progress: as in ``iter_caption_batches``.
        **generate_kwargs: passed to ``ImageCaptioner.generate``.

    Returns:
        One dict per path, in order: ``{"image", "image_id", "caption"}`` or, for a file that could
        not be read, ``{"image", "image_id", "error"}``.

    Example:
        >>> caption_images(load_bundle("runs/coco/bundle"), ["cat.jpg"], num_beams=3)
        [{'image': 'cat.jpg', 'image_id': 0, 'caption': 'a cat sitting on a couch'}]
    """
    inputs = [p if isinstance(p, InputImage) else InputImage(str(p), i) for i, p in enumerate(paths)]
    results: list[dict[str, Any]] = []
    for batch in iter_caption_batches(
        bundle, inputs, batch_size=batch_size, num_workers=num_workers, progress=progress, **generate_kwargs
    ):
        results += batch.records
    return results


# ---------------------------------------------------------------------------------------- output


@dataclass
class CaptionSummary:
    """What ``caption_to_file`` did: counts over all the inputs, earlier runs' records included."""

    captioned: int
    failed: int
    skipped: int  # already in the output from an earlier run
    out: Path
    records: list[dict[str, Any]]


def read_records(path: str | os.PathLike, repair: bool = False) -> dict[str, dict[str, Any]]:
    """Records of a JSON Lines output file, keyed by image path (the first record of a path wins).

    Args:
        path: the file; missing means no records.
        repair: cut off a trailing partial line (a run killed mid-write) from the file.
    """
    path = Path(path)
    if not path.is_file():
        return {}
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        if repair:
            log.warning(
                "%s: dropping an incomplete last line (%d bytes) left by an interrupted run", path, len(data) - end
            )
            with open(path, "r+b") as f:
                f.truncate(end)
                os.fsync(f.fileno())
        data = data[:end]
    records: dict[str, dict[str, Any]] = {}
    for n, line in enumerate(data.decode("utf-8", errors="replace").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            log.warning("%s:%d is not a JSON record; ignored", path, n)
            continue
        if isinstance(record, dict) and isinstance(record.get("image"), str):
            records.setdefault(record["image"], record)
    return records


def caption_to_file(
    bundle: Bundle,
    inputs: Sequence[InputImage],
    out: str | os.PathLike,
    *,
    format: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    attention_maps: str | os.PathLike | None = None,
    **generate_kwargs: Any,
) -> CaptionSummary:
    """Caption ``inputs`` into ``out``, resuming where an earlier run of the same command stopped.

    Records are appended to a JSON Lines progress file (``out`` itself for ``jsonl``, else
    ``out + ".partial.jsonl"``), one ``write`` and ``fsync`` per batch. Images already recorded there
    (keyed by path) are skipped, so each image appears once. For ``coco`` (``[{"image_id",
    "caption"}]``, successes only) and ``csv`` (``image,image_id,caption,error``) the progress file is
    converted at the end, atomically, and removed.

    Args:
        bundle: a caption bundle.
        inputs: from ``list_inputs``.
        out: the output file.
        format: ``jsonl``, ``coco`` or ``csv``.
        batch_size, num_workers, progress: as in ``iter_caption_batches``.
        attention_maps: a folder for one attention figure per captioned image (``<stem>.png``).
        **generate_kwargs: passed to ``ImageCaptioner.generate``.
    """
    if format not in OUTPUT_FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {list(OUTPUT_FORMATS)}")
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"out={out} is a folder; give a file path")
    out.parent.mkdir(parents=True, exist_ok=True)
    progress_path = out if format == "jsonl" else out.with_name(out.name + ".partial.jsonl")
    first: dict[str, InputImage] = {}
    for x in inputs:
        first.setdefault(x.path, x)  # each path once, the first kept
    inputs = list(first.values())
    figures = _figure_paths(inputs, Path(attention_maps)) if attention_maps is not None else None
    with open(progress_path, "ab") as f:
        _lock(f, progress_path)
        done = read_records(progress_path, repair=True)
        todo = [x for x in inputs if x.path not in done]
        skipped = len(inputs) - len(todo)
        if skipped:
            log.info(
                "%d of %d images are already in %s; captioning the other %d",
                skipped,
                len(inputs),
                progress_path,
                len(todo),
            )
        for batch in iter_caption_batches(
            bundle, todo, batch_size=batch_size, num_workers=num_workers, progress=progress, **generate_kwargs
        ):
            if figures is not None:
                _write_figures(bundle, batch, figures)
            f.write("".join(_json_line(r) for r in batch.records).encode("utf-8"))  # whole lines, one write
            f.flush()
            os.fsync(f.fileno())
            for r in batch.records:
                done.setdefault(r["image"], r)
    records = [done[x.path] for x in inputs]
    if format != "jsonl":
        atomic_write(out, _coco_text(records) if format == "coco" else _csv_text(records))
        progress_path.unlink(missing_ok=True)
    failed = sum("caption" not in r for r in records)
    return CaptionSummary(len(records) - failed, failed, skipped, out, records)


def _lock(f: Any, path: Path) -> None:
    """Hold an exclusive lock on the progress file: two runs appending to it would repeat images."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not on POSIX
        return
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        raise ValueError(f"{path} is being written by another run; wait for it or choose another out=") from None


def _json_line(record: Mapping[str, Any]) -> str:
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a file name that is not valid UTF-8: \u escapes read back to the same str
        line = json.dumps(record)
    return line + "\n"


def _coco_text(records: Sequence[Mapping[str, Any]]) -> str:
    results = [{"image_id": r["image_id"], "caption": r["caption"]} for r in records if "caption" in r]
    return json.dumps(results, ensure_ascii=False, indent=1) + "\n"


def _csv_text(records: Sequence[Mapping[str, Any]]) -> str:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=["image", "image_id", "caption", "error"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
    return buffer.getvalue()


def _figure_paths(inputs: Sequence[InputImage], folder: Path) -> dict[str, Path]:
    """``folder/<stem>.png`` per input; later inputs with a stem already taken get ``<stem>-2.png``, ...
    Computed over all inputs, so a resumed run names each image as the first run did."""
    names: dict[str, Path] = {}
    used: set[str] = set()
    for x in inputs:
        stem = Path(x.path).stem or "image"
        name, n = stem, 1
        while name.lower() in used:
            n += 1
            name = f"{stem}-{n}"
        used.add(name.lower())
        names[x.path] = folder / f"{name}.png"
    return names


def _write_figures(bundle: Bundle, batch: CaptionBatch, figures: Mapping[str, Path]) -> None:
    from vitattn.inference.attention_maps import attention_from_tokens, save_attention_figure

    if batch.images is None:
        return
    cross, rollout = attention_from_tokens(bundle.model, batch.images, batch.tokens)  # (b, T', gh, gw), (b, gh, gw)
    mean = batch.images.new_tensor(bundle.preprocess["mean"]).view(3, 1, 1)
    std = batch.images.new_tensor(bundle.preprocess["std"]).view(3, 1, 1)
    shown = (batch.images * std + mean).clamp(0, 1).cpu()  # (b, 3, H, W) what the model saw
    vocab = bundle.vocab
    for row, pos in enumerate(batch.captioned):
        record = batch.records[pos]
        words = _words(batch.tokens[row].tolist(), vocab)
        path = figures[record["image"]]
        path.parent.mkdir(parents=True, exist_ok=True)
        save_attention_figure(shown[row], words, cross[row], rollout[row], path, title=record.get("caption"))


def _words(ids: Sequence[int], vocab: Any) -> list[str]:
    """Tokens before ``<eos>`` as strings (``<unk>`` kept so words line up with positions)."""
    words = []
    for i in ids:
        if i == vocab.eos_id or i == vocab.pad_id:
            break
        words.append(vocab.itos[i])
    return words
