"""Non-finite training losses, noted on the device and read on the host only when a decision needs them."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["NonFiniteNotes"]


class NonFiniteNotes:
    """The earliest non-finite loss since the last look: its step and value, kept on the loss's device.

    ``note`` queues a few device operations and reads nothing back, so a step that notes its loss makes no
    host sync; ``take`` reads the notes (one sync) and clears them.
    """

    def __init__(self) -> None:
        self.step: Tensor | None = None  # () long: the step of the earliest non-finite loss, -1 for none
        self.loss: Tensor | None = None  # () float32: its value

    def note(self, loss: Tensor, step: int) -> None:
        """Note ``loss`` (a scalar) of training step ``step`` if it is the first non-finite one since the last look."""
        value = loss.detach()
        if self.step is None:
            self.step, self.loss = self._empty(value.device)
        first = ~torch.isfinite(value) & (self.step < 0)
        self.step = torch.where(first, step, self.step)
        self.loss = torch.where(first, value.float(), self.loss)

    def take(
        self, device: torch.device, gather: Callable[[Tensor], Tensor] | None = None, rank: int = 0
    ) -> tuple[int, int, float] | None:
        """``(step, rank, loss)`` of the earliest non-finite loss noted, or None; the notes are cleared.

        Args:
            device: where a rank that noted nothing puts its empty note.
            gather: under DDP, the all-gather of a scalar over the ranks (``LightningModule.all_gather``): every
                rank must then take its notes together. None: this process's notes alone.
            rank: this process's rank, named when its notes are taken alone.
        """
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
