"""The gated (SwiGLU/GeGLU) MLP check, with and without sequence parallelism, and its lab-scale run.

The lab-scale test prints its time next to the dense MLP's own forward+backward (run with ``-s``);
timings are reported, never asserted.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from tpsim.cli import main
from tpsim.layers.mlp import DenseMLP
from tpsim.placement import Replicate, Shard
from tpsim.props.mlp import TPSIM_MLP, check_mlp
from tpsim.props.sequence import declared_mlps, search_mlp


def _mlp(**changes):
    return dataclasses.replace(TPSIM_MLP, **changes)


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "gelu"])
@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("ws", [1, 2, 3])
def test_parallel_mlp_matches_the_dense_mlp(activation, sequence_parallel, ws) -> None:
    v = _mlp(activation=activation, sequence_parallel=sequence_parallel)
    for dtype, batch in (("float64", (2 * ws,)), ("float32", (2, 3 * ws)), ("bfloat16", (ws,))):
        failures = check_mlp(v, hidden=6, intermediate=2 * ws, world_size=ws, dtype=dtype, batch_shape=batch, seed=ws)
        assert failures == [], [f.message for f in failures]


def test_gated_mlp_with_gate_and_up_split_contiguously_fails() -> None:
    # The harness loads fc1 as one contiguous block (Shard(0) with explicit one-part "parts"): the
    # layer then pairs the wrong gate and up rows (vllm #3775) and the check sees it.
    params = dict(TPSIM_MLP.params)
    params["fc1.weight"] = ("w1", Shard(0, parts=(1,)))
    params["fc1.bias"] = ("b1", Shard(0, parts=(1,)))
    v = _mlp(activation="swiglu", params=params)
    failures = check_mlp(v, hidden=4, intermediate=4, world_size=2, dtype="float64", batch_shape=(3,))
    assert failures and failures[0].property == "forward-equivalence" and failures[0].diagnosis == "mismatch"


def _no_bias_reduce_build(hidden, intermediate, bias, *, group, dtype, activation, sequence_parallel=False,
                          sequence_dim=-2, **_):
    from tpsim.layers import ParallelMLP

    mlp = ParallelMLP(hidden, intermediate, activation=activation, bias=bias, group=group, dtype=dtype,
                      sequence_parallel=sequence_parallel, sequence_dim=sequence_dim)
    fc2 = mlp.fc2
    original = fc2.forward

    def forward(x):  # add fc2's replicated bias on the sequence shard without the grad all-reduce
        saved, fc2.bias = fc2.bias, None
        try:
            out = original(x)
        finally:
            fc2.bias = saved
        return out + saved

    fc2.forward = forward
    return mlp


def test_sequence_parallel_mlp_bias_grad_not_reduced_is_named() -> None:
    v = _mlp(name="no-bias-reduce", build=_no_bias_reduce_build, activation="swiglu", sequence_parallel=True)
    failures = check_mlp(v, hidden=4, intermediate=4, world_size=2, dtype="float64", batch_shape=(4,))
    assert [(f.diagnosis, f.details.get("param")) for f in failures] == [("grad-not-reduced", "fc2.bias")]
    assert isinstance(v.placements("swiglu")["fc2.bias"][1], Replicate)


def test_tpsim_layers_declares_the_gated_mlps_and_they_pass() -> None:
    mlps = declared_mlps("tpsim.layers")
    assert [(m.activation, m.sequence_parallel) for m in mlps] == [("swiglu", False), ("swiglu", True)]
    assert declared_mlps("tpsim.layers:ColumnParallelLinear") == []
    for m in mlps:
        report = search_mlp(m, seed=1)
        assert report.passed and report.examples == 12, [f.message for f in report.failures]


def test_cli_main_job_lists_the_mlps(capsys) -> None:
    rc = main(["check", "tpsim.layers", "--max-examples", "3", "--world-sizes", "2", "--seed", "0"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "PASS ParallelMLP(swiglu, sequence_parallel=True)" in out
    assert "PASS ColumnParallelLinear(parts=q8,k2,v2)" in out and "PASS RowParallelLinear(sequence_parallel=True)" in out


def test_gated_mlp_check_on_gloo() -> None:
    v = _mlp(activation="swiglu", sequence_parallel=True)
    assert check_mlp(v, hidden=4, intermediate=4, world_size=2, dtype="float32", batch_shape=(2, 4), backend="gloo") == []


@pytest.mark.slow
def test_lab_scale_gated_sequence_parallel_mlp() -> None:
    # hidden 4096, intermediate 11008, tp 2, float32, SwiGLU, sequence parallelism: forward and
    # gradient equivalence (all four parameter grads) against the float64 dense MLP.
    v = _mlp(activation="swiglu", sequence_parallel=True)
    started = time.monotonic()
    failures = check_mlp(v, hidden=4096, intermediate=11008, world_size=2, dtype="float32", batch_shape=(2, 8))
    check_s = time.monotonic() - started
    assert failures == [], [f.message for f in failures]
    torch.manual_seed(0)
    dense = DenseMLP(4096, 11008, activation="swiglu", dtype=torch.float32)
    x = torch.randn(2, 8, 4096, requires_grad=True)
    started = time.monotonic()
    y = dense(x)
    y.backward(torch.randn_like(y))
    dense_s = time.monotonic() - started
    print(f"\nlab-scale gated SP MLP check: {check_s:.2f}s; dense fwd+bwd: {dense_s:.3f}s")
