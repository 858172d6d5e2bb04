"""ParallelMLP (plain and gated) against a dense float64 MLP, and the collectives each layer issues.

The oracle is written out here with ``torch.nn.functional`` (not :class:`tpsim.layers.DenseMLP`),
so a mistake shared by the dense twin and the parallel layer cannot hide. Collective counts
come from the backend's trace: one world runs forward only, another forward and backward, and
the difference is what backward issued.
"""

from __future__ import annotations

import itertools
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from helpers import forward_backward
from test_layers import BACKENDS, DTYPES, assert_within, backend_ws_params, feature_index, seq_chunk

import tpsim
from tpsim.comm.procs import nccl_unavailable_reason
from tpsim.layers import ColumnParallelLinear, DenseMLP, ParallelMLP, RowParallelLinear

HIDDEN, INTER = 16, 24  # 24 is divisible by every world size tested (1, 2, 3, 4, 8)
ACT = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "swiglu": F.silu, "geglu": F.gelu}
GATED = {"swiglu", "geglu"}
#: Safety factor of the first-order error bound: max|act'| <= 1.13 (gelu; silu 1.10, relu 1),
#: max|act''| <= 0.8 (gelu; silu 0.5), and the product rule of a gated unit adds one more term
#: of the same size (1.13 + 1 = 2.13 < 3).
LIPSCHITZ_FACTOR = 3.0


def mlp_case(ws, activation="gelu", *, bias=True, batch=(5,), dtype="float64", options=None, seed=0,
             hidden=HIDDEN, inter=INTER) -> dict:
    return {"ws": ws, "activation": activation, "bias": bias, "batch": tuple(batch), "dtype": dtype,
            "options": dict(options or {}), "seed": seed, "hidden": hidden, "inter": inter}


def make_mlp_data(case: dict) -> dict:
    """fc1/fc2 weights and biases, input and upstream grad: float64 draws rounded to the case's dtype."""
    g = torch.Generator().manual_seed(case["seed"])
    dt = DTYPES[case["dtype"]]
    h, f = case["hidden"], case["inter"]
    f1 = 2 * f if case["activation"] in GATED else f

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dt)

    data = {
        "w1": draw(f1, h, scale=h**-0.5), "w2": draw(h, f, scale=f**-0.5),
        "b1": draw(f1) if case["bias"] else None, "b2": draw(h) if case["bias"] else None,
        "x": draw(*case["batch"], h), "gy": draw(*case["batch"], h),
    }
    return data


def dense_mlp(case: dict, data: dict, device="cpu") -> DenseMLP:
    mlp = DenseMLP(case["hidden"], case["inter"], activation=case["activation"], bias=case["bias"],
                   dtype=DTYPES[case["dtype"]], device=device)
    with torch.no_grad():
        for name, t in (("fc1.weight", "w1"), ("fc2.weight", "w2"), ("fc1.bias", "b1"), ("fc2.bias", "b2")):
            if data[t] is not None:
                mlp.get_parameter(name).copy_(data[t])
    return mlp


def mlp_oracle(case: dict, data: dict | None = None) -> dict:
    """Float64 forward/backward with F.* and an elementwise first-order error bound per quantity.

    Magnitudes propagate |values| through the network (|act(z)| <= |z| for gelu/silu/relu); every
    quantity's error is at most LIPSCHITZ_FACTOR x eps x (total reduction length) x its magnitude,
    the total length ``hidden + intermediate + tokens + ws + 4`` bounding the dot products on
    any path to it plus the cross-rank sums and roundings (see test_layers.tolerance).
    """
    data = make_mlp_data(case) if data is None else data
    d = {k: None if v is None else v.double() for k, v in data.items()}
    fn, gated, f, h = ACT[case["activation"]], case["activation"] in GATED, case["inter"], case["hidden"]
    params = {k: d[k].clone().requires_grad_() for k in ("w1", "w2", "b1", "b2") if d[k] is not None}
    x = d["x"].clone().requires_grad_()
    hid = F.linear(x, params["w1"], params.get("b1"))
    act = fn(hid[..., :f]) * hid[..., f:] if gated else fn(hid)
    y = F.linear(act, params["w2"], params.get("b2"))
    y.backward(d["gy"])

    tokens = d["x"].numel() // h
    ax, ag = d["x"].abs(), d["gy"].abs()
    m1 = ax @ d["w1"].abs().T + (0 if d["b1"] is None else d["b1"].abs())
    ga = ag @ d["w2"].abs()
    if gated:
        mg, mu = m1[..., :f], m1[..., f:]
        a = mg * mu
        gh = torch.cat([ga * mu * (1.13 + 0.8 * mg), ga * mg], dim=-1)
    else:
        a = m1
        gh = ga * (1.13 + 0.8 * m1)
    scale = LIPSCHITZ_FACTOR * torch.finfo(DTYPES[case["dtype"]]).eps * (h + f + tokens + case["ws"] + 4)
    flat = lambda t: t.reshape(tokens, t.shape[-1])  # noqa: E731
    out = {
        "y": (y.detach(), scale * (a @ d["w2"].abs().T + (0 if d["b2"] is None else d["b2"].abs()))),
        "gx": (x.grad, scale * (gh @ d["w1"].abs())),
        "fc1.weight": (params["w1"].grad, scale * (flat(gh).T @ flat(ax))),
        "fc2.weight": (params["w2"].grad, scale * (flat(ag).T @ flat(a))),
    }
    if case["bias"]:
        out["fc1.bias"] = (params["b1"].grad, scale * flat(gh).sum(0))
        out["fc2.bias"] = (params["b2"].grad, scale * flat(ag).sum(0))
    return out


def mlp_expected_local(case: dict, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    ws, o, f = case["ws"], case["options"], case["inter"]
    parts = (f, f) if case["activation"] in GATED else (f,)
    if name in ("y", "gx"):
        return seq_chunk(full, o.get("sequence_dim", -2), ws, rank) if o.get("sequence_parallel") else full
    if name.startswith("fc1"):
        return full.index_select(0, feature_index(parts, ws, rank))
    if name == "fc2.weight":
        return full.index_select(1, feature_index((f,), ws, rank))
    return full  # fc2.bias: replicated


def run_mlp_case(case: dict, device: str = "cpu") -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device(device)
    data = make_mlp_data(case)
    mlp = ParallelMLP.from_dense(dense_mlp(case, data, dev), **case["options"])
    o = case["options"]
    x = data["x"]
    gy = data["gy"]
    if o.get("sequence_parallel"):
        x, gy = (seq_chunk(t, o.get("sequence_dim", -2), ws, rank) for t in (x, gy))
    return {name: t.cpu() for name, t in forward_backward(mlp, x.to(dev), gy.to(dev)).items()}


def rank_mlp_cases(cases: list[dict], device: str = "cpu") -> list[dict]:
    return [run_mlp_case(c, device) for c in cases]


def check_mlp_results(case: dict, per_rank: list[dict], data: dict | None = None) -> None:
    oracle = mlp_oracle(case, data)
    for rank, got in enumerate(per_rank):
        assert set(got) == set(oracle), f"rank {rank}: {sorted(got)} != {sorted(oracle)} ({case})"
        for name, (full, tol) in oracle.items():
            assert_within(got[name], mlp_expected_local(case, name, full, rank),
                          mlp_expected_local(case, name, tol, rank), f"{name} on rank {rank} of {case}")
    replicated = ["fc2.bias"] if case["bias"] else []
    if not case["options"].get("sequence_parallel"):
        replicated += ["y", "gx"]
    for name in replicated:
        for rank in range(1, len(per_rank)):
            assert torch.equal(per_rank[rank][name], per_rank[0][name]), f"{name}: rank {rank} != rank 0 ({case})"


def run_and_check_mlp(cases: list[dict], ws: int, backend: str, device: str = "cpu") -> None:
    per_rank = tpsim.run(rank_mlp_cases, ws, backend=backend, args=(cases, device))
    for i, case in enumerate(cases):
        check_mlp_results(case, [per_rank[r][i] for r in range(ws)])


def _mlp_cases(ws, activation, dtype="float64", batches=((), (5,), (2, 3)), options=None) -> list[dict]:
    return [mlp_case(ws, activation, bias=bias, batch=batch, dtype=dtype, options=options, seed=seed)
            for seed, (bias, batch) in enumerate(itertools.product((True, False), batches))]


# ------------------------------------------------------------------ equivalence


def test_oracle_agrees_with_dense_mlp():
    """The hand-written oracle and DenseMLP (the twin ParallelMLP.to_dense returns) compute the same."""
    for activation in ACT:
        case = mlp_case(1, activation, batch=(2, 3))
        data = make_mlp_data(case)
        dense = dense_mlp(case, data)
        y, tol = mlp_oracle(case)["y"]
        assert_within(dense(data["x"]).detach(), y, tol, f"DenseMLP({activation})")


@pytest.mark.parametrize("activation", ["gelu", "silu", "swiglu", "geglu"])
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 8])
def test_mlp_matches_dense_inproc(ws, activation):
    run_and_check_mlp(_mlp_cases(ws, activation), ws, "inproc")


@pytest.mark.parametrize(("backend", "ws"), backend_ws_params([2, 4]))
def test_mlp_float32(backend, ws):
    cases = [c for act in ("gelu", "relu", "swiglu") for c in _mlp_cases(ws, act, "float32", batches=[(2, 3)])]
    run_and_check_mlp(cases, ws, backend)


@pytest.mark.gloo
def test_mlp_matches_dense_gloo():
    cases = [c for act in ("gelu", "swiglu", "geglu") for c in _mlp_cases(3, act, batches=[(), (2, 3)])]
    run_and_check_mlp(cases, 3, "gloo")


def rank_round_trip(activation: str) -> bool:
    torch.manual_seed(1)
    dense = DenseMLP(HIDDEN, INTER, activation=activation)
    back = ParallelMLP.from_dense(dense).to_dense()
    same = all(torch.equal(a, b) for a, b in zip(dense.state_dict().values(), back.state_dict().values(), strict=True))
    return same and list(dense.state_dict()) == list(back.state_dict()) and back.gated == dense.gated


@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
@pytest.mark.parametrize("ws", [1, 2, 4])
def test_mlp_dense_round_trip(ws, activation):
    assert tpsim.run(rank_round_trip, ws, args=(activation,)) == [True] * ws


# ------------------------------------------------------------------ collectives from the trace


def rank_steps(layer: str, options: dict, backward: bool, batch: tuple) -> None:
    """Build ``layer`` (seeded alike on every rank), run forward and, if asked, backward."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    opts = dict(options)
    if layer == "mlp":
        module = ParallelMLP(HIDDEN, INTER, **opts)
        x = torch.randn(*batch, HIDDEN)
    elif layer == "column":
        module = ColumnParallelLinear(HIDDEN, INTER, **opts)
        x = torch.randn(*batch, HIDDEN)
    else:
        module = RowParallelLinear(INTER, HIDDEN, **opts)
        x = torch.randn(*batch, INTER)
        if opts.get("input_is_parallel", True):
            x = x.chunk(ws, dim=-1)[rank]
    if opts.get("sequence_parallel") and layer != "row":
        x = x.chunk(ws, dim=-2)[rank]
    y = module(x.requires_grad_())
    if backward:
        y.sum().backward()


def collectives(layer: str, options: dict, ws: int, backend: str, batch=(2, 4)) -> tuple[list, Counter]:
    """(forward ops, Counter of backward ops) of every rank, which must agree."""
    fwd = tpsim.run_world(rank_steps, ws, backend=backend, args=(layer, options, False, batch)).trace
    both = tpsim.run_world(rank_steps, ws, backend=backend, args=(layer, options, True, batch)).trace
    forward_ops = fwd.ops(0)
    for rank in range(ws):
        assert fwd.ops(rank) == forward_ops, f"rank {rank} forward {fwd.ops(rank)} != rank 0 {forward_ops}"
        assert both.ops(rank)[: len(forward_ops)] == forward_ops
        assert both.ops(rank)[len(forward_ops):] == both.ops(0)[len(forward_ops):]
        assert all(c.group_ranks == tuple(range(ws)) for c in both.of(rank))
    return forward_ops, Counter(both.ops(0)[len(forward_ops):])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_mlp_one_all_reduce_forward_one_backward(backend, activation):
    ws = 2 if backend == "gloo" else 4
    forward_ops, backward_ops = collectives("mlp", {"activation": activation}, ws, backend)
    assert forward_ops == ["all_reduce"]
    assert backward_ops == Counter({"all_reduce": 1})
    # and both carry the hidden-size activations [B, S, hidden], not the intermediate ones
    trace = tpsim.run_world(rank_steps, ws, backend=backend, args=("mlp", {"activation": activation}, True,
                                                                    (2, 4))).trace
    assert [c.shapes for c in trace.of(0)] == [((2, 4, HIDDEN),), ((2, 4, HIDDEN),)]


EXPECTED_COLLECTIVES = [
    # layer, options, forward ops, backward ops
    ("column", {}, [], {"all_reduce": 1}),
    ("column", {"gather_output": True}, ["all_gather_into_tensor"], {"all_reduce": 1}),
    ("column", {"sequence_parallel": True}, ["all_gather_into_tensor"], {"reduce_scatter_tensor": 1}),
    ("row", {}, ["all_reduce"], {}),
    ("row", {"input_is_parallel": False}, ["all_reduce"], {"all_gather_into_tensor": 1}),
    # the bias is replicated but sees only this rank's tokens: its grad is all-reduced
    ("row", {"sequence_parallel": True}, ["reduce_scatter_tensor"], {"all_gather_into_tensor": 1, "all_reduce": 1}),
    ("row", {"sequence_parallel": True, "bias": False}, ["reduce_scatter_tensor"], {"all_gather_into_tensor": 1}),
    ("mlp", {"sequence_parallel": True, "activation": "swiglu"}, ["all_gather_into_tensor", "reduce_scatter_tensor"],
     {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1, "all_reduce": 1}),
    ("mlp", {"sequence_parallel": True, "bias": False}, ["all_gather_into_tensor", "reduce_scatter_tensor"],
     {"all_gather_into_tensor": 1, "reduce_scatter_tensor": 1}),
]


@pytest.mark.parametrize(("layer", "options", "forward", "backward"), EXPECTED_COLLECTIVES,
                         ids=[f"{e[0]}-{'-'.join(f'{k}={v}' for k, v in e[1].items()) or 'default'}"
                              for e in EXPECTED_COLLECTIVES])
def test_collectives_of_each_layer(layer, options, forward, backward):
    forward_ops, backward_ops = collectives(layer, options, 2, "inproc")
    assert forward_ops == forward
    assert backward_ops == Counter(backward)


@pytest.mark.nccl
@pytest.mark.parametrize("ws", [1, 2])
def test_mlp_matches_dense_nccl(ws):
    reason = nccl_unavailable_reason(ws)
    if reason:
        pytest.skip(reason)
    cases = [c for act in ("gelu", "swiglu") for c in _mlp_cases(ws, act, "float32", batches=[(2, 4)])]
    cases += _mlp_cases(ws, "swiglu", "float32", batches=[(2, 4)], options={"sequence_parallel": True})
    run_and_check_mlp(cases, ws, "nccl", device="cuda")
