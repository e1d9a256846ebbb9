"""Checkpoints that are whole or absent, whatever kills the process."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from vitattn.fileio import atomic_open

__all__ = ["AtomicCheckpointIO"]


class AtomicCheckpointIO(TorchCheckpointIO):
    """Writes each checkpoint to a temporary file beside it, then renames it: a kill leaves the old file whole.

    Lightning's own ``_atomic_save`` stages the bytes in ``tempfile.mkstemp()`` (the system temp
    folder, fsspec's ``LocalFileOpener``) and commits with ``shutil.move``: a rename only when that
    folder is on the run directory's filesystem, otherwise a copy onto the checkpoint itself.
    """

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        if storage_options is not None or "://" in str(path):  # remote storage: fsspec's way
            return super().save_checkpoint(checkpoint, path, storage_options)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_open(path, "wb") as f:
            torch.save(checkpoint, f)
