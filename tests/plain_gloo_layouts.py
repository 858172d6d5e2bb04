"""What plain torch gloo (no tpsim) computes for each op and place of tpsim's layout table.

``probe(rank, world_size, folder)`` runs in each of two spawned processes: for every (op, place,
layout) it issues the op on a process group of its own with a non-contiguous tensor in that place
and records ``ok`` (the values are right), ``storage`` (they are wrong: gloo computed on the storage)
or ``raises``. tests/test_layouts.py compares the records with :data:`tpsim.comm.ops._LAYOUT_RULES`.
Module-level so the spawned processes import it.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable

import torch
import torch.distributed as dist

ROWS, COLS = 3, 4


def values(rank: int, rows: int = ROWS, cols: int = COLS) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 100 * (rank + 1)


def laid_out(x: torch.Tensor, layout: str) -> torch.Tensor:
    """``x``'s values in a tensor of ``layout``: ``slice`` (``big[..., :n]``, not dense) or ``transposed``
    (dense, not contiguous); the memory around a slice holds a sentinel."""
    rows, cols = x.shape
    if layout == "slice":
        big = torch.full((rows, cols + 3), -7.0, dtype=x.dtype)
        view = big[:, :cols]
    elif layout == "transposed":
        view = torch.empty(cols, rows, dtype=x.dtype).t()
    else:
        raise ValueError(layout)
    view.copy_(x)
    return view


def _cases(r: int, ws: int, layout: str) -> dict[tuple[str, str], Callable[[], bool]]:
    """(op, place) -> a call of that op with a ``layout`` tensor in that place; True when right."""
    n = ws * ROWS

    def v(k: int, rows: int = ROWS) -> torch.Tensor:
        return values(k, rows)

    def lay(x: torch.Tensor) -> torch.Tensor:
        return laid_out(x, layout)

    def all_reduce() -> bool:
        t = lay(v(r))
        dist.all_reduce(t)
        return torch.equal(t, sum(v(k) for k in range(ws)))

    def broadcast() -> bool:
        t = lay(v(r))
        dist.broadcast(t, src=0)
        return torch.equal(t, v(0))

    def reduce() -> bool:
        t = lay(v(r))
        dist.reduce(t, dst=0)
        return r != 0 or torch.equal(t, sum(v(k) for k in range(ws)))

    def all_gather_in() -> bool:
        outs = [torch.empty(ROWS, COLS, dtype=torch.float64) for _ in range(ws)]
        dist.all_gather(outs, lay(v(r)))
        return all(torch.equal(outs[k], v(k)) for k in range(ws))

    def all_gather_out() -> bool:
        outs = [lay(torch.zeros(ROWS, COLS, dtype=torch.float64)) for _ in range(ws)]
        dist.all_gather(outs, v(r))
        return all(torch.equal(outs[k], v(k)) for k in range(ws))

    def all_gather_into_tensor_in() -> bool:
        out = torch.empty(n, COLS, dtype=torch.float64)
        dist.all_gather_into_tensor(out, lay(v(r)))
        return torch.equal(out, torch.cat([v(k) for k in range(ws)]))

    def all_gather_into_tensor_out() -> bool:
        out = lay(torch.zeros(n, COLS, dtype=torch.float64))
        dist.all_gather_into_tensor(out, v(r))
        return torch.equal(out, torch.cat([v(k) for k in range(ws)]))

    def reduce_scatter_in() -> bool:
        out = torch.empty(ROWS, COLS, dtype=torch.float64)
        dist.reduce_scatter(out, [lay(v(10 * r + k)) for k in range(ws)])
        return torch.equal(out, sum(v(10 * k + r) for k in range(ws)))

    def reduce_scatter_out() -> bool:
        out = lay(torch.zeros(ROWS, COLS, dtype=torch.float64))
        dist.reduce_scatter(out, [v(10 * r + k) for k in range(ws)])
        return torch.equal(out, sum(v(10 * k + r) for k in range(ws)))

    def reduce_scatter_tensor_in() -> bool:
        out = torch.empty(ROWS, COLS, dtype=torch.float64)
        dist.reduce_scatter_tensor(out, lay(v(r, n)))
        return torch.equal(out, sum(v(k, n) for k in range(ws))[r * ROWS:(r + 1) * ROWS])

    def reduce_scatter_tensor_out() -> bool:
        out = lay(torch.zeros(ROWS, COLS, dtype=torch.float64))
        dist.reduce_scatter_tensor(out, v(r, n))
        return torch.equal(out, sum(v(k, n) for k in range(ws))[r * ROWS:(r + 1) * ROWS])

    def scatter_in() -> bool:
        out = torch.empty(ROWS, COLS, dtype=torch.float64)
        dist.scatter(out, [lay(v(k)) for k in range(ws)] if r == 0 else None, src=0)
        return torch.equal(out, v(r))

    def scatter_out() -> bool:
        out = lay(torch.zeros(ROWS, COLS, dtype=torch.float64))
        dist.scatter(out, [v(k) for k in range(ws)] if r == 0 else None, src=0)
        return torch.equal(out, v(r))

    def gather_in() -> bool:
        outs = [torch.empty(ROWS, COLS, dtype=torch.float64) for _ in range(ws)] if r == 0 else None
        dist.gather(lay(v(r)), outs, dst=0)
        return r != 0 or all(torch.equal(outs[k], v(k)) for k in range(ws))

    def gather_out() -> bool:
        outs = [lay(torch.zeros(ROWS, COLS, dtype=torch.float64)) for _ in range(ws)] if r == 0 else None
        dist.gather(v(r), outs, dst=0)
        return r != 0 or all(torch.equal(outs[k], v(k)) for k in range(ws))

    def all_to_all_in() -> bool:
        outs = [torch.empty(ROWS, COLS, dtype=torch.float64) for _ in range(ws)]
        dist.all_to_all(outs, [lay(v(10 * r + k)) for k in range(ws)])
        return all(torch.equal(outs[k], v(10 * k + r)) for k in range(ws))

    def all_to_all_out() -> bool:
        outs = [lay(torch.zeros(ROWS, COLS, dtype=torch.float64)) for _ in range(ws)]
        dist.all_to_all(outs, [v(10 * r + k) for k in range(ws)])
        return all(torch.equal(outs[k], v(10 * k + r)) for k in range(ws))

    def all_to_all_single_in() -> bool:
        out = torch.empty(n, COLS, dtype=torch.float64)
        dist.all_to_all_single(out, lay(v(r, n)))
        return torch.equal(out, torch.cat([v(k, n)[r * ROWS:(r + 1) * ROWS] for k in range(ws)]))

    def all_to_all_single_out() -> bool:
        out = lay(torch.zeros(n, COLS, dtype=torch.float64))
        dist.all_to_all_single(out, v(r, n))
        return torch.equal(out, torch.cat([v(k, n)[r * ROWS:(r + 1) * ROWS] for k in range(ws)]))

    def send() -> bool:
        if r == 0:
            dist.send(lay(v(0)), 1)
            return True
        got = torch.empty(ROWS, COLS, dtype=torch.float64)
        dist.recv(got, 0)
        return torch.equal(got, v(0))

    def recv() -> bool:
        if r == 0:
            dist.send(v(0), 1)
            return True
        got = lay(torch.zeros(ROWS, COLS, dtype=torch.float64))
        dist.recv(got, 0)
        return torch.equal(got, v(0))

    return {
        ("all_reduce", "input"): all_reduce, ("broadcast", "input"): broadcast, ("reduce", "input"): reduce,
        ("all_gather", "input"): all_gather_in, ("all_gather", "output"): all_gather_out,
        ("all_gather_into_tensor", "input"): all_gather_into_tensor_in,
        ("all_gather_into_tensor", "output"): all_gather_into_tensor_out,
        ("reduce_scatter", "input"): reduce_scatter_in, ("reduce_scatter", "output"): reduce_scatter_out,
        ("reduce_scatter_tensor", "input"): reduce_scatter_tensor_in,
        ("reduce_scatter_tensor", "output"): reduce_scatter_tensor_out,
        ("scatter", "input"): scatter_in, ("scatter", "output"): scatter_out,
        ("gather", "input"): gather_in, ("gather", "output"): gather_out,
        ("all_to_all", "input"): all_to_all_in, ("all_to_all", "output"): all_to_all_out,
        ("all_to_all_single", "input"): all_to_all_single_in, ("all_to_all_single", "output"): all_to_all_single_out,
        ("send", "input"): send, ("recv", "input"): recv,
    }


def probe(rank: int, world_size: int, folder: str) -> None:
    """Every case on a process group of its own (a refused point-to-point call leaves its pair broken)."""
    results = {}
    count = 0
    for layout in ("slice", "transposed"):
        for (op, place), case in _cases(rank, world_size, layout).items():
            count += 1
            dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                    init_method=f"file://{os.path.join(folder, f'store{count}')}",
                                    # Generous: on a loaded machine a 5 s connect timed out (no case waits it out).
                                    timeout=datetime.timedelta(seconds=60))
            try:
                outcome = "ok" if case() else "storage"
            except Exception:  # noqa: BLE001 - any refusal counts (gloo's words vary by op)
                outcome = "raises"
            dist.destroy_process_group()
            results[f"{op}|{place}|{layout}"] = outcome
    with open(os.path.join(folder, f"rank{rank}.json"), "w") as fh:
        json.dump(results, fh)
