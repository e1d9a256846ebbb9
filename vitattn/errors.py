"""How an exception becomes the one line a user reads."""

from __future__ import annotations

__all__ = ["NonFiniteLossError", "first_line"]


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """The error's message on one line (whitespace collapsed), cut at ``limit`` characters; its type if empty."""
    text = str(err).strip()
    text = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."
