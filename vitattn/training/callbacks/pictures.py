"""Pictures of every validation for the loggers that show them, found by type (TensorBoard, MLflow, wandb):
captioning's attention figures of the first validation images, classification's confusion matrix
(docs/training.md#pictures-in-tensorboard-and-mlflow).
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.loggers import Logger, MLFlowLogger, TensorBoardLogger, WandbLogger
from PIL import Image
from torchmetrics.classification import MulticlassConfusionMatrix

from vitattn.evaluation.report import confusion_figure
from vitattn.inference.attention_maps import attention_figures, figure_png
from vitattn.inference.captioning import generate_tokens

if TYPE_CHECKING:
    from matplotlib.figure import Figure

__all__ = ["ValidationPictures"]

_PICTURE_LOGGERS = (TensorBoardLogger, MLFlowLogger, WandbLogger)


class ValidationPictures(pl.Callback):
    """After every validation (not the sanity check), log pictures to the image-taking loggers: captioning's
    ``num_images`` first validation images, classification's confusion matrix (its classes and counts named up to
    ``max_labelled_classes``)."""

    def __init__(self, num_images: int = 4, max_labelled_classes: int = 20) -> None:
        if num_images < 1:
            raise ValueError(f"num_images={num_images} must be at least 1")
        self.num_images = num_images
        self.max_labelled_classes = max_labelled_classes
        self._confmat: MulticlassConfusionMatrix | None = None
        self._images: tuple[torch.Tensor, list[list[str]]] | None = None

    def on_validation_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if pl_module.task == "classification" and _picture_loggers(trainer):
            num_classes = len(pl_module.hparams["class_names"])
            self._confmat = MulticlassConfusionMatrix(num_classes).to(pl_module.device)

    def on_validation_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, *args: Any
    ) -> None:
        if self._confmat is not None and isinstance(outputs, torch.Tensor):
            self._confmat.update(outputs.argmax(dim=-1), batch[1])  # logits (B, K), labels (B,)

    def on_validation_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        loggers = _picture_loggers(trainer)
        if trainer.sanity_checking or not loggers:
            self._confmat = None
            return
        if pl_module.task == "classification":
            if self._confmat is None:
                return
            matrix = self._confmat.compute()  # every rank: the counts are summed over ranks
            self._confmat = None
            if trainer.is_global_zero:
                limit = self.max_labelled_classes
                figure = confusion_figure(matrix, pl_module.hparams["class_names"], named=limit, counted=limit)
                _log_figure(loggers, "val/confusion_matrix", figure, trainer.global_step)
        elif trainer.is_global_zero:
            self._log_captions(trainer, pl_module, loggers)

    def _log_captions(self, trainer: pl.Trainer, pl_module: pl.LightningModule, loggers: list[Logger]) -> None:
        images, references = self._validation_images(trainer)
        images = trainer.datamodule.normalize(images.to(pl_module.device))  # uint8 as the loaders yield them
        model = pl_module.model
        # bf16 autocast on GPUs; fp32 on CPUs, as training runs there (precision=auto would take bf16 units)
        precision = "bf16" if images.device.type == "cuda" else "fp32"
        tokens = generate_tokens(model, images, precision, **pl_module.generate_kwargs)  # (b, T')
        captions = pl_module.vocab.decode_batch(tokens)
        titles = [f"generated: {c}\nreference: {r[0] if r else ''}" for c, r in zip(captions, references)]
        preprocess = pl_module.hparams.get("preprocess") or trainer.datamodule.preprocess
        figures = attention_figures(model, images, tokens, pl_module.vocab, preprocess, titles)
        step = trainer.global_step
        for k, figure in enumerate(figures):
            _log_figure(loggers, f"val/attention/{k}", figure, step)
        for logger in loggers:
            if isinstance(logger, TensorBoardLogger):
                text = "\n\n".join(
                    f"{k}. **{c}**  \nreference: {'; '.join(r)}" for k, (c, r) in enumerate(zip(captions, references))
                )
                logger.experiment.add_text("val/attention/captions", text, step)

    def _validation_images(self, trainer: pl.Trainer) -> tuple[torch.Tensor, list[list[str]]]:
        """The split's first ``num_images`` (uint8 images (b, C, height, width), references), read once."""
        if self._images is None:
            loader = trainer.val_dataloaders
            dataset = (loader[0] if isinstance(loader, (list, tuple)) else loader).dataset
            items = [dataset[i] for i in range(min(self.num_images, len(dataset)))]
            self._images = torch.stack([x["image"] for x in items]), [list(x["references"]) for x in items]
        return self._images


def _picture_loggers(trainer: pl.Trainer) -> list[Logger]:
    return [logger for logger in trainer.loggers if isinstance(logger, _PICTURE_LOGGERS)]


def _log_figure(loggers: list[Logger], tag: str, figure: Figure, step: int) -> None:
    """``figure`` to each logger: a TensorBoard image, an MLflow artifact ``<tag>/step<step>.png``, a wandb image."""
    pixels = np.asarray(Image.open(io.BytesIO(figure_png(figure))).convert("RGB"))  # (height, width, 3)
    for logger in loggers:
        if isinstance(logger, TensorBoardLogger):
            logger.experiment.add_image(tag, pixels, step, dataformats="HWC")
        elif isinstance(logger, MLFlowLogger):
            logger.experiment.log_figure(logger.run_id, figure, f"{tag}/step{step:06d}.png")
        elif isinstance(logger, WandbLogger):
            logger.log_image(key=tag, images=[pixels], step=step)
