"""`python -m moescope.examples.loadgen` — the reference load generator (examples/moe_runtime/loadgen.py)."""

import sys

from moescope.examples.moe_runtime.loadgen import main

if __name__ == "__main__":
    sys.exit(main())
