"""How an exception becomes the one line a user reads."""

from __future__ import annotations

import reprlib
from typing import Any

__all__ = ["NonFiniteLossError", "brief", "first_line", "printable"]


class NonFiniteLossError(RuntimeError):
    """Training produced a NaN or infinite loss."""


def first_line(err: BaseException, limit: int = 300) -> str:
    """The error's message on one line (whitespace collapsed), cut at ``limit`` characters; its type if empty."""
    text = str(err).strip()
    text = " ".join(text.splitlines()[0].split()) if text else type(err).__name__
    return text if len(text) <= limit else text[:limit] + "..."


_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxlong, _brief.maxother = 3, 60, 40, 60


def brief(value: Any, limit: int = 80) -> str:
    """A short ``repr`` of a value read from a file, for an error message: however large or deeply
    nested the value, the result is one line of at most ``limit`` characters, computed in little time."""
    text = _brief.repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def printable(text: str) -> str:
    """``text`` as it is when every character prints, else its ``repr``: a name that a user typed or a
    file holds stays on one line of a message even when it holds a line break or a control character."""
    return text if text.isprintable() else repr(text)
