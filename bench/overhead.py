"""``python -m bench.overhead WORLD_SIZE CALLS REPEATS``: inproc's cost per collective per rank with tiny
tensors, in a fresh process; prints one JSON line. See :func:`bench.sections.overhead_worker`."""

from __future__ import annotations

import json
import sys
import warnings

from bench.sections import overhead_worker

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    ws, calls, repeats = (int(a) for a in sys.argv[1:4])
    print(json.dumps(overhead_worker(ws, calls, repeats)))
