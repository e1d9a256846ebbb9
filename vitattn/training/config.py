"""The training config: composed as ``vitattn-train`` composes it, its ``_target_`` nodes kept to an allow-list
(a run folder's config is input), and checked once resolved (``training.plan``).

``check_config`` finds, before any data is read, every user error in the keys no constructor sees, as one
``ConfigError`` line naming the key and the fix. What a constructor checks (the model's shape, ``tokenizer``, the
``data.*`` preprocessing, ``data.augment``, ``data.bad_images``, ``head.generate``, head=coca's loss and weights) is
checked there, once, when the run builds it (``training.build`` names its config key).
"""

from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path

import hydra
from hydra import compose, initialize_config_module
from omegaconf import DictConfig, ListConfig, OmegaConf

from vitattn.errors import ConfigError
from vitattn.models import TASKS
from vitattn.run_dir import check_targets
from vitattn.training.systems.caption import ZERO_SHOT_MONITOR
from vitattn.training.systems.coca import RETRIEVAL_MONITORS

__all__ = [
    "Task",
    "check_config",
    "check_data_paths",
    "compose_train",
    "data_name",
    "fully_sharded",
    "head_task",
    "qualify",
]


class Task(StrEnum):
    """What a run trains for (``head.task``): a caption or a class per image. A ``StrEnum``: it equals its name, so
    the library, which takes the task as a string, takes it as it is."""

    caption = "caption"
    classification = "classification"


def head_task(head: DictConfig) -> tuple[Task, bool]:
    """The task of a ``head`` config and whether its captioner also learns image and text embeddings (head=coca:
    a caption head with a ``contrastive`` part); the one place either is read from the config."""
    task = head.task
    if task not in TASKS:
        raise ConfigError(f"head.task={task!r} is unknown; choose head=caption or head=classification")
    return Task(task), head.get("contrastive") is not None


_DIR_KEYS = ("root", "image_dir")
_FILE_KEYS = ("train_annotations", "val_annotations", "test_annotations", "vocab_path", "dataset_json")


def compose_train(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with Hydra ``overrides``, without a run directory (``paths.output_dir``)."""
    with initialize_config_module("vitattn.conf", version_base="1.3"):
        return compose("train", overrides=list(overrides))


def data_name(data: DictConfig) -> str:
    """The DataModule class a data config names (``ShapesDataModule``, ...)."""
    return str(data._target_).rsplit(".", 1)[-1]


def check_data_paths(data: DictConfig) -> None:
    """Raise ``ConfigError`` for a data folder or file that is required, missing or unreadable."""
    for key in (*_DIR_KEYS, *_FILE_KEYS):
        if key not in data.keys():  # `key in data` is False for a ??? value
            continue
        if OmegaConf.is_missing(data, key):
            raise ConfigError(f"data.{key} is required: add data.{key}=PATH")
        value = data[key]
        if value is None:
            continue
        path, kind = Path(value), "folder" if key in _DIR_KEYS else "file"
        if not path.exists():
            raise ConfigError(f"data.{key}={value} does not exist; give an existing {kind}")
        if not (path.is_dir() if kind == "folder" else path.is_file()):
            raise ConfigError(f"data.{key}={value} is not a {kind}")
        if not os.access(path, os.R_OK | (os.X_OK if kind == "folder" else 0)):
            raise ConfigError(f"data.{key}={value} is not readable; fix its permissions")


def _check_sizes(cfg: DictConfig) -> None:
    splits = ("num_train", "num_val", "num_test") if cfg.test else ("num_train", "num_val")
    for key in splits:
        if key in cfg.data and cfg.data[key] < 1:
            raise ConfigError(f"data.{key}={cfg.data[key]} leaves that split empty; use 1 or more")


def qualify(message: str, keys: dict[str, str]) -> str:
    """``num_heads=3 must divide embed_dim=32`` -> ``model.num_heads=3 must divide model.embed_dim=32``; a list's
    entry too: ``merge_tokens[1]=9`` -> ``model.merge_tokens[1]=9``."""
    return re.sub(r"(?<![\w.])(\w+)(?==|\.\w|\[\d+\]=)", lambda m: keys.get(m[1], m[1]), message)


def _check_contrastive(cfg: DictConfig) -> None:
    """head=coca: the best checkpoint's monitor (its loss, weights and logit bias: ``CocaSystem``'s)."""
    head = cfg.head
    monitors = ("val/cider_d", *RETRIEVAL_MONITORS, ZERO_SHOT_MONITOR)
    if head.monitor not in monitors or head.monitor_mode != "max":
        raise ConfigError(
            f"head.monitor={head.monitor} head.monitor_mode={head.monitor_mode}: head=coca picks its best "
            f"checkpoint by one of {', '.join(monitors)}, with head.monitor_mode=max"
        )
    if head.monitor == ZERO_SHOT_MONITOR and head.get("zero_shot", {}).get("data_root") is None:
        raise ConfigError(
            f"head.monitor={ZERO_SHOT_MONITOR} needs head.zero_shot.data_root=DIR, a folder <split>/<class>/<image> "
            "classified by its class names at each validation"
        )


def _check_finetuning(cfg: DictConfig) -> None:
    layer_decay, head_lr = cfg.optim.get("layer_decay"), cfg.optim.get("head_lr")
    if layer_decay is not None and not 0 < layer_decay <= 1:
        raise ConfigError(f"optim.layer_decay={layer_decay} must be in (0, 1] (e.g. 0.75), or null for none")
    if head_lr is not None and not head_lr > 0:
        raise ConfigError(f"optim.head_lr={head_lr} must be positive, or null for optim.lr")


def _check_self_critical(cfg: DictConfig, task: Task) -> None:
    if cfg.finetune.get("scst") is None:
        return
    if task is not Task.caption:
        raise ConfigError(
            f"finetune=scst trains captioners on a caption reward; head={task} has no captions: "
            "use head=caption, or drop finetune=scst"
        )
    if not cfg.finetune.get("init"):
        raise ConfigError(
            "finetune=scst needs finetune.init=RUN_OR_BUNDLE: a captioner trained with cross-entropy first "
            "(self-critical training from random weights samples nothing a reward can rank)"
        )


def _check_semi(cfg: DictConfig, task: Task, contrastive: bool) -> None:
    """``semi=``: what online pseudo-labels do not combine with, refused in one line each (its own keys:
    ``SemiSettings``')."""
    method = (cfg.get("semi") or {}).get("method", "none")
    if method == "none":
        return
    if contrastive:
        raise ConfigError(
            f"semi={method} with head=coca is not supported (whether pseudo-captioned images should enter the "
            "contrastive term is untested): use head=caption or head=classification"
        )
    if cfg.finetune.get("scst") is not None:
        raise ConfigError(f"semi={method} does not combine with finetune=scst: train one of them per run")
    if method == "freematch" and task != Task.classification:
        raise ConfigError(f"semi=freematch adapts a threshold per class; head={task} has no classes: use semi=fixmatch")
    if cfg.get("bootstrap") and (cfg.bootstrap.get("teacher") or cfg.bootstrap.get("candidates")):
        raise ConfigError(
            f"semi={method} and bootstrap.teacher / bootstrap.candidates are two sources of pseudo-labels: use one"
        )
    if data_name(cfg.data) == "WebDatasetDataModule":
        raise ConfigError(
            f"semi={method} pairs each labelled batch with the unlabelled stream of a resumable sampler, which "
            "data=webdataset's shard streams have not: use data=imagefolder (shards are fine as semi.images)"
        )


def fully_sharded(strategy: str) -> bool:
    """``trainer=fsdp``: ``strategy``, the class a configured ``trainer.strategy`` names, is Lightning's
    ``ModelParallelStrategy`` (``FullyShardedStrategy``)."""
    return strategy.endswith(("FullyShardedStrategy", "ModelParallelStrategy"))


def _check_sharded(cfg: DictConfig) -> None:
    """``trainer=fsdp`` with the EMA or self-critical training: refused in one line, with the reason."""
    strategy = cfg.trainer.get("strategy")
    if not isinstance(strategy, DictConfig) or not fully_sharded(str(strategy.get("_target_", ""))):
        return
    if cfg.get("ema", {}).get("decay"):
        raise ConfigError(
            f"ema.decay={cfg.ema.decay} does not work with trainer=fsdp: Lightning's WeightAveraging keeps a whole "
            "copy of the model on every process and averages it with the sharded weights; set ema.decay=null, "
            "or train with trainer=ddp"
        )
    method = (cfg.get("semi") or {}).get("method", "none")
    if method != "none":
        raise ConfigError(
            f"semi={method} does not work with trainer=fsdp: its labelling pass calls the sharded model in eval mode "
            "outside the step's forward, untested under FSDP; train it with trainer=ddp"
        )
    if cfg.finetune.get("scst") is not None:
        raise ConfigError(
            "finetune=scst does not work with trainer=fsdp: its sampling loop calls the sharded decoder step by "
            "step outside forward, where FSDP gathers no weights, and the ranks' samples end at different steps; "
            "train it with trainer=ddp"
        )


def _check_patches(cfg: DictConfig) -> None:
    """``data.max_patches`` with token merging (``TokenMerge`` refuses padding) or with a pool of images without
    labels (``semi=``, ``bootstrap.*``: their views are square), and ``data.batch_patches`` with
    ``trainer.overfit_batches``: refused before anything is built."""
    max_patches, merge = cfg.data.get("max_patches"), cfg.model.get("merge_tokens") or 0
    per_layer = OmegaConf.to_container(merge) if isinstance(merge, ListConfig) else [merge]
    if max_patches is not None and any(per_layer):
        spelled = f"[{','.join(map(str, per_layer))}]" if isinstance(merge, ListConfig) else merge  # as typed
        raise ConfigError(
            f"model.merge_tokens={spelled} merges padded patches into real ones (data.max_patches={max_patches}): "
            "set model.merge_tokens=0, or leave data.max_patches unset"
        )
    semi = (cfg.get("semi") or {}).get("method", "none")
    pool = cfg.get("bootstrap") and (cfg.bootstrap.get("teacher") or cfg.bootstrap.get("candidates"))
    if max_patches is not None and (semi != "none" or pool):
        key = f"semi={semi}" if semi != "none" else "bootstrap.teacher / bootstrap.candidates"
        raise ConfigError(
            f"{key} reads its pool images square; data.max_patches={max_patches} batches images at their own aspect: "
            "leave data.max_patches unset for a run with a pool"
        )
    batch_patches, overfit = cfg.data.get("batch_patches"), cfg.trainer.get("overfit_batches") or 0
    if batch_patches is not None and overfit:  # Lightning replays the first batches through a sampler of its own
        raise ConfigError(
            f"trainer.overfit_batches={overfit} replays batches of data.batch_size, not batches by patches "
            f"(data.batch_patches={batch_patches}): leave data.batch_patches unset to overfit"
        )


def check_config(cfg: DictConfig) -> tuple[Task, bool]:
    """Raise ``ConfigError`` for the first user error in ``cfg`` (the composed ``train`` config); return its task and
    whether its captioner is head=coca's (``head_task``)."""
    check_targets(OmegaConf.to_container(cfg))  # plain values: the library reads no config object
    task, contrastive = head_task(cfg.head)
    warmup = cfg.optim.warmup_steps
    if warmup != "auto" and (not isinstance(warmup, int) or warmup < 0):
        raise ConfigError(f"optim.warmup_steps={warmup!r} must be a whole number of steps, or auto")
    try:
        supported = tuple(getattr(hydra.utils.get_class(cfg.data._target_), "tasks", TASKS))
    except (ImportError, ValueError) as err:
        raise ConfigError(
            f"data._target_={cfg.data._target_} cannot be imported ({type(err).__name__}); "
            "choose data=shapes, data=imagefolder, data=coco or data=karpathy"
        ) from err
    if task not in supported:
        if task is Task.caption:
            what, fix = "captions", "use head=classification, or data=shapes / data=coco / data=karpathy"
        else:
            what, fix = "class labels", "use head=caption, or data=shapes / data=imagefolder"
        raise ConfigError(f"data={data_name(cfg.data)} has no {what} for head={task}; {fix}")
    if contrastive:
        _check_contrastive(cfg)
    _check_finetuning(cfg)
    _check_self_critical(cfg, task)
    _check_semi(cfg, task, contrastive)
    _check_sharded(cfg)
    _check_patches(cfg)
    _check_sizes(cfg)
    check_data_paths(cfg.data)
    return task, contrastive
