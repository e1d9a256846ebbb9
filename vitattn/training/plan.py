"""The run's plan: the composed config with everything the run derives resolved into it, checked once, frozen.

``resolve(cfg)`` fits the config to the start weights (``finetune.init``), makes the preprocessing concrete, checks
the result once (``check_config``, which returns the task typed), then reads the run-level keys into typed parts,
their defaults applied here once: the trainer (its accelerator decided against this machine), the precision, the
checkpoint a resume continues (read once), the weights to test and the tokenizer a restart reads. Data, system and
trainer are built from the plan alone; ``data`` and ``head`` stay configs for the constructors that own their
defaults, and ``plan.cfg`` is the config saved into the run folder: the one that ran
(docs/development.md#plan-then-build).
"""

from __future__ import annotations

import copy
import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from vitattn.data.preprocess import WEIGHTS_KEYS
from vitattn.data.tokenizer import Tokenizer, load_tokenizer
from vitattn.errors import ConfigError, first_line
from vitattn.precision import cuda_bf16, native_bf16
from vitattn.run_dir import RunDir
from vitattn.training.config import Task, check_config, fully_sharded
from vitattn.training.rank_zero import WAIT_SECONDS, wait_for_rank_zero
from vitattn.training.start_weights import EncoderWeights, ModelWeights, read_start

__all__ = [
    "BF16_TRAIN_MIN_WIDTH",
    "Config",
    "MATMUL_PRECISIONS",
    "Plan",
    "Precision",
    "Resume",
    "Task",
    "TrainerPlan",
    "global_rank",
    "processes_per_node",
    "resolve",
    "run_tokenizer",
]

log = logging.getLogger(__name__)

# The width from which a bf16-mixed training step beats fp32 on a CPU with bf16 matrix units (docs/benchmarks.md).
BF16_TRAIN_MIN_WIDTH = 192


MATMUL_PRECISIONS = ("auto", "highest", "high", "medium")
Config = DictConfig  # the composed config ``train(cfg)`` takes: only the plan, the checks and build read it raw


@dataclass(frozen=True)
class TrainerPlan:
    """The ``trainer`` keys the run reads itself (``_trainer_plan`` applies their defaults); ``pl.Trainer`` takes
    the node as configured."""

    accelerator: str
    devices: int | str | list[int]  # a count, device ids, or auto
    num_nodes: int
    strategy: str  # the strategy's name, or its class for a configured one (trainer=fsdp)
    on_gpu: bool  # accelerator gpu or cuda, or auto with CUDA available
    no_gpu: str  # a GPU trainer on a machine without one: the line the run stops with when it builds; "" otherwise
    sharded: bool  # trainer=fsdp
    processes: int  # the training processes on this machine: ``processes_per_node``, the one parse of devices
    rank: int  # this process's rank among all of the run's processes (global_rank)
    fast_dev_run: bool
    progress_bar: bool

    @property
    def distributed(self) -> bool:
        """More than one training process (``processes``, on any spelling of devices: Hydra composes ``'0,1'`` and
        ``${oc.env:...}`` as strings), more than one node, or a strategy that starts them."""
        starts = self.sharded or any(s in self.strategy for s in ("ddp", "fsdp", "deepspeed"))
        return self.processes > 1 or self.num_nodes > 1 or starts


@dataclass(frozen=True)
class Precision:
    """``trainer.precision`` (``auto`` made concrete by the plan) and ``float32_matmul_precision``."""

    trainer: str
    matmul: str

    def __post_init__(self) -> None:
        if self.trainer in ("bf16-true", "16-true"):
            raise ConfigError(
                f"trainer.precision={self.trainer} keeps the weights and AdamW's state in 16 bits, where an update "
                "smaller than 1/256 of a weight rounds to nothing (most of them, at fine-tuning learning rates); use "
                "trainer.precision=bf16-mixed: 16-bit matrix products, 32-bit weights"
            )
        if self.matmul not in MATMUL_PRECISIONS:
            raise ConfigError(
                f"float32_matmul_precision={self.matmul!r} is unknown; choose one of {', '.join(MATMUL_PRECISIONS)}"
            )


@dataclass(frozen=True)
class Resume:
    """The checkpoint fit continues from, read once before the run starts (it rewrites last.ckpt)."""

    ckpt_path: str | None = None
    key: str = "ckpt_path"  # the config key that names it, for error lines: resume or ckpt_path
    first_step: int = 0  # its step; 0 for a fresh start
    hparams: dict[str, Any] = field(default_factory=dict)  # its hyperparameters: the vocabulary or class names
    log_from: int | None = None  # the step the loggers continue from (a resume, or resume=auto); None: a new run


@dataclass(frozen=True)
class Plan:
    """What a run builds from: its resolved, read-only config and its typed run-level parts."""

    cfg: DictConfig  # read-only, interpolations resolved: what is built and saved
    run_dir: Path
    task: Task  # head.task: caption or classification
    contrastive: bool  # head=coca: the caption head also learns image and text embeddings
    trainer: TrainerPlan
    precision: Precision
    resume: Resume
    start: ModelWeights | EncoderWeights | None  # the finetune.init weights, read once
    vocab: Tokenizer | None  # a tokenizer taken whole: the start model's, or this run's own on a restart
    tokenizer_kind: str | None  # tokenizer=words, bpe or file; None for classification
    weights: str  # which weights are tested and exported: best or last
    preprocess_from: str  # where each part of the preprocessing comes from, for the log line
    system_keys: dict[str, str]  # head.system's arguments -> the config key each comes from, for error lines


def resolve(cfg: DictConfig, overrides: Sequence[str] = ()) -> Plan:
    """The plan of ``cfg`` (the composed ``conf/train.yaml``, left as it is): every user error in the keys no
    constructor sees as one ``ConfigError`` line before any data is read (the constructors' own: at ``build``).

    Args:
        overrides: the command line's ``key=value`` overrides (``vitattn-train`` passes Hydra's; a Python caller
            those it composed ``cfg`` with): a size or tokenizer that ``finetune.init``'s model contradicts is
            refused when given here, and set from the model otherwise.

    Besides these it reads: ``finetune.init``'s weights (a file, folder or the Hub); the checkpoint ``resume`` or
    ``ckpt_path`` continues (read once); the machine (CUDA, a CPU's bf16 units: the accelerator and precision); the
    environment (``LOCAL_WORLD_SIZE``: the processes; ``VITATTN_NATIVE_BF16``); rank 0's files (the run's
    tokenizer, which the other ranks wait for). Nothing else: no Hydra global.
    """
    cfg = copy.deepcopy(cfg)
    configured_kind = str(cfg.tokenizer.kind) if "tokenizer" in cfg else None  # the tokenizer group's own default
    init = cfg.finetune.get("init")
    values = _start_values(cfg, configured_kind) if init else {}
    configured = [k for k in WEIGHTS_KEYS if cfg.data.get(k) is not None]  # the preprocessing the config sets
    start = read_start(init, cfg.finetune.get("init_kind", "model")) if init else None
    changes = start.resolve(values, [o.split("=", 1)[0].lstrip("+~") for o in overrides]) if start else {}
    with open_dict(cfg):  # sizes, switches and preprocessing, read and fitted in one step
        for key, value in changes.items():
            OmegaConf.update(cfg, key, value, merge=False)
    task, contrastive = check_config(cfg)  # the resolved config: the one that runs and is saved
    taken = [k.removeprefix("data.") for k in changes if k.removeprefix("data.") in WEIGHTS_KEYS]
    preprocess_from = _preprocess_from(configured, taken, start)
    kind = configured_kind if task is Task.caption else None
    trainer = _trainer_plan(cfg.trainer)
    rank_zero_only.rank = trainer.rank  # Lightning's rank-zero helpers answer as the Trainer will, before it exists
    weights = str(cfg.get("weights", "best"))
    if weights not in ("best", "last"):
        raise ConfigError(f"weights={weights!r} is unknown; choose weights=best or weights=last")
    epochs = cfg.finetune.get("freeze_encoder_epochs") or 0  # null: none, as 0
    if not isinstance(epochs, int) or epochs < 0:
        raise ConfigError(f"finetune.freeze_encoder_epochs={epochs} must be a whole number of epochs, 0 for none")
    if epochs and trainer.distributed:  # DDP syncs only the parameters that train when it wraps the model (#20340)
        raise ConfigError(
            f"finetune.freeze_encoder_epochs={epochs} does not work with several processes (trainer.strategy="
            f"{trainer.strategy}, trainer.devices={trainer.devices}): train on one device or set "
            "finetune.freeze_encoder_epochs=0"
        )
    with open_dict(cfg):
        precision = Precision(_resolve_precision(cfg, trainer), str(cfg.get("float32_matmul_precision", "auto")))
    run_dir = Path(cfg.paths.output_dir)
    resume = _resume(cfg.ckpt_path, cfg.resume, run_dir)
    if start is not None:
        vocab = start.vocab
    else:
        vocab = run_tokenizer(None if cfg.data.get("vocab_path") else kind, run_dir, resume.ckpt_path is not None)
    system_keys = {
        k: _config_key(cfg.head.system, k, f"head.{k}" if k in cfg.head else f"head.system.{k}")
        for k in cfg.head.system
    }
    OmegaConf.resolve(cfg)  # what is built and saved: Hydra's instantiate cannot resolve a read-only config
    OmegaConf.set_readonly(cfg, True)
    return Plan(
        cfg,
        run_dir,
        task,
        contrastive,
        trainer,
        precision,
        resume,
        start,
        vocab,
        kind,
        weights,
        preprocess_from,
        system_keys,
    )


def _start_values(cfg: DictConfig, tokenizer_kind: str | None) -> dict[str, Any]:
    """The keys the start weights fit the config by, as plain values (``head.task``, ``data.img_size``, ``model.*``,
    ``head.decoder.*``, ``data.vocab_path``, ``tokenizer.kind``), in the config's order; a missing value left out."""
    values: dict[str, Any] = {"head.task": str(cfg.head.task), "tokenizer.kind": tokenizer_kind}
    for group in ("data", "model", "head.decoder"):
        node = OmegaConf.select(cfg, group)
        for key in node if isinstance(node, DictConfig) else ():
            if not OmegaConf.is_missing(node, key):
                value = node[key]
                plain = isinstance(value, DictConfig | ListConfig)
                values[f"{group}.{key}"] = OmegaConf.to_container(value, resolve=True) if plain else value
    return values


def _trainer_plan(trainer: DictConfig) -> TrainerPlan:
    """The ``trainer`` keys with their defaults, read once; the accelerator decided against this machine."""
    accelerator = str(trainer.get("accelerator", "auto"))
    devices = trainer.get("devices", 1)
    devices = list(devices) if isinstance(devices, ListConfig) else devices
    strategy = trainer.get("strategy", "auto")
    strategy = str(strategy.get("_target_", "")) if isinstance(strategy, DictConfig) else str(strategy)
    on_gpu = accelerator in ("gpu", "cuda") or (accelerator == "auto" and torch.cuda.is_available())
    processes = processes_per_node(devices, on_gpu)
    no_gpu = ""
    if accelerator in ("gpu", "cuda") and not torch.cuda.is_available():  # check_config passes GPU recipes anywhere
        no_gpu = (
            f"trainer.accelerator={accelerator} but this machine has no GPU; to train on its CPUs add "
            f"trainer.accelerator=cpu trainer.devices={processes} trainer.precision=32-true"
        )
    return TrainerPlan(
        accelerator=accelerator,
        devices=devices,
        num_nodes=int(trainer.get("num_nodes", 1)),
        strategy=strategy,
        on_gpu=on_gpu,
        no_gpu=no_gpu,
        sharded=fully_sharded(strategy),
        processes=processes,
        rank=global_rank(processes),
        fast_dev_run=bool(trainer.get("fast_dev_run", False)),
        progress_bar=bool(trainer.get("enable_progress_bar", True)),
    )


def processes_per_node(devices: Any, on_gpu: bool = False) -> int:
    """The training processes on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else ``trainer.devices`` (a count or
    device ids, as an int, a list or a string); ``auto`` and ``-1``: every GPU ``on_gpu`` (Lightning's), else 1."""
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    if str(devices).strip() in ("auto", "-1"):
        return max(1, torch.cuda.device_count()) if on_gpu else 1
    if isinstance(devices, str):  # a count, or ids ("0,1")
        devices = int(devices) if devices.strip().isdigit() else [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, int):
        return max(1, devices)
    return max(1, len(devices)) if isinstance(devices, Sequence) else 1


def global_rank(processes: int) -> int:
    """This process's rank among all of the run's processes (0: the one that writes what every rank reads), before
    a Trainer exists, as Lightning's will be: ``RANK`` where the launcher sets it (torchrun); else, in the processes
    Lightning's own launcher starts or is (it sets only ``LOCAL_RANK`` and ``NODE_RANK``, and the first process of a
    node has neither before fit), ``NODE_RANK`` (or ``GROUP_RANK``) x ``processes`` + ``LOCAL_RANK``; else SLURM's
    ``SLURM_PROCID``; else 0. Every "am I rank 0?" of a run asks the plan's answer (``TrainerPlan.rank``)."""
    env = os.environ
    if "RANK" in env:
        return int(env["RANK"])
    node = env.get("NODE_RANK", env.get("GROUP_RANK"))
    if "LOCAL_RANK" in env or node is not None:
        return int(node or 0) * processes + int(env.get("LOCAL_RANK", 0))
    return int(env.get("SLURM_PROCID", 0))


def _config_key(node: DictConfig, key: str, default: str) -> str:
    """The config key a node's ``key`` takes its value from (``scst: ${finetune.scst}``: ``finetune.scst``)."""
    value = node._get_node(key)._value()
    interpolated = OmegaConf.is_interpolation(node, key) and re.fullmatch(r"\$\{([\w.]+)\}", str(value))
    return interpolated[1] if interpolated else default


def _resolve_precision(cfg: DictConfig, trainer: TrainerPlan) -> str:
    """``trainer.precision=auto`` made concrete in ``cfg``, logged and returned: ``bf16-mixed`` on GPUs with bf16
    units (else ``16-mixed``) and on CPUs with them from width ``BF16_TRAIN_MIN_WIDTH``; ``32-true`` elsewhere."""
    configured = str(cfg.trainer.get("precision", "32-true"))
    if configured != "auto":
        return configured
    width = int(cfg.model.embed_dim)
    if trainer.no_gpu:  # the run stops on it with its own line
        chosen, why = "32-true", f"trainer.accelerator={trainer.accelerator} but this machine has no GPU"
    elif trainer.on_gpu and cuda_bf16():
        chosen, why = "bf16-mixed", "a GPU with bf16 units"
    elif trainer.on_gpu:
        chosen, why = "16-mixed", "a GPU of compute capability below 8.0, which has no bf16 units"
    elif width < BF16_TRAIN_MIN_WIDTH:
        chosen, why = "32-true", f"model.embed_dim={width} is below {BF16_TRAIN_MIN_WIDTH}, where bf16 stops paying"
    elif native_bf16():
        chosen, why = "bf16-mixed", f"bf16 matrix units on this CPU and model.embed_dim={width}"
    else:
        chosen, why = "32-true", "this CPU has no bf16 matrix units"
    cfg.trainer.precision = chosen
    log.info("trainer.precision=auto: %s (%s)", chosen, why)
    return chosen


def _preprocess_from(configured: list[str], taken: list[str], start: ModelWeights | EncoderWeights | None) -> str:
    """Where each part of the preprocessing comes from, for the log line: the ``data.*`` keys the config sets
    (``configured``), those ``taken`` from ``start`` (the weights' own), the rest the data's."""
    parts = []
    if configured:
        parts.append((", ".join(f"data.{k}" for k in configured), "from the config"))
    if taken:
        parts.append((", ".join(taken), f"the pretrained weights' own, from {start.preprocess_from}"))
    rest = [k for k in WEIGHTS_KEYS if k not in configured and k not in taken]
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


def _resume(ckpt_path: str | None, resume: str | None, run_dir: Path) -> Resume:
    """The checkpoint fit continues from, read once: a file that is missing or cannot be read stops the run in one
    line."""
    if ckpt_path:
        if not Path(ckpt_path).is_file():
            raise ConfigError(f"ckpt_path={ckpt_path} does not exist")
        return _read_checkpoint(str(ckpt_path), "ckpt_path")
    if resume == "auto":  # the run folder's own checkpoint when it has one: a fresh start otherwise
        last = RunDir(run_dir).last_checkpoint
        if not last.is_file():
            log.info("resume=auto: no %s, starting afresh", last)
            return Resume(log_from=0)  # the folder's logs continue
        found = _read_checkpoint(str(last), "resume")
        log.info("resume=auto: continuing from %s (step %d)", last, found.first_step)
        return found
    if resume:
        run = RunDir(resume)
        if not run.last_checkpoint.is_file():
            raise ConfigError(f"resume={resume} has no {run.last_checkpoint.relative_to(run.path)} to continue from")
        return _read_checkpoint(str(run.last_checkpoint), "resume")
    return Resume()


def _read_checkpoint(ckpt_path: str, key: str) -> Resume:
    try:  # mmap: the weights stay on disk, only the step and the hyperparameters are read
        checkpoint = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
        step = int(checkpoint["global_step"])
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file; say which
        raise ConfigError(
            f"{key}: checkpoint {ckpt_path} cannot be read ({first_line(err)}); use another checkpoint"
        ) from err
    return Resume(ckpt_path, key, step, dict(checkpoint.get("hyper_parameters", {})), log_from=step)


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
