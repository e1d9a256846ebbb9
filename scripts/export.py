"""python scripts/export.py [key=value ...] == vitattn-export [key=value ...]"""

import sys

from vitattn.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
