"""python scripts/load_serve.py model=PATH [requests=1000] [clients=16] ...: load-test vitattn-serve on
localhost (latency, throughput, 400s for bad images, no 5xx, flat memory); see docs/serving.md."""

import sys

from vitattn.serve.load import main

if __name__ == "__main__":
    sys.exit(main())
