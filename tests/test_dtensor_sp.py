"""Differential property: tpsim's sequence-parallel layers against PyTorch's.

A norm -> MLP block (``LayerNorm``/``RMSNorm``, plain or gated MLP) is built once densely; tpsim's
``LayerNorm``/``RMSNorm(sequence_parallel=True)`` + ``ParallelMLP(..., sequence_parallel=True)``
and DTensor's ``SequenceParallel`` + ``ColwiseParallel(input_layouts=Shard(1))`` /
``RowwiseParallel(output_layouts=Shard(1))`` (``examples/dtensor_sp.py``, the TP tutorial's plan)
are built from it. Every rank gets its shard of the sequence; both must give equal outputs, input
grads and parameter grads (DTensor's ``Partial`` norm grads as the optimizer sees them, reduced).

Tolerance: each result is within ``tolerance(dtype, M, K, ws)`` of the exact value, so the two are
within twice that. ``M`` per element comes from a float64 *magnitude model* of the block: the norm
output replaced by ``|w| * |xhat| + |b|``, the MLP on absolute weights with the activation bounded
by ``1.2 * z`` (``|act(z)| <= |z|`` and ``|act'(z)| <= 1.2`` for gelu, relu, silu; gated:
``1.2 * gate * up``), the input grad through the norm's backward bounded term by term
(``(|w dh| + mean|w dh| + |xhat| mean|w dh xhat|) / sigma``). ``K`` chains the reductions:
hidden (norm statistics, fc1), intermediate (fc2) and the token count (weight-grad sums).

Rank functions are module-level so gloo workers can unpickle them.
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import tpsim
from tpsim.layers import DenseMLP, LayerNorm, ParallelMLP, RMSNorm
from tpsim.layers.mlp import GATED_ACTIVATIONS
from tpsim.props.tolerance import tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")
if EXAMPLES not in sys.path:
    sys.path.insert(0, EXAMPLES)

from dtensor_sp import grad_value, parallelize_block  # noqa: E402

ACTS = ("gelu", "relu", "silu", "swiglu", "geglu")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        yield


def _dense(hidden, intermediate, activation, bias, norm_kind, dtype, seed):
    torch.manual_seed(seed)
    if norm_kind == "layer":
        norm = nn.LayerNorm(hidden, bias=bias, dtype=dtype)
    else:
        norm = nn.RMSNorm(hidden, dtype=dtype)
    with torch.no_grad():  # away from the init values (ones, zeros), so a wrong grad shows
        norm.weight.uniform_(0.5, 1.5)
        if getattr(norm, "bias", None) is not None:
            norm.bias.uniform_(-0.5, 0.5)
    mlp = DenseMLP(hidden, intermediate, activation=activation, bias=bias, dtype=dtype)
    return norm, mlp


def _data(batch, seq, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64).to(dtype)
    g = torch.randn(batch, seq, hidden, generator=gen, dtype=torch.float64).to(dtype)
    return x, g


def rank_sp_pair(hidden, intermediate, activation, bias, norm_kind, dtype_name, batch, seq_per_rank, seed,
                 norm_sp=True):
    """Both sequence-parallel blocks from one dense block; per-rank outputs and grads of each, the grads
    keyed by dense parameter name (``norm.weight``, ``fc1.weight`` packed ``[gate; up]`` shards, ...)."""
    dtype = getattr(torch, dtype_name)
    ws, r = dist.get_world_size(), dist.get_rank()
    norm, mlp = _dense(hidden, intermediate, activation, bias, norm_kind, dtype, seed)
    x, g = _data(batch, seq_per_rank * ws, hidden, dtype, seed)
    xs, gs = x.chunk(ws, 1)[r], g.chunk(ws, 1)[r]
    group = dist.group.WORLD
    results = {}

    # tpsim: sequence dim -2 of [batch, seq, hidden] (the layers' default)
    norm_cls = LayerNorm if norm_kind == "layer" else RMSNorm
    tnorm = norm_cls.from_dense(norm, group=group, sequence_parallel=norm_sp)
    tmlp = ParallelMLP.from_dense(mlp, group=group, sequence_parallel=True)
    xi = xs.clone().requires_grad_(True)
    out = tmlp(tnorm(xi))
    out.backward(gs)
    grads = {f"norm.{n}": p.grad for n, p in tnorm.named_parameters()}
    grads.update({n: p.grad for n, p in tmlp.named_parameters()})
    results["tpsim"] = {"out": out.detach(), "dx": xi.grad, "grads": grads}

    # DTensor: the tutorial's plan on a mesh over the same group
    block = parallelize_block(norm, mlp, group)
    xd = xs.clone().requires_grad_(True)
    out = block(xd)
    out.backward(gs)
    raw = {n: grad_value(p) for n, p in block.named_parameters()}
    grads = {n: v for n, v in raw.items() if n.startswith("norm.") or n.startswith("w2.")}
    grads = {n.replace("w2.", "fc2."): v for n, v in grads.items()}
    for what in ("weight", "bias"):
        if f"w1.{what}" in raw:  # tpsim's fc1 shard packs [gate shard r; up shard r]
            parts = [raw[f"w1.{what}"]] + ([raw[f"w3.{what}"]] if f"w3.{what}" in raw else [])
            grads[f"fc1.{what}"] = torch.cat(parts, 0)
    placements = {n: str(p.grad.placements) for n, p in block.named_parameters() if n.startswith("norm.")}
    # clone(): DTensor's reduce-scatter output is an AsyncCollectiveTensor and detach() alone is a
    # view that stays un-waited (tpsim's gloo worker waits returned ones: see docs/dtensor.md).
    results["dtensor"] = {"out": out.detach().clone(), "dx": xd.grad, "grads": grads, "norm_grad_placements": placements}
    return results


def _magnitudes(hidden, intermediate, activation, bias, norm_kind, dtype, batch, seq, seed):
    """Per-element magnitudes (float64) of the output, input grad and dense parameter grads."""
    norm, mlp = _dense(hidden, intermediate, activation, bias, norm_kind, dtype, seed)
    x, g = (t.double() for t in _data(batch, seq, hidden, dtype, seed))
    gated = activation in GATED_ACTIVATIONS
    if norm_kind == "layer":
        mu = x.mean(-1, keepdim=True)
        sigma = ((x - mu).square().mean(-1, keepdim=True) + norm.eps).sqrt()
        xhat = (x - mu) / sigma
    else:
        eps = norm.eps if norm.eps is not None else torch.finfo(dtype).eps
        sigma = (x.square().mean(-1, keepdim=True) + eps).sqrt()
        xhat = x / sigma
    w = norm.weight.detach().double().abs().requires_grad_(True)
    b = norm.bias.detach().double().abs().requires_grad_(True) if getattr(norm, "bias", None) is not None else None
    h = w * xhat.abs() + (b if b is not None else 0)
    h.retain_grad()
    p = {n: t.detach().double().abs().requires_grad_(True) for n, t in mlp.named_parameters()}
    z = h @ p["fc1.weight"].t() + (p["fc1.bias"] if "fc1.bias" in p else 0)
    if gated:
        gate, up = z.chunk(2, -1)
        a = 1.2 * gate * up
    else:
        a = 1.2 * z
    out = a @ p["fc2.weight"].t() + (p["fc2.bias"] if "fc2.bias" in p else 0)
    out.backward(g.abs())
    dh = h.grad
    wd = w.detach() * dh
    dx = (wd + wd.mean(-1, keepdim=True) + xhat.abs() * (wd * xhat.abs()).mean(-1, keepdim=True)) / sigma
    grads = {"norm.weight": w.grad}
    if b is not None:
        grads["norm.bias"] = b.grad
    grads.update({n: t.grad for n, t in p.items()})
    return out.detach(), dx, grads


def _sharded(name, mag, ws, r, gated, intermediate):
    """The rank-``r`` part of a dense magnitude, as tpsim's parameter shard holds it."""
    if name.startswith("fc1."):
        if gated:  # packed [gate; up]: shard r of each part
            gate, up = mag.split(intermediate, 0)
            return torch.cat([gate.chunk(ws, 0)[r], up.chunk(ws, 0)[r]], 0)
        return mag.chunk(ws, 0)[r]
    if name == "fc2.weight":
        return mag.chunk(ws, 1)[r]
    return mag  # replicated: norm parameters, fc2's bias


def _compare(backend, ws, hidden, per_rank, activation, bias, norm_kind, dtype, batch, seq_per_rank, seed,
             norm_sp=True):
    # at least 2: DTensor (torch 2.13.0) refuses a sharded dim of global size 1 (docs/dtensor.md)
    intermediate = max(per_rank * ws, 2)
    out = tpsim.run(rank_sp_pair, ws, backend=backend, timeout=60,
                    args=(hidden, intermediate, activation, bias, norm_kind, dtype, batch, seq_per_rank, seed,
                          norm_sp))
    tdtype = getattr(torch, dtype)
    seq = seq_per_rank * ws
    m_out, m_dx, m_grads = _magnitudes(hidden, intermediate, activation, bias, norm_kind, tdtype, batch, seq, seed)
    k = 2 * hidden + intermediate + batch * seq
    gated = activation in GATED_ACTIVATIONS

    def tol(mag):
        return 2 * tolerance(tdtype, mag, reduction_length=k, world_size=ws)

    for r, v in enumerate(out):
        a, b = v["tpsim"], v["dtensor"]
        # DTensor leaves the SequenceParallel norm's grads as partial sums (compared reduced below)
        assert all(p == "(Partial(sum),)" for p in b["norm_grad_placements"].values()), b["norm_grad_placements"]
        for what, x, y, mag in (("output", a["out"], b["out"], m_out.chunk(ws, 1)[r]),
                                ("input grad", a["dx"], b["dx"], m_dx.chunk(ws, 1)[r])):
            assert x.shape == y.shape == mag.shape, f"{what} on rank {r}: {x.shape} vs {y.shape}"
            bad = ((x.double() - y.double()).abs() > tol(mag)).nonzero()
            assert bad.numel() == 0, f"{what} differs on rank {r} at {bad[:3].tolist()}"
        assert set(a["grads"]) == set(b["grads"]) == set(m_grads), (sorted(a["grads"]), sorted(b["grads"]))
        for name, mag in m_grads.items():
            mag = _sharded(name, mag, ws, r, gated, intermediate)
            x, y = a["grads"][name], b["grads"][name]
            assert x is not None and y is not None, f"{name} has no grad on rank {r}"
            assert x.shape == y.shape == mag.shape, f"{name} grad on rank {r}: {x.shape} vs {y.shape}"
            bad = ((x.double() - y.double()).abs() > tol(mag)).nonzero()
            assert bad.numel() == 0, f"{name} grad differs on rank {r} at {bad[:3].tolist()}"
    return out


@settings(max_examples=15)
@given(
    ws=st.sampled_from([1, 2, 3, 4]),
    hidden=st.integers(2, 6),
    per_rank=st.integers(1, 3),
    activation=st.sampled_from(ACTS),
    bias=st.booleans(),
    norm_kind=st.sampled_from(["layer", "rms"]),
    dtype=st.sampled_from(["float64", "float32"]),
    batch=st.integers(1, 2),
    seq_per_rank=st.integers(1, 3),
    seed=st.integers(0, 2**20),
)
def test_sequence_parallel_block_equals_dtensor(ws, hidden, per_rank, activation, bias, norm_kind, dtype, batch,
                                               seq_per_rank, seed):
    _compare("inproc", ws, hidden, per_rank, activation, bias, norm_kind, dtype, batch, seq_per_rank, seed)


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_norm_grads_equal_on_every_rank(activation):
    # the replicated norm parameters: after reduction both give the same, full grad on every rank
    out = _compare("inproc", 2, 4, 2, activation, True, "layer", "float64", 2, 2, 3)
    for impl in ("tpsim", "dtensor"):
        for name in ("norm.weight", "norm.bias"):
            torch.testing.assert_close(out[0][impl]["grads"][name], out[1][impl]["grads"][name], rtol=0, atol=0)


def test_norm_without_grad_reduction_is_caught():
    # the bug of NeMo #7184 / gpt-neox #1257: a replicated norm under sequence parallelism whose grads
    # are never all-reduced (tpsim's norm with sequence_parallel=False); the property must see it
    with pytest.raises(AssertionError, match="norm.weight grad differs on rank 0"):
        _compare("inproc", 2, 4, 2, "gelu", True, "layer", "float64", 2, 2, 3, norm_sp=False)


@pytest.mark.gloo
def test_sequence_parallel_block_equals_dtensor_gloo():
    _compare("gloo", 2, 5, 3, "swiglu", True, "rms", "float32", 2, 2, 11)


def test_magnitude_model_bounds_the_dense_block():
    # the tolerance's magnitudes are upper bounds of the dense block's values (a sanity check of the model)
    norm, mlp = _dense(4, 3, "swiglu", True, "layer", torch.float64, 0)
    x, _ = _data(2, 3, 4, torch.float64, 0)
    y = mlp(norm(x)).detach()
    m_out, _, _ = _magnitudes(4, 3, "swiglu", True, "layer", torch.float64, 2, 3, 0)
    assert bool((y.abs() <= m_out + 1e-12).all())
    assert math.isfinite(float(m_out.max()))
