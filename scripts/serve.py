"""python scripts/serve.py [key=value ...] == vitattn-serve [key=value ...]"""

import sys

from vitattn.cli.serve import main

if __name__ == "__main__":
    sys.exit(main())
