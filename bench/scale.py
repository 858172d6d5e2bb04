"""``python -m bench.scale FAMILY SIZE ROUNDS [quick]``: one family's whole check at one size against its
dense twin's forward+backward, side by side in a fresh process; prints one JSON line. See
:func:`bench.sections.scale_worker`."""

from __future__ import annotations

import json
import sys
import warnings

from bench.sections import scale_worker

if __name__ == "__main__":
    warnings.simplefilter("ignore")
    family, size, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    print(json.dumps(scale_worker(family, size, rounds, quick=sys.argv[4:5] == ["quick"])))
