"""Issue 3's collective-step workload, on every backend and as the single-thread floor.

One step of a column-parallel linear layer, per rank (B=8 rows, I=64 inputs, O=64 output features
per rank, float32), with its communication:

    y  = x @ W_rᵀ                      forward (autograd), [B, O]
    Y  = all_gather(y)                 the gathered output, [ws*B, O]
    y.backward(g_r)                    backward (autograd): dx = g_r W_r, dW = g_rᵀ x
    all_reduce(dx)                     the input grad summed over ranks, [B, I]
    W_r -= lr * dW                     SGD step

The floor does exactly this arithmetic for every rank, rank after rank, in one thread, with the
gather as one ``torch.cat`` and the reduction as a sum in rank order: the cost of the computation
with no communication machinery at all.

Run one measurement in a fresh process (what :mod:`bench.sections` does, with a time limit)::

    python -m bench.workload --backend inproc --world-size 8 --steps 200
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

ROWS, IN_FEATURES, OUT_FEATURES = 8, 64, 64  # B, I, O of issue 3
LR = 1e-3
#: backends :func:`measure` knows; "threaded" is torch's private test process group (comparison only).
BACKENDS = ("floor", "inproc", "threaded", "gloo")


def _rank_tensors(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, IN_FEATURES, generator=torch.Generator().manual_seed(1000))
    gen = torch.Generator().manual_seed(rank)
    return x, torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen), torch.randn(ROWS, OUT_FEATURES, generator=gen)


def _sgd(w: torch.Tensor) -> None:
    with torch.no_grad():
        w -= LR * w.grad
    w.grad = None


WARMUP = 3


def rank_loop(steps: int) -> float:
    """The workload on this rank of an initialised world; returns its loop's wall seconds
    (``WARMUP`` untimed steps first, so one-time autograd and dispatch set-up is not counted)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    x, w, g = _rank_tensors(rank)
    w.requires_grad_(True)
    gathered = torch.empty(ws * ROWS, OUT_FEATURES)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    for step in range(WARMUP + steps):
        if step == WARMUP:
            dist.barrier()
            start = time.perf_counter()
        xr = x.clone().requires_grad_(True)
        y = xr @ w.t()
        gather(gathered, y.detach())
        y.backward(g)
        dist.all_reduce(xr.grad)
        _sgd(w)
    dist.barrier()
    return time.perf_counter() - start


def floor(world_size: int, steps: int) -> float:
    """The same arithmetic for every rank in one thread; returns wall seconds."""
    tensors = [_rank_tensors(r) for r in range(world_size)]
    for _x, w, _g in tensors:
        w.requires_grad_(True)
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        xs = [x.clone().requires_grad_(True) for x, _w, _g in tensors]
        ys = [xr @ w.t() for xr, (_x, w, _g) in zip(xs, tensors, strict=True)]
        torch.cat([y.detach() for y in ys])
        for y, (_x, _w, g) in zip(ys, tensors, strict=True):
            y.backward(g)
        total = xs[0].grad
        for xr in xs[1:]:
            total = total + xr.grad
        for _x, w, _g in tensors:
            _sgd(w)
    return time.perf_counter() - start


def threaded(world_size: int, steps: int) -> float:
    """The workload on torch's internal threaded process group (a comparison, never a dependency)."""
    from torch.testing._internal.distributed import multi_threaded_pg as mtpg

    world = mtpg._install_threaded_pg()
    store = dist.HashStore()
    times: list[float] = [0.0] * world_size
    errors: list[BaseException] = []

    def worker(rank: int) -> None:
        dist.init_process_group(backend="threaded", rank=rank, world_size=world_size, store=store)
        try:
            times[rank] = rank_loop(steps)
        except BaseException as err:  # reported by the parent thread
            errors.append(err)
            mtpg.ProcessLocalGroup.exception_handle(err)
        finally:
            if world == dist.distributed_c10d._world:
                dist.destroy_process_group()

    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    try:
        threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world_size)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        mtpg._uninstall_threaded_pg()
    if errors:
        raise errors[0]
    return max(times)


def measure(backend: str, world_size: int, steps: int) -> dict[str, Any]:
    """One measurement: loop seconds (max over ranks) and the world's whole wall time."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
    start = time.perf_counter()
    if backend == "floor":
        loop = floor(world_size, steps)
    elif backend == "threaded":
        loop = threaded(world_size, steps)
    else:
        import tpsim

        if backend == "gloo":  # start the worker pool first: the loop is what is compared
            tpsim.run(rank_loop, world_size, backend="gloo", args=(1,), timeout=120)
            start = time.perf_counter()
        loop = max(tpsim.run(rank_loop, world_size, backend=backend, args=(steps,), timeout=120))
    return {"backend": backend, "world_size": world_size, "steps": steps, "loop_s": loop,
            "wall_s": time.perf_counter() - start}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workload", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # every backend gets the same intra-op threads: one, as each rank of a 2-core box
    print(json.dumps(measure(args.backend, args.world_size, args.steps)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
