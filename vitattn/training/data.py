"""The run's data, set up before any step: empty splits and a checkpoint that does not fit are one-line errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from vitattn.data.images import BadImageError
from vitattn.data.tokenizer import tokenizer_file_name, tokenizer_from_labels, tokenizer_labels
from vitattn.errors import ConfigError, first_line
from vitattn.run_dir import RunDir
from vitattn.training.config import data_name

__all__ = ["setup_data"]


def setup_data(cfg: DictConfig, datamodule: Any, ckpt_path: str | None = None) -> None:
    """``datamodule.setup("fit")``, with what only the data can tell reported as ``ConfigError``.

    An unreadable or empty split, and a vocabulary or class list that differs from the one the
    checkpoint being resumed (``ckpt_path``) was trained with, are one-line errors before any step.
    """
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
    if (
        task == "caption"
        and trained == "caption"
        and (isinstance(hparams["vocab"], str) or isinstance(tokenizer_labels(datamodule.vocab), str))
    ):
        _check_subword_matches(cfg, datamodule.vocab, hparams["vocab"], ckpt_path)
    elif task == "caption" and trained == "caption":
        words, theirs = list(datamodule.vocab.words), list(hparams["vocab"])
        if words != theirs:
            i = next((i for i, (a, b) in enumerate(zip(words, theirs)) if a != b), min(len(words), len(theirs)))
            differ = f"{words[i]!r} vs {theirs[i]!r}" if i < min(len(words), len(theirs)) else "one list is longer"
            source = (
                f"data.vocab_path={cfg.data.vocab_path}"
                if cfg.data.get("vocab_path")
                else "the vocabulary built from the training captions"
            )
            saved = RunDir(Path(ckpt_path).resolve().parents[1]).vocab
            fix = f"data.vocab_path={saved}" if saved.is_file() else f"data.vocab_path=<the run's {saved.name}>"
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
    saved = RunDir(Path(ckpt_path).resolve().parents[1]).path / tokenizer_file_name(theirs)
    fix = f"data.vocab_path={saved}" if saved.is_file() else f"data.vocab_path=<the run's {saved.name}>"
    raise ConfigError(
        f"{source}: the tokenizer ({type(ours).__name__}, {len(ours)} tokens) differs from the checkpoint's "
        f"({type(theirs).__name__}, {len(theirs)} tokens); use the tokenizer the model was trained with: {fix}"
    )
