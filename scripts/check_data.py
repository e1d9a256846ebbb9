"""python scripts/check_data.py [override ...] == vitattn-check-data [override ...]"""

import sys

from vitattn.cli.check_data import main

if __name__ == "__main__":
    sys.exit(main())
