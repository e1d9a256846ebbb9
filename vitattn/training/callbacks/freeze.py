"""Train the head (or the caption decoder) alone for the first epochs, then the whole model (Lightning's
``BaseFinetuning`` freezes, thaws and checkpoints the param groups added on the way)."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.callbacks import BaseFinetuning
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LambdaLR

from vitattn.training.systems.base import add_param_groups, head_modules, schedule_all_groups

__all__ = ["FreezeEncoder"]


class FreezeEncoder(BaseFinetuning):
    """Freeze everything but ``head_modules(model)`` until epoch ``unfreeze_at_epoch``
    (``finetune.freeze_encoder_epochs``); the encoder then joins the optimizer with the groups it would have had
    from the start (``VisionSystem.param_groups``, at the schedule's current factor), not Lightning's one group.
    """

    def __init__(self, unfreeze_at_epoch: int) -> None:
        super().__init__()
        if unfreeze_at_epoch < 1:
            raise ValueError(f"unfreeze_at_epoch={unfreeze_at_epoch} must be 1 or more")
        self.unfreeze_at_epoch = unfreeze_at_epoch

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage == "fit":  # a test or validation run after training leaves the model as training left it
            super().setup(trainer, pl_module, stage)

    def freeze_before_training(self, pl_module: pl.LightningModule) -> None:
        self.freeze(pl_module.model)
        self.make_trainable(head_modules(pl_module.model))

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)  # a resumed run: the saved param groups, thawed ones included
        for scheduler in _lambda_schedulers(trainer):
            schedule_all_groups(scheduler)

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # A run resumed in the middle of an epoch gets no on_train_epoch_start for it: thaw here as well.
        self.on_train_epoch_start(trainer, pl_module)

    def finetune_function(self, pl_module: pl.LightningModule, epoch: int, optimizer: Optimizer) -> None:
        model = pl_module.model
        if epoch < self.unfreeze_at_epoch or all(p.requires_grad for p in model.parameters()):
            return
        self.make_trainable(model)
        # A run resumed after the thaw has the encoder's groups already (restored in on_fit_start).
        present = {id(p) for group in optimizer.param_groups for p in group["params"]}
        groups = [{**g, "params": [p for p in g["params"] if id(p) not in present]} for g in pl_module.param_groups()]
        scheduler = next(s for s in _lambda_schedulers(pl_module.trainer) if s.optimizer is optimizer)
        add_param_groups(scheduler, [g for g in groups if g["params"]])


def _lambda_schedulers(trainer: pl.Trainer) -> list[LambdaLR]:
    return [c.scheduler for c in trainer.lr_scheduler_configs if isinstance(c.scheduler, LambdaLR)]
