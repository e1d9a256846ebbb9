"""The run's DataModule and system, each built once from the resolved config, given what only the run knows:
the tokenizer, the sizes only the data knows, the machine's cores, the ``finetune=scst`` reward. What rank 0
computes once per run (the tokenizer, the reward's CIDEr-D statistics) is written into the run folder, where
the other ranks and every restart read it."""

from __future__ import annotations

import json
import logging
import os
import re
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import hydra
import torch
from hydra.errors import InstantiationException
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitattn.data.images import BadImageError
from vitattn.data.tokenizer import (
    Tokenizer,
    load_tokenizer,
    tokenizer_file_name,
    tokenizer_from_labels,
    tokenizer_labels,
)
from vitattn.errors import ConfigError, first_line
from vitattn.fileio import atomic_write, read_json
from vitattn.metrics import CiderD
from vitattn.precision import cuda_bf16, native_bf16
from vitattn.run_dir import VOCAB_FILE, RunDir
from vitattn.training.config import data_name, qualify
from vitattn.training.start import Encoder, WholeModel
from vitattn.training.systems import VisionSystem
from vitattn.training.systems.contrastive import contrastive_model_config

__all__ = [
    "BF16_TRAIN_MIN_WIDTH",
    "WAIT_SECONDS",
    "build_datamodule",
    "build_system",
    "model_config_from",
    "on_gpu",
    "plan_cores",
    "prepare_reward",
    "processes_per_node",
    "read_statistics",
    "resolve_train_precision",
    "run_tokenizer",
    "set_matmul_precision",
    "setup_data",
    "wait_for_rank_zero",
    "write_statistics",
]

log = logging.getLogger(__name__)

WAIT_SECONDS = 3600.0  # how long a rank other than 0 waits for a file rank 0 writes (the tokenizer, the reward)


def run_tokenizer(cfg: DictConfig, run_dir: str | Path, resuming: bool, wait: float = WAIT_SECONDS) -> Tokenizer | None:
    """The run's own ``vocab.json`` or ``tokenizer.json`` (``tokenizer=words`` or ``bpe``, built by rank 0) on a
    restart and on the other ranks (``wait_for_rank_zero``); None where the DataModule builds or reads it itself."""
    if cfg.head.task != "caption" or "tokenizer" not in cfg:
        return None
    kind = cfg.tokenizer.get("kind")
    if kind not in ("words", "bpe") or cfg.data.get("vocab_path"):
        return None  # file and vocab_path read their own path
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


def build_datamodule(cfg: DictConfig, vocab: Tokenizer | None = None) -> Any:
    """The DataModule ``cfg.data`` names, given the ``tokenizer`` group and ``vocab`` (a tokenizer to use as it is)
    for captions; its constructor's refusals as one-line ``ConfigError``s naming the ``data.*`` key."""
    extra: dict[str, Any] = {}
    if cfg.head.task == "caption" and "tokenizer" in cfg:
        tokenizer = OmegaConf.to_container(cfg.tokenizer, resolve=True, throw_on_missing=False)
        extra["tokenizer"] = {k: v for k, v in tokenizer.items() if v != "???"}  # a missing path: the owner says so
        extra["vocab"] = vocab
    return _instantiate(cfg.data, "data", {k: f"data.{k}" for k in cfg.data}, **extra)


def build_system(cfg: DictConfig, datamodule: Any, start: WholeModel | Encoder | None = None) -> VisionSystem:
    """The LightningModule ``cfg.head.system`` names, sized from the data, started from ``start``'s weights."""
    caption = cfg.head.task == "caption"
    labels = {"vocab": tokenizer_labels(datamodule.vocab)} if caption else {"class_names": list(datamodule.class_names)}
    keys = {
        k: _config_key(cfg.head.system, k, f"head.{k}" if k in cfg.head else f"head.system.{k}")
        for k in cfg.head.system
    }
    system = _instantiate(
        cfg.head.system,
        "head.system",
        keys,
        model_config=model_config_from(cfg, datamodule),
        preprocess=dict(datamodule.preprocess),
        **labels,
    )
    if start is not None:
        start.load_into(system)
    return system


def _config_key(node: DictConfig, key: str, default: str) -> str:
    """The config key a node's ``key`` takes its value from (``scst: ${finetune.scst}``: ``finetune.scst``)."""
    value = node._get_node(key)._value()
    interpolated = OmegaConf.is_interpolation(node, key) and re.fullmatch(r"\$\{([\w.]+)\}", str(value))
    return interpolated[1] if interpolated else default


def _instantiate(node: DictConfig, where: str, keys: dict[str, str], **kwargs: Any) -> Any:
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, (ValueError, TypeError)):
            message = qualify(first_line(cause), keys)
            raise ConfigError(message if message != first_line(cause) else f"{where}: {message}") from None
        raise


def model_config_from(cfg: DictConfig, datamodule: Any) -> dict[str, Any]:
    """Plain model keyword arguments from the config and the values only the data knows."""
    encoder = OmegaConf.to_container(cfg.model, resolve=True)
    encoder["img_size"] = datamodule.img_size
    if cfg.head.task == "classification":
        return {**encoder, "num_classes": datamodule.num_classes}
    vocab = datamodule.vocab
    decoder = OmegaConf.to_container(cfg.head.decoder, resolve=True)
    decoder.update(
        vocab_size=len(vocab),
        memory_dim=encoder["embed_dim"],
        pad_id=vocab.pad_id,
        bos_id=vocab.bos_id,
        eos_id=vocab.eos_id,
        unk_id=vocab.unk_id,
        other_special_ids=list(vocab.other_special_ids),
    )
    config = {"encoder": {**encoder, "num_classes": 0}, "decoder": decoder}
    if "contrastive" in cfg.head:  # head=coca
        pairs = int(cfg.data.batch_size) * processes_per_node(cfg) * int(cfg.trainer.get("num_nodes", 1))
        config["contrastive"] = contrastive_model_config(
            OmegaConf.to_container(cfg.head.contrastive, resolve=True), pairs
        )
    return config


def setup_data(cfg: DictConfig, datamodule: Any, ckpt_path: str | None = None) -> None:
    """``datamodule.setup("fit")``; an unreadable or empty split, and a vocabulary or class list other than the
    resumed checkpoint's (``ckpt_path``), as one-line ``ConfigError``s before any step."""
    data = cfg.data
    where = f"data.root={data.root}" if "root" in data else f"data={data_name(data)}"
    try:
        datamodule.setup("fit")
    except BadImageError:
        raise  # names the file already
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
        layout = "; expected ROOT/train/<class>/<image> and ROOT/val/<class>/<image>" if "root" in data else ""
        raise ConfigError(f"{where}: {first_line(err)}{layout}") from err
    for split in ("train", "val"):
        dataset = getattr(datamodule, f"{split}_dataset", None)
        if dataset is not None and len(dataset) == 0:
            raise ConfigError(f"{where}: the {split} split has no samples; point the data at a non-empty {split} split")
    if ckpt_path:
        _check_checkpoint_matches(cfg, datamodule, ckpt_path)


def _check_checkpoint_matches(cfg: DictConfig, datamodule: Any, ckpt_path: str) -> None:
    key = "resume" if cfg.get("resume") and not cfg.get("ckpt_path") else "ckpt_path"
    try:  # mmap: the weights stay on disk, only the hyperparameters are read
        hparams = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True).get("hyper_parameters", {})
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file; say which
        raise ConfigError(
            f"{key}: checkpoint {ckpt_path} cannot be read ({first_line(err)}); use another checkpoint"
        ) from err
    task = cfg.head.task
    trained = "caption" if "vocab" in hparams else "classification" if "class_names" in hparams else None
    if trained is not None and trained != task:
        raise ConfigError(
            f"{key}: checkpoint {ckpt_path} was trained with head={trained}, not head={task}; use head={trained}"
        )
    caption = trained == "caption"
    if caption and (isinstance(hparams["vocab"], str) or isinstance(tokenizer_labels(datamodule.vocab), str)):
        _check_subword_matches(cfg, datamodule.vocab, hparams["vocab"], ckpt_path)
    elif caption:
        words, theirs = list(datamodule.vocab.words), list(hparams["vocab"])
        if words != theirs:
            i = next((i for i, (a, b) in enumerate(zip(words, theirs)) if a != b), min(len(words), len(theirs)))
            differ = f"{words[i]!r} vs {theirs[i]!r}" if i < min(len(words), len(theirs)) else "one list is longer"
            source = (
                f"data.vocab_path={cfg.data.vocab_path}"
                if cfg.data.get("vocab_path")
                else "the vocabulary built from the training captions"
            )
            raise ConfigError(
                f"data.vocab_path: {source} ({len(words)} words) differs from the checkpoint's ({len(theirs)} words, "
                f"first difference at word {i}: {differ}); use the vocabulary the model was trained with: "
                f"{_saved_tokenizer(ckpt_path, VOCAB_FILE)}"
            )
    elif trained == "classification":
        names, theirs = list(datamodule.class_names), list(hparams["class_names"])
        if names != theirs:
            raise ConfigError(
                f"data: classes {names} differ from the checkpoint's {theirs} ({ckpt_path}); train on the same classes"
            )


def _check_subword_matches(cfg: DictConfig, ours: Any, labels: Any, ckpt_path: str) -> None:
    """The run's tokenizer is the checkpoint's (one of them a subword tokenizer): else one line with the fix."""
    try:
        theirs = tokenizer_from_labels(labels, f"checkpoint {ckpt_path}")
    except ValueError as err:
        raise ConfigError(f"{first_line(err)}; use another checkpoint") from None
    if type(ours) is type(theirs) and ours == theirs:
        return
    kind = cfg.get("tokenizer", {}).get("kind", "words")
    source = f"data.vocab_path={cfg.data.vocab_path}" if cfg.data.get("vocab_path") else f"tokenizer={kind}"
    raise ConfigError(
        f"{source}: the tokenizer ({type(ours).__name__}, {len(ours)} tokens) differs from the checkpoint's "
        f"({type(theirs).__name__}, {len(theirs)} tokens); use the tokenizer the model was trained with: "
        f"{_saved_tokenizer(ckpt_path, tokenizer_file_name(theirs))}"
    )


def _saved_tokenizer(ckpt_path: str, name: str) -> str:
    """``data.vocab_path=`` the tokenizer file ``name`` of the checkpoint's run folder."""
    saved = RunDir(Path(ckpt_path).resolve().parents[1]).path / name
    return f"data.vocab_path={saved}" if saved.is_file() else f"data.vocab_path=<the run's {name}>"


# The width from which a bf16-mixed training step beats fp32 on a CPU with bf16 matrix units (docs/benchmarks.md).
BF16_TRAIN_MIN_WIDTH = 192


def on_gpu(cfg: DictConfig) -> bool:
    """The run trains on GPUs: ``trainer.accelerator`` is gpu or cuda, or auto with CUDA available."""
    return cfg.trainer.accelerator in ("gpu", "cuda") or (
        cfg.trainer.accelerator == "auto" and torch.cuda.is_available()
    )


def plan_cores(cfg: DictConfig, datamodule: Any) -> tuple[int, int]:
    """``(workers, threads)`` of this process's share of the node's cores: ``auto`` workers the DataModule's
    ``plan_workers``, ``auto`` threads what they leave on a CPU (torch's default on GPUs); a number set is kept."""
    cores, processes = len(os.sched_getaffinity(0)), processes_per_node(cfg)
    share = max(1, cores // processes)
    plan = getattr(datamodule, "plan_workers", None)
    workers = plan(on_gpu(cfg), share) if plan is not None else int(getattr(datamodule, "num_workers", 0))
    wanted = cfg.get("num_threads")
    if wanted == "auto":
        wanted = torch.get_num_threads() if on_gpu(cfg) else max(1, share - workers)
    if wanted:
        torch.set_num_threads(int(wanted))
    threads = torch.get_num_threads()
    log.info("cores: %d for %d process(es); loader workers: %d; torch threads: %d", cores, processes, workers, threads)
    return workers, threads


def processes_per_node(cfg: DictConfig) -> int:
    """The training processes on this machine: torchrun's ``LOCAL_WORLD_SIZE``, else ``trainer.devices`` (a count or
    device ids); 1 for ``auto`` and ``-1``."""
    if os.environ.get("LOCAL_WORLD_SIZE", "").isdigit():
        return max(1, int(os.environ["LOCAL_WORLD_SIZE"]))
    devices = cfg.trainer.get("devices", 1)
    if isinstance(devices, str):  # a count, or ids ("0,1"); "auto" and "-1" are one id each
        devices = int(devices) if devices.strip().isdigit() else [d for d in devices.split(",") if d.strip()]
    if isinstance(devices, int):
        return max(1, devices)
    return max(1, len(devices)) if isinstance(devices, Sequence) else 1


def resolve_train_precision(cfg: DictConfig) -> str:
    """``trainer.precision=auto`` made concrete in place, logged: ``bf16-mixed`` on GPUs with bf16 units (else
    ``16-mixed``) and on CPUs with them from width ``BF16_TRAIN_MIN_WIDTH``; ``32-true`` elsewhere."""
    precision = str(cfg.trainer.get("precision", "32-true"))
    if precision != "auto":
        return precision
    width = int(cfg.model.embed_dim)
    if on_gpu(cfg) and not torch.cuda.is_available():  # the run stops on it with its own line
        chosen, why = "32-true", f"trainer.accelerator={cfg.trainer.accelerator} but this machine has no GPU"
    elif on_gpu(cfg) and cuda_bf16():
        chosen, why = "bf16-mixed", "a GPU with bf16 units"
    elif on_gpu(cfg):
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


def set_matmul_precision(cfg: DictConfig) -> str:
    """Set and return ``float32_matmul_precision`` (``auto``: ``high``, TF32, on GPUs; else torch's default)."""
    wanted = str(cfg.get("float32_matmul_precision", "auto"))
    if wanted == "auto" and not on_gpu(cfg):
        return torch.get_float32_matmul_precision()  # left as torch has it
    wanted = "high" if wanted == "auto" else wanted
    torch.set_float32_matmul_precision(wanted)
    return wanted


FORMAT = "vitattn-cider-statistics/2"  # /2: <eos> a word of every reference (CiderD's eos_word)


def prepare_reward(datamodule: Any, run_dir: str | Path, resuming: bool, wait: float = WAIT_SECONDS) -> CiderD:
    """The run's CIDEr-D reward: its statistics read from the run folder (a restart; the other ranks wait), else
    computed by rank 0 from ``datamodule.train_references()`` (``ConfigError`` without them) and written there."""
    path = RunDir(run_dir).cider_statistics
    if rank_zero_only.rank != 0:
        return wait_for_rank_zero(path, wait, read_statistics)
    saved = read_statistics(path) if resuming and path.is_file() else None
    if saved is not None:
        log.info("finetune=scst: CIDEr-D statistics from this run's %s (computed once per run)", path)
        return saved
    get = getattr(datamodule, "train_references", None)
    references = get() if get is not None else None
    if not references:
        raise ConfigError(
            f"finetune=scst: the data ({type(datamodule).__name__}) gives no reference captions for its training "
            "images, and the reward is CIDEr-D against them; use caption data (data=coco, karpathy, webdataset with "
            "captions, shapes)"
        )
    started = time.monotonic()
    scorer = CiderD(references, eos_word=True)
    write_statistics(scorer, path)
    log.info(
        "finetune=scst: CIDEr-D document frequencies of %d n-grams over the %d training images' references "
        "(%.1f s), written to %s",
        len(scorer.doc_freq),
        scorer.num_images,
        time.monotonic() - started,
        path,
    )
    return scorer


def write_statistics(scorer: CiderD, path: Path) -> None:
    """Save the scorer's document frequencies (n-grams as space-joined tokens) atomically."""
    frequencies = {" ".join(gram): count for gram, count in scorer.doc_freq.items()}
    payload = {
        "format": FORMAT,
        "eos_word": scorer.eos_word,
        "num_images": scorer.num_images,
        "n": scorer.n,
        "document_frequency": frequencies,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, json.dumps(payload, ensure_ascii=False))


def read_statistics(path: Path) -> CiderD | None:
    """The scorer ``write_statistics`` saved; None for an older vitattn format (a rule no longer used); a
    one-line ``ValueError`` for a file that is not one."""
    saved = read_json(path, "CIDEr-D statistics")
    found = saved.get("format", "") if isinstance(saved, dict) else ""
    if found != FORMAT:
        if found.startswith("vitattn-cider-statistics/"):
            log.info("%s was built under an older rule (%s): computing it again", path, found)
            return None
        raise ValueError(
            f"{path} is not a vitattn CIDEr-D statistics file ({FORMAT}); move it away to compute it again"
        )
    frequencies = Counter({tuple(gram.split(" ")): count for gram, count in saved["document_frequency"].items()})
    return CiderD.from_statistics(frequencies, saved["num_images"], n=saved["n"], eos_word=saved["eos_word"])
