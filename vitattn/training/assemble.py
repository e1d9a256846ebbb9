"""The LightningModule of a run: model keyword arguments from the config and the data, then the system
(its encoder started from ``model.pretrained`` when one is given)."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from vitattn.models import TRAINING_KEYS
from vitattn.systems import CaptionSystem, ClassificationSystem, VisionSystem
from vitattn.training.pretrained import read_pretrained

__all__ = ["build_system", "model_config_from"]


def model_config_from(cfg: DictConfig, datamodule: Any) -> dict[str, Any]:
    """Plain model keyword arguments from the config and the values only the data knows
    (``model.pretrained`` names a source of weights, not an argument: it is left out)."""
    encoder = OmegaConf.to_container(cfg.model, resolve=True)
    for key in TRAINING_KEYS:  # callbacks' settings, not model arguments
        encoder.pop(key, None)
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


def build_system(cfg: DictConfig, datamodule: pl.LightningDataModule) -> VisionSystem:
    """The LightningModule for ``cfg.head.task``, sized from the data (classes, vocabulary, image), its
    encoder loaded from ``model.pretrained`` (switches the weights show set in the saved model config)."""
    head = cfg.head
    model_config = model_config_from(cfg, datamodule)
    pretrained = read_pretrained(cfg.model.pretrained) if cfg.model.get("pretrained") else None
    if pretrained is not None:
        pretrained.fit(model_config["encoder"] if head.task == "caption" else model_config)
    common = dict(
        preprocess=dict(datamodule.preprocess),
        label_smoothing=head.label_smoothing,
        optim=OmegaConf.to_container(cfg.optim, resolve=True),
        nonfinite=head.nonfinite,
    )
    if head.task == "classification":
        mixing = {k: float(head.get(k, 0.0)) for k in ("mixup", "cutmix")}
        system = ClassificationSystem(model_config, class_names=list(datamodule.class_names), **mixing, **common)
    else:
        system = CaptionSystem(
            model_config,
            vocab=datamodule.vocab.words,
            generate=OmegaConf.to_container(head.generate, resolve=True),
            num_samples=head.num_samples,
            **common,
        )
    if pretrained is not None:
        pretrained.load_into(system.model.encoder if head.task == "caption" else system.model)
    return system
