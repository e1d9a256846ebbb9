"""The layout of a training run folder (``runs/<task>/<date>_<time>/``); every other module asks ``RunDir``."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

from vitattn.errors import ConfigError
from vitattn.fileio import atomic_write, read_json

__all__ = ["ALLOWED_TARGET_PREFIXES", "TOKENIZER_FILE", "VOCAB_FILE", "RunDir", "check_targets"]

VOCAB_FILE = "vocab.json"  # the caption vocabulary, in a run folder and in a bundle or ONNX folder
TOKENIZER_FILE = "tokenizer.json"  # a subword tokenizer (Hugging Face tokenizers), where vocab.json would be
# What a config's ``_target_`` may name: a run folder's config is input, instantiated by training and evaluation.
ALLOWED_TARGET_PREFIXES = ("vitattn.", "torch.", "torchvision.", "timm.", "lightning.", "pytorch_lightning.")


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
            trainer = self.load_config().get("trainer") or {}
            if any(str(value) != str(trainer.get(key)) for key, value in length.items()):
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
