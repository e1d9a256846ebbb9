"""``vitattn-caption``: caption image files (or WebDataset shards) with a trained model.

    vitattn-caption model=PATH images=INPUT out=FILE [image_dir=DIR] [format=jsonl|coco|csv]
    vitattn-caption model=PATH shards='DIR/{00000..00999}.tar' out=OUTDIR [format=jsonl|parquet]
        [batch_size=32] [num_workers=2] [num_beams=N] [max_new_tokens=N] [length_penalty=X] [merge_tokens=R|[R,...]]
        [early_stopping=true|false|never] [do_sample=true temperature=X top_k=N top_p=X] [seed=N] [min_new_tokens=N]
        [no_repeat_ngram_size=N] [repetition_penalty=X] [rerank=N] [device=auto|cpu|cuda] [precision=auto|fp32|bf16]
        [attention_maps=DIR] [progress=true] [num_threads=N] [devices=N num_nodes=M accelerator=auto|cpu|gpu]
        [num_return_sequences=K [include_greedy=true] [score=MODEL [score_by=auto|contrastive|likelihood]]]

The same command resumes a killed run. Exit 0: all captioned, 1: some unreadable, 2: a usage or model error.
merge_tokens: ToMe. num_return_sequences=K: K scored candidates per image. More: docs/captioning.md."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import MISSING

from vitattn.cli.args import DecodingArgs, UsageError, parse_key_values, resolve_device, run_main
from vitattn.cli.errors import USER_ERRORS

__all__ = ["CaptionConfig", "UsageError", "main", "parse_args", "run"]

log = logging.getLogger("vitattn")

# The arguments that reach ``generate``: the search ones (DecodingArgs: SEARCH_KEYS) and sampling's.
GENERATE_KEYS = (*(f.name for f in fields(DecodingArgs)), "do_sample", "temperature", "top_k", "top_p")


@dataclass
class CaptionConfig(DecodingArgs):
    """``vitattn-caption`` arguments; decoding ones (``DecodingArgs``) left None take the bundle's defaults."""

    model: str = MISSING
    images: str | None = None
    out: str = MISSING
    shards: str | None = None
    image_dir: str | None = None
    format: str = "jsonl"
    batch_size: int = 32
    num_workers: int = 2
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    device: str = "auto"
    precision: str = "auto"  # auto, fp32 or bf16 (vitattn.precision)
    merge_tokens: Any = None  # ToMe: an int, or a list of one per encoder layer; None: the model's own
    num_threads: int | None = None  # torch CPU threads; 1 is steadier on a shared machine
    attention_maps: str | None = None
    num_return_sequences: int | None = None  # K candidates per image in each record's ``candidates``
    include_greedy: bool = False  # the model's greedy caption among them, first
    score: str | None = None  # a caption model (any path load_model takes) that scores every candidate
    score_by: str = "auto"  # contrastive (head=coca) or likelihood (any captioner); auto: contrastive if it can
    progress: bool = True
    devices: int = 1  # processes per machine; more than 1 (or num_nodes > 1) starts them with Lightning Fabric
    num_nodes: int = 1
    accelerator: str | None = None  # Lightning's; default from device: auto, cpu or gpu


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``CaptionConfig``."""
    cfg = parse_key_values(argv, CaptionConfig, "vitattn-caption")
    if cfg.images is None and cfg.shards is None:
        raise UsageError("missing images=... (image files) or shards=... (WebDataset tars); see vitattn-caption --help")
    if cfg.images is not None and cfg.shards is not None:
        raise UsageError("images=... and shards=... are both given; caption image files or shards, not both")
    if cfg.num_return_sequences is None and (cfg.include_greedy or cfg.score is not None):
        raise UsageError("include_greedy= and score= are for candidates; add num_return_sequences=K")
    if cfg.shards is not None and Path(cfg.out).is_file():
        raise UsageError(f"out={cfg.out} is a file; with shards= it is the folder of one output per shard")
    if cfg.shards is not None and cfg.attention_maps is not None:
        raise UsageError("attention_maps= is for image files; drop it with shards=")
    return cfg


def run(cfg: Any) -> int:
    """Caption as ``cfg`` says; returns the exit status (0 all captioned, 1 some failed)."""
    import torch

    from vitattn.bundle.hub import resolve_model_path
    from vitattn.inference.jobs import CaptionJob, run_caption_job

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    job = CaptionJob(
        model=str(resolve_model_path(cfg.model)),  # a hf-hub: name fetched once, for the processes and the model
        name=cfg.model,
        images=cfg.shards if cfg.shards is not None else cfg.images,
        shards=cfg.shards is not None,
        image_dir=cfg.image_dir,
        out=cfg.out,
        format=cfg.format,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        progress=cfg.progress,
        seed=cfg.seed,
        precision=cfg.precision,
        merge_tokens=cfg.merge_tokens,
        generate={key: cfg[key] for key in GENERATE_KEYS},
        samples=cfg.num_return_sequences,
        include_greedy=cfg.include_greedy,
        score=cfg.score,
        score_by=cfg.score_by,
        attention_maps=cfg.attention_maps,
        devices=cfg.devices,
        num_nodes=cfg.num_nodes,
        accelerator=cfg.accelerator or {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}.get(cfg.device, cfg.device),
        device=resolve_device(cfg.device),
    )
    processes = job.launch()
    if not processes.is_zero:
        log.setLevel(logging.WARNING)
    try:
        summary = run_caption_job(job, processes)
    except USER_ERRORS:
        if processes.is_zero:
            raise
        return 2  # rank 0 says why, in one line
    finally:
        processes.close()
    if processes.is_zero:
        if job.shards:
            print(
                f"captioned {summary.captioned} samples of {summary.units} shards ({summary.units_before} finished "
                f"before), {summary.failed} failed -> {cfg.out}",
                flush=True,
            )
        else:
            print(f"captioned {summary.captioned} images, {summary.failed} failed -> {summary.out}", flush=True)
        _say_candidates(summary)
    return 1 if summary.failed else 0


def _say_candidates(summary: Any) -> None:
    """The candidates' line: their count, the null scores and where the manifest is."""
    if summary.manifest is not None:
        from vitattn.inference.captioning import manifest_path

        counts, scorer = summary.manifest["counts"], summary.manifest["filter"]
        scored = "" if scorer is None else f", scored by {scorer['model']} ({scorer['score']}): "
        nulls = "" if scorer is None else f"{counts['null_scores']} null (words the filter cannot spell)"
        print(
            f"{counts['candidates']} distinct candidates of {counts['captioned']} images{scored}{nulls} -> "
            f"{manifest_path(summary.out)}",
            flush=True,
        )


def main(argv: list[str] | None = None) -> int:
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
