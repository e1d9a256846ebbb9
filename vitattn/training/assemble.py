"""The LightningModule of a run: ``head.system`` instantiated by Hydra, as the trainer and the loggers are,
with what only the data knows passed in (the model config sized from the class count or the vocabulary,
the preprocessing, the class names or the vocabulary) and its encoder started from ``finetune.pretrained``
when one is given."""

from __future__ import annotations

from typing import Any

import hydra
import lightning.pytorch as pl
from omegaconf import DictConfig, OmegaConf

from vitattn.data.tokenizer import tokenizer_labels
from vitattn.training.pretrained import PretrainedEncoder, read_pretrained
from vitattn.training.systems import VisionSystem

__all__ = ["build_system", "model_config_from"]


def model_config_from(cfg: DictConfig, datamodule: Any) -> dict[str, Any]:
    """Plain model keyword arguments from the config and the values only the data knows."""
    encoder = OmegaConf.to_container(cfg.model, resolve=True)
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
        unk_id=vocab.unk_id,
    )
    return {"encoder": {**encoder, "num_classes": 0}, "decoder": decoder}


def build_system(
    cfg: DictConfig, datamodule: pl.LightningDataModule, pretrained: PretrainedEncoder | None = None
) -> VisionSystem:
    """The LightningModule ``cfg.head.system`` names, sized from the data (classes, vocabulary, image), its
    encoder loaded from ``finetune.pretrained`` (switches the weights show set in the saved model config):
    ``pretrained`` when the run has read it already, else read here."""
    caption = cfg.head.task == "caption"
    model_config = model_config_from(cfg, datamodule)
    source = cfg.finetune.get("pretrained")
    if pretrained is None and source:
        pretrained = read_pretrained(source)
    if pretrained is not None:
        pretrained.fit(model_config["encoder"] if caption else model_config)
    labels = {"vocab": tokenizer_labels(datamodule.vocab)} if caption else {"class_names": list(datamodule.class_names)}
    system = hydra.utils.instantiate(
        cfg.head.system, model_config=model_config, preprocess=dict(datamodule.preprocess), **labels
    )
    if pretrained is not None:
        pretrained.load_into(system.model.encoder if caption else system.model)
    return system
