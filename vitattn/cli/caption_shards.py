"""``vitattn-caption shards=... out=OUTDIR``: caption WebDataset shards, one output file per input shard.

    vitattn-caption model=RUN shards='DIR/{00000..00999}.tar' out=OUTDIR [format=jsonl|parquet]
        [devices=N num_nodes=M accelerator=auto|cpu|gpu] [batch_size=32] [num_workers=2] [decoding settings]

Several processes (``devices`` x ``num_nodes``; Lightning Fabric starts the local ones, ``torchrun`` or
``srun`` every one) share the unfinished shards (``vitattn.inference.shard_captioning``). Running the command again
skips the shards whose output is there. Exit status: 0 when every sample was captioned, 1 when some
could not be, 2 on a usage or model error.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch
from lightning.fabric import Fabric

from vitattn.bundle import load_bundle
from vitattn.cli.args import GENERATE_KEYS, UsageError, generate_settings, resolve_device
from vitattn.data.shards import expand_shards, shard_sizes
from vitattn.inference.shard_captioning import SHARD_FORMATS, caption_shards, finished_outputs, remove_temporaries

__all__ = ["run_shards"]

log = logging.getLogger("vitattn")


def run_shards(cfg: Any) -> int:
    """Caption ``cfg.shards`` into the folder ``cfg.out``; returns the exit status."""
    if cfg.format not in SHARD_FORMATS:
        raise UsageError(f"format={cfg.format!r} is unknown for shards; choose {' or '.join(SHARD_FORMATS)}")
    urls = expand_shards(cfg.shards, "shards")
    if Path(cfg.out).is_file():
        raise UsageError(f"out={cfg.out} is a file; with shards= it is the folder of one output per shard")
    Path(cfg.out).mkdir(parents=True, exist_ok=True)
    rank, world, device, fabric = 0, 1, resolve_device(cfg.device), None
    if cfg.devices * cfg.num_nodes > 1:
        accelerator = cfg.accelerator or {"auto": "auto", "cpu": "cpu", "cuda": "gpu"}.get(cfg.device, cfg.device)
        fabric = Fabric(accelerator=accelerator, devices=cfg.devices, num_nodes=cfg.num_nodes, strategy="ddp")
        fabric.launch()
        rank, world, device = fabric.global_rank, fabric.world_size, fabric.device
        if rank:
            log.setLevel(logging.WARNING)
    finished = finished_outputs(cfg.out, urls, cfg.format)
    if rank == 0:
        remove_temporaries(cfg.out, urls, cfg.format)
    if fabric is not None:  # the same listing on every rank, taken before any writes
        finished = fabric.broadcast(finished, src=0)
    bundle = load_bundle(cfg.model, device=device)
    if bundle.task != "caption":
        raise UsageError(f"model={cfg.model} is a {bundle.task} model; vitattn-caption needs a caption model")
    generate = generate_settings(bundle, {k: cfg[k] for k in GENERATE_KEYS})
    if cfg.seed is not None:
        generate["generator"] = torch.Generator(device=device).manual_seed(cfg.seed + rank)
    log.info("captioning %d shards (%d finished before) on %d process(es)", len(urls), len(finished), world)
    summary = caption_shards(
        bundle,
        urls,
        shard_sizes(urls),
        cfg.out,
        fmt=cfg.format,
        rank=rank,
        world_size=world,
        finished=finished,
        batch_size=cfg.batch_size,
        num_workers=cfg.num_workers,
        progress=cfg.progress and rank == 0,
        **generate,
    )
    counts = torch.tensor([summary.shards, summary.captioned, summary.failed])
    if fabric is not None:
        counts = fabric.all_reduce(counts.to(fabric.device), reduce_op="sum").cpu()
    shards, captioned, failed = (int(x) for x in counts)
    if rank == 0:
        print(
            f"captioned {captioned} samples of {shards} shards ({summary.finished_before} finished before), "
            f"{failed} failed -> {cfg.out}",
            flush=True,
        )
    return 1 if failed else 0
