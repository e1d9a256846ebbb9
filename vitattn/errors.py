"""How an exception becomes the one line a user reads."""

from __future__ import annotations

import re
import reprlib
from pathlib import Path
from typing import Any

__all__ = [
    "ConfigError",
    "MissingDependencyError",
    "NonFiniteLossError",
    "Preempted",
    "brief",
    "first_line",
    "printable",
]


class ConfigError(ValueError):
    """A configuration value that cannot work; the message names the key and the fix."""


class MissingDependencyError(ImportError):
    """An optional package that a feature needs is not installed; the message says how to install it."""


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


# PyTorch re-raises a DataLoader worker's error as the same type with the worker's traceback as its message.
_WORKER_ERROR = re.compile(r"^Caught \w+ in DataLoader worker process \d+\.\n")


def _worker_message(text: str) -> str:
    """The original message of a DataLoader worker's error: the line after the last traceback's frames."""
    lines = text.splitlines()
    start = max(i for i, line in enumerate(lines) if line.endswith("Traceback (most recent call last):"))
    last = next((line for line in lines[start + 1 :] if line and not line[0].isspace()), lines[-1])
    return re.sub(r"^[\w.]+: ", "", last, count=1)


def first_line(err: BaseException, limit: int = 300) -> str:
    """The error's message on one line, cut at ``limit`` characters (its type if empty); a DataLoader worker's
    error gives the worker's message, not PyTorch's traceback around it."""
    text = str(err).strip()
    if _WORKER_ERROR.match(text) and "Traceback (most recent call last):" in text:
        text = _worker_message(text)
    text = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


class Preempted(RuntimeError):
    """Training stopped on ``signal`` after a whole step; ``checkpoint`` holds ``step`` (None: the signal came while
    testing, after training), or is None where no callback keeps one (``callbacks=none``)."""

    def __init__(self, signal: str, step: int | None, checkpoint: Path | None) -> None:
        self.signal, self.step, self.checkpoint = signal, step, checkpoint
        where = f"at step {step}" if step is not None else "after training, while testing"
        kept = f"checkpoint {checkpoint}" if checkpoint else "no checkpoint: callbacks=none keeps none"
        super().__init__(f"preempted by {signal} {where}; {kept}")


_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxlong, _brief.maxother = 3, 60, 40, 60


def brief(value: Any, limit: int = 80) -> str:
    """A one-line ``repr`` of at most ``limit`` characters for an error message, quick for any large value."""
    text = _brief.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str) -> str:
    """``text``, or its ``repr`` when a character would not print: a name with a line break stays on one line."""
    return text if text.isprintable() else repr(text)
