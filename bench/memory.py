"""``python -m bench.memory MODE SIZE WS``: peak RSS of a dense layer (MODE=dense) or an inproc world
(MODE=inproc) in a fresh process; prints one JSON line. See :func:`bench.sections.memory_worker`."""

from __future__ import annotations

import json
import sys
import warnings

from bench.sections import memory_worker

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    mode, size, ws = sys.argv[1:4]
    print(json.dumps(memory_worker(mode, int(size), int(ws))))
