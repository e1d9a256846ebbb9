"""``vitattn-caption``: caption image files with a trained model.

Usage::

    vitattn-caption model=PATH images=INPUT out=FILE [image_dir=DIR] [format=jsonl|coco|csv]
    vitattn-caption model=PATH shards='DIR/{00000..00999}.tar' out=OUTDIR [format=jsonl|parquet]
        [batch_size=32] [num_workers=2] [num_beams=N] [max_new_tokens=N] [length_penalty=X]
        [do_sample=true temperature=X top_k=N top_p=X] [seed=N] [device=auto|cpu|cuda]
        [attention_maps=DIR] [progress=true] [num_threads=N]
        [devices=N num_nodes=M accelerator=auto|cpu|gpu]

``model`` is a bundle folder, a training run folder, a ``.ckpt`` or an ONNX folder (``vitattn-export
format=onnx``: run by ONNX Runtime on the CPU); ``images`` a folder, a glob, a
text file of paths or a COCO JSON file. Decoding settings left out come from the bundle. Running
the same command again captions only the images not yet in ``out``. Exit status: 0 when every image
was captioned, 1 when some could not be read, 2 on a usage or model error.

``devices=N`` (and ``num_nodes=M``) caption with Lightning's ``Trainer.predict`` on N x M processes
(DDP): each rank appends to its own part file and rank 0 merges them into ``out`` in input order.
Lightning starts the other local processes itself; under ``torchrun`` or ``srun`` every process runs
this same command. ``accelerator`` defaults to what ``device`` says.

``shards`` (WebDataset tars, instead of ``images``) writes one output per shard into ``out``
(``vitattn.cli.caption_shards``).
"""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Any

from omegaconf import MISSING

from vitattn.cli.args import GENERATE_KEYS, UsageError, generate_settings, parse_key_values, resolve_device, run_main
from vitattn.cli.errors import USER_ERRORS
from vitattn.upstream import defer_wandb_in_timm

__all__ = ["CaptionConfig", "UsageError", "main", "parse_args", "run"]

log = logging.getLogger("vitattn")


@dataclass
class CaptionConfig:
    """``vitattn-caption`` arguments; decoding ones left None take the bundle's defaults."""

    model: str = MISSING
    images: str | None = None
    out: str = MISSING
    shards: str | None = None
    image_dir: str | None = None
    format: str = "jsonl"
    batch_size: int = 32
    num_workers: int = 2
    num_beams: int | None = None
    max_new_tokens: int | None = None
    length_penalty: float | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None
    device: str = "auto"
    num_threads: int | None = None  # torch CPU threads; 1 is steadier on a shared machine
    attention_maps: str | None = None
    progress: bool = True
    devices: int = 1  # processes per machine; more than 1 (or num_nodes > 1) runs Lightning's Trainer.predict
    num_nodes: int = 1
    accelerator: str | None = None  # Lightning's; default from device: auto, cpu or gpu


def parse_args(argv: list[str]) -> Any:
    """``key=value`` arguments -> a validated ``CaptionConfig`` (an OmegaConf structured config).

    Values are taken literally (a glob such as ``images=*.jpg`` is not YAML); ``null`` clears an option.
    """
    cfg = parse_key_values(argv, CaptionConfig, "vitattn-caption")
    if cfg.images is None and cfg.shards is None:
        raise UsageError("missing images=... (image files) or shards=... (WebDataset tars); see vitattn-caption --help")
    if cfg.images is not None and cfg.shards is not None:
        raise UsageError("images=... and shards=... are both given; caption image files or shards, not both")
    if cfg.shards is None and cfg.format not in ("jsonl", "coco", "csv"):
        raise UsageError(f"format={cfg.format!r} is unknown; choose jsonl, coco or csv")
    for key in ("devices", "num_nodes"):
        if cfg[key] < 1:
            raise UsageError(f"{key}={cfg[key]} must be at least 1")
    return cfg


def run(cfg: Any) -> int:
    """Caption as ``cfg`` says; returns the exit status (0 all captioned, 1 some failed)."""
    # heavy: torch and Lightning stay out of the command's import, so --help and usage errors are instant
    import torch

    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    if cfg.shards is not None:
        from vitattn.cli.caption_shards import run_shards  # Lightning Fabric and the shard reader

        return run_shards(cfg)
    if cfg.devices * cfg.num_nodes > 1:
        return _run_distributed(cfg)
    # heavy: torch and Lightning stay out of the command's import, so --help and usage errors are instant
    from vitattn.inference import list_inputs
    from vitattn.inference.api import Captioner

    device = resolve_device(cfg.device)
    bundle, generate = _load(cfg, device)
    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
        generate["generator"] = torch.Generator(device=device).manual_seed(cfg.seed)
    inputs = list_inputs(cfg.images, cfg.image_dir)
    log.info("captioning %d images with %s on %s", len(inputs), cfg.model, device)
    summary = Captioner(bundle).caption_files(
        inputs,
        cfg.out,
        format=cfg.format,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        progress=cfg.progress,
        attention_maps=cfg.attention_maps,
        **generate,
    )
    return _report(summary)


def _load(cfg: Any, device: str) -> tuple[Any, dict[str, Any]]:
    # heavy: torch and Lightning stay out of the command's import, so --help and usage errors are instant
    from vitattn.inference.api import load_model

    bundle = load_model(cfg.model, device=device)
    if bundle.task != "caption":
        raise UsageError(f"model={cfg.model} is a {bundle.task} model; vitattn-caption needs a caption model")
    return bundle, generate_settings(bundle, {k: cfg[k] for k in GENERATE_KEYS})


def _run_distributed(cfg: Any) -> int:
    """This process's part of a ``Trainer.predict`` run; only rank 0 reports, every rank returns the status."""
    # heavy: torch and Lightning stay out of the command's import, so --help and usage errors are instant
    from lightning.pytorch.utilities import rank_zero_only

    from vitattn.inference import list_inputs
    from vitattn.inference.distributed import caption_with_trainer

    zero = rank_zero_only.rank == 0  # from the launcher's environment (LOCAL_RANK, RANK, SLURM_PROCID)
    if not zero:
        log.setLevel(logging.WARNING)
    accelerator = cfg.accelerator or {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}.get(cfg.device, cfg.device)
    try:
        bundle, generate = _load(cfg, "cpu")  # Lightning moves the model to each rank's device
        if bundle.config.get("runtime") == "onnx":
            raise UsageError(
                f"model={cfg.model} is an ONNX folder, which captions in one process; drop devices= and num_nodes="
            )
        inputs = list_inputs(cfg.images, cfg.image_dir)
        log.info(
            "captioning %d images with %s on %d x %d %s processes",
            len(inputs),
            cfg.model,
            cfg.num_nodes,
            cfg.devices,
            accelerator,
        )
        summary = caption_with_trainer(
            bundle,
            inputs,
            cfg.out,
            devices=cfg.devices,
            num_nodes=cfg.num_nodes,
            accelerator=accelerator,
            format=cfg.format,
            batch_size=cfg.batch_size,
            num_workers=cfg.num_workers,
            progress=cfg.progress,
            attention_maps=cfg.attention_maps,
            seed=cfg.seed,
            **generate,
        )
    except USER_ERRORS:
        if zero:
            raise
        return 2  # rank 0 says why, in one line
    return _report(summary, print_line=zero)


def _report(summary: Any, print_line: bool = True) -> int:
    """The one summary line (every rank's counts) and the exit status: 1 when any image failed."""
    if print_line:
        print(f"captioned {summary.captioned} images, {summary.failed} failed -> {summary.out}", flush=True)
    return 1 if summary.failed else 0


def main(argv: list[str] | None = None) -> int:
    """Console entry point; ``argv`` defaults to ``sys.argv[1:]``."""
    defer_wandb_in_timm()  # this process only: timm's import then leaves wandb unimported (vitattn.upstream)
    return run_main(__doc__, argv, parse_args, run)


if __name__ == "__main__":
    sys.exit(main())
