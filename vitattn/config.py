"""Checks and derived values for the composed training config.

Every user error in a config is found here, before any data is read or any step runs, and is
reported as one ``ConfigError`` line that names the key and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from timm.data import IMAGENET_DEFAULT_MEAN, IMAGENET_DEFAULT_STD

from vitattn.layers.feedforward import ACTIVATIONS
from vitattn.models.vit import POOLS

__all__ = ["ConfigError", "check_config", "model_config_from", "data_preprocess", "ALLOWED_TARGET_PREFIXES"]

TASKS = ("caption", "classification")
# Modules a saved config's `_target_` may name (configs read back from disk are not trusted further).
ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


def _check_width(prefix: str, width: int, heads: int) -> None:
    if heads <= 0 or width % heads != 0:
        raise ConfigError(f"{prefix}.num_heads={heads} must divide {prefix}.embed_dim={width}; pick a divisor such as {_divisor(width)}")


def _divisor(n: int) -> int:
    return next(d for d in (8, 6, 4, 3, 2, 1) if n % d == 0)


def _data_tasks(data: DictConfig) -> tuple[str, ...]:
    cls = hydra.utils.get_class(data._target_)
    return tuple(getattr(cls, "tasks", TASKS))


def _check_paths(data: DictConfig) -> None:
    for key in ("root", "image_dir", "train_annotations", "val_annotations", "test_annotations", "vocab_path"):
        if key not in data:
            continue
        if OmegaConf.is_missing(data, key):
            raise ConfigError(f"data.{key} is required: add data.{key}=PATH")
        value = data[key]
        if value is not None and not Path(value).exists():
            raise ConfigError(f"data.{key}={value} does not exist")


def check_targets(cfg: DictConfig) -> None:
    """Refuse a ``_target_`` outside vitattn, torch, torchvision, timm and lightning."""
    def walk(node: Any, path: str) -> None:
        if isinstance(node, DictConfig):
            target = node.get("_target_") if "_target_" in node else None
            if target is not None and not str(target).startswith(ALLOWED_TARGET_PREFIXES):
                raise ConfigError(f"{path}._target_={target} is not allowed; targets must be in {', '.join(p.rstrip('.') for p in ALLOWED_TARGET_PREFIXES)}")
            for key in node.keys():
                walk(node._get_node(key), f"{path}.{key}" if path else str(key))
    walk(cfg, "")


def check_config(cfg: DictConfig) -> None:
    """Raise ``ConfigError`` for the first user error in ``cfg`` (composed ``conf/train.yaml``)."""
    check_targets(cfg)
    task = cfg.head.task
    if task not in TASKS:
        raise ConfigError(f"head.task={task!r} is unknown; choose head=caption or head=classification")
    supported = _data_tasks(cfg.data)
    if task not in supported:
        other = "head=classification" if task == "caption" else "data=shapes or data=coco"
        raise ConfigError(f"data={cfg.data._target_.rsplit('.', 1)[-1]} has no {'captions' if task == 'caption' else 'class labels'} for head={task}; use {other}")
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
            raise ConfigError(f"head.decoder.activation={dec.activation!r} is unknown; choose one of {sorted(ACTIVATIONS)}")
        max_new = cfg.head.generate.get("max_new_tokens")
        if max_new is not None and max_new + 1 > dec.max_len:
            raise ConfigError(f"head.generate.max_new_tokens={max_new} must be below head.decoder.max_len={dec.max_len}")
    if cfg.get("resume") and not (Path(cfg.resume) / "checkpoints" / "last.ckpt").is_file():
        raise ConfigError(f"resume={cfg.resume} has no checkpoints/last.ckpt to continue from")
    if cfg.get("ckpt_path") and not Path(cfg.ckpt_path).is_file():
        raise ConfigError(f"ckpt_path={cfg.ckpt_path} does not exist")
    _check_paths(cfg.data)


def model_config_from(cfg: DictConfig, datamodule: Any) -> dict[str, Any]:
    """Plain model keyword arguments from the config and the values only the data knows."""
    encoder = OmegaConf.to_container(cfg.model, resolve=True)
    encoder.pop("_target_", None)
    encoder["img_size"] = datamodule.img_size
    if cfg.head.task == "classification":
        return {**encoder, "num_classes": datamodule.num_classes}
    vocab = datamodule.vocab
    decoder = OmegaConf.to_container(cfg.head.decoder, resolve=True)
    decoder.update(vocab_size=len(vocab), memory_dim=encoder["embed_dim"], pad_id=vocab.pad_id, bos_id=vocab.bos_id, eos_id=vocab.eos_id)
    return {"encoder": {**encoder, "num_classes": 0}, "decoder": decoder}


def data_preprocess(datamodule: Any) -> dict[str, Any]:
    """How to turn an image file into the model's input: the DataModule's own, else a squash resize."""
    preprocess = getattr(datamodule, "preprocess", None)
    if preprocess is not None:
        return dict(preprocess)
    return {
        "img_size": datamodule.img_size,
        "crop_pct": 1.0,
        "crop_mode": "squash",
        "interpolation": "bicubic",
        "mean": list(IMAGENET_DEFAULT_MEAN),
        "std": list(IMAGENET_DEFAULT_STD),
    }
