"""Image captioning: teacher-forced cross-entropy, or self-critical training on CIDEr-D (``scst``); validation
scores the whole split gathered from every rank, so each rank logs the single-process figure."""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any

import torch
from lightning.pytorch.loggers import TensorBoardLogger
from torch import Tensor

from vitattn.data.images import image_folder_split, open_image_folder
from vitattn.data.preprocess import default_preprocess, eval_transform
from vitattn.data.tokenizer import tokenizer_from_labels
from vitattn.evaluation.classification import topk_hits
from vitattn.inference.captioning import file_batches
from vitattn.inference.zero_shot import check_labels, resolve_scorer, templates_from, zero_shot_classifier
from vitattn.layers import Memory
from vitattn.losses import CaptionLoss
from vitattn.metrics import CaptionMetrics, CiderD
from vitattn.models import captioner_from_config
from vitattn.models.caption import per_caption
from vitattn.training.semi import caption_token_probs, labelling, unlabelled_caption_loss
from vitattn.training.systems.base import VisionSystem
from vitattn.training.systems.self_critical import ScstConfig, SelfCritical

__all__ = ["ZERO_SHOT_MONITOR", "CaptionSystem"]

ZERO_SHOT_MONITOR = "val/zero_shot_top1"  # what validation logs with ``zero_shot``


class CaptionSystem(VisionSystem):
    """Trains an ``ImageCaptioner`` with teacher forcing and scores generated captions.

    Args:
        model_config: ``{"encoder": VisionTransformer kwargs, "decoder": CaptionDecoder kwargs}``.
        vocab: the tokenizer as ``tokenizer_labels`` keeps it (plain types: checkpoints load with weights_only).
        preprocess: evaluation preprocessing kept with the checkpoint for inference.
        generate: ``ImageCaptioner.generate`` keyword arguments of validation and test; its ``max_new_tokens``
            (None: the decoder's ``max_len - 1``) is the generation length (``self.max_new_tokens``) of validation,
            test, the bundle, ``semi=``'s pseudo-captions and, unless ``scst.max_new_tokens`` says otherwise, SCST's
            samples.
        num_samples: captions shown in the log (TensorBoard text) each validation.
        optim, nonfinite: ``VisionSystem``'s.
        scst: ``ScstConfig`` settings: train self-critically with the reward ``use_reward`` gives.
        zero_shot: ``data_root``, ``split``, ``templates``, ``scorer`` (``vitattn.inference.zero_shot``'s): a folder
            ``<split>/<class>/<image>`` classified by its class names at each validation, as ``vitattn-eval
            task=zero_shot`` classifies it, in the run's precision; logged as ``val/zero_shot_top1`` and ``top5``.
    """

    task = "caption"

    def __init__(
        self,
        model_config: dict[str, Any],
        vocab: list[str] | str,
        preprocess: dict[str, Any] | None = None,
        label_smoothing: float = 0.0,
        generate: dict[str, Any] | None = None,
        num_samples: int = 8,
        optim: dict[str, Any] | None = None,
        nonfinite: str = "raise",
        scst: dict[str, Any] | None = None,
        zero_shot: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(optim, nonfinite)
        self.scst = ScstConfig(**scst) if scst is not None else None
        self.self_critical: SelfCritical | None = None
        self.vocab = tokenizer_from_labels(vocab)
        vocab_size = model_config["decoder"]["vocab_size"]
        if vocab_size != len(self.vocab):
            raise ValueError(f"decoder vocab_size={vocab_size} does not match the tokenizer's {len(self.vocab)} tokens")
        self.save_hyperparameters()
        self.model = captioner_from_config(model_config)  # a CocaCaptioner for CocaSystem
        tokens = torch.zeros(1, self.model.decoder.max_len - 1, dtype=torch.long)  # (1, T): a full-length caption
        self.example_input_array = (self.example_images(self.model.encoder), tokens)  # summary: FLOPs per caption
        self.caption_loss = CaptionLoss(self.vocab.pad_id)
        self.label_smoothing = label_smoothing
        self.generate_kwargs = dict(generate or {})
        checked = inspect.signature(self.model.check_generate).parameters
        try:  # the decoder owns what it can decode with: its length, beams, rerank (head=coca's embeddings)
            given = {k: v for k, v in self.generate_kwargs.items() if k in checked}
            self.max_new_tokens = self.model.check_generate(**given)  # the generation length (null: max_len - 1)
        except ValueError as err:
            raise ValueError(f"generate.{err}") from None
        if self.scst is not None:  # the samples' length (null: the generation length), refused before any step
            length = self.max_new_tokens if self.scst.max_new_tokens is None else self.scst.max_new_tokens
            try:
                length = self.model.check_generate(length, 1, True, self.scst.temperature)
            except ValueError as err:
                raise ValueError(f"scst.{err}") from None
            self.scst = dataclasses.replace(self.scst, max_new_tokens=length)
        self.num_samples = num_samples
        self.caption_metrics = CaptionMetrics(synthetic=True)  # every rank's captions, scored once
        self.last_samples: list[tuple[str, list[str]]] = []  # (caption, references) of the last evaluation
        self._zero_shot = (
            None
            if not zero_shot or zero_shot.get("data_root") is None
            else self._zero_shot_folder(
                zero_shot, preprocess or default_preprocess(model_config["encoder"]["img_size"])
            )
        )

    def _zero_shot_folder(self, zero_shot: dict[str, Any], preprocess: dict[str, Any]) -> tuple:
        """(the folder's (path, class) samples, class names, templates or None, scorer, inference's transform)."""
        where = f"head.zero_shot.data_root={zero_shot['data_root']}"
        try:
            folder = open_image_folder(image_folder_split(zero_shot["data_root"], zero_shot.get("split") or "val"))
        except (FileNotFoundError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from None
        names = check_labels(folder.classes, f"{where}'s class folders")
        templates = zero_shot.get("templates")
        try:
            scorer = resolve_scorer(self.model, zero_shot.get("scorer") or "auto")
        except ValueError as err:
            raise ValueError(f"head.zero_shot.{err}") from None
        templates = None if templates is None else templates_from(templates)  # None: the spellable defaults
        return folder.samples, names, templates, scorer, eval_transform(preprocess)

    def forward(self, images: Tensor, tokens: Tensor) -> Tensor:
        return self.model(images, tokens)

    def _loss(self, batch: dict[str, Any], label_smoothing: float = 0.0) -> Tensor:
        tokens = batch["tokens"]  # (N, T): bos ... eos pad, N >= B with several captions per image
        logits = self.model(batch["images"], tokens[:, :-1], batch.get("caption_image"))  # (N, T-1, V)
        return self.caption_loss(logits, tokens, label_smoothing)

    def use_reward(self, scorer: CiderD) -> None:
        """Train self-critically with ``scorer`` as the reward (needs ``scst`` settings)."""
        if self.scst is None:
            raise ValueError("use_reward needs the system's scst settings (finetune=scst)")
        self.self_critical = SelfCritical(self.scst, scorer, self.vocab.decode_batch)

    def _training_loss(self, batch: dict[str, Any]) -> Tensor:
        if "labelled" in batch:  # semi=: the labelled batch, and the weak and strong views of the unlabelled one
            size = len(batch["labelled"]["image_ids"])
            loss = self._loss(batch["labelled"], self.label_smoothing)
            if self.global_step >= self.semi.start_step:
                loss = loss + self.semi.weight * self._unlabelled(batch["weak"], batch["strong"])
        else:
            size = len(batch["image_ids"])
            scst = self.scst is not None
            loss = self._self_critical_loss(batch, size) if scst else self._loss(batch, self.label_smoothing)
        self.log("train/loss", loss, prog_bar=self.loss_on_progress_bar, batch_size=size)
        return loss

    def _unlabelled(self, weak: Tensor, strong: Tensor) -> Tensor:
        """FixMatch for captions: the teacher captions ``weak`` (U, C, height, width) greedily with the key/value cache
        (eval mode, no gradient); a caption whose mean token probability passes the threshold is learned, teacher
        forced, on ``strong``."""
        teacher, ids = self.labeller, self.model.special_ids
        with labelling(teacher):
            generated = teacher.generate(weak, max_new_tokens=self.max_new_tokens)  # (U, T'): no <bos>, <eos>, <pad>
            tokens = torch.cat([generated.new_full((len(generated), 1), ids.bos_id), generated], dim=1)  # (U, 1 + T')
            probs = caption_token_probs(teacher(weak, tokens[:, :-1]), generated, ids)  # (U, T')
        real = (generated != ids.pad_id).sum(dim=1).clamp(min=1)  # (U,)
        confidence = probs.sum(dim=1) / real  # the mean token probability
        mask = self.semi_threshold(confidence[:, None])  # (U,)
        loss = unlabelled_caption_loss(self.model(strong, tokens[:, :-1]), generated, mask, ids.pad_id)
        self.last_pseudo = {"tokens": generated, "confidence": confidence, "mask": mask}
        self.log("train/semi_loss", loss, batch_size=len(weak))
        self.log("train/semi_mask", mask.float().mean(), batch_size=len(weak))  # the share above the threshold
        return loss

    def _self_critical_loss(self, batch: dict[str, Any], size: int) -> Tensor:
        scst, caption = self._self_critical_terms(batch, size, self.model.encoder.forward_tokens(batch["images"]))
        return scst if caption is None else scst + self.scst.xe_weight * caption

    def _self_critical_terms(self, batch: dict[str, Any], size: int, encoded: Memory) -> tuple[Tensor, Tensor | None]:
        """The SCST loss and, when ``xe_weight`` is not 0, the teacher-forced cross-entropy, both from the encoder's
        ``Memory`` of the batch's images (``forward_tokens``): each image encoded once a step."""
        memory = self.model.memory(encoded)
        if self.self_critical is None:
            raise RuntimeError("scst is set but no reward was given: call use_reward(scorer) before training")
        scst, logged = self.self_critical(self.model, batch["images"], batch["references"], None, memory)
        self.log_dict({f"train/{k}": v for k, v in logged.items()}, batch_size=size)
        if not self.scst.xe_weight:
            return scst, None
        tokens = batch["tokens"]  # (N, T)
        logits = self.model.decoder(tokens[:, :-1], per_caption(memory, batch.get("caption_image")))  # (N, T-1, V)
        return scst, self.caption_loss(logits, tokens, self.label_smoothing)

    def _evaluate(self, batch: dict[str, Any], stage: str) -> None:
        self.log(f"{stage}/loss", self._loss(batch), sync_dist=True, prog_bar=True, batch_size=len(batch["image_ids"]))
        captions = self.vocab.decode_batch(self.model.generate(batch["images"], **self.generate_kwargs))
        self.caption_metrics.update(captions, batch["references"], batch["image_ids"].tolist())

    def _score(self, stage: str) -> None:
        """The captions' scores and, at validation, the zero-shot accuracy."""
        metrics = {} if self.trainer.sanity_checking else self.caption_metrics.compute()  # every rank alike
        outputs = self.caption_metrics.corpus  # what was scored: one per image, sorted by id
        self.caption_metrics.reset()
        if not metrics:
            return
        if stage == "val" and self._zero_shot is not None:
            metrics.update(self._zero_shot_accuracy())
        # Every rank holds the whole split, so the values already agree: no reduction.
        self.log_dict({f"{stage}/{k}": float(v) for k, v in metrics.items()}, sync_dist=False, rank_zero_only=False)
        self.last_samples = [(caption, refs) for _, caption, refs in outputs][: self.num_samples]
        if isinstance(self.logger, TensorBoardLogger) and self.trainer.is_global_zero:
            text = "\n\n".join(f"**{c}**  \nreference: {r[0]}" for c, r in self.last_samples)
            self.logger.experiment.add_text(f"{stage}/samples", text, self.global_step)

    @torch.no_grad()
    def _zero_shot_accuracy(self, batch_size: int = 64) -> dict[str, Tensor]:
        """Top-1 and top-5 of the zero-shot folder read as ``vitattn-eval task=zero_shot`` reads it, each rank
        classifying every world_size-th image, the counts summed over the ranks (unreadable images left out). In
        the validation steps' precision context: outside it, ``on_validation_epoch_end`` runs in fp32, which FSDP's
        bf16 weights refuse and which is not the precision ``vitattn-eval`` classifies in."""
        samples, names, templates, scorer, transform = self._zero_shot
        paths, labels = zip(*samples[self.global_rank :: self.trainer.world_size]) if samples else ((), ())
        counts = torch.zeros(3, device=self.device)  # top-1 hits, top-5 hits, images read
        with self.trainer.precision_plugin.val_step_context():
            classify = zero_shot_classifier(self.model, self.vocab, names, templates, scorer, self.device)
            for images, targets in file_batches(paths, labels, transform, batch_size, 0, []):
                counts += topk_hits(classify(images.to(self.device)), targets).to(counts)  # as vitattn-eval counts
        top1, top5, read = self.trainer.strategy.reduce(counts, reduce_op="sum").tolist()
        return {
            "zero_shot_top1": torch.tensor(top1 / max(read, 1)),
            "zero_shot_top5": torch.tensor(top5 / max(read, 1)),
        }

    def on_validation_epoch_end(self) -> None:
        self._score("val")

    def on_test_epoch_end(self) -> None:
        self._score("test")
