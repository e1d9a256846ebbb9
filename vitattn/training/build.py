"""The run's objects, each built once from its plan: DataModule, system, trainer. What they need that only the
run knows comes in here: the sizes only the data knows, the machine's cores, the ``finetune=scst`` reward. What
rank 0 computes once per run (the reward's CIDEr-D statistics) is written into the run folder, where the other
ranks and every restart read it. Once the data is built, one warning line for each way the config fights it."""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import hydra
import lightning.pytorch as pl
import torch
from hydra.errors import InstantiationException
from lightning.pytorch.utilities import rank_zero_only
from omegaconf import DictConfig, OmegaConf

from vitattn.data.images import BadImageError
from vitattn.data.tokenizer import (
    describe_tokenizer,
    tokenizer_file_name,
    tokenizer_from_labels,
    tokenizer_labels,
    unknown_share,
)
from vitattn.errors import ConfigError, first_line
from vitattn.fileio import atomic_write, read_json
from vitattn.metrics import CiderD
from vitattn.models import VisionTransformer
from vitattn.models.coca import CONTRASTIVE_PARTS
from vitattn.models.timm_weights import load_encoder_state
from vitattn.run_dir import VOCAB_FILE, RunDir
from vitattn.training.bootstrap import BootstrapSettings, prepare_pool
from vitattn.training.callbacks import PseudoLabels
from vitattn.training.config import Task, head_task, qualify
from vitattn.training.loggers import check_loggers, logger_arguments
from vitattn.training.plan import Plan, Resume
from vitattn.training.rank_zero import WAIT_SECONDS, wait_for_rank_zero
from vitattn.training.semi import SemiSettings
from vitattn.training.start_weights import EncoderWeights, ModelWeights, log_preprocess
from vitattn.training.systems import VisionSystem
from vitattn.training.systems.coca import contrastive_model_config

__all__ = [
    "MIN_TOKENS",
    "UNK_WARN_SHARE",
    "build",
    "build_datamodule",
    "build_system",
    "check_fit",
    "instantiate_group",
    "load_start",
    "model_config_from",
    "plan_cores",
    "prepare_reward",
    "semi_settings",
    "read_statistics",
    "set_matmul_precision",
    "setup_data",
    "should_compile",
    "write_statistics",
]

log = logging.getLogger(__name__)


def build(plan: Plan, plugins: list[Any]) -> tuple[Any, VisionSystem, pl.Trainer]:
    """The run's DataModule (set up for fit), system and Trainer (with ``plugins``), in that order, and its config
    and tokenizer written into the run folder: a bad split or a model the data cannot size stops the run in one
    line before any step."""
    cfg = plan.cfg
    if plan.trainer.no_gpu:
        raise ConfigError(plan.trainer.no_gpu)
    set_matmul_precision(plan)
    semi = semi_settings(cfg)
    datamodule = build_datamodule(plan)
    log_preprocess(datamodule, plan.preprocess_from)
    bootstrap = BootstrapSettings.from_config(OmegaConf.to_container(cfg.bootstrap) if cfg.get("bootstrap") else None)
    # empty data, a vocabulary other than the checkpoint's: one line, no step run
    setup_data(cfg, datamodule, plan.resume, plan.tokenizer_kind, plan.task)
    if bootstrap is not None and bootstrap.soft and (cfg.head.get("mixup") or cfg.head.get("cutmix")):
        raise ConfigError("bootstrap.soft=true takes no head.mixup / head.cutmix: timm's Mixup mixes class indices")
    if bootstrap is not None:  # after setup: the pool keeps what the human captions' vocabulary spells
        run = {**_pool_run(plan), "class_names": list(getattr(datamodule, "class_names", None) or [])}
        datamodule.pool = prepare_pool(bootstrap, plan.task, plan.run_dir, run, datamodule.vocab)
        log.info("bootstrap: %s", datamodule.use_pool(bootstrap))
    if semi is not None:
        log.info("semi=%s: %s", semi.method, datamodule.use_unlabelled(semi))
    plan_cores(plan, datamodule)
    if rank_zero_only.rank == 0:
        check_fit(plan, datamodule)  # a coarse patch grid, a vocabulary of <unk>, a schedule with no end
    system = build_system(plan, datamodule)
    callbacks = instantiate_group(cfg.get("callbacks"))
    if semi is not None:
        system.use_semi(semi)
        classes = datamodule.class_names if plan.task == Task.classification else None
        callbacks.append(PseudoLabels(RunDir(plan.run_dir).semi, classes))
    if cfg.finetune.get("scst") is not None:
        system.use_reward(prepare_reward(datamodule, plan.run_dir, plan.resume.ckpt_path is not None))
    if should_compile(plan):
        system.model.compile()  # in place: parameter names (checkpoints, bundles) stay as they are
    loggers = instantiate_group(cfg.get("logger"), logger_arguments(plan.run_dir, plan.resume.log_from))
    check_loggers(loggers)
    trainer: pl.Trainer = hydra.utils.instantiate(
        cfg.trainer,
        callbacks=callbacks,
        logger=loggers or False,
        default_root_dir=str(plan.run_dir),
        plugins=plugins,
    )
    _save_run_files(plan, datamodule)
    return datamodule, system, trainer


def semi_settings(cfg: DictConfig) -> SemiSettings | None:
    """The ``semi`` group's settings (None: ``semi=none``); their refusal as one line naming the ``semi.*`` key."""
    node = OmegaConf.to_container(cfg.semi, resolve=True) if cfg.get("semi") is not None else None
    try:
        return SemiSettings.from_config(node)
    except ValueError as err:
        raise ConfigError(qualify(first_line(err), {k: f"semi.{k}" for k in node or {}})) from None


def _pool_run(plan: Plan) -> dict[str, Any]:
    """What labelling the pool takes of the run: its seed, processes (a GPU each; on CPUs one process, whose
    threads take every core), progress bar, this process's global rank and the run's precision (bf16 where the
    run trains in it, else fp32)."""
    trainer = plan.trainer
    return {
        "rank": trainer.rank,
        "precision": "bf16" if plan.precision.trainer.startswith("bf16") else "fp32",
        "seed": int(plan.cfg.seed),
        "devices": trainer.processes if trainer.on_gpu else 1,
        "accelerator": {"cuda": "gpu"}.get(trainer.accelerator, trainer.accelerator),
        "progress": trainer.progress_bar,
    }


@rank_zero_only
def _save_run_files(plan: Plan, datamodule: Any) -> None:
    run = RunDir(plan.run_dir)
    # A complete run trained further is no longer complete: the ranks Lightning starts during fit would
    # otherwise read its old result.json beside the new config (the new length) and stop at once.
    run.result.unlink(missing_ok=True)
    run.save_config(plan.cfg)  # the config that runs
    if getattr(datamodule, "vocab", None) is not None:
        datamodule.vocab.save(run.path / tokenizer_file_name(datamodule.vocab))


def instantiate_group(group: DictConfig | None, extra: Callable[[type], dict[str, Any]] | None = None) -> list[Any]:
    """Build each ``_target_`` entry of ``group``, in order, except one whose ``enabled`` (not passed on) is
    false, null or 0; ``extra``, given an entry's class, returns keyword arguments that only the run knows."""
    entries = OmegaConf.to_container(group, resolve=True) if group else {}
    return [
        hydra.utils.instantiate(
            {k: v for k, v in node.items() if k != "enabled"},
            **(extra(hydra.utils.get_class(node["_target_"])) if extra else {}),
        )
        for node in entries.values()
        if isinstance(node, dict) and "_target_" in node and node.get("enabled", True)
    ]


def should_compile(plan: Plan) -> bool:
    """``compile=auto`` compiles on GPUs only: on CPUs eager is as fast (see docs/benchmarks.md); and not under
    ``trainer=fsdp``, whose sharded layers have not been tested compiled (``compile=true`` asks for it)."""
    if str(plan.cfg.compile).lower() == "auto":
        return plan.trainer.on_gpu and not plan.trainer.sharded
    return bool(plan.cfg.compile)


def build_datamodule(plan: Plan) -> Any:
    """The DataModule ``data`` names, given the ``tokenizer`` group and the plan's tokenizer (used as it is) for
    captions; its constructor's refusals as one-line ``ConfigError``s naming the ``data.*`` key."""
    cfg, extra = plan.cfg, {}
    if plan.task is Task.caption and "tokenizer" in cfg:
        tokenizer = OmegaConf.to_container(cfg.tokenizer, resolve=True, throw_on_missing=False)
        extra["tokenizer"] = {k: v for k, v in tokenizer.items() if v != "???"}  # a missing path: the owner says so
        extra["vocab"] = plan.vocab
    keys = {k: f"data.{k}" for k in cfg.data}
    return _instantiate(cfg.data, "data", keys, _convert_="all", **extra)


def build_system(plan: Plan, datamodule: Any) -> VisionSystem:
    """The LightningModule ``head.system`` names, sized from the data, started from the plan's start weights; the
    model's refusals as one line naming the config key (``model.num_heads=3 must divide model.embed_dim=32``)."""
    cfg = plan.cfg
    caption = plan.task is Task.caption
    labels = {"vocab": tokenizer_labels(datamodule.vocab)} if caption else {"class_names": list(datamodule.class_names)}
    parts = _model_keys(cfg, plan.task)  # a classifier's model is the system's own: its keys are the system's
    keys = plan.system_keys if caption else plan.system_keys | parts.pop("encoder")
    system = _instantiate(
        cfg.head.system,
        "head.system",
        keys,
        parts=parts,
        model_config=model_config_from(plan, datamodule),
        preprocess=dict(datamodule.preprocess),
        **labels,
    )
    if plan.start is not None:
        load_start(system, plan.start)
    return system


def load_start(target: Any, start: ModelWeights | EncoderWeights) -> None:
    """Copy the plan's start weights into ``target``, built from the config they fitted, and log one line: a whole
    model (``ModelWeights``) into a system's ``model``, an encoder's (``EncoderWeights``) into its encoder (of a
    system, or a bare ``VisionTransformer``).

    A classifier trains on its own classes, in its order. Between ``head=caption`` and ``head=coca`` the captioner's
    weights load: the contrastive parts the model lacks start fresh, those it has and the run lacks are dropped,
    each said in one line; any other mismatch is refused (``ConfigError``)."""
    if isinstance(start, EncoderWeights):
        encoder = target if isinstance(target, VisionTransformer) else getattr(target.model, "encoder", target.model)
        try:
            notes = load_encoder_state(encoder, start.state)
        except ValueError as err:
            raise ConfigError(f"finetune.init={start.source}: {first_line(err)}") from None
        parts = [f"pretrained encoder: loaded {len(start.state)} tensors of {start.what}"]
        if start.changes:
            parts.append(f"set from the weights: {', '.join(start.changes)}")
        _info("; ".join(parts + notes + start.notes))
        return
    bundle, classes = start.bundle, target.hparams.get("class_names")
    if bundle.task == "classification" and list(classes) != list(bundle.class_names):
        raise ConfigError(
            f"finetune.init={start.source} classifies {list(bundle.class_names)}; the data's classes are "
            f"{list(classes)}; train on the same classes"
        )
    ours, theirs = target.model.state_dict(), bundle.model.state_dict()
    new, dropped = _parts(ours.keys() - theirs.keys()), _parts(theirs.keys() - ours.keys())
    other = [part for part in new + dropped if part not in CONTRASTIVE_PARTS]
    if other:
        raise ConfigError(
            f"finetune.init={start.source}: its model and the run's differ in {', '.join(other)}; only the "
            f"contrastive parts ({', '.join(CONTRASTIVE_PARTS)}) may differ, between head=caption and head=coca"
        )
    strict = not (new or dropped)
    try:
        target.model.load_state_dict({k: v for k, v in theirs.items() if k in ours}, strict=strict)
    except RuntimeError as err:
        raise ConfigError(f"finetune.init={start.source}: {first_line(err)}") from None
    what = "every weight" if strict else "the captioner's weights"
    _info(
        f"finetune.init: started from {what} of the {bundle.task} model {start.source}"
        + (f"; new (the model has none): {', '.join(new)}" if new else "")
        + (f"; dropped (the run has none): {', '.join(dropped)}" if dropped else "")
    )


def _parts(keys: Any) -> list[str]:
    """The top-level modules and parameters that ``keys`` (state-dict keys) belong to, sorted."""
    return sorted({key.split(".")[0] for key in keys})


@rank_zero_only
def _info(line: str) -> None:
    log.info(line)


def _model_keys(cfg: DictConfig, task: Task) -> dict[str, dict[str, str]]:
    """The config keys of each model part's keyword arguments, by the part's name as a captioner's errors start
    (``decoder: num_heads=3 ...``): ``encoder``, and for captioners ``decoder`` and ``contrastive``."""
    encoder = {k: f"model.{k}" for k in cfg.model} | {"img_size": "data.img_size", "d_model": "model.embed_dim"}
    if task is not Task.caption:
        return {"encoder": encoder}
    decoder = {k: f"head.decoder.{k}" for k in cfg.head.decoder} | {"d_model": "head.decoder.embed_dim"}
    contrastive = {k: f"head.contrastive.{k}" for k in cfg.head.get("contrastive", {})}
    contrastive |= {f"text_{k}": f"head.contrastive.text_{k}" for k in ("num_heads", "depth", "mlp_ratio")}
    return {"encoder": encoder, "decoder": decoder, "contrastive": contrastive}


def _instantiate(
    node: DictConfig, where: str, keys: dict[str, str], parts: dict[str, dict[str, str]] | None = None, **kwargs: Any
) -> Any:
    """``hydra.utils.instantiate``; a ``ValueError`` or ``TypeError`` of the constructor as a one-line
    ``ConfigError`` with its keys named in full: ``keys``, or a model part's (``parts``) when the line starts with
    that part's name; a line that names its config key already (``head.contrastive.loss=...``) as it is."""
    try:
        return hydra.utils.instantiate(node, **kwargs)
    except InstantiationException as err:
        cause = err.__cause__
        if isinstance(cause, ConfigError):
            raise cause from None
        if isinstance(cause, (ValueError, TypeError)):
            line = first_line(cause)
            part, _, rest = line.partition(": ")
            if rest and part in (parts or {}):
                raise ConfigError(qualify(rest, parts[part])) from None
            line = rest if rest and part == where else line  # the owner's ``data: std=...``: its keys in full
            message = qualify(line, keys)
            named = message != line or line.startswith(f"{where.split('.')[0]}.")  # ``data.augment.crop=...``
            raise ConfigError(message if named else f"{where}: {message}") from None
        raise


def model_config_from(plan: Plan, datamodule: Any) -> dict[str, Any]:
    """Plain model keyword arguments from the plan and the values only the data knows."""
    cfg = plan.cfg
    encoder = OmegaConf.to_container(cfg.model, resolve=True)
    encoder["img_size"] = datamodule.img_size
    if plan.task is Task.classification:
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
    if plan.contrastive:  # head=coca
        images = int(cfg.data.batch_size)
        if cfg.data.get("batch_patches"):  # training batches by patches: a full-length one (batch_size: evaluation)
            images = int(cfg.data.batch_patches) // int(cfg.data.max_patches)
        pairs = images * plan.trainer.processes * plan.trainer.num_nodes
        config["contrastive"] = contrastive_model_config(
            OmegaConf.to_container(cfg.head.contrastive, resolve=True), pairs
        )
    return config


def setup_data(
    cfg: DictConfig,
    datamodule: Any,
    resume: Resume | None = None,
    tokenizer_kind: str | None = None,
    task: Task | None = None,
) -> None:
    """``datamodule.setup("fit")``; an unreadable or empty split, and a vocabulary or class list other than the
    resumed checkpoint's (``resume``, read by the plan; ``task``: the plan's, else ``head.task``), as one-line
    ``ConfigError``s before any step."""
    data = cfg.data
    where = f"data.root={data.root}" if "root" in data else f"data={str(data._target_).rsplit('.', 1)[-1]}"
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
    if resume is not None and resume.ckpt_path:
        _check_checkpoint_matches(cfg, datamodule, resume, tokenizer_kind, task or head_task(cfg.head)[0])


def _check_checkpoint_matches(
    cfg: DictConfig, datamodule: Any, resume: Resume, tokenizer_kind: str | None, task: Task
) -> None:
    key, ckpt_path, hparams = resume.key, resume.ckpt_path, resume.hparams
    trained = Task.caption if "vocab" in hparams else Task.classification if "class_names" in hparams else None
    if trained is not None and trained is not task:
        raise ConfigError(
            f"{key}: checkpoint {ckpt_path} was trained with head={trained}, not head={task}; use head={trained}"
        )
    caption = trained is Task.caption
    if caption and (isinstance(hparams["vocab"], str) or isinstance(tokenizer_labels(datamodule.vocab), str)):
        _check_subword_matches(cfg, datamodule.vocab, hparams["vocab"], ckpt_path, tokenizer_kind)
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
    elif trained is Task.classification:
        names, theirs = list(datamodule.class_names), list(hparams["class_names"])
        if names != theirs:
            raise ConfigError(
                f"data: classes {names} differ from the checkpoint's {theirs} ({ckpt_path}); train on the same classes"
            )


def _check_subword_matches(cfg: DictConfig, ours: Any, labels: Any, ckpt_path: str, kind: str | None) -> None:
    """The run's tokenizer is the checkpoint's (one of them a subword tokenizer): else one line with the fix."""
    try:
        theirs = tokenizer_from_labels(labels, f"checkpoint {ckpt_path}")
    except ValueError as err:
        raise ConfigError(f"{first_line(err)}; use another checkpoint") from None
    if type(ours) is type(theirs) and ours == theirs:
        return
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


def plan_cores(plan: Plan, datamodule: Any) -> tuple[int, int]:
    """``(workers, threads)`` of this process's share of the node's cores: ``auto`` workers the DataModule's
    ``plan_workers``, ``auto`` threads what they leave on a CPU (torch's default on GPUs); a number set is kept."""
    cores, processes, gpu = len(os.sched_getaffinity(0)), plan.trainer.processes, plan.trainer.on_gpu
    share = max(1, cores // processes)
    choose = getattr(datamodule, "plan_workers", None)
    workers = choose(gpu, share) if choose is not None else int(getattr(datamodule, "num_workers", 0))
    wanted = plan.cfg.get("num_threads")
    if wanted == "auto":
        wanted = torch.get_num_threads() if gpu else max(1, share - workers)
    if wanted:
        torch.set_num_threads(int(wanted))
    threads = torch.get_num_threads()
    log.info("cores: %d for %d process(es); loader workers: %d; torch threads: %d", cores, processes, workers, threads)
    return workers, threads


def set_matmul_precision(plan: Plan) -> str:
    """Set and return ``float32_matmul_precision`` (``auto``: ``high``, TF32, on GPUs; else torch's default)."""
    wanted = plan.precision.matmul
    if wanted == "auto" and not plan.trainer.on_gpu:
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


MIN_TOKENS = 36  # a 6 x 6 patch grid
UNK_WARN_SHARE = 0.05


def _grid(cfg: DictConfig, img_size: int) -> str | None:
    side = img_size // cfg.model.patch_size
    if side * side >= MIN_TOKENS:
        return None
    better = next((p for p in (16, 14, 8, 7, 4, 2) if (img_size // p) ** 2 >= MIN_TOKENS and img_size % p == 0), None)
    fix = f"; try model.patch_size={better}" if better else ""
    return (
        f"model.patch_size={cfg.model.patch_size} cuts {img_size} px images into a {side}x{side} grid "
        f"({side * side} tokens, fewer than {MIN_TOKENS}): attention has little to work with{fix}"
    )


def _vocabulary(cfg: DictConfig, datamodule: Any, kind: str | None) -> str | None:
    vocab, train = getattr(datamodule, "vocab", None), getattr(datamodule, "train_dataset", None)
    captions = getattr(datamodule, "train_captions", None) or getattr(getattr(train, "dataset", None), "captions", None)
    if vocab is None or (captions is None and vocab.unk_id is not None):
        return None
    share = unknown_share(vocab, captions or [])
    if vocab.unk_id is None:
        log.info(
            "tokenizer=%s: no caption word is outside %s (it has no unknown token)", kind, describe_tokenizer(vocab)
        )
    else:
        also = "; tokenizer=bpe has none" if kind != "bpe" else ""
        log.info("%.1f %% of caption words are outside %s%s", 100 * share, describe_tokenizer(vocab), also)
    if share <= UNK_WARN_SHARE:
        return None
    fix = (
        f"tokenizer.path={cfg.tokenizer.path} lacks these words: choose another file"
        if kind == "file"
        else f"lower data.min_word_freq={cfg.data.min_word_freq}"
        if "min_word_freq" in cfg.data
        else "use a vocabulary built from these captions (data.vocab_path=null)"
    )
    fix += "; or tokenizer=bpe, which has no unknown token"
    most = "most " if share > 0.5 else ""
    return f"{most}training caption tokens become <unk> ({100 * share:.1f} %, over {100 * UNK_WARN_SHARE:.0f} %); {fix}"


def _step_limit(trainer: DictConfig, steps_per_epoch: int) -> float:
    """Optimizer steps at which ``max_steps`` or ``max_epochs`` ends training (the first of them), or inf."""
    steps, epochs = trainer.get("max_steps") or 0, trainer.get("max_epochs") or 0
    limits = [n for n in (steps, epochs * steps_per_epoch) if n > 0]  # -1 or null: no limit
    return float(min(limits)) if limits else math.inf


def _schedule(cfg: DictConfig, datamodule: Any, fast_dev_run: bool) -> str | None:
    trainer = cfg.trainer
    if fast_dev_run:
        return None
    batches = len(datamodule.train_dataloader())
    if isinstance(trainer.get("limit_train_batches"), int):  # a float is a share of the epoch
        batches = min(batches, trainer.limit_train_batches)
    steps_per_epoch = max(1, math.ceil(batches / max(1, trainer.get("accumulate_grad_batches") or 1)))
    limit = _step_limit(trainer, steps_per_epoch)
    if not math.isfinite(limit) and not trainer.get("max_time"):
        return (
            "no trainer.max_steps, trainer.max_epochs or trainer.max_time: the learning-rate schedule has no end "
            "and stays at its peak; set one of them"
        )
    warmup = cfg.optim.warmup_steps  # auto (conf/train.yaml's default) fits any run: no advice needed
    if warmup != "auto" and math.isfinite(limit) and warmup > limit // 10 and not trainer.get("max_time"):
        return (
            f"optim.warmup_steps={warmup} is more than a tenth of the {int(limit)}-step run: warmup is cut to "
            f"{max(1, int(limit) // 10)} steps; lower optim.warmup_steps or train longer"
        )
    return None


def check_fit(plan: Plan, datamodule: Any) -> list[str]:
    """Warn (one line each) where the plan fights the data or the limits; returns the warnings."""
    cfg = plan.cfg
    grid, vocabulary = _grid(cfg, datamodule.img_size), _vocabulary(cfg, datamodule, plan.tokenizer_kind)
    warnings = [w for w in (grid, vocabulary, _schedule(cfg, datamodule, plan.trainer.fast_dev_run)) if w]
    for warning in warnings:
        log.warning(warning)
    return warnings
