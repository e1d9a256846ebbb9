"""Checks and derived values for the composed training config.

Every user error in a config is found here, before any data is read or any step runs, and is
reported as one ``ConfigError`` line that names the key and the fix.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import hydra
import torch
from omegaconf import DictConfig, OmegaConf

from vitattn.layers.feedforward import ACTIVATIONS
from vitattn.models.vit import POOLS

__all__ = ["ConfigError", "check_config", "check_targets", "setup_data", "model_config_from", "ALLOWED_TARGET_PREFIXES"]

TASKS = ("caption", "classification")
# Modules a saved config's `_target_` may name (configs read back from disk are not trusted further).
ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


def _check_width(prefix: str, width: int, heads: int) -> None:
    if heads <= 0 or width % heads != 0:
        raise ConfigError(
            f"{prefix}.num_heads={heads} must divide {prefix}.embed_dim={width}; pick a divisor such as {_divisor(width)}"
        )


def _divisor(n: int) -> int:
    return next(d for d in (8, 6, 4, 3, 2, 1) if n % d == 0)


def _data_tasks(data: DictConfig) -> tuple[str, ...]:
    try:
        cls = hydra.utils.get_class(data._target_)
    except (ImportError, ValueError) as err:
        raise ConfigError(
            f"data._target_={data._target_} cannot be imported ({type(err).__name__}); choose data=shapes, data=imagefolder or data=coco"
        ) from err
    return tuple(getattr(cls, "tasks", TASKS))


_DIR_KEYS = ("root", "image_dir")
_FILE_KEYS = ("train_annotations", "val_annotations", "test_annotations", "vocab_path")


def _check_paths(data: DictConfig) -> None:
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


def check_targets(cfg: DictConfig) -> None:
    """Refuse a ``_target_`` outside vitattn, torch, torchvision, timm and lightning."""

    def walk(node: Any, path: str) -> None:
        if isinstance(node, DictConfig):
            target = node.get("_target_") if "_target_" in node else None
            if target is not None and not str(target).startswith(ALLOWED_TARGET_PREFIXES):
                raise ConfigError(
                    f"{path}._target_={target} is not allowed; targets must be in {', '.join(p.rstrip('.') for p in ALLOWED_TARGET_PREFIXES)}"
                )
            for key in node.keys():
                walk(node._get_node(key), f"{path}.{key}" if path else str(key))

    walk(cfg, "")


def check_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first user error in ``cfg`` (composed ``conf/train.yaml``)."""
    check_targets(cfg)
    task = cfg.head.task
    if task not in TASKS:
        raise ConfigError(f"head.task={task!r} is unknown; choose head=caption or head=classification")
    if cfg.head.get("nonfinite", "raise") not in ("raise", "skip"):
        raise ConfigError(f"head.nonfinite={cfg.head.nonfinite!r} is unknown; choose raise or skip")
    supported = _data_tasks(cfg.data)
    if task not in supported:
        if task == "caption":
            what, fix = "captions", "use head=classification, or data=shapes / data=coco"
        else:
            what, fix = "class labels", "use head=caption, or data=shapes / data=imagefolder"
        raise ConfigError(f"data={_data_name(cfg.data)} has no {what} for head={task}; {fix}")
    model = cfg.model
    _check_width("model", model.embed_dim, model.num_heads)
    img_size = cfg.data.img_size
    if img_size % model.patch_size != 0:
        raise ConfigError(f"data.img_size={img_size} must be divisible by model.patch_size={model.patch_size}")
    if model.global_pool not in POOLS:
        raise ConfigError(f"model.global_pool={model.global_pool!r} is unknown; choose one of {list(POOLS)}")
    if model.activation not in ACTIVATIONS:
        raise ConfigError(f"model.activation={model.activation!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
    if task == "caption":
        dec = cfg.head.decoder
        _check_width("head.decoder", dec.embed_dim, dec.num_heads)
        if dec.activation not in ACTIVATIONS:
            raise ConfigError(
                f"head.decoder.activation={dec.activation!r} is unknown; choose one of {sorted(ACTIVATIONS)}"
            )
        max_new = cfg.head.generate.get("max_new_tokens")
        if max_new is not None and max_new + 1 > dec.max_len:
            raise ConfigError(
                f"head.generate.max_new_tokens={max_new} must be below head.decoder.max_len={dec.max_len}"
            )
    if cfg.get("resume") and not (Path(cfg.resume) / "checkpoints" / "last.ckpt").is_file():
        raise ConfigError(f"resume={cfg.resume} has no checkpoints/last.ckpt to continue from")
    if cfg.get("ckpt_path") and not Path(cfg.ckpt_path).is_file():
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} does not exist")
    _check_sizes(cfg)
    _check_paths(cfg.data)


def _data_name(data: DictConfig) -> str:
    return str(data._target_).rsplit(".", 1)[-1]


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def setup_data(cfg: DictConfig, datamodule: Any, ckpt_path: str | None = None) -> None:
    """``datamodule.setup("fit")``, with what only the data can tell reported as ``ConfigError``.

    An unreadable or empty split, and a vocabulary or class list that differs from the one the
    checkpoint being resumed (``ckpt_path``) was trained with, are one-line errors before any step.
    """
    data = cfg.data
    where = f"data.root={data.root}" if "root" in data else f"data={_data_name(data)}"
    try:
        datamodule.setup("fit")
    except (ValueError, FileNotFoundError, NotADirectoryError, PermissionError) as err:
        layout = "; expected ROOT/train/<class>/<image> and ROOT/val/<class>/<image>" if "root" in data else ""
        raise ConfigError(f"{where}: {_first_line(err)}{layout}") from err
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
            f"{key}: checkpoint {ckpt_path} cannot be read ({_first_line(err)}); use another checkpoint"
        ) from err
    task = cfg.head.task
    trained = "caption" if "vocab" in hparams else "classification" if "class_names" in hparams else None
    if trained is not None and trained != task:
        raise ConfigError(
            f"{key}: checkpoint {ckpt_path} was trained with head={trained}, not head={task}; use head={trained}"
        )
    if task == "caption" and trained == "caption":
        words, theirs = list(datamodule.vocab.itos[4:]), list(hparams["vocab"])
        if words != theirs:
            i = next((i for i, (a, b) in enumerate(zip(words, theirs)) if a != b), min(len(words), len(theirs)))
            differ = f"{words[i]!r} vs {theirs[i]!r}" if i < min(len(words), len(theirs)) else "one list is longer"
            source = (
                f"data.vocab_path={cfg.data.vocab_path}"
                if cfg.data.get("vocab_path")
                else "the vocabulary built from the training captions"
            )
            saved = Path(ckpt_path).resolve().parents[1] / "vocab.json"
            fix = f"data.vocab_path={saved}" if saved.is_file() else "data.vocab_path=<the run's vocab.json>"
            raise ConfigError(
                f"data.vocab_path: {source} ({len(words)} words) differs from the checkpoint's ({len(theirs)} words, "
                f"first difference at word {i}: {differ}); use the vocabulary the model was trained with: {fix}"
            )
    if task == "classification" and trained == "classification":
        names, theirs = list(datamodule.class_names), list(hparams["class_names"])
        if names != theirs:
            raise ConfigError(
                f"data: classes {names} differ from the checkpoint's {theirs} ({ckpt_path}); train on the same classes"
            )


def model_config_from(cfg: DictConfig, datamodule: Any) -> dict[str, Any]:
    """Plain model keyword arguments from the config and the values only the data knows."""
    encoder = OmegaConf.to_container(cfg.model, resolve=True)
    encoder.pop("_target_", None)
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
    )
    return {"encoder": {**encoder, "num_classes": 0}, "decoder": decoder}
