"""The pool's side files: written once by the teacher into the run folder (rank 0; the other ranks wait), then
read with the keep policy into the kept ``Pool``. Candidates come from the captioning child (``child``); class
probabilities from the teacher classifier in this process."""

from __future__ import annotations

import gc
import json
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from vitattn.bundle import load_model, runtime_of
from vitattn.data.shards import expand_shards, read_shard
from vitattn.data.shards.stream import image_member
from vitattn.data.tokenizer import Tokenizer
from vitattn.errors import ConfigError
from vitattn.fileio import atomic_open
from vitattn.inference import list_inputs
from vitattn.inference.candidates import read_records
from vitattn.inference.captioning import file_batches, shard_output
from vitattn.inference.jobs import CaptionJob
from vitattn.training.bootstrap.child import caption_in_child
from vitattn.training.bootstrap.lineage import BOOTSTRAP_DIR, candidates_manifest, lineage, write_lineage
from vitattn.training.bootstrap.pool import Pool
from vitattn.training.bootstrap.settings import BootstrapSettings
from vitattn.training.rank_zero import wait_for_rank_zero

__all__ = ["prepare_pool", "read_labels"]

log = logging.getLogger(__name__)

POOL_WAIT_SECONDS = 7 * 24 * 3600.0  # the other ranks wait while rank 0's teacher labels the whole pool


def prepare_pool(
    settings: BootstrapSettings, task: str, run_dir: Path, run: dict[str, Any], vocab: Tokenizer | None = None
) -> Pool:
    """The kept pool of a run: its side files written first where there are none (rank 0; the other ranks wait
    for them), then read with the keep policy; a caption student keeps only the candidates its ``vocab`` (the human
    captions') spells. ``run``: ``seed``, ``devices``, ``accelerator``, ``progress``, ``rank`` (the plan's global
    rank), ``precision`` (the teacher's: the run's), ``class_names`` (a classification student's)."""
    folder = run_dir / BOOTSTRAP_DIR
    if settings.soft and task != "classification":
        raise ConfigError(
            "bootstrap.soft=true: soft targets are the teacher's class probabilities; head=classification"
        )
    if settings.candidates is not None:
        side = _given_side_files(Path(settings.candidates), task)
    else:
        side = folder / ("labels.jsonl" if task == "classification" else _candidates_name(settings))
        manifest = side if task == "classification" else candidates_manifest(side)
        if not manifest.exists():
            if run.get("rank", 0) == 0:
                label_pool(settings, task, side, run)
            else:
                wait_for_rank_zero(manifest, POOL_WAIT_SECONDS)
    pool = _read_pool(settings, task, side, run.get("class_names"), vocab)
    if not len(pool):
        raise ConfigError(
            f"bootstrap: no pool image kept a {'label' if task == 'classification' else 'candidate'} under "
            f"bootstrap.keep={settings.keep}; loosen bootstrap.keep.min_score / percentile"
        )
    pool.lineage = lineage(settings, side, task)
    if run.get("rank", 0) == 0:
        write_lineage(folder, pool.lineage, pool.counts)
    return pool


def _candidates_name(settings: BootstrapSettings) -> str:
    return "candidates" if settings.shards else "candidates.jsonl"


def _given_side_files(path: Path, task: str) -> Path:
    """``bootstrap.candidates=``: side files as ``vitattn-caption`` or a run wrote them (a run folder: its own)."""
    if (path / BOOTSTRAP_DIR).is_dir():
        found = [p for p in (path / BOOTSTRAP_DIR).iterdir() if p.name in ("candidates", "candidates.jsonl")]
        if task == "classification":
            found = [path / BOOTSTRAP_DIR / "labels.jsonl"]
        path = found[0] if found else path / BOOTSTRAP_DIR / "candidates.jsonl"
    marker = path if task == "classification" else candidates_manifest(path)
    if not marker.exists():
        raise ConfigError(f"bootstrap.candidates={path}: no side files there ({marker.name} is missing)")
    return path


def label_pool(settings: BootstrapSettings, task: str, side: Path, run: dict[str, Any]) -> None:
    """Write the side files: the teacher's kind is checked against the student's task in one line first."""
    teacher = load_model(settings.teacher, precision=teacher_precision(settings, run))
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
        apart = settings.filter not in ("teacher", "none")
        scorer = load_model(settings.filter, precision=teacher_precision(settings, run)) if apart else None
        if scorer is not None and (scorer.task != task or list(scorer.class_names) != list(run["class_names"])):
            raise ConfigError(
                f"bootstrap.filter={settings.filter}: a classification student's filter is a classifier of its "
                f"classes {run['class_names']}"
            )
        _write_labels(teacher, settings, side, scorer)
        del teacher, scorer
        gc.collect()
        return
    del teacher
    gc.collect()
    side.parent.mkdir(parents=True, exist_ok=True)
    caption_in_child(caption_job(settings, side, run))


def caption_job(settings: BootstrapSettings, side: Path, run: dict[str, Any]) -> CaptionJob:
    """The captioning child's job: the settings' sampling and filter, on the run's processes, in its precision."""
    scorer = {"none": None, "teacher": settings.teacher}.get(settings.filter, settings.filter)
    search: dict[str, Any] = {"do_sample": settings.do_sample}
    search |= {"top_p": settings.top_p} if settings.do_sample else {"num_beams": settings.num_beams or settings.samples}
    accelerator = run.get("accelerator", "cpu")
    return CaptionJob(
        model=settings.teacher,
        images=settings.images,
        out=str(side),
        shards=settings.shards,
        shards_key="bootstrap.images",
        samples=settings.samples,
        seed=run.get("seed", 0),
        generate=search,
        score=scorer,
        batch_size=settings.batch_size,
        num_workers=0,
        progress=run.get("progress", True),
        devices=run.get("devices", 1),
        accelerator=accelerator,
        device="cuda" if accelerator == "gpu" else "cpu",
        precision=teacher_precision(settings, run),
    )


def teacher_precision(settings: BootstrapSettings, run: dict[str, Any]) -> str:
    """The precision the teacher labels in: the run's (``fp32`` or ``bf16``), not ``auto``, whose bf16 on CPUs with
    bf16 units would make the candidates depend on the machine; an ONNX folder's own (``auto``)."""
    return "auto" if runtime_of(settings.teacher) == "onnx" else run.get("precision", "fp32")


def _write_labels(teacher: Any, settings: BootstrapSettings, out: Path, scorer: Any = None) -> None:
    """Each pool image's class probabilities from the teacher classifier (and a filter classifier trained apart,
    ``filter_probabilities``), one jsonl record a line, atomically."""
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
            judged = probs if scorer is None else scorer.model(images.to(scorer.device)).float().softmax(-1).cpu()
            for i, p, q in zip(ids.tolist(), probs, judged):
                record = {"image": paths[i], "probabilities": [round(float(x), 6) for x in p]}
                if scorer is not None:
                    record["filter_probabilities"] = [round(float(x), 6) for x in q]
                records.append(record)
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


def _read_pool(
    settings: BootstrapSettings, task: str, side: Path, class_names: Sequence[str] | None, vocab: Tokenizer | None
) -> Pool:
    if task == "classification":
        return read_labels(settings, side, len(class_names or []))
    files = sorted(side.glob("*.jsonl")) + sorted(side.glob("*.parquet")) if side.is_dir() else [side]
    records = [r for r in read_records(files) if r.get("candidates")]
    shards = _shard_images(settings, side) if side.is_dir() else None
    ranked = [[(_score(c), c["text"]) for c in r["candidates"]] for r in records]
    kept = settings.keep.captions(ranked)
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


def read_labels(settings: BootstrapSettings, side: Path, num_classes: int) -> Pool:
    """The kept pool of a class side file: each image's most probable class (its probabilities too with
    ``settings.soft``), kept by ``settings.keep`` on its confidence: the teacher's probability of that class, or the
    filter's where a filter trained apart judged it (``filter_probabilities``)."""
    records = sorted((r for r in read_records([side]) if "probabilities" in r), key=lambda r: r["image"])
    if records and len(records[0]["probabilities"]) != num_classes:
        raise ConfigError(f"bootstrap: {side} holds {len(records[0]['probabilities'])} classes, the data {num_classes}")
    labels = [max(range(num_classes), key=r["probabilities"].__getitem__) for r in records]
    judged = [r.get("filter_probabilities", r["probabilities"]) for r in records]
    confidences = [p[label] for p, label in zip(judged, labels)]
    kept = settings.keep.classes(labels, confidences, num_classes)
    sources, kept_labels = [records[i]["image"] for i in kept], [labels[i] for i in kept]
    targets = [records[i]["probabilities"] for i in kept] if settings.soft else None
    per_class = settings.keep.per_class(len(records), num_classes)
    counts = {"pool_images": len(records), "kept_images": len(set(sources)), "kept_samples": len(sources)}
    counts |= {"repeated_to_balance": len(kept) - len(set(kept)), "per_class": per_class or 0}
    counts |= {f"kept_class_{label}": n for label, n in sorted(Counter(kept_labels).items())}
    log.info(
        "bootstrap: %d of %d pool images keep a pseudo-label, %d samples an epoch (keep %s)",
        counts["kept_images"],
        len(records),
        len(sources),
        settings.keep,
    )
    return Pool(sources, labels=kept_labels, targets=targets, counts=counts)


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
