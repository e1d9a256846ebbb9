"""``python -m benchmarks SECTION [options]``: the registry and its parser are ``benchmarks.cli``."""

import sys

from benchmarks.cli import main
from benchmarks.learning_data import DataError

if __name__ == "__main__":
    try:
        main()
    except (DataError, RuntimeError, ValueError) as err:
        sys.exit(f"error: {err}")
