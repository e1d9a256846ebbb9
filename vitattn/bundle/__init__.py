"""Model bundles: what inference loads, from a bundle folder, a training run folder or a checkpoint.

``folder`` writes and reads bundle folders; ``checkpoint`` turns Lightning checkpoints and trained
systems into bundles; ``onnx_folder`` describes ONNX folders and ``onnx_export`` writes them.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from vitattn.bundle.checkpoint import bundle_from_system, load_checkpoint
from vitattn.bundle.folder import BUNDLE_FORMAT, BUNDLE_VERSION, CONFIG_FILE, Bundle, load_bundle_folder, save_bundle
from vitattn.run_dir import RunDir

__all__ = ["BUNDLE_FORMAT", "BUNDLE_VERSION", "Bundle", "bundle_from_system", "load_bundle", "save_bundle"]


def load_bundle(path: str | os.PathLike, device: str | torch.device = "cpu") -> Bundle:
    """Load a model for inference from a bundle, a training run folder, or a Lightning checkpoint.

    Args:
        path: a bundle folder (has ``config.json``); a training run folder (uses ``RUN/bundle`` if
            present, else ``RUN/checkpoints/last.ckpt``); or a ``.ckpt`` file whose
            ``hyper_parameters`` hold ``task``, ``model_config``, ``preprocess`` and ``vocab`` (words
            in id order) or ``class_names``, and whose ``state_dict`` keys start with ``model.``.
        device: where to put the model.

    Returns:
        A ``Bundle`` with the model in eval mode.

    Raises:
        FileNotFoundError: nothing loadable at ``path``.
        ValueError: a file is corrupt or incomplete, or a checkpoint holds pickled objects
            (it is never unpickled).
    """
    path = Path(path)
    if path.is_dir():
        run = RunDir(path)
        if (path / CONFIG_FILE).is_file():
            return load_bundle_folder(path, device)
        if (run.bundle / CONFIG_FILE).is_file():
            return load_bundle_folder(run.bundle, device)
        if run.last_checkpoint.is_file():
            return load_checkpoint(run.last_checkpoint, device)
        raise FileNotFoundError(
            f"{path} is neither a bundle (no {CONFIG_FILE}) nor a training run (no "
            f"{(run.bundle / CONFIG_FILE).relative_to(path)} or {run.last_checkpoint.relative_to(path)})"
        )
    if path.is_file():
        if path.name == CONFIG_FILE:
            return load_bundle_folder(path.parent, device)
        return load_checkpoint(path, device)
    raise FileNotFoundError(
        f"model not found: {path} (expected a bundle folder, a training run folder or a .ckpt file)"
    )
