"""python scripts/bench.py [--quick] [--sections ...]: speed of vitattn against timm and Hugging Face.

The code is in vitattn/bench/ (vitattn.bench.cli); see docs/benchmarks.md.
"""

from vitattn.bench.cli import main

if __name__ == "__main__":
    main()
