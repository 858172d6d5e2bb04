"""inproc hand-off micro-benchmark: 200 steps of all_gather + all_reduce per rank, at 8 and 32 ranks.

    python -m bench.handoff plain|watched|rank_local

Modes: ``plain`` (nothing watched: the rank function's module rebinds no global), ``watched`` (this
module has 3 globals rebound by ``global`` statements: compared at every hand-off), ``rank_local``
(this module, ~40 globals, declared rank-local: swapped at every hand-off). Prints the best wall and
CPU time of 7 runs per collective per rank. A quick check of the hand-off path's cost, not part of
``python -m bench`` (no report, no assertions); compare modes, or a change, in one sitting.
"""

from __future__ import annotations

import sys
import time
import types

import torch
import torch.distributed as dist

import tpsim

_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
# Module state the way a library keeps it: 3 globals a function rebinds (the watch compares them at
# every hand-off), and padding up to ~40 globals (a rank-local module is swapped whole).
_A = _B = _C = None
for _i in range(35):
    globals()[f"_pad{_i}"] = _i


def _set_state() -> None:
    global _A, _B, _C
    _A, _B, _C = 1, 2, 3


def loop(steps: int) -> None:
    r, ws = dist.get_rank(), dist.get_world_size()
    x = torch.ones(4) * r
    out = torch.empty(4 * ws)
    for _ in range(steps):
        _GATHER(out, x)
        dist.all_reduce(x)
    return None


def main(mode: str, reps: int = 7) -> None:
    kw = {"rank_local": (sys.modules[__name__],)} if mode == "rank_local" else {}
    if mode == "plain":  # hide the `global` statements from the watch: a copy of loop in a module without them
        m = types.ModuleType("plainmod")
        m.__dict__.update(dist=dist, torch=torch, _GATHER=_GATHER)
        exec(compile(
            "def loop(steps):\n r, ws = dist.get_rank(), dist.get_world_size()\n x = torch.ones(4) * r\n"
            " out = torch.empty(4 * ws)\n for _ in range(steps):\n  _GATHER(out, x)\n  dist.all_reduce(x)\n",
            "plainmod", "exec"), m.__dict__)
        sys.modules["plainmod"] = m
        fn = m.loop
    else:
        fn = loop
    out = []
    for ws in (8, 32):
        tpsim.run(fn, ws, args=(5,), **kw)
        cpus, walls = [], []
        for _ in range(reps):
            t0, c0 = time.perf_counter(), time.process_time()
            tpsim.run(fn, ws, args=(200,), **kw)
            walls.append(time.perf_counter() - t0)
            cpus.append(time.process_time() - c0)
        n = 200 * 2 * ws
        out.append(f"ws={ws} wall {min(walls)/n*1e6:.1f} cpu {min(cpus)/n*1e6:.1f}")
    print(mode, "|", " | ".join(out), f"(us per collective per rank, best of {reps})")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "plain")
