"""CoCa training: the captioner's teacher-forced cross-entropy and a contrastive loss between its image and text
embeddings, weighted, from one encoding of each image; validation logs both terms, scores the captions as
``CaptionSystem`` does, retrieval among the split's images and captions, and, given a labelled folder, zero-shot
classification by its class names (docs/captioning.md#coca)."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from vitattn.data.images import image_folder_split, open_image_folder
from vitattn.data.preprocess import default_preprocess, eval_transform
from vitattn.inference.captioning import file_batches
from vitattn.inference.embeddings import encode_texts
from vitattn.inference.zero_shot import check_labels, templates_from, zero_shot_classifier
from vitattn.metrics.metric import RetrievalMetrics
from vitattn.training.systems.captioning import CaptionSystem
from vitattn.training.systems.contrastive import check_contrastive, contrastive_loss

__all__ = ["CocaSystem"]


class CocaSystem(CaptionSystem):
    """Trains a ``CocaCaptioner`` (``model_config`` with its ``contrastive`` part) on ``caption_weight`` · caption
    + ``contrastive_weight`` · ``contrastive_loss`` (``clip`` or ``siglip``, every rank's negatives; open_clip's
    weights: 2 and 1). ``zero_shot`` (``data_root``, ``split``, ``templates``): a folder ``<split>/<class>/<image>``
    classified by its class names at each validation, as open_clip's ``--imagenet-val``, logged as
    ``val/zero_shot_top1`` and ``val/zero_shot_top5``. Other arguments are ``CaptionSystem``'s; under ``scst`` the
    SCST loss and its cross-entropy term take the caption's weight."""

    def __init__(
        self,
        model_config: dict[str, Any],
        vocab: list[str] | str,
        contrastive_loss: str = "clip",
        contrastive_weight: float = 1.0,
        caption_weight: float = 2.0,
        zero_shot: dict[str, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        check_contrastive(contrastive_loss, contrastive_weight, caption_weight)
        if "contrastive" not in model_config:
            raise ValueError("model_config has no 'contrastive' part: CocaSystem trains a CocaCaptioner")
        super().__init__(model_config, vocab, **kwargs)
        self.contrastive_loss = contrastive_loss
        self.contrastive_weight, self.caption_weight = contrastive_weight, caption_weight
        self.retrieval_metrics = RetrievalMetrics()  # every rank's embeddings, ranked once
        self._terms: dict[str, Tensor] = {}  # the last ``_loss``'s two terms, logged by the step that asked for it
        self._zero_shot = None  # (the folder's (path, class) samples, class names, templates, inference's transform)
        if zero_shot and zero_shot.get("data_root") is not None:
            where = f"head.zero_shot.data_root={zero_shot['data_root']}"
            try:
                folder = open_image_folder(image_folder_split(zero_shot["data_root"], zero_shot.get("split") or "val"))
            except (FileNotFoundError, ValueError) as err:
                raise ValueError(f"{where}: {err}") from None
            names = check_labels(folder.classes, f"{where}'s class folders")
            preprocess = kwargs.get("preprocess") or default_preprocess(model_config["encoder"]["img_size"])
            self._zero_shot = (
                folder.samples,
                names,
                templates_from(zero_shot.get("templates")),
                eval_transform(preprocess),
            )

    def _loss(self, batch: dict[str, Any], label_smoothing: float = 0.0) -> Tensor:
        """The weighted sum; the contrastive pairs are each image and its first caption."""
        caption, contrastive = self._pair_terms(batch, label_smoothing)
        return self.caption_weight * caption + self.contrastive_weight * contrastive

    def _self_critical_loss(self, batch: dict[str, Any], size: int) -> Tensor:
        """``contrastive_weight`` · contrastive + ``caption_weight`` · (SCST + ``xe_weight`` · cross-entropy), each
        image encoded once for all three: the contrastive term keeps training the embeddings the first stage built."""
        tokens, caption_image, images = batch["tokens"], batch.get("caption_image"), batch["images"]
        features = self.model.encoder.forward_features(images)  # (B, 1 + patches, D)
        scst, caption = self._self_critical_terms(batch, size, features)
        texts = tokens  # (B, T): one caption per image for the contrastive pairs
        if caption_image is not None and len(caption_image) != len(images):
            first = torch.searchsorted(caption_image, torch.arange(len(images), device=caption_image.device))
            texts = tokens.index_select(0, first)
        image, text = self.model.embed_features(features), self.model.embed_texts(texts)
        contrastive = contrastive_loss(self.contrastive_loss, image, text, self.model)
        self._terms = {"scst_loss": scst.detach(), "contrastive_loss": contrastive.detach()}
        if caption is None:
            return self.contrastive_weight * contrastive + self.caption_weight * scst
        self._terms["caption_loss"] = caption.detach()
        return self.contrastive_weight * contrastive + self.caption_weight * (scst + self.scst.xe_weight * caption)

    def _pair_terms(self, batch: dict[str, Any], label_smoothing: float) -> tuple[Tensor, Tensor]:
        """The caption cross-entropy and the contrastive loss, from one encoding of each image."""
        tokens, caption_image = batch["tokens"], batch.get("caption_image")  # (N, T), (N,) or None
        images = batch["images"]
        texts = tokens  # (B, T): one caption per image for the contrastive pairs
        if caption_image is not None and len(caption_image) != len(images):
            first = torch.searchsorted(caption_image, torch.arange(len(images), device=caption_image.device))
            texts = tokens.index_select(0, first)
        logits, image, text = self.model.forward_coca(images, tokens, texts, caption_image)
        caption = self._caption_loss(logits, tokens, label_smoothing)
        contrastive = contrastive_loss(self.contrastive_loss, image, text, self.model)
        self._terms = {"caption_loss": caption.detach(), "contrastive_loss": contrastive.detach()}
        return caption, contrastive

    def _log_terms(self, stage: str, size: int) -> None:
        terms, self._terms = self._terms, {}
        if terms:
            self.log_dict({f"{stage}/{k}": v for k, v in terms.items()}, sync_dist=stage != "train", batch_size=size)

    def _training_loss(self, batch: dict[str, Any]) -> Tensor:
        loss = super()._training_loss(batch)
        self._log_terms("train", len(batch["images"]))
        return loss

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        super()._evaluate(batch, stage)
        self._log_terms(stage, len(batch["images"]))
        references = batch["references"]
        texts = encode_texts(self.vocab, [t for refs in references for t in refs], self.model.decoder.max_len)
        text_image = torch.tensor([i for i, refs in enumerate(references) for _ in refs], device=self.device)
        self.retrieval_metrics.update(
            self.model.embed_images(batch["images"]),
            batch["image_ids"],
            self.model.embed_texts(texts.to(self.device)),
            text_image,
        )

    def _score(self, stage: str) -> None:
        """The captions' scores, the split's retrieval recalls, and at validation the zero-shot accuracy."""
        super()._score(stage)
        metrics = {} if self.trainer.sanity_checking else self.retrieval_metrics.compute()
        self.retrieval_metrics.reset()
        if stage == "val" and self._zero_shot is not None and not self.trainer.sanity_checking:
            metrics.update(self._zero_shot_accuracy())
        self.log_dict({f"{stage}/{k}": float(v) for k, v in metrics.items()}, sync_dist=False, rank_zero_only=False)

    @torch.no_grad()
    def _zero_shot_accuracy(self, batch_size: int = 64) -> dict[str, Tensor]:
        """Top-1 and top-5 of the zero-shot folder read as ``vitattn-eval task=zero_shot`` reads it, each rank
        classifying every world_size-th image, the counts summed over the ranks (unreadable images left out)."""
        samples, names, templates, transform = self._zero_shot
        classify = zero_shot_classifier(self.model, self.vocab, names, templates, "contrastive", self.device)
        paths, labels = zip(*samples[self.global_rank :: self.trainer.world_size]) if samples else ((), ())
        counts = torch.zeros(3, device=self.device)  # top-1 hits, top-5 hits, images read
        for images, targets in file_batches(paths, labels, transform, batch_size, 0, []):
            top = classify(images.to(self.device)).topk(min(5, len(names)))
            hits = top.indices == targets.to(self.device)[:, None]  # (B, 5)
            counts += torch.stack([hits[:, 0].sum(), hits.any(dim=1).sum(), torch.tensor(len(targets))]).to(counts)
        top1, top5, read = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        return {
            "zero_shot_top1": torch.tensor(top1 / max(read, 1)),
            "zero_shot_top5": torch.tensor(top5 / max(read, 1)),
        }
