"""The layout of a training run folder (``runs/<task>/<date>_<time>/``); every other module asks ``RunDir``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vitattn.errors import ConfigError
from vitattn.fileio import atomic_write, read_json

__all__ = [
    "ALLOWED_TARGET_PREFIXES",
    "TOKENIZER_FILE",
    "VOCAB_FILE",
    "BootstrapRecord",
    "RunConfig",
    "RunDir",
    "SemiRecord",
    "check_targets",
]

VOCAB_FILE = "vocab.json"  # the caption vocabulary, in a run folder and in a bundle or ONNX folder
TOKENIZER_FILE = "tokenizer.json"  # a subword tokenizer (Hugging Face tokenizers), where vocab.json would be
# What a config's ``_target_`` may name: a run folder's config is input, instantiated by training and evaluation.
ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")


@dataclass(frozen=True)
class BootstrapRecord:
    """``bootstrap.*`` of a run that also trained on images without labels, labelled once before it started."""

    teacher: str | None  # the model that labelled them, or None: read from side files
    candidates: str | None  # the side files written before
    filter: str
    samples: int  # candidates per image
    keep: dict[str, Any]  # the keep policy's limits that are set (top_k, min_score, ...)


@dataclass(frozen=True)
class SemiRecord:
    """``semi=`` of a run that also learned from images without labels, pseudo-labelled online each step."""

    method: str  # fixmatch or freematch
    images: str
    ratio: Any  # unlabelled images per labelled one in a step
    threshold: Any
    weight: Any
    ema_decay: Any  # 0: the model labels; else an EMA copy of it
    strong: str  # the strong view's augmentation


@dataclass(frozen=True)
class RunConfig:
    """What a run folder's saved training config records for the library (the model card, the split evaluation
    rebuilds, whether a run is complete), read by ``RunDir.saved``: the one reader of the training config's keys
    outside training. Values as saved; a key an older run lacks reads None."""

    data: Any  # the data group as saved (a DictConfig whose _target_ names the DataModule), or None
    data_target: str  # data._target_, "" without one
    images: dict[str, Any]  # data.num_train, num_val and num_test, those the data has
    lr: Any  # optim.lr
    weight_decay: Any  # optim.weight_decay
    generate: dict[str, Any] | None  # head.generate: the decoding the run's test used (captioners)
    init: str | None  # finetune.init: the weights it started from
    length: dict[str, Any]  # trainer.max_steps and max_epochs
    bootstrap: BootstrapRecord | None  # None: no teacher and no side files
    semi: SemiRecord | None  # None: semi=none, or a run from before semi=

    @classmethod
    def of(cls, cfg: DictConfig) -> RunConfig:
        """The record of a saved (resolved) training config ``cfg``."""

        def at(key: str) -> Any:
            value = OmegaConf.select(cfg, key, default=None)
            return OmegaConf.to_container(value, resolve=True) if isinstance(value, DictConfig) else value

        data = OmegaConf.select(cfg, "data", default=None)
        images = {k: data[k] for k in ("num_train", "num_val", "num_test") if k in data} if data is not None else {}
        return cls(
            data=data,
            data_target=str(at("data._target_") or ""),
            images=images,
            lr=at("optim.lr"),
            weight_decay=at("optim.weight_decay"),
            generate=at("head.generate"),
            init=at("finetune.init"),
            length={k: at(f"trainer.{k}") for k in ("max_steps", "max_epochs")},
            bootstrap=_bootstrap(at("bootstrap") or {}),
            semi=_semi(at("semi") or {}),
        )


def _bootstrap(boot: dict[str, Any]) -> BootstrapRecord | None:
    if not (boot.get("teacher") or boot.get("candidates")):
        return None
    values = {f.name: boot.get(f.name) for f in fields(BootstrapRecord)}
    return BootstrapRecord(**values | {"keep": {k: v for k, v in (values["keep"] or {}).items() if v is not None}})


def _semi(semi: dict[str, Any]) -> SemiRecord | None:
    if semi.get("method") in (None, "none"):
        return None
    return SemiRecord(**{f.name: semi.get(f.name) for f in fields(SemiRecord)})


@dataclass(frozen=True)
class RunDir:
    """A training run folder at ``path`` (it need not exist yet)."""

    path: Path

    def __init__(self, path: str | os.PathLike) -> None:
        path = Path(path)
        checkpoints = path / "checkpoints"
        paths = dict(
            path=path,
            config=path / "config.yaml",  # the resolved training config
            overrides=path / ".hydra" / "overrides.yaml",  # Hydra's record of the command-line overrides
            vocab=path / VOCAB_FILE,  # the caption vocabulary
            tokenizer=path / TOKENIZER_FILE,  # a subword tokenizer, written once by rank 0 and read on restart
            checkpoints=checkpoints,
            last_checkpoint=checkpoints / "last.ckpt",  # what ``resume=RUN`` continues from
            best_checkpoint=checkpoints / "best.ckpt",  # by the head's validation metric (``head.monitor``)
            bundle=path / "bundle",  # the exported model
            result=path / "result.json",  # written when the run completes; ``resume`` leaves it as it is
            cider_statistics=path / "cider_statistics.json",  # CIDEr-D's training document frequencies (scst)
            mlflow_run_id=path / "mlflow_run_id.txt",  # the MLflow run a resumed run logs to again
            wandb_run_id=path / "wandb_run_id.txt",  # the Weights & Biases run a resumed run continues
            semi=path / "semi",  # semi=: each step's pseudo-labels, pseudo_labels.rank<R>.jsonl
        )
        for name, value in paths.items():
            object.__setattr__(self, name, value)

    @classmethod
    def find(cls, model: str | os.PathLike) -> RunDir | None:
        """The run folder of ``model`` (the folder, its bundle or its ``config.json``, a checkpoint), or None."""
        path = Path(model).resolve()
        if path.is_file():
            path = path.parent  # checkpoints/x.ckpt or bundle/config.json
        return next((run for run in (cls(path), cls(path.parent)) if run.config.is_file()), None)

    def load_config(self) -> Any:
        """The saved training config (a ``DictConfig``); a one-line ``ValueError`` when unreadable."""
        try:
            return OmegaConf.load(self.config)
        except Exception as err:  # noqa: BLE001 - YAML and OmegaConf raise their own types
            raise ValueError(f"{self.config} cannot be read: {' '.join(str(err).split())[:200]}") from None

    def saved(self) -> RunConfig:
        """What the saved training config records (``RunConfig``); a one-line ``ValueError`` when unreadable."""
        return RunConfig.of(self.load_config())

    def saved_overrides(self) -> list[str]:
        """The overrides the run was started with (empty when Hydra wrote none)."""
        return [str(o) for o in OmegaConf.load(self.overrides)] if self.overrides.is_file() else []

    def save_result(self, global_step: int, weights: str, metrics: dict[str, float], bundle: bool) -> None:
        """Mark the run complete: its last step, the weights tested, the final metrics, whether it has a bundle."""
        result = {"global_step": global_step, "weights": weights, "metrics": metrics, "bundle": bundle}
        atomic_write(self.result, json.dumps(result, indent=2) + "\n")

    def load_result(self) -> dict[str, Any] | None:
        """What ``save_result`` wrote, or None while the run is not complete (a one-line ``ValueError``: not that)."""
        if not self.result.is_file():
            return None
        result = read_json(self.result, "run result")
        fields = {"global_step": int, "weights": str, "metrics": dict, "bundle": bool}
        if not isinstance(result, dict) or any(not isinstance(result.get(k), t) for k, t in fields.items()):
            raise ValueError(f"{self.result} is not a run result (keys {', '.join(fields)}): move it away to run again")
        return result

    def completion(
        self, resume: str | None, ckpt_path: str | None = None, length: Mapping[str, Any] | None = None
    ) -> str | None:
        """Is this run complete? The line saying so and where its bundle is, when ``resume`` continues this folder
        (``auto``, or its path) from its own checkpoint (no ``ckpt_path``); None when it does not, while the run is
        not complete, or when ``length`` (``max_steps`` / ``max_epochs`` asked for now) differs from the run's: a
        longer run trains further. ``vitattn-train`` asks before Hydra writes into the folder, ``train(cfg)`` too."""
        if not resume or ckpt_path or (resume != "auto" and Path(resume).resolve() != self.path.resolve()):
            return None
        result = self.load_result()
        if result is None:
            return None
        if length and self.config.is_file():
            saved = self.saved().length
            if any(str(value) != str(saved.get(key)) for key, value in length.items()):
                return None
        bundle = f"bundle {self.bundle}" if result["bundle"] else "no bundle (export_bundle=false)"
        return f"run complete: {self.path} (step {result['global_step']}); {bundle}; nothing to train"

    def save_config(self, cfg: Any) -> None:
        """Write the resolved config (and create the folder)."""
        self.path.mkdir(parents=True, exist_ok=True)
        atomic_write(self.config, OmegaConf.to_yaml(cfg, resolve=True))


def check_targets(cfg: DictConfig | Mapping[str, Any]) -> None:
    """Refuse a ``_target_`` outside vitattn, torch, torchvision, timm and lightning (a config, or its plain values)."""

    def walk(node: Any, path: str) -> None:
        if not isinstance(node, DictConfig | Mapping):
            return
        target = node.get("_target_") if "_target_" in node else None
        if target is not None and not str(target).startswith(ALLOWED_TARGET_PREFIXES):
            allowed = ", ".join(p.rstrip(".") for p in ALLOWED_TARGET_PREFIXES)
            raise ConfigError(f"{path}._target_={target} is not allowed; targets must be in {allowed}")
        # a child unresolved: a `???` elsewhere is no error here
        children = node.items_ex(resolve=False) if isinstance(node, DictConfig) else node.items()
        for key, child in children:
            walk(child, f"{path}.{key}" if path else str(key))

    walk(cfg, "")
