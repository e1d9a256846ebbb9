"""python scripts/caption.py [key=value ...] == vitattn-caption [key=value ...]"""

import sys

from vitattn.cli.caption import main

if __name__ == "__main__":
    sys.exit(main())
