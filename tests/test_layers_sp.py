"""Packed weights (gate/up, grouped-query QKV) and sequence parallelism, against dense layers.

Reuses the linear-case machinery of ``test_layers``: a case is data, every rank's input,
output and grads are checked against its slice of a float64 dense ``nn.Linear``, with the
slices written out independently (shard ``r`` of every packed part; chunk ``r`` of the
sequence dim). The norm tests run a whole sequence-parallel block (norm -> column -> act ->
row) and check that the replicated norm parameters get the full dense gradient on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from test_layers import BACKENDS, run_and_check, seq_chunk
from test_layers import linear_case as _linear_case
from torch import nn

import tpsim
from tpsim.layers import (
    ColumnParallelLinear,
    LayerNorm,
    RMSNorm,
    RowParallelLinear,
    gather_from_sequence_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)
from tpsim.props.tolerance import tolerance

OUT_F = 48


def sp_layouts(ws: int) -> list[tuple[tuple[int, ...], dict]]:
    """(batch shape, sequence options): 2-D [S, I] (sequence dim 0), 3-D [B, S, I] (default -2),
    3-D [S, B, I] (Megatron's layout, as 0 and as -3) and 4-D [B, S, H, I] (dim 1)."""
    s = 2 * ws
    return [
        ((s,), {}),
        ((2, s), {}),
        ((s, 3), {"sequence_dim": 0}),
        ((s, 3), {"sequence_dim": -3}),
        ((2, s, 3), {"sequence_dim": 1}),
    ]


def sp_cases(ws: int, dtype: str = "float64") -> list[dict]:
    cases = []
    seed = 0
    for batch, seq in sp_layouts(ws):
        for kind, extra in (("column", {}), ("column", {"gather_output": True}),
                            ("row", {}), ("row", {"input_is_parallel": False})):
            for bias in (True, False):
                seed += 1
                options = {"sequence_parallel": True, **seq, **extra}
                cases.append(_linear_case(kind, ws, bias=bias, batch=batch, dtype=dtype, options=options, seed=seed))
    return cases


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 8])
def test_sequence_parallel_linear_matches_dense_inproc(ws):
    """Column: all-gather the sequence, reduce-scatter the input grad; row: reduce-scatter the output,
    bias once per shard, all-gather the grad; every grad equals the dense one's slice."""
    run_and_check(sp_cases(ws), ws, "inproc")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_sequence_parallel_linear_low_precision(backend, dtype):
    ws = 2
    cases = [c for c in sp_cases(ws, dtype) if c["batch"] in ((2, 2 * ws), (2 * ws, 3))]
    run_and_check(cases, ws, backend)


@pytest.mark.gloo
def test_sequence_parallel_linear_matches_dense_gloo():
    run_and_check([c for c in sp_cases(3) if c["bias"]], 3, "gloo")


# ------------------------------------------------------------------ packed column weights


def packed_layouts(ws: int) -> list[tuple[int, ...]]:
    """gate/up (K=2), and Q/K/V with more query than key/value heads (grouped-query attention)."""
    if 8 % ws == 0:
        return [(24, 24), (32, 8, 8), (16, 16, 16)]
    return [(24, 24), (24, 12, 12), (12, 18, 18)]  # ws=3


def packed_cases(ws: int, dtype: str = "float64") -> list[dict]:
    cases = []
    seed = 100
    for parts in packed_layouts(ws):
        for extra, batch in (({}, (5,)), ({"gather_output": True}, (2, 3)), ({"gather_output": True}, ()),
                             ({"sequence_parallel": True}, (2, 2 * ws)),
                             ({"sequence_parallel": True, "gather_output": True}, (2 * ws,))):
            seed += 1
            cases.append(_linear_case("column", ws, batch=batch, dtype=dtype, seed=seed,
                                      options={"parts": parts, **extra}))
    return cases


@pytest.mark.parametrize("ws", [1, 2, 3, 4, 8])
def test_packed_column_matches_dense_inproc(ws):
    """Rank r holds shard r of every part; gather_output returns the dense part order."""
    run_and_check(packed_cases(ws), ws, "inproc")


@pytest.mark.gloo
def test_packed_column_matches_dense_gloo():
    run_and_check(packed_cases(2), 2, "gloo")


def rank_packed_local_output(parts: tuple[int, ...]) -> tuple[list[int], list[bool]]:
    """``y.split(local_parts, -1)`` is this rank's shard of each part's output: within the derived
    rounding bound of the dense output (the rank's matmul is a slice of the dense one, which other
    kernels may compute, so not bit for bit)."""
    torch.manual_seed(0)
    dense = nn.Linear(8, sum(parts), dtype=torch.float64)
    layer = ColumnParallelLinear.from_dense(dense, parts=parts)
    x = torch.randn(3, 8, dtype=torch.float64)
    pieces = layer(x).split(layer.local_parts, dim=-1)
    ws, rank = dist.get_world_size(), dist.get_rank()
    with torch.no_grad():
        full = dense(x).split(list(parts), dim=-1)
        bounds = tolerance(torch.float64, F.linear(x.abs(), dense.weight.abs(), dense.bias.abs()),
                           reduction_length=8, world_size=ws).split(list(parts), dim=-1)
    return list(layer.local_parts), [
        p.shape == f.chunk(ws, dim=-1)[rank].shape and bool(((p - f.chunk(ws, dim=-1)[rank]).abs()
                                                              <= b.chunk(ws, dim=-1)[rank]).all())
        for p, f, b in zip(pieces, full, bounds, strict=True)]


@pytest.mark.parametrize("ws", [2, 4])
def test_packed_local_output_splits_into_part_shards(ws):
    parts = (32, 8, 8)
    for local_parts, same in tpsim.run(rank_packed_local_output, ws, args=(parts,)):
        assert local_parts == [p // ws for p in parts]
        assert same == [True, True, True]


# ------------------------------------------------------------------ the regions themselves


def rank_regions(seed: int) -> dict:
    """Scatter/gather/reduce-scatter along the sequence dim against slicing and summing by hand."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(3, 2 * ws, 5, generator=g, dtype=torch.float64)  # same on every rank
    mine = full * (rank + 1)  # a per-rank summand for the reduce-scatter
    out = {}
    x = full.clone().requires_grad_()
    s = scatter_to_sequence_parallel_region(x, None, dim=1)
    (s * (rank + 1)).sum().backward()
    out["scatter"], out["scatter_grad"] = s.detach(), x.grad
    x = seq_chunk(full, 1, ws, rank).clone().requires_grad_()
    gathered = gather_from_sequence_parallel_region(x, None, dim=1)
    (gathered * (rank + 1)).sum().backward()
    out["gather"], out["gather_grad"] = gathered.detach(), x.grad
    x = mine.clone().requires_grad_()
    rs = reduce_scatter_to_sequence_parallel_region(x, None, dim=-2)
    rs.sum().backward()
    out["reduce_scatter"], out["reduce_scatter_grad"] = rs.detach(), x.grad
    out["full"] = full
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_sequence_regions_by_hand(backend):
    ws = 3
    values = tpsim.run(rank_regions, ws, backend=backend, args=(5,))
    full = values[0]["full"]
    total = sum(r + 1 for r in range(ws))
    for rank, v in enumerate(values):
        chunk = seq_chunk(full, 1, ws, rank)
        assert torch.equal(v["scatter"], chunk)
        # grad of sum_r (r+1)*scatter_r w.r.t. the replicated input: rank r's own (r+1) in its chunk
        # (all-gather of the per-rank grads; each rank contributes only its chunk)
        expect = torch.cat([torch.full_like(seq_chunk(full, 1, ws, r), r + 1.0) for r in range(ws)], dim=1)
        assert torch.equal(v["scatter_grad"], expect)
        assert torch.equal(v["gather"], full)
        # every rank's loss uses the full sequence: the grad is the sum over ranks, then this chunk
        assert torch.equal(v["gather_grad"], torch.full_like(chunk, float(total)))
        torch.testing.assert_close(v["reduce_scatter"], chunk * total, rtol=0, atol=1e-12)
        assert torch.equal(v["reduce_scatter_grad"], torch.ones_like(full))


# ------------------------------------------------------------------ norms in a sequence-parallel block

HID, FF = 8, 24  # FF is sharded: divisible by ws 2 and 3


def block_data(seed: int, batch: tuple[int, ...]) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "norm_w": 1 + 0.1 * torch.randn(HID, generator=g, dtype=torch.float64),
        "norm_b": 0.1 * torch.randn(HID, generator=g, dtype=torch.float64),
        "w1": torch.randn(FF, HID, generator=g, dtype=torch.float64) / HID**0.5,
        "b1": torch.randn(FF, generator=g, dtype=torch.float64),
        "w2": torch.randn(HID, FF, generator=g, dtype=torch.float64) / FF**0.5,
        "b2": torch.randn(HID, generator=g, dtype=torch.float64),
        "x": torch.randn(*batch, HID, generator=g, dtype=torch.float64),
        "gy": torch.randn(*batch, HID, generator=g, dtype=torch.float64),
    }


def dense_block(norm: str, d: dict, x: torch.Tensor, params: dict) -> torch.Tensor:
    if norm == "layernorm":
        h = F.layer_norm(x, (HID,), params["norm_w"], params["norm_b"], 1e-5)
    else:
        h = F.rms_norm(x, (HID,), params["norm_w"], 1e-6)
    return F.linear(F.gelu(F.linear(h, params["w1"], params["b1"])), params["w2"], params["b2"])


def rank_block(norm: str, seed: int, batch: tuple[int, ...], sequence_dim: int, norm_sp: bool) -> dict:
    """x (sequence shard) -> norm -> column(SP) -> gelu -> row(SP) -> y (sequence shard)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    d = block_data(seed, batch)
    sp = {"sequence_parallel": True, "sequence_dim": sequence_dim}
    if norm == "layernorm":
        dense_norm = nn.LayerNorm(HID, eps=1e-5, dtype=torch.float64)
    else:
        dense_norm = nn.RMSNorm(HID, eps=1e-6, dtype=torch.float64)
    with torch.no_grad():
        dense_norm.weight.copy_(d["norm_w"])
        if norm == "layernorm":
            dense_norm.bias.copy_(d["norm_b"])
    cls = LayerNorm if norm == "layernorm" else RMSNorm
    tp_norm = cls.from_dense(dense_norm, sequence_parallel=norm_sp, sequence_dim=sequence_dim)
    fc1 = nn.Linear(HID, FF, dtype=torch.float64)
    fc2 = nn.Linear(FF, HID, dtype=torch.float64)
    with torch.no_grad():
        fc1.weight.copy_(d["w1"]), fc1.bias.copy_(d["b1"]), fc2.weight.copy_(d["w2"]), fc2.bias.copy_(d["b2"])
    col = ColumnParallelLinear.from_dense(fc1, **sp)
    row = RowParallelLinear.from_dense(fc2, **sp)
    x = seq_chunk(d["x"], sequence_dim, ws, rank).clone().requires_grad_()
    y = row(F.gelu(col(tp_norm(x))))
    y.backward(seq_chunk(d["gy"], sequence_dim, ws, rank))
    out = {"y": y.detach(), "gx": x.grad, "norm_w": tp_norm.weight.grad, "b2": row.bias.grad,
           "to_dense_w": tp_norm.to_dense().weight.detach()}
    if norm == "layernorm":
        out["norm_b"] = tp_norm.bias.grad
    return out


def block_oracle(norm: str, seed: int, batch: tuple[int, ...]) -> dict:
    d = block_data(seed, batch)
    params = {k: d[k].clone().requires_grad_() for k in ("norm_w", "norm_b", "w1", "b1", "w2", "b2")}
    x = d["x"].clone().requires_grad_()
    y = dense_block(norm, d, x, params)
    y.backward(d["gy"])
    out = {"y": y.detach(), "gx": x.grad, "norm_w": params["norm_w"].grad, "b2": params["b2"].grad}
    if norm == "layernorm":
        out["norm_b"] = params["norm_b"].grad
    return out


def block_tolerance(tokens: int, ws: int) -> float:
    """float64, O(1) values: eps x the longest chain of reductions (norm over HID, two matmuls, the
    sums over tokens and ranks), times 16 for the norm's 1/sigma and gelu's slope; any layout or
    reduction bug is off by O(1)."""
    return 16 * torch.finfo(torch.float64).eps * (2 * HID + FF + tokens + ws + 4)


BLOCK_LAYOUTS = {"BSH": ((2, 6), -2), "SH": ((6,), -2), "SBH": ((6, 2), 0)}
BLOCK_PARAMS = [("inproc", layout) for layout in BLOCK_LAYOUTS] + [
    pytest.param("gloo", "BSH", marks=pytest.mark.gloo)]  # gloo: one layout (runtime)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize(("backend", "layout"), BLOCK_PARAMS)
def test_sequence_parallel_block_with_norm(backend, layout, norm):
    """Norm parameters are replicated but see 1/ws of the tokens: their grads must be all-reduced,
    so every rank holds the full dense gradient after backward."""
    batch, sequence_dim = BLOCK_LAYOUTS[layout]
    ws = 2 if backend == "gloo" else 3
    values = tpsim.run(rank_block, ws, backend=backend, args=(norm, 11, batch, sequence_dim, True))
    expected = block_oracle(norm, 11, batch)
    tol = block_tolerance(batch[0] * (batch[1] if len(batch) > 1 else 1), ws)
    for rank, got in enumerate(values):
        for name in ("y", "gx"):
            torch.testing.assert_close(got[name], seq_chunk(expected[name], sequence_dim, ws, rank),
                                       rtol=tol, atol=tol, msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}")
        for name in ("norm_w", "norm_b", "b2"):
            if name in expected:
                torch.testing.assert_close(got[name], expected[name], rtol=tol, atol=tol,
                                           msg=lambda m, n=name, r=rank: f"{n} rank {r}: {m}")
                assert torch.equal(got[name], values[0][name]), f"{name}: replicas differ (rank {rank})"


def test_norm_without_sequence_parallel_grads_are_partial():
    """The control: with sequence_parallel=False on sharded tokens each rank has only its part
    of the norm's weight grad (the NeMo #7184 bug); the parts sum to the dense grad."""
    ws, batch = 3, (2, 6)
    values = tpsim.run(rank_block, ws, args=("layernorm", 11, batch, -2, False))
    expected = block_oracle("layernorm", 11, batch)["norm_w"]
    assert not torch.allclose(values[0]["norm_w"], expected)
    torch.testing.assert_close(sum(v["norm_w"] for v in values), expected, rtol=1e-12, atol=1e-12)
