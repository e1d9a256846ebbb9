"""What a run learned from: ``RUN/bootstrap/lineage.json`` (its teacher, filter and settings, what was kept, and
the teacher's own lineage when the teacher was itself a student)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from vitattn.fileio import atomic_open
from vitattn.inference.captioning import manifest_path
from vitattn.training.bootstrap.settings import BootstrapSettings

__all__ = ["BOOTSTRAP_DIR", "LINEAGE_FILE", "lineage", "write_lineage"]

BOOTSTRAP_DIR = "bootstrap"  # in the run folder: the side files, their manifest, the lineage
LINEAGE_FILE = "lineage.json"


def lineage(settings: BootstrapSettings, side: Path, task: str) -> dict[str, Any]:
    """What the run learned from: its teacher, filter and settings, and the teacher's own lineage (rounds)."""
    record: dict[str, Any] = {
        "teacher": settings.teacher,
        "filter": None if task == "classification" and settings.filter in ("teacher", "none") else settings.filter,
        "side_files": str(side),
        "samples": settings.samples,
        "sampling": {"do_sample": settings.do_sample, "top_p": settings.top_p, "num_beams": settings.num_beams},
        "keep": vars(settings.keep),
        "human_repeat": settings.human_repeat,
        "randaugment": settings.randaugment,
        "soft": settings.soft,
        "labelled_images": settings.labelled_images,
    }
    if task == "caption":
        manifest = candidates_manifest(side)
        if manifest.exists():
            made = json.loads(manifest.read_text(encoding="utf-8"))
            record["teacher"] = record["teacher"] or made.get("captioner")
            record["candidates"] = {k: made.get(k) for k in ("captioner", "filter", "settings", "counts")}
    if record["teacher"] is not None:
        teacher_lineage = Path(record["teacher"]) / BOOTSTRAP_DIR / LINEAGE_FILE
        if teacher_lineage.exists():
            record["teacher_lineage"] = json.loads(teacher_lineage.read_text(encoding="utf-8"))
    return record


def write_lineage(folder: Path, record: dict[str, Any], kept: dict[str, int]) -> None:
    """``folder/lineage.json``: the ``record`` and the ``kept`` counts, atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    with atomic_open(folder / LINEAGE_FILE, "w", encoding="utf-8") as f:
        json.dump({**record, "kept": kept}, f, indent=2)
        f.write("\n")


def candidates_manifest(side: Path) -> Path:
    """The manifest of candidate side files: a shards' folder's, or a jsonl file's."""
    return manifest_path(side, shards=side.suffix != ".jsonl")
