"""A training run's own data, rebuilt from its saved config for evaluation."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import hydra

from vitattn.data.tokenizer import Tokenizer
from vitattn.run_dir import RunDir
from vitattn.training.compose import check_targets

__all__ = ["datamodule_from_run"]


def datamodule_from_run(
    run: RunDir,
    *,
    vocab: Tokenizer | None = None,
    preprocess: Mapping[str, Any] | None = None,
    batch_size: int = 32,
    num_workers: int = 0,
    **overrides: Any,
) -> Any:
    """The run's DataModule, set up for evaluation (``val`` and ``test``; no training split where it costs).

    Args:
        run: the training run folder.
        vocab: the model's tokenizer, used instead of one built from the training captions.
        preprocess: the model's preprocessing (a bundle's): what the run's data took from its pretrained weights
            (``use_weights_preprocess``), which its saved config does not hold.
        batch_size, num_workers: loader settings for the evaluation (the run's own are replaced).
        **overrides: other data settings to replace (e.g. ``image_dir`` when the images have moved).

    Raises:
        ValueError: the run's config has no data section that names a DataModule.
        KeyError: an override names a setting the run's data does not have.
    """
    data = run.load_config().get("data")
    if data is None or "_target_" not in data:
        raise ValueError(f"{run.config} has no data config with a _target_; give the images and references directly")
    check_targets(data)
    unknown = [key for key in overrides if key not in data]
    if unknown:
        raise KeyError(f"the run's data ({data._target_}) has no {', '.join(unknown)}")
    try:
        datamodule = hydra.utils.instantiate(data, batch_size=batch_size, num_workers=num_workers, **overrides)
    except Exception as err:  # noqa: BLE001 - a key this version's DataModule does not take, a bad path, ...
        raise ValueError(f"the data of {run.config} cannot be rebuilt: {' '.join(str(err).split())[:200]}") from None
    datamodule.vocab = vocab
    if preprocess is not None:
        datamodule.use_weights_preprocess(preprocess)
    datamodule.cache_mode = "none"  # evaluation reads each file once itself: decoding them all first is waste
    datamodule.verify = False  # ... and counts the unreadable ones
    datamodule.setup("validate")
    return datamodule
