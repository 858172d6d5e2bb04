"""``python -m bench.overhead WORLD_SIZES CALLS REPEATS``: inproc's cost per collective per rank with tiny
tensors at each of the comma-separated WORLD_SIZES, beside its floor, in a fresh process; prints one
JSON line. See :func:`bench.sections.overhead_worker`."""

from __future__ import annotations

import json
import sys
import warnings

from bench.sections import overhead_worker

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    sizes = tuple(int(w) for w in sys.argv[1].split(","))
    calls, repeats = (int(a) for a in sys.argv[2:4])
    print(json.dumps(overhead_worker(sizes, calls, repeats)))
