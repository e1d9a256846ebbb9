"""What every system shares: the non-finite loss guard, and AdamW with warmup + cosine decay stepped every
optimizer step over a horizon that can move (``TimeBudgetHorizon`` moves it under ``trainer.max_time``). Each
parameter group has its own peak learning rate (layer-wise decay, a head or decoder rate); one ``WarmupCosine``
factor multiplies them all.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from timm.optim import param_groups_layer_decay, param_groups_weight_decay
from torch import Tensor, nn
from torch.optim import AdamW
from torch.optim.lr_scheduler import LambdaLR

from vitattn.errors import NonFiniteLossError
from vitattn.training.semi import FixedThreshold, SemiSettings, TeacherEma
from vitattn.training.systems.sharding import gather_for_evaluation, is_sharded, shard_again, shard_layers

__all__ = [
    "UNKNOWN_HORIZON",
    "NonFiniteNotes",
    "VisionSystem",
    "WarmupCosine",
    "add_param_groups",
    "build_optimizer",
    "head_modules",
    "param_groups",
    "schedule_all_groups",
]

UNKNOWN_HORIZON = 10**9  # steps: a schedule with no step, epoch or time limit stays at its peak

# Parameters without weight decay, wherever they sit (``encoder.pos_embed``, ``decoder.token_embed.weight``);
# norms and biases (one dimension) never get it either.
NO_WEIGHT_DECAY = ("pos_embed", "cls_token", "token_embed")


def no_weight_decay_names(model: nn.Module) -> set[str]:
    """The full names of ``model``'s position embeddings, class tokens and token embeddings."""
    return {name for name, _ in model.named_parameters() if any(part in NO_WEIGHT_DECAY for part in name.split("."))}


AUTO_WARMUP_STEPS = 200  # optim.warmup_steps=auto: 200 steps, or a tenth of a shorter run


class WarmupCosine:
    """Learning-rate factor at an optimizer step: linear warmup from 1/1000 over ``warmup_steps`` (at most a tenth
    of the horizon; ``auto``: ``AUTO_WARMUP_STEPS``), then cosine to ``min_lr_ratio`` at ``total_steps``. A plain
    object (its ``__dict__`` is the scheduler's saved state): a resumed run continues the same curve."""

    def __init__(self, total_steps: int, warmup_steps: int | str, min_lr_ratio: float) -> None:
        self.total_steps = max(1, int(total_steps))
        self.requested_warmup = AUTO_WARMUP_STEPS if warmup_steps == "auto" else int(warmup_steps)
        self.min_lr_ratio = float(min_lr_ratio)

    @property
    def warmup_steps(self) -> int:
        """The warmup actually used: at least 1 step, at most a tenth of the horizon."""
        return max(1, min(self.requested_warmup, self.total_steps // 10))

    def __call__(self, step: int) -> float:
        warmup = self.warmup_steps
        if step < warmup:
            return 1e-3 + (1.0 - 1e-3) * step / warmup
        progress = min(1.0, (step - warmup) / max(1, self.total_steps - warmup))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))


def head_modules(model: nn.Module) -> list[nn.Module]:
    """What is trained at ``head_lr`` and never frozen: a captioner's decoder, or a classifier's head."""
    decoder = getattr(model, "decoder", None)
    return [decoder] if isinstance(decoder, nn.Module) else [model.head]


def param_groups(
    model: nn.Module,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    layer_decay: float | None = None,
    head_lr: float | None = None,
) -> list[dict[str, Any]]:
    """AdamW groups ``[{"params", "lr", "weight_decay"}, ...]`` of the trainable parameters: no weight decay on
    norms, biases and embeddings; ``layer_decay`` as timm's ``param_groups_layer_decay`` (layer ``i`` of ``L`` at
    ``lr * layer_decay ** (L - i)``); ``head_lr`` the rate of ``head_modules(model)``."""
    no_decay = no_weight_decay_names(model)
    if layer_decay is None:
        groups = param_groups_weight_decay(model, weight_decay, no_weight_decay_list=no_decay)
    else:
        groups = param_groups_layer_decay(model, weight_decay, no_weight_decay_list=no_decay, layer_decay=layer_decay)
    groups = [{**g, "lr": lr * g.pop("lr_scale", 1.0)} for g in groups]
    if head_lr is None:
        return groups
    head = {id(p) for m in head_modules(model) for p in m.parameters()}
    split = []
    for group in groups:
        for in_head in (False, True):
            params = [p for p in group["params"] if (id(p) in head) == in_head]
            if params:
                split.append({**group, "params": params, "lr": head_lr if in_head else group["lr"]})
    return split


def build_optimizer(
    model: nn.Module,
    total_steps: int,
    lr: float = 1e-3,
    weight_decay: float = 0.05,
    betas: tuple[float, float] = (0.9, 0.999),
    warmup_steps: int | str = "auto",
    min_lr_ratio: float = 0.01,
    layer_decay: float | None = None,
    head_lr: float | None = None,
) -> tuple[AdamW, LambdaLR]:
    """AdamW over ``param_groups`` (a frozen encoder joins when it thaws) and a ``LambdaLR`` stepped every
    optimizer step, whose ``lr_lambdas[0]`` is the ``WarmupCosine`` that every group shares."""
    groups = param_groups(model, lr, weight_decay, layer_decay, head_lr)
    optimizer = AdamW(groups, lr=lr, betas=tuple(betas))
    schedule = WarmupCosine(total_steps, warmup_steps, min_lr_ratio)
    return optimizer, LambdaLR(optimizer, [schedule] * len(optimizer.param_groups))


def add_param_groups(scheduler: LambdaLR, groups: list[dict[str, Any]]) -> None:
    """Add ``groups`` (peak rates, as ``param_groups`` gives them) to a running schedule's optimizer, at the
    schedule's current factor: parameters that join late (an encoder that thaws) follow the same curve."""
    factor = scheduler.lr_lambdas[0](scheduler.last_epoch)
    for group in groups:
        scheduler.optimizer.add_param_group({**group, "initial_lr": group["lr"], "lr": group["lr"] * factor})
        scheduler.base_lrs.append(group["lr"])
    schedule_all_groups(scheduler)


def schedule_all_groups(scheduler: LambdaLR) -> None:
    """Give the shared schedule to param groups added after the scheduler was built (its saved state has
    one entry per group, so a resumed run needs this before the state is loaded)."""
    missing = len(scheduler.optimizer.param_groups) - len(scheduler.lr_lambdas)
    scheduler.lr_lambdas.extend([scheduler.lr_lambdas[0]] * missing)


class NonFiniteNotes:
    """The earliest non-finite loss since the last look, on the loss's device: ``note`` reads nothing back,
    ``take`` reads the notes (one sync) and clears them."""

    def __init__(self) -> None:
        self.step: Tensor | None = None  # () long: the step of the earliest non-finite loss, -1 for none
        self.loss: Tensor | None = None  # () float32: its value

    def note(self, loss: Tensor, step: int) -> None:
        """Note ``loss`` (a scalar) of ``step`` if it is the first non-finite one since the last look."""
        value = loss.detach()
        if self.step is None:
            self.step, self.loss = self._empty(value.device)
        first = ~torch.isfinite(value) & (self.step < 0)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, value.float(), self.loss)

    def take(
        self, device: torch.device, gather: Callable[[Tensor], Tensor] | None = None, rank: int = 0
    ) -> tuple[int, int, float] | None:
        """``(step, rank, loss)`` of the earliest non-finite loss noted, or None, clearing the notes; ``gather``: the
        all-gather over the ranks under DDP (every rank together); None: this process's notes, as ``rank``'s."""
        step, loss = (self.step, self.loss) if self.step is not None else self._empty(device)
        self.step = self.loss = None
        if gather is not None:
            step, loss = gather(step), gather(loss)  # (W,) each
        ranks = range(step.numel()) if gather is not None else [rank]
        noted = zip(step.view(-1).tolist(), ranks, loss.view(-1).tolist())
        return min(((s, r, v) for s, r, v in noted if s >= 0), default=None)

    @staticmethod
    def _empty(device: torch.device) -> tuple[Tensor, Tensor]:
        return torch.full((), -1, dtype=torch.long, device=device), torch.zeros((), dtype=torch.float32, device=device)


class VisionSystem(pl.LightningModule):
    """Base LightningModule: ``build_optimizer(**optim)``, and on a non-finite loss ``nonfinite=raise`` (stop,
    naming the step) or ``skip`` (skip the step on every rank, counted). Subclasses build ``self.model`` from
    plain-value hyperparameters, so a checkpoint loads with ``torch.load(weights_only=True)``."""

    model: torch.nn.Module

    def __init__(self, optim: dict[str, Any] | None = None, nonfinite: str = "raise") -> None:
        super().__init__()
        if nonfinite not in ("raise", "skip"):
            raise ValueError(f"nonfinite={nonfinite!r} is unknown; choose raise or skip")
        self.optim = dict(optim or {})
        self.nonfinite = nonfinite
        self.skipped_batches = 0
        self._nonfinite_notes = NonFiniteNotes()
        self.semi: SemiSettings | None = None  # semi=: online pseudo-labels (``use_semi``)
        self.teacher: TeacherEma | None = None  # semi.ema_decay > 0: the EMA copy that labels
        self.last_pseudo: dict[str, Tensor] = {}  # the last step's pseudo-labels, for the ``PseudoLabels`` callback

    def use_semi(self, settings: SemiSettings) -> None:
        """Learn each step's unlabelled batch too (``_unlabelled``): its threshold and, for ``settings.ema_decay``
        > 0, the EMA teacher, copied from the weights the system holds now."""
        self.semi = settings
        self.semi_threshold: torch.nn.Module = FixedThreshold(settings.threshold)
        self.teacher = TeacherEma(self.model, settings.ema_decay) if settings.teacher_is_ema else None

    @property
    def labeller(self) -> torch.nn.Module:
        """What labels the unlabelled images: the model itself, or its EMA teacher."""
        return self.model if self.teacher is None else self.teacher.module

    def on_fit_start(self) -> None:
        if self.teacher is not None:
            self.teacher.to(self.device)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.teacher is not None and "semi_teacher" in checkpoint:
            self.teacher.module.load_state_dict(checkpoint["semi_teacher"])

    @staticmethod
    def example_images(vit: torch.nn.Module) -> Tensor:
        """One blank image of the size ``vit`` takes: the model summary's FLOPs are counted on it."""
        height, width = vit.patch_embed.img_size
        return torch.zeros(1, vit.patch_embed.proj.in_channels, height, width)  # (1, C, height, width)

    @property
    def loss_on_progress_bar(self) -> bool:
        """Whether a progress bar shows the training loss (Lightning reads its values back at every step)."""
        return self._trainer is not None and self._trainer.progress_bar_callback is not None

    def guard(self, loss: Tensor) -> Tensor:
        """``loss``, unchanged; whether it is finite is noted on its device, without a host sync."""
        self._nonfinite_notes.note(loss, self.global_step)
        return loss

    def optimizer_step(
        self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Callable[[], Any] | None = None
    ) -> None:
        """Lightning's step, after a look at the noted losses: every step with ``nonfinite=skip`` (skipped on every
        rank, still counted), logging steps with ``raise`` (docs/scaling.md#on-gpus)."""
        try:
            loss = optimizer_closure()  # training_step and backward: under DDP every rank joins the all-reduce
            if self.nonfinite == "skip":
                noted = self._nonfinite_notes.take(self.device, self._gather)
                if noted is not None:
                    self._skip(*noted)
                    return
            elif self.trainer.log_every_n_steps and (self.global_step + 1) % self.trainer.log_every_n_steps == 0:
                self.check_finite()  # the step Lightning logs: its values are read back to the host anyway
            optimizer.step(closure=lambda: loss)
            if self.teacher is not None:
                self.teacher.update(self.model)
        except Exception as error:
            if self.nonfinite != "raise" or isinstance(error, NonFiniteLossError):
                raise
            # A step after a non-finite loss not yet looked at may fail otherwise (an overflow, a sampler given NaN
            # probabilities): name that loss. This rank's notes alone: the other ranks may be anywhere.
            found = self._nonfinite_error(self._nonfinite_notes.take(self.device, rank=self.global_rank))
            if found is None:
                raise
            raise found from error

    def check_finite(self) -> None:
        """``NonFiniteLossError`` if a loss noted since the last look, on any rank, was not finite (one sync)."""
        found = self._nonfinite_error(self._nonfinite_notes.take(self.device, self._gather))
        if found is not None:
            raise found

    def configure_model(self) -> None:
        """``trainer=fsdp``: shard the model for fitting, one unit per layer (a test after training: whole weights)."""
        mesh = self.device_mesh
        if mesh is None or self.trainer.state.fn != TrainerFn.FITTING or is_sharded(self.model):
            return
        shard_layers(self.model, mesh["data_parallel"], str(self.trainer.precision))
        self.example_input_array = None  # the summary's forward runs on rank 0 alone: the others would not gather

    def on_validation_model_eval(self) -> None:
        super().on_validation_model_eval()
        if is_sharded(self.model):
            gather_for_evaluation(self.model)  # decoding loops of different lengths on each rank gather nothing

    def on_validation_model_train(self) -> None:
        if is_sharded(self.model):
            shard_again(self.model)
        super().on_validation_model_train()

    def on_validation_start(self) -> None:
        if self.nonfinite == "raise":
            self.check_finite()

    def on_train_epoch_end(self) -> None:
        if self.nonfinite == "raise":
            self.check_finite()

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        if self.nonfinite == "raise":
            self.check_finite()  # before the checkpoint is written: the last good one stays the last
        if self.teacher is not None:  # beside the state dict: never averaged by the ``ema`` callback nor exported
            checkpoint["semi_teacher"] = self.teacher.module.state_dict()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        if batch is None:  # no image of the batch could be read (data.bad_images=skip)
            return self.nothing_to_train()
        return self.guard(self._training_loss(batch))

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        """What ``_evaluate`` returns for callbacks (a classifier's logits); nothing for an unread batch."""
        return None if batch is None else self._evaluate(batch, "val")

    def test_step(self, batch: Any, batch_idx: int) -> None:
        if batch is not None:
            self._evaluate(batch, "test")

    def nothing_to_train(self) -> Tensor | None:
        """The step of a batch with no readable image: None (Lightning's skip) in one process; under DDP, which
        refuses None, a zero loss over every trainable weight, so that the rank joins the all-reduce."""
        if self._gather is None:
            return None
        zero = torch.zeros((), device=self.device)
        return sum((p.sum() * 0.0 for p in self.parameters() if p.requires_grad), zero)

    @property
    def _gather(self) -> Callable[[Tensor], Tensor] | None:
        return self.all_gather if self._trainer is not None and self._trainer.world_size > 1 else None

    def _nonfinite_message(self, step: int, rank: int, loss: float) -> str:
        where = f" on rank {rank}" if self._gather is not None else ""
        return f"non-finite training loss {loss} at step {step} (epoch {self.current_epoch}){where}"

    def _nonfinite_error(self, noted: tuple[int, int, float] | None) -> NonFiniteLossError | None:
        if noted is None:
            return None
        fix = "; the last good checkpoint is kept; set head.nonfinite=skip to skip such batches"
        return NonFiniteLossError(self._nonfinite_message(*noted) + fix)

    def _skip(self, step: int, rank: int, loss: float) -> None:
        self.skipped_batches += 1  # on every rank alike; rank 0 warns and logs
        skipped = "step skipped on every rank" if self._gather is not None else "batch skipped"
        rank_zero_warn(self._nonfinite_message(step, rank, loss) + f"; {skipped} ({self.skipped_batches} so far)")
        self.log("train/skipped_batches", float(self.skipped_batches))

    def param_groups(self) -> list[dict[str, Any]]:
        """The optimizer's groups of the parameters trainable now: what a thawing encoder adds."""
        keys = ("lr", "weight_decay", "layer_decay", "head_lr")
        return param_groups(self.model, **{k: v for k, v in self.optim.items() if k in keys})

    def configure_optimizers(self) -> dict[str, Any]:
        # The step or epoch limit; under a time budget alone ``TimeBudgetHorizon`` sets it later.
        limit = self.trainer.estimated_stepping_batches
        total = int(limit) if math.isfinite(limit) else UNKNOWN_HORIZON
        optimizer, scheduler = build_optimizer(self.model, total_steps=total, **self.optim)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
