"""Lab-note scale: ParallelMLP(hidden=4096, intermediate=11008), tp=2, float32, on inproc.

A sanity check that the layer core handles a realistic MLP (plain, and gated with sequence
parallelism) and stays equivalent to the dense float64 result within the first-order bound of
``test_layers_mlp``. The weights are drawn once in the parent and shared with the rank threads
(inproc only: the ranks copy their shards out of the one dense module). Timing is printed
(``-s``), never asserted; bench/ owns timings.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
from helpers import forward_backward
from test_layers_mlp import check_mlp_results, dense_mlp, mlp_case, seq_chunk

import tpsim
from tpsim.layers import ParallelMLP

# Lab-scale cases take up to ~18 GB each: CI and tox run them in a pytest of their own, one at a time, with
# nothing beside them (-m labscale; the rest of the thorough tier: -m "thorough and not labscale").
pytestmark = pytest.mark.labscale

HIDDEN, INTER, TP = 4096, 11008, 2


def lab_data(case: dict) -> dict:
    """Weights at nn.Linear's scale (about 1/sqrt(fan_in)), drawn in float32 directly (fast)."""
    g = torch.Generator().manual_seed(case["seed"])
    f1 = 2 * INTER if case["activation"] in ("swiglu", "geglu") else INTER

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float32).mul_(scale)

    return {"w1": draw(f1, HIDDEN, scale=HIDDEN**-0.5), "w2": draw(HIDDEN, INTER, scale=INTER**-0.5),
            "b1": draw(f1, scale=0.1), "b2": draw(HIDDEN, scale=0.1),
            "x": draw(*case["batch"], HIDDEN), "gy": draw(*case["batch"], HIDDEN)}


def rank_lab_mlp(case: dict, dense, data: dict) -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    mlp = ParallelMLP.from_dense(dense, **case["options"])
    x, gy = data["x"], data["gy"]
    if case["options"].get("sequence_parallel"):
        x, gy = (seq_chunk(t, -2, ws, rank) for t in (x, gy))
    return forward_backward(mlp, x, gy)


@pytest.mark.slow  # ~15 s and ~6 GB each (the float64 oracle dominates; the tp world is ~1.5 s)
@pytest.mark.parametrize(("activation", "options"), [("gelu", {}), ("swiglu", {"sequence_parallel": True})],
                         ids=["plain", "gated-sequence-parallel"])
def test_lab_scale_mlp_matches_dense(activation, options):
    case = mlp_case(TP, activation, batch=(2, 8), dtype="float32", options=options, seed=4,
                    hidden=HIDDEN, inter=INTER)
    data = lab_data(case)
    dense = dense_mlp(case, data)
    start = time.perf_counter()
    values = tpsim.run(rank_lab_mlp, TP, args=(case, dense, data), timeout=300)
    world_s = time.perf_counter() - start
    check_mlp_results(case, values, data)
    total_s = time.perf_counter() - start
    print(f"\nlab-scale {activation} {options}: tp={TP} world (shard + fwd + bwd) {world_s:.2f} s, "
          f"with float64 oracle and checks {total_s:.2f} s")
