"""How an exception becomes the one line a user reads."""

from __future__ import annotations

from pathlib import Path

__all__ = ["NonFiniteLossError", "Preempted", "first_line"]


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """The error's message on one line (whitespace collapsed), cut at ``limit`` characters; its type if empty."""
    text = str(err).strip()
    text = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


class Preempted(RuntimeError):
    """Training stopped on a signal (SIGTERM, SIGUSR1) after a whole step, with a checkpoint to continue from.

    Args:
        signal: the signal's name, e.g. ``"SIGTERM"``.
        step: the global step the checkpoint holds; None when the signal came after training (while testing).
        checkpoint: the checkpoint file.
    """

    def __init__(self, signal: str, step: int | None, checkpoint: Path) -> None:
        self.signal, self.step, self.checkpoint = signal, step, checkpoint
        where = f"at step {step}" if step is not None else "after training, while testing"
        super().__init__(f"preempted by {signal} {where}; checkpoint {checkpoint}")
