"""CoCa training: the captioner's teacher-forced cross-entropy and a contrastive loss between its image and text
embeddings, weighted, from one encoding of each image; validation logs both terms, scores the captions as
``CaptionSystem`` does, retrieval among the split's images and captions, and, given a labelled folder, zero-shot
classification by its class names (docs/captioning.md#coca)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vitattn.errors import ConfigError
from vitattn.inference.embeddings import encode_texts
from vitattn.losses import CONTRASTIVE_LOSSES, INIT_LOGIT_SCALE, MAX_LOGIT_SCALE, loss_over_ranks
from vitattn.metrics.metric import RetrievalMetrics
from vitattn.training.systems.caption import CaptionSystem

__all__ = ["RETRIEVAL_MONITORS", "CocaSystem", "contrastive_model_config"]

RETRIEVAL_MONITORS = ("val/i2t_r1", "val/t2i_r1")  # what validation logs from ``RetrievalMetrics``


def contrastive_model_config(contrastive: dict[str, Any], pairs: int) -> dict[str, Any]:
    """``CocaCaptioner``'s keyword arguments from ``head.contrastive``: its sizes, and the logit scale and bias its
    loss starts from. SigLIP's bias ``auto``: -log(pairs - 1), ``pairs`` the images of a step on all ranks, where
    random embeddings (cosine 0) are at the loss's minimum (open_clip issue #650; open_clip's -10 suits 22,000)."""
    loss = contrastive["loss"]
    sizes = {k: contrastive[k] for k in ("embed_dim", "text_depth", "text_num_heads", "text_mlp_ratio")}
    bias = contrastive.get("init_logit_bias", "auto")
    if bias != "auto" and (isinstance(bias, bool) or not isinstance(bias, (int, float))):
        raise ConfigError(f"head.contrastive.init_logit_bias={bias!r} must be auto or a number (e.g. -10)")
    if loss != "siglip":
        bias = None
    elif bias == "auto":
        bias = -math.log(max(pairs - 1, 1))
    scale = INIT_LOGIT_SCALE.get(loss)  # None for an unknown loss, which ``CocaSystem`` refuses before any model
    return {**sizes, "init_logit_scale": scale, "init_logit_bias": bias}


class CocaSystem(CaptionSystem):
    """Trains a ``CocaCaptioner`` (``model_config`` with its ``contrastive`` part) on ``caption_weight`` · caption
    + ``contrastive_weight`` · ``contrastive_loss`` (``clip`` or ``siglip``, every rank's negatives; open_clip's
    weights: 2 and 1), the contrastive weight ramped from 0 over the first ``contrastive_ramp_steps``. Other
    arguments are ``CaptionSystem``'s (``zero_shot``: its ``scorer`` ``auto`` is ``AUTO_COCA`` here, as open_clip's
    ``--imagenet-val`` classifies); under ``scst`` the SCST loss and its cross-entropy term take the caption's
    weight."""

    def __init__(
        self,
        model_config: dict[str, Any],
        vocab: list[str] | str,
        contrastive_loss: str = "clip",
        contrastive_weight: float = 1.0,
        caption_weight: float = 2.0,
        contrastive_ramp_steps: int = 0,
        **kwargs: Any,
    ) -> None:
        if contrastive_loss not in CONTRASTIVE_LOSSES:
            raise ValueError(f"head.contrastive.loss={contrastive_loss!r} is unknown; choose clip or siglip")
        for key, weight in (("contrastive_weight", contrastive_weight), ("caption_weight", caption_weight)):
            if not (isinstance(weight, (int, float)) and math.isfinite(weight) and weight >= 0):
                raise ValueError(f"head.{key}={weight!r} must be a number of 0 or more")
        if contrastive_weight == caption_weight == 0:
            raise ValueError("head.contrastive_weight=0 and head.caption_weight=0 train nothing; set one above 0")
        ramp = contrastive_ramp_steps
        if isinstance(ramp, bool) or not isinstance(ramp, int) or ramp < 0:
            raise ValueError(f"head.contrastive_ramp_steps={ramp!r} must be a whole number of steps, 0 or more")
        if "contrastive" not in model_config:
            raise ValueError("model_config has no 'contrastive' part: CocaSystem trains a CocaCaptioner")
        super().__init__(model_config, vocab, **kwargs)
        self.contrastive_loss = CONTRASTIVE_LOSSES[contrastive_loss]()
        self.contrastive_weight, self.caption_weight = contrastive_weight, caption_weight
        self.contrastive_ramp_steps = contrastive_ramp_steps
        self.retrieval_metrics = RetrievalMetrics()  # every rank's embeddings, ranked once
        self._terms: dict[str, Tensor] = {}  # the last ``_loss``'s two terms, logged by the step that asked for it

    def _loss(self, batch: dict[str, Any], label_smoothing: float = 0.0) -> Tensor:
        """The weighted sum."""
        caption, contrastive = self._pair_terms(batch, label_smoothing)
        return self.caption_weight * caption + self._contrastive_weight() * contrastive

    def _contrastive_weight(self) -> float:
        """``contrastive_weight``, ramped linearly from 0 over the first ``contrastive_ramp_steps`` optimizer steps
        at training (the caption term shapes the features first); the full weight at 0 steps and at evaluation."""
        if not self.training or self.contrastive_ramp_steps == 0:
            return self.contrastive_weight
        return self.contrastive_weight * min(1.0, self.global_step / self.contrastive_ramp_steps)

    def _self_critical_loss(self, batch: dict[str, Any], size: int) -> Tensor:
        """``contrastive_weight`` · contrastive + ``caption_weight`` · (SCST + ``xe_weight`` · cross-entropy), each
        image encoded once for all three: the contrastive term keeps training the embeddings the first stage built."""
        tokens, caption_image = batch["tokens"], batch.get("caption_image")  # (N, T), (N,) or None
        encoded = self.model.encoder.forward_tokens(batch["images"])  # (B, N, D), merged tokens' sizes
        scst, caption = self._self_critical_terms(batch, size, encoded)
        image, text = self.model.embed_features(encoded), self.model.embed_texts(tokens)
        contrastive = self._contrastive(image, text, caption_image, tokens)
        self._terms = {"scst_loss": scst.detach(), "contrastive_loss": loss_over_ranks(contrastive)}
        weighted = self._contrastive_weight() * contrastive
        if caption is None:
            return weighted + self.caption_weight * scst
        self._terms["caption_loss"] = caption.detach()
        return weighted + self.caption_weight * (scst + self.scst.xe_weight * caption)

    def _pair_terms(self, batch: dict[str, Any], label_smoothing: float) -> tuple[Tensor, Tensor]:
        """The caption cross-entropy and the contrastive loss, from one encoding of each image; the contrastive
        texts are every caption of the batch, each a positive of its own image and of the images of its equals."""
        tokens, caption_image = batch["tokens"], batch.get("caption_image")  # (N, T), (N,) or None: caption n, image n
        logits, image, text = self.model.forward_coca(batch["images"], tokens, tokens, caption_image)
        caption = self.caption_loss(logits, tokens, label_smoothing)
        contrastive = self._contrastive(image, text, caption_image, tokens)
        self._terms = {"caption_loss": caption.detach(), "contrastive_loss": loss_over_ranks(contrastive)}
        return caption, contrastive

    def _contrastive(self, image: Tensor, text: Tensor, caption_image: Tensor | None, tokens: Tensor) -> Tensor:
        """The contrastive loss of (B, E) images and (N, E) texts, the (N, T) tokens padded to the model's length:
        one width on every rank, padded as the batch is, so that equal texts have equal rows."""
        tokens = F.pad(tokens, (0, self.model.max_len - tokens.shape[1]), value=self.model.decoder.pad_id)
        model = self.model
        return self.contrastive_loss(image, text, model.logit_scale, model.logit_bias, caption_image, tokens)

    def optimizer_step(self, *args: Any, **kwargs: Any) -> None:
        """Lightning's step (once per ``accumulate_grad_batches``), then the temperature clamped in place to
        [0, ``MAX_LOGIT_SCALE``] as open_clip does: the loss has no cap, so its gradient reaches the scale at every
        value."""
        super().optimizer_step(*args, **kwargs)
        with torch.no_grad():
            self.model.logit_scale.clamp_(0, MAX_LOGIT_SCALE)  # a DTensor under FSDP: each shard clamped

    def _log_terms(self, stage: str, size: int) -> None:
        terms, self._terms = self._terms, {}
        if terms:
            self.log_dict({f"{stage}/{k}": v for k, v in terms.items()}, sync_dist=stage != "train", batch_size=size)

    def _training_loss(self, batch: dict[str, Any]) -> Tensor:
        loss = super()._training_loss(batch)
        self._log_terms("train", len(batch["image_ids"]))
        return loss

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        super()._evaluate(batch, stage)
        self._log_terms(stage, len(batch["image_ids"]))
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
        """The captions' scores (and ``CaptionSystem``'s zero-shot accuracy), and the split's retrieval recalls."""
        super()._score(stage)
        metrics = {} if self.trainer.sanity_checking else self.retrieval_metrics.compute()
        self.retrieval_metrics.reset()
        self.log_dict({f"{stage}/{k}": float(v) for k, v in metrics.items()}, sync_dist=False, rank_zero_only=False)
