"""``python -m bench.props BACKEND N SIZES TARGET``: property examples per second in a fresh process
(so a gloo world's start-up is measured cold); prints one JSON line. See :func:`bench.sections.props_worker`."""

from __future__ import annotations

import json
import sys
import warnings

from bench.sections import props_worker

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    backend, n, sizes, target = sys.argv[1:5]
    result = props_worker(backend, int(n), tuple(int(s) for s in sizes.split(",")), target)
    print(json.dumps(result))
