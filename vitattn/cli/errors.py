"""One-line errors for user mistakes, shared by every entry point; full tracebacks only with ``debug=true``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf.errors import OmegaConfBaseException

from vitattn.errors import MissingDependencyError, NonFiniteLossError, first_line

__all__ = ["USER_ERRORS", "report_user_error", "user_errors"]

# What a config, a path, a file or the data can cause; anything else is a bug and keeps its traceback.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    FileExistsError,
    OmegaConfBaseException,
    NonFiniteLossError,
    MissingDependencyError,
)


def report_user_error(err: BaseException, hint: str = "") -> int:
    """Print ``error: <first line>`` on stderr; returns the exit status of a user error (2)."""
    print(f"error: {first_line(err, limit=1000)}{hint}", file=sys.stderr, flush=True)
    return 2


@contextmanager
def user_errors(debug: bool = False) -> Iterator[None]:
    """Turn user errors into ``error: <message>`` on stderr and exit status 2 (``debug`` re-raises)."""
    try:
        yield
    except USER_ERRORS as err:
        if debug:
            raise
        sys.exit(report_user_error(err, " (debug=true shows the traceback)"))
