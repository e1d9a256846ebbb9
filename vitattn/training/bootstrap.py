"""Learning from images without captions: a teacher's scored caption candidates (or class probabilities) for a
pool of images, written once into the run folder, a keep policy applied when they are read, and the kept pool
mixed into the student's training stream (docs/bootstrap.md).

Candidates are written by ``vitattn-caption num_return_sequences=K`` in a child process on the run's processes
(exactly once, resumable after kill -9; the teacher and filter never share the student's memory); class labels
by the teacher classifier in this process. A run that finds them written reads them and captions nothing.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import io
import json
import logging
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

from vitattn.bundle import load_model, runtime_of
from vitattn.bundle.hub import is_hub_name
from vitattn.data.images import read_image
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.stream import image_member
from vitattn.data.tokenizer import Tokenizer
from vitattn.errors import ConfigError
from vitattn.fileio import atomic_open
from vitattn.inference import list_inputs
from vitattn.inference.candidates import read_records
from vitattn.inference.captioning import file_batches, manifest_path, shard_output

__all__ = ["BOOTSTRAP_DIR", "BootstrapSettings", "Keep", "Pool", "PoolCaptions", "PoolLabels", "prepare_pool"]

log = logging.getLogger(__name__)

BOOTSTRAP_DIR = "bootstrap"  # in the run folder: the side files, their manifest, the lineage
LINEAGE_FILE = "lineage.json"


@dataclass(frozen=True)
class Keep:
    """Which candidates (or pseudo-labels) a pool image keeps, applied when they are read. Captions: those scoring at
    least ``min_score`` and at least the ``percentile``-th percentile of every score, then the image's ``top_k``
    best (BLIP-2 keeps 2). A candidate's score is its filter's, else the plain model's mean token log-probability.
    Classes: an image's one hard pseudo-label (its teacher's most probable class; ``top_k`` per image never bounds
    it) if its confidence is at least ``min_score``; ``percentile``: the same count for every class, (100 -
    percentile) % of the pool split evenly, each class's most confident (noisy student's balance)."""

    top_k: int | None = 2
    min_score: float | None = None
    percentile: float | None = None

    def __post_init__(self) -> None:
        if self.top_k is not None and self.top_k < 1:
            raise ConfigError(f"bootstrap.keep.top_k={self.top_k} must be at least 1 (null: all)")
        if self.percentile is not None and not 0 <= self.percentile < 100:
            raise ConfigError(f"bootstrap.keep.percentile={self.percentile} must be in [0, 100) (null: off)")


@dataclass(frozen=True)
class BootstrapSettings:
    """The ``bootstrap`` config group: a ``teacher`` (a run, bundle or ONNX folder) labels the pool ``images`` (a
    folder, a file list or WebDataset shards), or another run's side files (``candidates``) are read; ``filter``
    scores the candidates (a model path, ``teacher`` or ``none``); ``samples`` candidates per image (``do_sample``
    with ``top_p``, or the beam's best); ``keep``; ``human_repeat``: how many times each human-labelled sample
    appears per epoch; ``randaugment``: timm's RandAugment of the pool images (the student's named noise)."""

    teacher: str | None = None
    images: str | None = None
    candidates: str | None = None
    filter: str = "teacher"
    samples: int = 5
    do_sample: bool = True
    top_p: float = 0.9
    num_beams: int | None = None
    keep: Keep = field(default_factory=Keep)
    human_repeat: int = 1
    randaugment: str | None = None
    batch_size: int = 32

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> BootstrapSettings | None:
        """The settings of the ``bootstrap`` node (plain values), or None when the run bootstraps from nothing (no
        ``teacher`` and no ``candidates``)."""
        if node is None or (node.get("teacher") is None and node.get("candidates") is None):
            return None
        values = dict(node)
        values["keep"] = Keep(**(values.get("keep") or {}))
        settings = cls(**values)
        known = settings.filter in ("teacher", "none") or is_hub_name(settings.filter) or Path(settings.filter).exists()
        if not known:
            raise ConfigError(
                f"bootstrap.filter={settings.filter} is not teacher, none, or a caption model (a run, bundle or ONNX "
                "folder; hf-hub:NAME): no such path"
            )
        if settings.samples < 1:
            raise ConfigError(f"bootstrap.samples={settings.samples} must be at least 1")
        if not isinstance(settings.human_repeat, int) or settings.human_repeat < 0:
            raise ConfigError(f"bootstrap.human_repeat={settings.human_repeat} must be a whole number, 0 or more")
        if settings.teacher is not None and settings.images is None:
            raise ConfigError("bootstrap.teacher=... labels the images of bootstrap.images=POOL; give the pool")
        return settings

    @property
    def shards(self) -> bool:
        return self.images is not None and ".tar" in str(self.images)


@dataclass
class Pool:
    """The kept pool: each image (a path, or a shard sample's bytes by key) with its kept captions or label."""

    sources: list[Any]  # a path, or (key, image bytes)
    captions: list[list[str]] | None = None  # each image's kept captions (caption teacher)
    labels: list[int] | None = None  # each image's kept class (classification teacher)
    counts: dict[str, int] = field(default_factory=dict)
    lineage: dict[str, Any] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.sources)

    def name(self, i: int) -> str:
        source = self.sources[i]
        return source if isinstance(source, str) else source[0]

    def read(self, i: int) -> Any:
        """Image ``i`` as a PIL image (``read_image``'s, as captioning read it)."""
        source = self.sources[i]
        return read_image(source if isinstance(source, str) else io.BytesIO(source[1]))

    def keep_only(self, drop: set[int]) -> None:
        keep = [i for i in range(len(self)) if i not in drop]
        self.sources = [self.sources[i] for i in keep]
        if self.captions is not None:
            self.captions = [self.captions[i] for i in keep]
        if self.labels is not None:
            self.labels = [self.labels[i] for i in keep]


class PoolCaptions(Dataset):
    """The kept pool as a caption dataset (``TokenizedCaptions`` draws one kept caption of an image per visit):
    ``image`` (3, height, width) uint8 by ``transform``, its ``references`` the kept captions."""

    def __init__(self, pool: Pool, transform: Callable[[Any], torch.Tensor]) -> None:
        self.pool, self.transform = pool, transform

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, index: int) -> dict[str, Any]:
        captions = self.pool.captions[index]
        image = self.pool.read(index)
        if getattr(self.transform, "reads_captions", False):  # CaptionAugment: what no kept caption contradicts
            image = self.transform(image, captions)
        else:
            image = self.transform(image)
        return {"image": image, "caption": captions[0], "references": captions, "image_id": -1 - index}


class PoolLabels(Dataset):
    """The kept pool as a classification dataset: ``(image, label)``, the image (3, height, width) uint8."""

    def __init__(self, pool: Pool, transform: Callable[[Any], torch.Tensor]) -> None:
        self.pool, self.transform = pool, transform

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.pool.read(index)), self.pool.labels[index]


class MixedTraining(Dataset):
    """One training stream: the human-labelled ``human`` dataset ``repeat`` times, then ``pool``; an index (or an
    ``(index, epoch seed)`` pair from ``EpochSampler(draws=True)``) goes to its part, so a resumed epoch reads what
    the interrupted one would have. Each repeat of a human sample draws its own references (a seed of its own
    from the epoch's seed and the repeat)."""

    draws = True

    def __init__(self, human: Dataset, repeat: int, pool: Dataset) -> None:
        self.human, self.repeat, self.pool = human, repeat, pool
        self.human_size = len(human) * repeat

    def __len__(self) -> int:
        return self.human_size + len(self.pool)

    def __getitem__(self, index: int | tuple[int, int]) -> Any:
        index, seed = index if isinstance(index, tuple) else (index, 0)
        if index < self.human_size:
            repeat, i = divmod(index, len(self.human))
            if getattr(self.human, "draws", False):
                return self.human[(i, seed * self.repeat + repeat)]  # each repeat its own draw
            return self.human[i]
        i = index - self.human_size
        return self.pool[(i, seed)] if getattr(self.pool, "draws", False) else self.pool[i]

    def __getattr__(self, name: str) -> Any:
        if name in ("human", "pool", "repeat", "human_size"):  # not set yet (unpickling in a loader worker)
            raise AttributeError(name)
        return getattr(self.human, name)  # the DataModule's own readers of its training split (``samples``, ...)

    def part(self, index: int) -> tuple[str, int]:
        """``("human", i)`` or ``("pool", i)``: where training sample ``index`` comes from."""
        if index < self.human_size:
            return "human", index % len(self.human)
        return "pool", index - self.human_size


def prepare_pool(
    settings: BootstrapSettings, task: str, run_dir: Path, run: dict[str, Any], vocab: Tokenizer | None = None
) -> Pool:
    """The kept pool of a run: its side files written first where there are none (rank 0; the other ranks wait
    for them), then read with the keep policy; a caption student keeps only the candidates its ``vocab`` (the human
    captions') spells. ``run``: ``seed``, ``devices``, ``accelerator``, ``progress``, ``rank`` (the plan's global
    rank), ``precision`` (the teacher's: the run's), ``class_names`` (a classification student's)."""
    folder = run_dir / BOOTSTRAP_DIR
    if settings.candidates is not None:
        side = _given_side_files(Path(settings.candidates), task)
    else:
        side = folder / ("labels.jsonl" if task == "classification" else _candidates_name(settings))
        manifest = side if task == "classification" else _manifest(side)
        if not manifest.exists():
            if run.get("rank", 0) == 0:
                _label_pool(settings, task, side, run)
            else:
                _wait_for(manifest)
    pool = _read_pool(settings, task, side, run.get("class_names"), vocab)
    if not len(pool):
        raise ConfigError(
            f"bootstrap: no pool image kept a {'label' if task == 'classification' else 'candidate'} under "
            f"bootstrap.keep={settings.keep}; loosen bootstrap.keep.min_score / percentile"
        )
    pool.lineage = _lineage(settings, side, task)
    if run.get("rank", 0) == 0:
        folder.mkdir(parents=True, exist_ok=True)
        with atomic_open(folder / LINEAGE_FILE, "w", encoding="utf-8") as f:
            json.dump({**pool.lineage, "kept": pool.counts}, f, indent=2)
            f.write("\n")
    return pool


def _candidates_name(settings: BootstrapSettings) -> str:
    return "candidates" if settings.shards else "candidates.jsonl"


def _manifest(side: Path) -> Path:
    """The manifest of candidate side files: a shards' folder's, or a jsonl file's."""
    return manifest_path(side, shards=side.suffix != ".jsonl")


def _given_side_files(path: Path, task: str) -> Path:
    """``bootstrap.candidates=``: side files as ``vitattn-caption`` or a run wrote them (a run folder: its own)."""
    if (path / BOOTSTRAP_DIR).is_dir():
        found = [p for p in (path / BOOTSTRAP_DIR).iterdir() if p.name in ("candidates", "candidates.jsonl")]
        if task == "classification":
            found = [path / BOOTSTRAP_DIR / "labels.jsonl"]
        path = found[0] if found else path / BOOTSTRAP_DIR / "candidates.jsonl"
    marker = path if task == "classification" else _manifest(path)
    if not marker.exists():
        raise ConfigError(f"bootstrap.candidates={path}: no side files there ({marker.name} is missing)")
    return path


def _wait_for(path: Path, timeout: float = 7 * 24 * 3600) -> None:
    """Until rank 0 has written ``path`` (its process group, if any, ends this one if rank 0 dies)."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"bootstrap: rank 0 did not write {path}")
        time.sleep(1.0)


def _label_pool(settings: BootstrapSettings, task: str, side: Path, run: dict[str, Any]) -> None:
    """Write the side files: the teacher's kind is checked against the student's task in one line first."""
    teacher = load_model(settings.teacher, precision=_teacher_precision(settings, run))
    if teacher.task != task:
        raise ConfigError(
            f"bootstrap.teacher={settings.teacher} is a {teacher.task} model; a head={task} student learns from a "
            f"{task} teacher"
        )
    if task == "classification":
        if list(teacher.class_names) != list(run["class_names"]):
            raise ConfigError(
                f"bootstrap.teacher={settings.teacher} has the classes {teacher.class_names}, the data "
                f"{run['class_names']}: a teacher labels the student's classes"
            )
        _write_labels(teacher, settings, side)
        del teacher
        gc.collect()
        return
    del teacher
    gc.collect()
    _caption_pool(settings, side, run)


def _write_labels(teacher: Any, settings: BootstrapSettings, out: Path) -> None:
    """Each pool image's class probabilities from the teacher classifier, one jsonl record a line, atomically."""
    if settings.shards:
        raise ConfigError("bootstrap.images: a classification teacher labels an image folder or list, not shards")
    paths = list_inputs(settings.images).paths
    failed: list[str] = []
    records = []
    with torch.inference_mode():
        for images, ids in file_batches(
            paths, list(range(len(paths))), teacher.transform, settings.batch_size, 0, failed
        ):
            probs = teacher.model(images.to(teacher.device)).float().softmax(-1).cpu()  # (B, classes)
            for i, p in zip(ids.tolist(), probs):
                records.append({"image": paths[i], "probabilities": [round(float(x), 6) for x in p]})
    records += [{"image": path, "error": "unreadable"} for path in failed]
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_open(out, "w", encoding="utf-8") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    log.info(
        "bootstrap: %d pool images labelled by %s (%d unreadable)",
        len(records) - len(failed),
        settings.teacher,
        len(failed),
    )


def _caption_pool(settings: BootstrapSettings, side: Path, run: dict[str, Any]) -> None:
    """``vitattn-caption`` in a child process, which dies with this one; the same command resumes it."""
    pool = f"shards={settings.images}" if settings.shards else f"images={settings.images}"
    command = [sys.executable, "-m", "vitattn.cli.caption", f"model={settings.teacher}", pool, f"out={side}"]
    command += [f"num_return_sequences={settings.samples}", f"seed={run.get('seed', 0)}"]
    command += [f"do_sample={str(settings.do_sample).lower()}", f"batch_size={settings.batch_size}"]
    command += (
        [f"top_p={settings.top_p}"] if settings.do_sample else [f"num_beams={settings.num_beams or settings.samples}"]
    )
    if settings.filter != "none":
        command.append(f"score={settings.teacher if settings.filter == 'teacher' else settings.filter}")
    command += [f"progress={str(run.get('progress', True)).lower()}", f"devices={run.get('devices', 1)}"]
    command += [f"accelerator={run.get('accelerator', 'cpu')}", "num_workers=0"]
    command.append(f"precision={_teacher_precision(settings, run)}")
    side.parent.mkdir(parents=True, exist_ok=True)
    log.info(
        "bootstrap: %s writes %d candidates per pool image: %s",
        settings.teacher,
        settings.samples,
        " ".join(command[2:]),
    )
    done = subprocess.run(command, preexec_fn=_die_with_parent, stdout=subprocess.PIPE, text=True)
    if done.returncode not in (0, 1):  # 1: some pool images could not be read, counted in the manifest
        raise ConfigError(f"bootstrap: captioning the pool failed (exit {done.returncode}); see the lines above")


def _teacher_precision(settings: BootstrapSettings, run: dict[str, Any]) -> str:
    """The precision the teacher labels in: the run's (``fp32`` or ``bf16``), not ``auto``, whose bf16 on CPUs with
    bf16 units would make the candidates depend on the machine; an ONNX folder's own (``auto``)."""
    return "auto" if runtime_of(settings.teacher) == "onnx" else run.get("precision", "fp32")


def _die_with_parent() -> None:
    """In the child: SIGKILL when the training process dies (Linux), so a killed run leaves no captioner running."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:  # pragma: no cover - not Linux
        pass


def _read_pool(
    settings: BootstrapSettings, task: str, side: Path, class_names: Sequence[str] | None, vocab: Tokenizer | None
) -> Pool:
    if task == "classification":
        return _read_labels(settings, side, len(class_names or []))
    files = sorted(side.glob("*.jsonl")) + sorted(side.glob("*.parquet")) if side.is_dir() else [side]
    records = [r for r in read_records(files) if r.get("candidates")]
    shards = _shard_images(settings, side) if side.is_dir() else None
    ranked = [[(_score(c), c["text"]) for c in r["candidates"]] for r in records]
    kept = _keep_candidates(ranked, settings.keep)
    unknown = {"kept_captions_outside_vocabulary": 0, "pool_images_left_without_caption": 0}
    if vocab is not None and vocab.unk_id is not None:  # never an <unk> target: drop what the vocabulary cannot spell
        spelt = [[t for t in texts if vocab.unk_id not in vocab.encode(t)[1:-1]] for texts in kept]
        unknown["kept_captions_outside_vocabulary"] = sum(map(len, kept)) - sum(map(len, spelt))
        unknown["pool_images_left_without_caption"] = sum(1 for a, b in zip(kept, spelt) if a and not b)
        kept = spelt
    sources, captions = [], []
    for record, texts in zip(records, kept):
        if texts:
            sources.append(record["image"] if shards is None else (record["key"], shards[record["key"]]))
            captions.append(texts)
    counts = {"pool_images": len(records), "kept_images": len(sources), "kept_captions": sum(map(len, captions))}
    counts |= unknown
    if unknown["kept_captions_outside_vocabulary"]:
        log.warning(
            "bootstrap: %d kept pool captions hold a word outside the vocabulary of the human captions (%d tokens): "
            "left out, never trained as <unk>; %d pool images kept no other",
            unknown["kept_captions_outside_vocabulary"],
            len(vocab),
            unknown["pool_images_left_without_caption"],
        )
    log.info(
        "bootstrap: %d of %d pool images keep %d captions (keep %s)",
        counts["kept_images"],
        counts["pool_images"],
        counts["kept_captions"],
        settings.keep,
    )
    return Pool(sources, captions=captions, counts=counts)


def _score(candidate: dict[str, Any]) -> float | None:
    """A candidate's filter score; without a filter its mean token log-probability; None: the filter cannot spell it."""
    if "score" in candidate:
        return candidate["score"]
    return candidate["logprob"] / max(1, candidate["length"])


def _keep_candidates(ranked: list[list[tuple[float | None, str]]], keep: Keep) -> list[list[str]]:
    """Each image's kept texts, best first (``Keep``); a null score is never kept."""
    scores = [s for image in ranked for s, _ in image if s is not None]
    floor = (
        float(torch.quantile(torch.tensor(scores, dtype=torch.float64), keep.percentile / 100))
        if (keep.percentile is not None and scores)
        else None
    )
    kept = []
    for image in ranked:
        good = [(s, t) for s, t in image if s is not None]
        good = [
            (s, t) for s, t in good if (keep.min_score is None or s >= keep.min_score) and (floor is None or s >= floor)
        ]
        good.sort(key=lambda st: -st[0])  # stable: ties keep the order drawn
        kept.append([t for _, t in good[: keep.top_k]])
    return kept


def _read_labels(settings: BootstrapSettings, side: Path, num_classes: int) -> Pool:
    records = [r for r in read_records([side]) if "probabilities" in r]
    if records and len(records[0]["probabilities"]) != num_classes:
        raise ConfigError(f"bootstrap: {side} holds {len(records[0]['probabilities'])} classes, the data {num_classes}")
    keep = settings.keep
    chosen: dict[int, list[tuple[float, str]]] = defaultdict(list)  # hard labels: each image's most probable class
    for record in records:
        label = max(range(num_classes), key=record["probabilities"].__getitem__)
        confidence = record["probabilities"][label]
        if keep.min_score is None or confidence >= keep.min_score:
            chosen[label].append((confidence, record["image"]))
    per_class = None  # percentile: (100 - percentile) % of the pool, the same count for every class
    if keep.percentile is not None and num_classes:
        per_class = max(1, round((100 - keep.percentile) / 100 * len(records) / num_classes))
    sources, labels, repeated = [], [], 0
    for label in sorted(chosen):
        best = sorted(chosen[label], key=lambda cp: (-cp[0], cp[1]))  # most confident first
        if per_class is not None:  # a class predicted less often repeats its own, best first (noisy student)
            repeated += max(0, per_class - len(best))
            best = [best[i % len(best)] for i in range(per_class)]
        for _, path in sorted(best, key=lambda cp: cp[1]):
            sources.append(path)
            labels.append(label)
    counts = {"pool_images": len(records), "kept_images": len(set(sources)), "kept_samples": len(sources)}
    counts |= {"repeated_to_balance": repeated, "per_class": per_class or 0}
    counts |= {f"kept_class_{label}": n for label, n in sorted(Counter(labels).items())}
    log.info(
        "bootstrap: %d of %d pool images keep a pseudo-label, %d samples an epoch (keep %s)",
        counts["kept_images"],
        len(records),
        len(sources),
        keep,
    )
    return Pool(sources, labels=labels, counts=counts)


def _shard_images(settings: BootstrapSettings, folder: Path) -> dict[str, bytes]:
    """Sample key -> image bytes of every pool shard (read once, held in memory) that has an output in ``folder``."""
    if settings.images is None:
        raise ConfigError("bootstrap.candidates of shards: give their bootstrap.images=SHARDS to read the images from")
    images = {}
    for url in expand_shards(str(settings.images), "bootstrap.images"):
        if shard_output(folder, url, "jsonl").exists() or shard_output(folder, url, "parquet").exists():
            for sample in read_shard(url):
                name = image_member(sample)
                if name is not None:
                    images[sample["__key__"]] = sample[name]
    return images


def _lineage(settings: BootstrapSettings, side: Path, task: str) -> dict[str, Any]:
    """What the run learned from: its teacher, filter and settings, and the teacher's own lineage (rounds)."""
    record: dict[str, Any] = {
        "teacher": settings.teacher,
        "filter": None if task == "classification" else settings.filter,
        "side_files": str(side),
        "samples": settings.samples,
        "sampling": {"do_sample": settings.do_sample, "top_p": settings.top_p, "num_beams": settings.num_beams},
        "keep": vars(settings.keep),
        "human_repeat": settings.human_repeat,
        "randaugment": settings.randaugment,
    }
    if task == "caption":
        manifest = _manifest(side)
        if manifest.exists():
            made = json.loads(manifest.read_text(encoding="utf-8"))
            record["teacher"] = record["teacher"] or made.get("captioner")
            record["candidates"] = {k: made.get(k) for k in ("captioner", "filter", "settings", "counts")}
    if record["teacher"] is not None:
        teacher_lineage = Path(record["teacher"]) / BOOTSTRAP_DIR / LINEAGE_FILE
        if teacher_lineage.exists():
            record["teacher_lineage"] = json.loads(teacher_lineage.read_text(encoding="utf-8"))
    return record


def image_digests(images: Iterable[torch.Tensor]) -> set[str]:
    """The digests of (3, height, width) uint8 images as the model takes them: identical pixels, identical digest."""
    return {hashlib.blake2b(image.contiguous().numpy().tobytes(), digest_size=16).hexdigest() for image in images}
