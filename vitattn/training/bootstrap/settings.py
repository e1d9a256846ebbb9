"""The ``bootstrap`` config group as one checked value: ``BootstrapSettings``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vitattn.bundle.hub import is_hub_name
from vitattn.errors import ConfigError
from vitattn.training.bootstrap.keep import Keep

__all__ = ["BootstrapSettings"]


@dataclass(frozen=True)
class BootstrapSettings:
    """The ``bootstrap`` config group: a ``teacher`` (a run, bundle or ONNX folder) labels the pool ``images`` (a
    folder, a file list or WebDataset shards), or another run's side files (``candidates``) are read; ``filter``
    scores the candidates (a model path, ``teacher`` or ``none``); ``samples`` candidates per image (``do_sample``
    with ``top_p``, or the beam's best); ``keep``; ``human_repeat``: how many times each human-labelled sample
    appears per epoch; ``randaugment``: timm's RandAugment of the pool images (the student's named noise);
    ``soft``: classes learnt from the teacher's stored probabilities (noisy student's soft targets);
    ``labelled_images``: pool images equal to human-labelled training ones ``drop`` out, or ``keep`` their teacher
    labels beside their human ones (distillation; validation and test images never enter)."""

    teacher: str | None = None
    images: str | None = None
    candidates: str | None = None
    filter: str = "teacher"
    samples: int = 5
    do_sample: bool = True
    top_p: float = 0.9
    num_beams: int | None = None
    keep: Keep = field(default_factory=Keep)
    human_repeat: int = 1
    randaugment: str | None = None
    soft: bool = False
    labelled_images: str = "drop"
    batch_size: int = 32

    @classmethod
    def from_config(cls, node: Mapping[str, Any] | None) -> BootstrapSettings | None:
        """The settings of the ``bootstrap`` node (plain values), or None when the run bootstraps from nothing (no
        ``teacher`` and no ``candidates``)."""
        if node is None or (node.get("teacher") is None and node.get("candidates") is None):
            return None
        values = dict(node)
        values["keep"] = Keep(**(values.get("keep") or {}))
        settings = cls(**values)
        known = settings.filter in ("teacher", "none") or is_hub_name(settings.filter) or Path(settings.filter).exists()
        if not known:
            raise ConfigError(
                f"bootstrap.filter={settings.filter} is not teacher, none, or a caption model (a run, bundle or ONNX "
                "folder; hf-hub:NAME): no such path"
            )
        if settings.samples < 1:
            raise ConfigError(f"bootstrap.samples={settings.samples} must be at least 1")
        if not isinstance(settings.human_repeat, int) or settings.human_repeat < 0:
            raise ConfigError(f"bootstrap.human_repeat={settings.human_repeat} must be a whole number, 0 or more")
        if settings.labelled_images not in ("drop", "keep"):
            raise ConfigError(f"bootstrap.labelled_images={settings.labelled_images} must be drop or keep")
        if settings.teacher is not None and settings.images is None:
            raise ConfigError("bootstrap.teacher=... labels the images of bootstrap.images=POOL; give the pool")
        return settings

    @property
    def shards(self) -> bool:
        return self.images is not None and ".tar" in str(self.images)
