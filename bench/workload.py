"""The collective-step workload, on every backend and as the single-thread floor.

One step of a column-parallel linear layer, per rank (B=8 rows, I=64 inputs, O=64 output features
per rank, float32), with its communication:

    y  = x @ W_rᵀ                      forward (autograd), [B, O]
    Y  = all_gather(y)                 the gathered output, [ws*B, O]
    y.backward(g_r)                    backward (autograd): dx = g_r W_r, dW = g_rᵀ x
    all_reduce(dx)                     the input grad summed over ranks, [B, I]
    W_r -= lr * dW                     SGD step

Two single-thread references run the same arithmetic for every rank, rank after rank, with no
communication machinery at all:

- *floor*: every rank also receives what the collectives deliver, as it must for the
  program to mean the same thing: the gathered output is built once (``torch.cat`` into rank 0's
  buffer) and copied into every other rank's buffer, the input grads are summed in rank order
  into rank 0's grad and copied into every other rank's. That is N copies of a [N*B, O] tensor per
  step, the O(N^2) traffic that makes the issue's own floor 6.9x slower at 128 than at 32 ranks.
- *compute*: the arithmetic only, each collective's result built once and never handed to the
  ranks: a lower bound no backend can reach, shown for transparency.

Run one measurement in a fresh process (what :mod:`bench.sections` does, with a time limit)::

    python -m bench.workload --backend inproc --world-size 8 --steps 200
    python -m bench.workload --backend floor compute inproc --world-size 32 --repeats 3

Several backends with ``--repeats`` run interleaved in one process (floor, compute, inproc, floor,
...) and each keeps its fastest run: on a shared machine a burst of load then hits one sample of
one backend, not a whole series.
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

ROWS, IN_FEATURES, OUT_FEATURES = 8, 64, 64  # B, I, O per rank: small layers, where per-call overhead dominates
LR = 1e-3
#: backends :func:`measure` knows; "threaded" is torch's private test process group (comparison only).
BACKENDS = ("floor", "compute", "inproc", "threaded", "gloo")


def _rank_tensors(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(ROWS, IN_FEATURES, generator=torch.Generator().manual_seed(1000))
    gen = torch.Generator().manual_seed(rank)
    return x, torch.randn(OUT_FEATURES, IN_FEATURES, generator=gen), torch.randn(ROWS, OUT_FEATURES, generator=gen)


def _sgd(w: torch.Tensor) -> None:
    with torch.no_grad():
        w -= LR * w.grad
    w.grad = None


WARMUP = 3
#: a backend whose run took this many seconds is not run again by :func:`measure_interleaved`
REPEAT_BELOW_S = 10.0


def rank_loop(steps: int) -> float:
    """The workload on this rank of an initialised world; returns its loop's wall seconds
    (``WARMUP`` untimed steps first, so one-time autograd and dispatch set-up is not counted)."""
    return _rank_run(steps)[0]


def rank_state(steps: int) -> dict[str, torch.Tensor]:
    """The workload on this rank; returns what it ends with (weight, gathered output, input grad)."""
    return _rank_run(steps)[1]


def _rank_run(steps: int) -> tuple[float, dict[str, torch.Tensor]]:
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
    seconds = time.perf_counter() - start
    return seconds, {"weight": w.detach(), "gathered": gathered, "input_grad": xr.grad}


def floor(world_size: int, steps: int, *, deliver: bool = True) -> float:
    """The same arithmetic for every rank in one thread; returns wall seconds.

    ``deliver``: every rank receives the collectives' results (the *floor*); False builds each
    result once and hands it to nobody (the *compute* reference).
    """
    return _floor_run(world_size, steps, deliver)[0]


def floor_state(world_size: int, steps: int) -> list[dict[str, torch.Tensor]]:
    """What every rank ends with in the floor (as :func:`rank_state` on each rank of a world)."""
    return _floor_run(world_size, steps, True)[1]


def _floor_run(world_size: int, steps: int, deliver: bool) -> tuple[float, list[dict[str, torch.Tensor]]]:
    tensors = [_rank_tensors(r) for r in range(world_size)]
    for _x, w, _g in tensors:
        w.requires_grad_(True)
    gathered = [torch.empty(world_size * ROWS, OUT_FEATURES) for _ in range(world_size if deliver else 1)]
    for step in range(WARMUP + steps):
        if step == WARMUP:
            start = time.perf_counter()
        xs = [x.clone().requires_grad_(True) for x, _w, _g in tensors]
        ys = [xr @ w.t() for xr, (_x, w, _g) in zip(xs, tensors, strict=True)]
        torch.cat([y.detach() for y in ys], out=gathered[0])
        for out in gathered[1:]:
            out.copy_(gathered[0])
        for y, (_x, _w, g) in zip(ys, tensors, strict=True):
            y.backward(g)
        if deliver:  # all_reduce in place: rank order into rank 0's grad, then to every other rank
            total = xs[0].grad
            for xr in xs[1:]:
                total.add_(xr.grad)
            for xr in xs[1:]:
                xr.grad.copy_(total)
        else:
            total = xs[0].grad
            for xr in xs[1:]:
                total = total + xr.grad
        for _x, w, _g in tensors:
            _sgd(w)
    seconds = time.perf_counter() - start
    states = [{"weight": w.detach(), "gathered": gathered[min(r, len(gathered) - 1)], "input_grad": xs[r].grad}
              for r, (_x, w, _g) in enumerate(tensors)]
    return seconds, states


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
    if backend in ("floor", "compute"):
        loop = floor(world_size, steps, deliver=backend == "floor")
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


def measure_interleaved(backends: list[str], world_size: int, steps: int, repeats: int = 1,
                        repeat_below_s: float = REPEAT_BELOW_S) -> dict[str, Any]:
    """``repeats`` rounds of every backend in turn; each backend keeps its fastest loop.

    A backend whose run took ``repeat_below_s`` seconds or more is not run again (its one
    sample stands). "threaded" must run alone: torch's threaded group switches the process's
    group registry to its own and back, which an inproc world in the same process relies on.
    """
    if repeats < 1:
        raise ValueError(f"repeats={repeats!r}; expected an integer >= 1")
    if "threaded" in backends and len(backends) > 1:
        raise ValueError(f"backends={backends!r}: 'threaded' must be measured in a process of its own")
    for backend in backends:
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
    samples: dict[str, list[float]] = {b: [] for b in backends}
    for _ in range(repeats):
        for backend in backends:
            done = samples[backend]
            if done and done[-1] >= repeat_below_s:
                continue
            done.append(measure(backend, world_size, steps)["loop_s"])
    return {"world_size": world_size, "steps": steps, "repeats": repeats,
            "loop_s": {b: min(v) for b, v in samples.items()}, "samples": samples}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.workload", description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=BACKENDS, nargs="+", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds; each backend keeps its fastest")
    parser.add_argument("--repeat-below", type=float, default=REPEAT_BELOW_S, metavar="SECONDS",
                        help=f"a backend whose run took this long is not run again (default {REPEAT_BELOW_S:g})")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # every backend gets the same intra-op threads: one, as each rank of a 2-core box
    print(json.dumps(measure_interleaved(args.backend, args.world_size, args.steps, args.repeats,
                                         args.repeat_below)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
