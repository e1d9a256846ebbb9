"""One-line errors for user mistakes; full tracebacks only with ``debug=true``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

from omegaconf.errors import OmegaConfBaseException

from vitattn.systems.base import NonFiniteLossError

# What a config, a path, a file or the data can cause; anything else is a bug and keeps its traceback.
USER_ERRORS = (
    ValueError,
    FileNotFoundError,
    NotADirectoryError,
    PermissionError,
    OmegaConfBaseException,
    NonFiniteLossError,
)


@contextmanager
def user_errors(debug: bool = False) -> Iterator[None]:
    """Turn user errors into ``error: <message>`` on stderr and exit status 2."""
    try:
        yield
    except USER_ERRORS as err:
        if debug:
            raise
        text = str(err).strip()
        message = text.splitlines()[0] if text else type(err).__name__
        print(f"error: {message} (debug=true shows the traceback)", file=sys.stderr, flush=True)
        sys.exit(2)
