"""python scripts/train.py [overrides...] == vitattn-train [overrides...]"""

from vitattn.cli.train import main

if __name__ == "__main__":
    main()
