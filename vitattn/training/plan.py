"""The run's plan: the composed config with everything the run derives resolved into it, checked once, frozen.

``resolve(cfg)`` fits the config to the start weights (``finetune.init``), makes ``trainer.precision`` and the
preprocessing concrete, checks the result once (``check_config``), then finds the checkpoint a resume continues
and the tokenizer a restart reads. Data, system and trainer are built from the plan alone, and ``plan.cfg`` is the
config saved into the run folder: the one that ran (docs/development.md#plan-then-build).
"""

from __future__ import annotations

import copy
import logging
import os
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf, open_dict

from vitattn.data.preprocess import WEIGHTS_KEYS, preprocess_taken
from vitattn.data.tokenizer import Tokenizer, load_tokenizer
from vitattn.precision import cuda_bf16, native_bf16
from vitattn.run_dir import RunDir
from vitattn.training.config import check_config, fully_sharded
from vitattn.training.start_weights import EncoderWeights, ModelWeights, command_line_keys, read_start

__all__ = [
    "BF16_TRAIN_MIN_WIDTH",
    "WAIT_SECONDS",
    "Plan",
    "on_gpu",
    "processes_per_node",
    "resolve",
    "run_tokenizer",
    "wait_for_rank_zero",
]

log = logging.getLogger(__name__)

# The width from which a bf16-mixed training step beats fp32 on a CPU with bf16 matrix units (docs/benchmarks.md).
BF16_TRAIN_MIN_WIDTH = 192
WAIT_SECONDS = 3600.0  # how long a rank other than 0 waits for a file rank 0 writes (the tokenizer, the reward)


@dataclass(frozen=True)
class Plan:
    """What a run builds from: its resolved, read-only config and what the config alone cannot hold."""

    cfg: DictConfig  # read-only, interpolations resolved: what is built and saved
    run_dir: Path
    start: ModelWeights | EncoderWeights | None  # the finetune.init weights, read once
    vocab: Tokenizer | None  # a tokenizer taken whole: the start model's, or this run's own on a restart
    ckpt_path: str | None  # the checkpoint fit continues from
    first_step: int  # that checkpoint's step; 0 for a fresh start
    preprocess_from: str  # where each part of the preprocessing comes from, for the log line
    on_gpu: bool  # trainer.accelerator is gpu or cuda, or auto with CUDA available
    sharded: bool  # trainer=fsdp
    processes: int  # the training processes on this machine
    system_keys: dict[str, str]  # head.system's arguments -> the config key each comes from, for error lines

    @property
    def log_from(self) -> int | None:
        """The step the loggers continue from: a resumed run, or a resume=auto start, continues the folder's logs;
        None: a new run."""
        return self.first_step if self.ckpt_path or self.cfg.resume == "auto" else None


def resolve(cfg: DictConfig) -> Plan:
    """The plan of ``cfg`` (the composed ``conf/train.yaml``, left as it is): every user error as one
    ``ConfigError`` line before any data is read."""
    cfg = copy.deepcopy(cfg)
    gpu = on_gpu(cfg.trainer)
    start = read_start(cfg.finetune.init, cfg.finetune.get("init_kind", "model")) if cfg.finetune.get("init") else None
    with open_dict(cfg):
        if start is not None:
            start.resolve(cfg, command_line_keys())
        _resolve_precision(cfg, gpu)
        preprocess_from = _resolve_preprocess(cfg, start)
    check_config(cfg)  # the resolved config: the one that runs and is saved
    sharded = fully_sharded(cfg.trainer)
    run_dir = Path(cfg.paths.output_dir)
    ckpt_path, first_step = _resume_checkpoint(cfg.ckpt_path, cfg.resume, run_dir)
    if start is not None:
        vocab = start.vocab
    else:
        kind = cfg.tokenizer.get("kind") if "tokenizer" in cfg and cfg.head.task == "caption" else None
        vocab = run_tokenizer(None if cfg.data.get("vocab_path") else kind, run_dir, ckpt_path is not None)
    system_keys = {
        k: _config_key(cfg.head.system, k, f"head.{k}" if k in cfg.head else f"head.system.{k}")
        for k in cfg.head.system
    }
    OmegaConf.resolve(cfg)  # what is built and saved: Hydra's instantiate cannot resolve a read-only config
    OmegaConf.set_readonly(cfg, True)
    return Plan(
        cfg,
        run_dir,
        start,
        vocab,
        ckpt_path,
        first_step,
        preprocess_from,
        gpu,
        sharded,
        processes_per_node(cfg.trainer.get("devices", 1)),
        system_keys,
    )


def on_gpu(trainer: DictConfig) -> bool:
    """The run trains on GPUs: ``trainer.accelerator`` is gpu or cuda, or auto with CUDA available."""
    return trainer.accelerator in ("gpu", "cuda") or (trainer.accelerator == "auto" and torch.cuda.is_available())


def processes_per_node(devices: Any) -> int:
    """The training processes on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else ``trainer.devices`` (a count or
    device ids); 1 for ``auto`` and ``-1``."""
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    if isinstance(devices, str):  # a count, or ids ("0,1"); "auto" and "-1" are one id each
        devices = int(devices) if devices.strip().isdigit() else [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, int):
        return max(1, devices)
    return max(1, len(devices)) if isinstance(devices, Sequence) else 1


def _config_key(node: DictConfig, key: str, default: str) -> str:
    """The config key a node's ``key`` takes its value from (``scst: ${finetune.scst}``: ``finetune.scst``)."""
    value = node._get_node(key)._value()
    interpolated = OmegaConf.is_interpolation(node, key) and re.fullmatch(r"\$\{([\w.]+)\}", str(value))
    return interpolated[1] if interpolated else default


def _resolve_precision(cfg: DictConfig, gpu: bool) -> None:
    """``trainer.precision=auto`` made concrete, logged: ``bf16-mixed`` on GPUs with bf16 units (else ``16-mixed``)
    and on CPUs with them from width ``BF16_TRAIN_MIN_WIDTH``; ``32-true`` elsewhere."""
    if str(cfg.trainer.get("precision", "32-true")) != "auto":
        return
    width = int(cfg.model.embed_dim)
    if gpu and not torch.cuda.is_available():  # the run stops on it with its own line
        chosen, why = "32-true", f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no GPU"
    elif gpu and cuda_bf16():
        chosen, why = "bf16-mixed", "a GPU with bf16 units"
    elif gpu:
        chosen, why = "16-mixed", "a GPU of compute capability below 8.0, which has no bf16 units"
    elif width < BF16_TRAIN_MIN_WIDTH:
        chosen, why = "32-true", f"model.embed_dim={width} is below {BF16_TRAIN_MIN_WIDTH}, where bf16 stops paying"
    elif native_bf16():
        chosen, why = "bf16-mixed", f"bf16 matrix units on this CPU and model.embed_dim={width}"
    else:
        chosen, why = "32-true", "this CPU has no bf16 matrix units"
    cfg.trainer.precision = chosen
    log.info("trainer.precision=auto: %s (%s)", chosen, why)


def _resolve_preprocess(cfg: DictConfig, start: ModelWeights | EncoderWeights | None) -> str:
    """Write into ``cfg.data`` the preprocessing ``start`` was trained with, where the config sets no ``data.*`` key
    and the data takes it (its ``weights_keys``); returns where each part comes from."""
    config = [k for k in WEIGHTS_KEYS if cfg.data.get(k) is not None]
    taken = preprocess_taken(cfg.data, start.preprocess if start is not None else None)
    for key, value in taken.items():
        cfg.data[key] = list(value) if isinstance(value, (list, tuple)) else value
    parts = []
    if config:
        parts.append((", ".join(f"data.{k}" for k in config), "from the config"))
    if taken:
        parts.append((", ".join(taken), f"the pretrained weights' own, from {start.preprocess_from}"))
    rest = [k for k in WEIGHTS_KEYS if k not in config and k not in taken]
    if rest:
        parts.append((", ".join(rest), _data_default(start, rest)))
    last = len(parts) - 1
    why = "; ".join(f"{'the rest' if i == last else keys}: {source}" for i, (keys, source) in enumerate(parts))
    return parts[0][1] if not last else why


def _data_default(start: ModelWeights | EncoderWeights | None, rest: list[str]) -> str:
    if start is None:
        return "the data's own (no finetune.init)"
    if start.preprocess is not None:
        return "the data's own"
    stats = [k for k in ("mean", "std") if k in rest]
    if not stats:
        return f"the data's own: {start.preprocess_from}"
    fix = " ".join(f"data.{k}=[...]" for k in stats)
    return (
        f"the data's own, ImageNet's {' and '.join(stats)}: {start.preprocess_from}; "
        f"if its weights were trained with others, set {fix}"
    )


def _resume_checkpoint(ckpt_path: str | None, resume: str | None, run_dir: Path) -> tuple[str | None, int]:
    """The checkpoint fit continues from, and its step (read before the run starts: it rewrites last.ckpt)."""
    if ckpt_path:
        return str(ckpt_path), _checkpoint_step(str(ckpt_path))
    if resume == "auto":  # the run folder's own checkpoint when it has one: a fresh start otherwise
        last = RunDir(run_dir).last_checkpoint
        if not last.is_file():
            log.info("resume=auto: no %s, starting afresh", last)
            return None, 0
        step = _checkpoint_step(str(last))
        log.info("resume=auto: continuing from %s (step %d)", last, step)
        return str(last), step
    if resume:
        last = RunDir(resume).last_checkpoint
        return str(last), _checkpoint_step(str(last))
    return None, 0


def _checkpoint_step(ckpt_path: str) -> int:
    return int(torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)["global_step"])


def run_tokenizer(kind: str | None, run_dir: Path, resuming: bool, wait: float = WAIT_SECONDS) -> Any:
    """The run's own ``vocab.json`` or ``tokenizer.json`` (``tokenizer=words`` or ``bpe``, ``kind``, built by rank 0)
    on a restart and on the other ranks (``wait_for_rank_zero``); None where the DataModule builds or reads it
    itself (a first start; ``tokenizer=file`` and ``data.vocab_path``, whose ``kind`` is None)."""
    if kind not in ("words", "bpe"):
        return None
    run = RunDir(run_dir)
    saved = run.tokenizer if kind == "bpe" else run.vocab
    if rank_zero_only.rank != 0:
        wait_for_rank_zero(saved, wait)
    elif not resuming:
        return None  # a first start builds it; a file from an earlier run in this folder is not this run's
    if not saved.is_file():
        return None
    log.info("tokenizer=%s: reading this run's %s (built once per run)", kind, saved)
    return load_tokenizer(saved)


def wait_for_rank_zero(path: Path, wait: float = WAIT_SECONDS, read: Any = None) -> Any:
    """Return once rank 0 has written ``path`` for every rank, with ``read(path)`` when given (None: not yet, an
    older file rank 0 is replacing); ``TimeoutError`` after ``wait`` seconds."""
    deadline = time.monotonic() + wait
    if not path.is_file():
        log.info("rank %d: waiting for rank 0 to write %s", rank_zero_only.rank, path)
    while not path.is_file() or (found := read(path) if read else True) is None:
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 wrote no {path} in {wait:.0f} s; see rank 0's log for why")
        time.sleep(1.0)
    return found
