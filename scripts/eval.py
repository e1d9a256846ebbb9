"""python scripts/eval.py [key=value ...] == vitattn-eval [key=value ...]"""

import sys

from vitattn.cli.evaluate import main

if __name__ == "__main__":
    sys.exit(main())
