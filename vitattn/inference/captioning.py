"""Captioning image files and shards in batches, with one resumable output engine for both.

Dimension letters: B batch, C channels, T' generated tokens; image sides are written out (height, width).

The work is cut into units, each written whole, atomically, once all of it is captioned: a shard
(``OUTDIR/<shard>.jsonl`` or ``.parquet``) or a chunk of an image list (``OUT.parts/<k>-<digest>.jsonl``, merged
by rank 0 into ``OUT``). A run killed at any moment leaves whole outputs, which the same command skips; every
rank plans from rank 0's one listing of them. Design: docs/captioning.md ("Resumable output").
"""

from __future__ import annotations

import csv
import hashlib
import io
import json
import logging
import os
import shutil
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import torch
from torch import Tensor
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from tqdm.auto import tqdm

from vitattn.bundle import LoadedModel
from vitattn.data.images import BadImageError, ImageSource, read_image
from vitattn.data.preprocess import ImagePatches, batch_images
from vitattn.data.shards import ShardError, read_shard, shard_sizes
from vitattn.data.shards.stream import image_member, sample_caption
from vitattn.fileio import atomic_open
from vitattn.inference.attention_maps import check_figures_runtime, figure_paths, write_figures
from vitattn.inference.candidates import CandidateOptions, candidate_lists, write_manifest
from vitattn.inference.file_list import InputImage, InputList
from vitattn.precision import precision_autocast

try:
    import fcntl
except ImportError:  # pragma: no cover - not on POSIX: the output is not locked
    fcntl = None

__all__ = [
    "FILE_FORMATS",
    "SHARD_FORMATS",
    "CaptionSummary",
    "Processes",
    "assign_units",
    "caption_files",
    "caption_images",
    "caption_shards",
    "generate_tokens",
    "file_batches",
    "launch_processes",
    "manifest_path",
    "read_pixels",
    "shard_output",
    "unfinished_shards",
]

log = logging.getLogger(__name__)

FILE_FORMATS = ("jsonl", "coco", "csv")
SHARD_FORMATS = ("jsonl", "parquet")
CHUNK_BATCHES = 8  # a chunk of an image list: this many batches


def generate_tokens(model: Any, images: Tensor, precision: str = "auto", **generate: Any) -> Tensor:
    """(B, T') ``model.generate(images)`` without autograd, under ``precision``'s autocast on the images' device."""
    with torch.inference_mode(), precision_autocast(precision, images.device):
        return model.generate(images, **generate)


def read_pixels(source: ImageSource, transform: Callable[[Any], Tensor]) -> Tensor | str:
    """An image (path or binary file) as a (C, height, width) model input, or the one-line reason it cannot be read."""
    image = read_image(source, on_error="skip")
    return image.reason if isinstance(image, BadImageError) else transform(image)


@dataclass
class CaptionSummary:
    """What a run did: for image files, counts of every input (``skipped``: done before), for shards this run's;
    ``units``: shards (or chunks) done now, ``units_before`` before."""

    captioned: int
    failed: int
    skipped: int
    out: Path
    units: int = 0
    units_before: int = 0
    manifest: dict[str, Any] | None = None  # candidates: what ``write_manifest`` wrote


@dataclass
class Processes:
    """This process among the captioning ones, and Lightning Fabric's collectives (``fabric`` None: one process)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    fabric: Any = None

    @property
    def is_zero(self) -> bool:
        """Rank 0 holds the lock, lists what is finished, merges and reports."""
        return self.rank == 0

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` (any picklable object), on every rank."""
        return value if self.fabric is None else self.fabric.broadcast(value, src=0)

    def barrier(self, name: str) -> None:
        """Wait until every rank is here."""
        if self.fabric is not None:
            self.fabric.barrier(name)

    def generator(self, seed: int | None) -> torch.Generator | None:
        """A sampling generator on this rank's device seeded ``seed + rank`` (None for no seed)."""
        return None if seed is None else torch.Generator(self.device).manual_seed(seed + self.rank)

    def close(self) -> None:
        """End the process group before the interpreter exits: gloo's threads left to its teardown can abort the
        process ("terminate called without an active exception") after every caption is written."""
        if self.fabric is not None and torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()

    def sum(self, counts: list[int]) -> list[int]:
        """Each of ``counts`` summed over the ranks."""
        if self.fabric is None:
            return list(counts)
        total = self.fabric.all_reduce(torch.tensor(counts, device=self.fabric.device), reduce_op="sum")
        return [int(x) for x in total.cpu()]


def launch_processes(
    *, devices: int = 1, num_nodes: int = 1, accelerator: str = "auto", device: str = "cpu", runtime: str = "torch"
) -> Processes:
    """Start (or join, under ``torchrun`` or ``srun``) ``devices`` x ``num_nodes`` captioning processes with
    Lightning Fabric; an ONNX folder (``runtime`` ``onnx``) runs on CPUs only."""
    if runtime == "onnx":
        if devices * num_nodes > 1 and accelerator not in ("auto", "cpu"):
            raise ValueError(
                "an ONNX folder runs on ONNX Runtime's CPU provider, not on GPUs; caption it on CPU processes "
                "(accelerator=cpu devices=N) or caption the bundle or run folder on GPUs"
            )
        accelerator, device = "cpu", "cpu"
    if devices * num_nodes == 1:
        return Processes(device=torch.device(device))
    from lightning.fabric import Fabric  # Lightning only where several processes caption

    fabric = Fabric(accelerator=accelerator, devices=devices, num_nodes=num_nodes, strategy="ddp")
    fabric.launch()
    return Processes(fabric.global_rank, fabric.world_size, fabric.device, fabric)


def assign_units(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """Unit indices per rank: largest first, each to the rank with the fewest samples so far."""
    load, plans = [0] * world_size, [[] for _ in range(world_size)]
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        plans[rank].append(i)
        load[rank] += sizes[i]
    return plans


@dataclass(frozen=True)
class _Unit:
    """A shard (``shard``, its address) or a chunk (``positions`` in the image list), and its output file."""

    output: Path
    size: int
    shard: str | None = None
    positions: Sequence[int] = ()


class _UnitBatches(IterableDataset):
    """Batches of some units' samples, ``([(unit, row)], (b, C, height, width) pixels or None, rows decoded)``;
    a row None closes its unit. Each DataLoader worker takes whole units, and a batch never holds two units' samples:
    a unit's captions depend on the unit alone, whichever process or worker takes it. ``transform`` may give a
    tuple of inputs (the captioner's and a filter's), each stacked."""

    def __init__(self, units: Sequence[tuple[int, _Unit]], inputs: InputList | None, transform: Any, size: int):
        self.units, self.inputs, self.transform, self.size = list(units), inputs, transform, size

    def __iter__(self) -> Iterator[tuple[list[tuple[int, dict | None]], torch.Tensor | None, list[int]]]:
        info = get_worker_info()
        mine = self.units if info is None else self.units[info.id :: info.num_workers]
        items: list[tuple[int, torch.Tensor | None, dict | None]] = []
        for k, unit in mine:
            samples = self._shard(unit.shard) if unit.shard is not None else self._files(unit.positions)
            for pixels, row in samples:
                if sum(row is not None for _, _, row in items) == self.size:
                    yield _collate(items)
                    items = []
                if isinstance(pixels, str):  # an image that cannot be read is an error row, not a stop
                    pixels, row = None, {**row, "error": pixels}
                items.append((k, pixels, row))
            items.append((k, None, None))  # the unit's end goes with its last sample: finished with that batch
            yield _collate(items)
            items = []

    def _files(self, positions: Sequence[int]) -> Iterator[tuple[torch.Tensor | str, dict[str, Any]]]:
        for i in positions:
            x = self.inputs[int(i)]
            yield read_pixels(x.path, self.transform), {"image": x.path, "image_id": x.image_id}

    def _shard(self, url: str) -> Iterator[tuple[torch.Tensor | str, dict[str, Any]]]:
        try:
            for sample in read_shard(url):
                found = {"original_caption": sample_caption(sample, None), "url": sample_caption(sample, "url")}
                row = {"key": sample["__key__"], **{k: v for k, v in found.items() if v is not None}}
                name = image_member(sample)
                pixels = "no image member" if name is None else read_pixels(io.BytesIO(sample[name]), self.transform)
                yield pixels, row
        except ShardError as err:  # a shard that ends early: one row with its error
            yield str(err), {}


def _collate(items: list[tuple[int, Any, dict | None]]) -> tuple[list, Any, list[int]]:
    """In the worker: one stacked tensor (or tuple of them) to send to the main process, not one per image."""
    decoded = [i for i, (_, pixels, _) in enumerate(items) if pixels is not None]
    images = None
    if decoded:
        inputs = [items[i][1] for i in decoded]
        both = isinstance(inputs[0], tuple) and not isinstance(inputs[0], ImagePatches)  # _BothInputs' pairs
        images = tuple(map(batch_images, zip(*inputs))) if both else batch_images(inputs)
    return [(k, row) for k, _, row in items], images, decoded


class _BothInputs:
    """The captioner's and the filter's inputs of one image, each by its own preprocessing."""

    def __init__(self, *transforms: Callable[[Any], Tensor]) -> None:
        self.transforms = transforms

    def __call__(self, image: Any) -> tuple[Tensor, ...]:
        return tuple(t(image) for t in self.transforms)


def _caption_units(
    model: LoadedModel,
    units: Sequence[tuple[int, _Unit]],
    finish: Callable[[int, list[dict[str, Any]]], None],
    *,
    inputs: InputList | None = None,
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    figures: Mapping[str, Path] | None = None,
    candidates: CandidateOptions | None = None,
    **generate: Any,
) -> None:
    """Caption ``units`` ((index, unit) pairs); ``finish(index, rows)`` gets each unit's rows once all are captioned.
    ``figures``: image path -> where its attention figure goes; ``candidates``: each row's ``candidates`` too."""
    if model.task != "caption":
        raise ValueError(f"this model is a {model.task} model; captioning needs a caption model")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size} must be at least 1")
    if num_workers < 0:
        raise ValueError(f"num_workers={num_workers} must be non-negative")
    device = model.device
    scorer = None if candidates is None else candidates.filter
    own = scorer is None or scorer.bundle.preprocess == model.preprocess  # the filter sees what the captioner sees
    transform = model.transform if own else _BothInputs(model.transform, scorer.transform)
    loader = DataLoader(
        _UnitBatches(units, inputs, transform, batch_size),
        batch_size=None,
        num_workers=min(num_workers, len(units)),
        pin_memory=device.type == "cuda",
    )
    rows: dict[int, list[dict[str, Any]]] = {}
    total = sum(unit.size for _, unit in units)
    with tqdm(total=total, unit="img", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        for items, images, decoded in loader:
            if images is not None and candidates is not None:
                images, filter_images = (
                    images if isinstance(images, (tuple, list)) else (images, None)
                )  # a tuple: a list
                found = [items[i][1] for i in decoded]
                keys = [row["key"] if "key" in row else row["image"] for row in found]
                lists = candidate_lists(model, images.to(device), keys, candidates, generate, filter_images)
                for row, listed in zip(found, lists):
                    row["caption"], row["candidates"] = listed[0]["text"], listed
            elif images is not None:
                images = images.to(device, non_blocking=True)
                tokens = generate_tokens(model.model, images, model.precision, **generate)  # (b, T')
                for i, caption in zip(decoded, model.vocab.decode_batch(tokens)):
                    items[i][1]["caption"] = caption
                if figures is not None:
                    write_figures(model, images, tokens, [items[i][1] for i in decoded], figures)
            for k, row in items:
                if row is None:
                    finish(k, rows.pop(k, []))
                else:
                    rows.setdefault(k, []).append(row)
                    bar.update(1 if "key" in row or "image" in row else 0)


def _chunks(inputs: InputList, positions: Sequence[int], size: int, folder: Path) -> list[_Unit]:
    """``positions`` of ``inputs`` cut into chunks of ``size``, each named by its place and its images."""
    units = []
    for k, start in enumerate(range(0, len(positions), size)):
        chunk = positions[start : start + size]
        digest = hashlib.blake2b(digest_size=8)
        for i in chunk:
            digest.update(f"{inputs.paths[i]}\0{inputs[i].image_id}\0".encode("utf-8", "surrogatepass"))
        units.append(_Unit(folder / f"{k:06d}-{digest.hexdigest()}.jsonl", len(chunk), positions=chunk))
    return units


def file_batches(
    paths: Sequence[str],
    labels: Sequence[int],
    transform: Callable[[Any], Tensor],
    batch_size: int,
    num_workers: int,
    failed: list[str],
) -> Iterator[tuple[Tensor, Tensor]]:
    """``(images, labels)`` batches of image files read as captioning reads them; unreadable files are logged,
    added to ``failed`` and left out."""
    inputs = InputList(list(paths), list(labels))
    units = list(enumerate(_chunks(inputs, range(len(inputs)), CHUNK_BATCHES * batch_size, Path())))
    workers = min(num_workers, len(units))
    for items, images, decoded in DataLoader(
        _UnitBatches(units, inputs, transform, batch_size), batch_size=None, num_workers=workers
    ):
        for _, row in items:
            if row is not None and "error" in row:
                log.warning("%s: %s", row["image"], row["error"])
                failed.append(row["image"])
        if images is not None:
            yield images, torch.tensor([items[i][1]["image_id"] for i in decoded])


def caption_images(
    model: LoadedModel, paths: Sequence[str | os.PathLike] | Sequence[InputImage], **options: Any
) -> list[dict[str, Any]]:
    """Caption image files in memory: one ``{"image", "image_id", "caption"}`` (or ``"error"``) per path, in
    order (a plain path's id: its position); ``options``: ``caption_files``' but ``out`` and ``processes``."""
    inputs = [p if isinstance(p, InputImage) else InputImage(str(p), i) for i, p in enumerate(paths)]
    listed = InputList([x.path for x in inputs], [x.image_id for x in inputs])
    units = _chunks(listed, range(len(listed)), CHUNK_BATCHES * options.get("batch_size", 32), Path())
    done: dict[int, list[dict[str, Any]]] = {}
    _caption_units(model, list(enumerate(units)), done.__setitem__, inputs=listed, **{"progress": False, **options})
    return [row for k in range(len(units)) for row in done[k]]


def caption_files(
    model: LoadedModel,
    inputs: Sequence[InputImage],
    out: str | os.PathLike,
    *,
    processes: Processes | None = None,
    format: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    attention_maps: str | os.PathLike | None = None,
    seed: int | None = None,
    candidates: CandidateOptions | None = None,
    **generate: Any,
) -> CaptionSummary:
    """Caption image files into ``out``, resuming what a run of the same command left; every rank of ``processes``
    (default: this process alone) calls it alike and gets the same summary. ``format``: ``jsonl`` (a line
    ``{"image", "image_id", "caption"}`` or ``"error"``), ``coco`` (``[{"image_id", "caption"}]``) or ``csv``.
    ``attention_maps``: a folder for each image's figure; ``seed + rank`` seeds sampling. ``candidates``: each
    record's ``candidates`` too (jsonl only; sampled by seed and path) and ``OUT.manifest.json`` beside ``out``."""
    processes = processes or Processes(device=model.device)
    if format not in FILE_FORMATS:
        raise ValueError(f"format={format!r} is unknown; choose one of {list(FILE_FORMATS)}")
    _check_candidates(candidates, format, attention_maps)
    out = Path(out)
    if out.is_dir():
        raise ValueError(f"out={out} is a folder; give a file path")
    if attention_maps is not None:
        check_figures_runtime(model)
    inputs = InputList.unique(inputs)
    parts = out.with_name(out.name + ".parts")
    with ExitStack() as held:
        plan: tuple | str | None = None
        if processes.is_zero:  # the others write nothing before rank 0 has listed what is there
            try:
                held.enter_context(_lock(parts, out))
                plan = _file_plan(inputs, out, parts, format, batch_size)
            except ValueError as err:
                plan = str(err)  # refused on every rank
        plan = processes.broadcast(plan)
        if isinstance(plan, str):
            raise ValueError(plan)
        recorded, units, finished = plan
        todo = [k for k, unit in enumerate(units) if unit.output.name not in finished]
        skipped = len(inputs) - sum(units[k].size for k in todo)
        if processes.is_zero and skipped:
            log.info(
                "%d of %d images are already captioned; captioning the other %d",
                skipped,
                len(inputs),
                len(inputs) - skipped,
            )
        if seed is not None and candidates is None:
            generate["generator"] = processes.generator(seed)
        mine = [todo[i] for i in assign_units([units[k].size for k in todo], processes.world_size)[processes.rank]]
        figures = figure_paths(inputs, Path(attention_maps)) if attention_maps is not None else None
        _caption_units(
            model,
            [(k, units[k]) for k in mine],
            lambda k, rows: _write_rows(units[k].output, rows, "jsonl"),
            inputs=inputs,
            batch_size=batch_size,
            num_workers=num_workers,
            progress=progress and processes.is_zero,
            figures=figures,
            candidates=candidates,
            **generate,
        )
        processes.barrier("caption-chunks-written")
        counts = None
        if processes.is_zero:
            counts = _merge(inputs, out, format, recorded, units)
            shutil.rmtree(parts, ignore_errors=True)
            if candidates is not None:
                counts = (*counts, write_manifest(manifest_path(out), [out], candidates.describe(generate)))
        captioned, failed, *manifest = processes.broadcast(counts)
    return CaptionSummary(captioned, failed, skipped, out, len(todo), len(units) - len(todo), *manifest)


def manifest_path(out: str | os.PathLike, shards: bool | None = None) -> Path:
    """Where the candidates' manifest goes: ``OUTDIR/manifest.json`` for shards, ``OUT.manifest.json`` for a file
    (``shards`` None: an existing folder is shards' output)."""
    out = Path(out)
    shards = out.is_dir() if shards is None else shards
    return out / "manifest.json" if shards else out.with_name(out.name + ".manifest.json")


def _check_candidates(candidates: CandidateOptions | None, format: str, attention_maps: Any = None) -> None:
    if candidates is None:
        return
    if format not in SHARD_FORMATS:
        raise ValueError(
            f"format={format} holds one caption per image; num_return_sequences={candidates.num_return_sequences} "
            "candidates are written as format=jsonl (or parquet, for shards)"
        )
    if attention_maps is not None:
        raise ValueError("attention_maps= draws one caption per image; drop it with num_return_sequences=K")


def _lock(parts: Path, out: Path) -> IO[bytes]:
    """The chunk folder's lock, held for the whole run: two runs writing the same chunks would repeat images."""
    parts.mkdir(parents=True, exist_ok=True)
    f = open(parts / ".lock", "ab")  # noqa: SIM115 - held for the whole run
    if fcntl is not None:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.close()
            raise ValueError(f"{out} is being written by another run; wait for it or choose another out=") from None
    return f


def _file_plan(
    inputs: InputList, out: Path, parts: Path, format: str, batch_size: int
) -> tuple[dict[str, int], list[_Unit], set[str]]:
    """``(path -> offset of its line in an existing jsonl out, the chunks of the other images, the chunks
    finished)``; stale temporaries of a killed run are removed."""
    recorded = _recorded(out) if format == "jsonl" else {}
    todo = [i for i, path in enumerate(inputs.paths) if path not in recorded] if recorded else range(len(inputs))
    units = _chunks(inputs, todo, CHUNK_BATCHES * batch_size, parts)
    return recorded, units, _finished(parts, units)


def _finished(folder: Path, units: Sequence[_Unit]) -> set[str]:
    """The names of ``units``' outputs already in ``folder`` (whole: only ever renamed into place); the
    temporaries a killed run left there (``atomic_open``'s ``.NAME.*.tmp``) are removed."""
    names = {unit.output.name for unit in units}
    found = set()
    for path in folder.iterdir():
        if path.name in names:
            found.add(path.name)
        elif path.name.startswith(".") and path.name.endswith(".tmp") and path.name[1:].rsplit(".", 2)[0] in names:
            path.unlink(missing_ok=True)
    return found


def _recorded(out: Path) -> dict[str, int]:
    """Image path -> byte offset of its record in an existing jsonl ``out`` (the first record of a path)."""
    offsets: dict[str, int] = {}
    if not out.is_file():
        return offsets
    with open(out, "rb") as f:
        at = 0
        for line in f:
            try:
                image = json.loads(line.decode("utf-8", errors="replace")).get("image")
            except (ValueError, AttributeError, RecursionError):
                image = None
            if isinstance(image, str):
                offsets.setdefault(image, at)
            at += len(line)
    return offsets


def _merge(
    inputs: InputList, out: Path, format: str, recorded: dict[str, int], units: Sequence[_Unit]
) -> tuple[int, int]:
    """Write every input's record into ``out`` in input order, atomically, and return ``(captioned, failed)``;
    a jsonl ``out`` keeps its records of images that are not among ``inputs``, after them. When every image
    was in ``out`` already, ``out`` is left as it is."""
    counts = [0, 0]
    with ExitStack() as stack:
        old = stack.enter_context(open(out, "rb")) if recorded else None
        chunks = (line for unit in units for line in unit.output.read_bytes().splitlines(keepends=True))

        def read(path: str) -> bytes:
            old.seek(recorded[path])
            return old.readline()

        def records() -> Iterator[tuple[bytes, dict[str, Any]]]:
            for path in inputs.paths:
                line = read(path) if path in recorded else next(chunks)
                record = json.loads(line.decode("utf-8", errors="replace"))
                counts["caption" not in record] += 1
                yield line, record

        if not units and out.exists():  # nothing new: out stays as it is
            for _ in records():
                pass
        elif format == "jsonl":
            with atomic_open(out, "wb") as f:
                f.writelines(line for line, _ in records())
                wanted = set(inputs.paths)
                f.writelines(read(path) for path in recorded if path not in wanted)
        else:
            with atomic_open(out, "w", encoding="utf-8", errors="surrogateescape", newline="") as f:
                (_write_coco if format == "coco" else _write_csv)(f, (record for _, record in records()))
    return counts[0], counts[1]


def shard_output(out_dir: str | Path, url: str, format: str) -> Path:
    """The output of shard ``url``: ``OUTDIR/<shard name without .tar>.<format>``."""
    name = url.rstrip("/").rsplit("/", 1)[-1].split(" ")[-1]
    return Path(out_dir) / f"{name.rsplit('.tar', 1)[0]}.{format}"


def caption_shards(
    model: LoadedModel,
    urls: Sequence[str],
    out_dir: str | os.PathLike,
    *,
    processes: Processes | None = None,
    format: str = "jsonl",
    batch_size: int = 32,
    num_workers: int = 2,
    progress: bool = True,
    seed: int | None = None,
    candidates: CandidateOptions | None = None,
    **generate: Any,
) -> CaptionSummary:
    """Caption the unfinished shards of ``urls``, one output per shard in ``out_dir`` (``jsonl`` or ``parquet``): a
    row per sample, ``key`` and ``caption`` (or ``error``), its ``url`` and original caption (``.txt``) if it has
    them. Called as ``caption_files`` (``candidates`` sampled by seed and sample key, ``OUTDIR/manifest.json``
    counting every shard); counts are this run's."""
    processes = processes or Processes(device=model.device)
    if format not in SHARD_FORMATS:
        raise ValueError(f"format={format!r} is unknown for shards; choose one of {list(SHARD_FORMATS)}")
    _check_candidates(candidates, format)
    if format == "parquet":
        import pyarrow  # noqa: F401 - optional: only parquet output needs it; fail before any work
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    todo = processes.broadcast(unfinished_shards(urls, out_dir, format) if processes.is_zero else None)
    sizes = dict(zip(todo, shard_sizes([urls[k] for k in todo])))  # one listing for every rank, taken before writes
    units = [_Unit(shard_output(out_dir, url, format), sizes.get(k, 0), shard=url) for k, url in enumerate(urls)]
    if processes.is_zero:
        log.info(
            "captioning %d shards (%d finished before) on %d process(es)",
            len(urls),
            len(urls) - len(todo),
            processes.world_size,
        )
    if seed is not None and candidates is None:
        generate["generator"] = processes.generator(seed)
    mine = [todo[i] for i in assign_units([units[k].size for k in todo], processes.world_size)[processes.rank]]
    counts = [0, 0, 0]  # shards, captioned, failed

    def finish(k: int, rows: list[dict[str, Any]]) -> None:
        _write_rows(units[k].output, rows, format)
        counts[0] += 1
        counts[1] += sum("caption" in row for row in rows)
        counts[2] += sum("caption" not in row for row in rows)

    _caption_units(
        model,
        [(k, units[k]) for k in mine],
        finish,
        batch_size=batch_size,
        num_workers=num_workers,
        progress=progress and processes.is_zero,
        candidates=candidates,
        **generate,
    )
    shards, captioned, failed = processes.sum(counts)  # every rank has written its shards
    manifest = None
    if candidates is not None and processes.is_zero:
        outputs = [unit.output for unit in units]
        manifest = write_manifest(manifest_path(out_dir), outputs, candidates.describe(generate))
    return CaptionSummary(captioned, failed, 0, out_dir, shards, len(units) - len(todo), processes.broadcast(manifest))


def unfinished_shards(urls: Sequence[str], out_dir: str | os.PathLike, format: str = "jsonl") -> list[int]:
    """Positions in ``urls`` of the shards without an output in ``out_dir`` (an output there is whole: outputs are
    only ever renamed into place); the temporaries a killed run left are removed."""
    units = [_Unit(shard_output(out_dir, url, format), 0, shard=url) for url in urls]
    finished = _finished(Path(out_dir), units)
    return [k for k, unit in enumerate(units) if unit.output.name not in finished]


def _write_rows(path: Path, rows: list[dict[str, Any]], format: str) -> None:
    """One unit's rows as JSON Lines or parquet, atomically."""
    if format == "jsonl":
        with atomic_open(path, "wb") as f:
            f.write("".join(_json_line(row) for row in rows).encode("utf-8"))
        return
    import pyarrow as pa  # optional: parquet output only
    import pyarrow.parquet as pq

    columns = sorted({k for row in rows for k in row} | {"key", "caption"})
    table = pa.table({c: [row.get(c) for row in rows] for c in columns})
    with atomic_open(path, "wb") as f:
        pq.write_table(table, f)


def _json_line(record: Mapping[str, Any]) -> str:
    line = json.dumps(record, ensure_ascii=False)
    try:
        line.encode("utf-8")
    except UnicodeEncodeError:  # a file name that is not valid UTF-8: \u escapes read back to the same str
        line = json.dumps(record)
    return line + "\n"


def _write_coco(f: IO[str], records: Iterable[Mapping[str, Any]]) -> None:
    f.write("[")
    sep = "\n"
    for r in records:
        if "caption" in r:
            f.write(sep + " " + json.dumps({"image_id": r["image_id"], "caption": r["caption"]}, ensure_ascii=False))
            sep = ",\n"
    f.write("\n]\n")


def _write_csv(f: IO[str], records: Iterable[Mapping[str, Any]]) -> None:
    writer = csv.DictWriter(f, fieldnames=["image", "image_id", "caption", "error"], extrasaction="ignore")
    writer.writeheader()
    writer.writerows(records)
