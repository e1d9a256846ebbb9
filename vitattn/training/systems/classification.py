"""Image classification: cross-entropy (optional label smoothing), top-1 / top-5 accuracy; with ``semi=``, the
unlabelled images' pseudo-labels learned in the same step (``vitattn.training.semi``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from timm.data import Mixup
from torch import Tensor
from torchmetrics.classification import MulticlassAccuracy

from vitattn.errors import ConfigError
from vitattn.losses import classification_loss, soft_target_cross_entropy
from vitattn.models import VisionTransformer
from vitattn.models.vit import Patches
from vitattn.training.semi import FreeMatchThreshold, SemiSettings, labelling, unlabelled_loss
from vitattn.training.systems.base import VisionSystem

__all__ = ["ClassificationSystem"]


class ClassificationSystem(VisionSystem):
    """Trains a ``VisionTransformer(**model_config)`` (``num_classes`` included) on ``class_names`` in label
    order; ``preprocess`` is kept for inference. ``mixup``, ``cutmix``: timm's ``Mixup`` alphas (0 = off), the loss
    then on the mixed, label-smoothed soft targets; ``optim``, ``nonfinite``: ``VisionSystem``'s. A training batch's
    labels are class indices (B,) or class probabilities (B, K) (``bootstrap.soft``: a teacher's, learnt by the
    soft cross-entropy -sum_k p_k log softmax(logits)_k)."""

    task = "classification"

    def __init__(
        self,
        model_config: dict[str, Any],
        class_names: list[str],
        preprocess: dict[str, Any] | None = None,
        label_smoothing: float = 0.0,
        optim: dict[str, Any] | None = None,
        nonfinite: str = "raise",
        mixup: float = 0.0,
        cutmix: float = 0.0,
    ) -> None:
        super().__init__(optim, nonfinite)
        if model_config.get("num_classes") != len(class_names):
            raise ValueError(f"model num_classes={model_config.get('num_classes')} but {len(class_names)} class names")
        self.save_hyperparameters()
        self.model = VisionTransformer(**model_config)
        self.example_input_array = self.example_images(self.model)  # the model summary counts FLOPs per image
        self.label_smoothing = label_smoothing
        n = len(class_names)
        self.mixup: Mixup | None = None
        if mixup > 0 or cutmix > 0:  # with both, timm draws one or the other per batch
            self.mixup = Mixup(mixup_alpha=mixup, cutmix_alpha=cutmix, label_smoothing=label_smoothing, num_classes=n)
        self.train_acc = MulticlassAccuracy(n, average="micro")
        self.val_acc = MulticlassAccuracy(n, average="micro")
        self.val_top5 = MulticlassAccuracy(n, top_k=min(5, n), average="micro")
        self.test_acc = MulticlassAccuracy(n, average="micro")
        self.test_top5 = MulticlassAccuracy(n, top_k=min(5, n), average="micro")

    def use_semi(self, settings: SemiSettings) -> None:
        """``VisionSystem.use_semi``; ``semi=freematch``: its adaptive threshold (buffers, checkpointed). A fixed
        threshold that label smoothing puts out of reach is refused: a model trained towards the smoothed target
        gives no class more than 1 - ε + ε/K, so no pseudo-label would ever pass."""
        classes = len(self.hparams.class_names)
        reach = 1 - self.label_smoothing + self.label_smoothing / classes
        if settings.method == "fixmatch" and settings.threshold >= reach:
            raise ConfigError(
                f"semi.threshold={settings.threshold} is never reached with head.label_smoothing="
                f"{self.label_smoothing} over {classes} classes (no class gets more than {reach:.3f}); FixMatch "
                "trains without smoothing: add head.label_smoothing=0, or set semi.threshold below that"
            )
        super().use_semi(settings)
        if settings.method == "freematch":
            self.semi_threshold = FreeMatchThreshold(len(self.hparams.class_names), settings.momentum)

    def forward(self, images: Tensor) -> Tensor:
        return self.model(images)

    def _training_loss(self, batch: tuple[Tensor, Tensor] | Mapping[str, Any]) -> Tensor:
        if not isinstance(batch, Mapping):
            loss = self._supervised(batch)
        else:  # semi=: the labelled batch, and the weak and strong views of the unlabelled one
            loss = self._supervised(batch["labelled"])
            if self.global_step >= self.semi.start_step:
                loss = loss + self.semi.weight * self._unlabelled(batch["weak"], batch["strong"])
        self.log("train/loss", loss, prog_bar=self.loss_on_progress_bar)
        return loss

    def _unlabelled(self, weak: Tensor, strong: Tensor) -> Tensor:
        """FixMatch's loss of the unlabelled views (U, C, height, width): the teacher labels ``weak`` (eval mode,
        no gradient), the model learns the labels that pass the threshold on ``strong``."""
        teacher = self.labeller
        with labelling(teacher):
            probs = teacher(weak).float().softmax(dim=-1)  # (U, K)
        adaptive = isinstance(self.semi_threshold, FreeMatchThreshold)
        everyone = self.all_gather(probs).flatten(0, 1) if adaptive and self._gather is not None else None
        mask = self.semi_threshold(probs, everyone)  # (U,)
        loss = unlabelled_loss(self.model(strong), probs, mask, self.semi.soft)
        confidence, labels = probs.max(dim=-1)
        self.last_pseudo = {"labels": labels, "confidence": confidence, "mask": mask}
        self.log("train/semi_loss", loss)
        self.log("train/semi_mask", mask.float().mean())  # the share above the threshold (USB's util_ratio)
        return loss

    def _supervised(self, batch: tuple[Tensor, Tensor]) -> Tensor:
        images, labels = batch
        if self.mixup is not None and isinstance(images, Patches):
            raise ValueError("head.mixup and head.cutmix mix square images: set them 0 with data.max_patches")
        soft_pool = labels.is_floating_point()  # (B, K) probabilities: a soft pool's (mixup refused with them at build)
        # timm mixes pairs: an odd last batch stays plain
        if self.mixup is not None and not soft_pool and len(images) % 2 == 0:
            mixed, soft = self.mixup(images, labels)  # (B, C, height, width), (B, K)
            logits = self.model(mixed)
            loss = soft_target_cross_entropy(logits, soft).mean()
        else:
            logits = self.model(images)
            loss = classification_loss(logits, labels, self.label_smoothing)
        self.train_acc(logits, labels.argmax(-1) if soft_pool else labels)
        self.log("train/acc", self.train_acc, on_step=True, on_epoch=False)
        return loss

    def _evaluate(self, batch: tuple[Tensor, Tensor], stage: str) -> Tensor:
        """The batch's logits (B, K), for callbacks (``ValidationPictures``' confusion matrix)."""
        images, labels = batch
        top1, top5 = getattr(self, f"{stage}_acc"), getattr(self, f"{stage}_top5")
        logits = self.model(images)
        self.log(f"{stage}/loss", classification_loss(logits, labels), sync_dist=True)
        top1(logits, labels)
        top5(logits, labels)
        self.log(f"{stage}/acc", top1, prog_bar=True)
        self.log(f"{stage}/top5", top5)
        return logits
