"""The layer core against dense ``nn.Linear``: forward, input/weight/bias grads, dtypes, errors.

Every rank function is module-level (gloo workers unpickle it by name) and builds its data
from a seed with a private generator, so the parent rebuilds the very same tensors for the
float64 oracle. The oracle is a dense ``nn.Linear`` in float64 fed the *same* values the
ranks saw (already rounded to the case's dtype), so the only error left is the ranks'
arithmetic, bounded elementwise by :func:`tolerance`.

The expected layout of every shard is written out here independently of the layer code
(:func:`feature_index`, :func:`seq_chunk`): Megatron's partition stride for packed parts,
equal chunks in rank order for the sequence dim. The helpers are imported by the other
``test_layers_*`` modules.
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from helpers import assert_errors_before_any_collective, errors_raised
from torch import nn

import tpsim
from tpsim.comm.procs import nccl_unavailable_reason
from tpsim.layers import (
    ColumnParallelLinear,
    LayerNorm,
    ParallelMLP,
    RMSNorm,
    RowParallelLinear,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

BACKENDS = ["inproc", pytest.param("gloo", marks=pytest.mark.gloo)]
DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KINDS = {
    "column": ("column", {}),
    "column-gather": ("column", {"gather_output": True}),
    "row": ("row", {}),
    "row-full-input": ("row", {"input_is_parallel": False}),
}
# 24 and 48 are divisible by every world size tested (1, 2, 3, 4, 8).
IN_F, OUT_F = 24, 48
BATCHES = [(), (5,), (2, 3)]  # 1-D [I], 2-D [B, I], 3-D [B, S, I] inputs


# ------------------------------------------------------------------ the expected layout


def feature_index(parts: tuple[int, ...], ws: int, rank: int) -> torch.Tensor:
    """Indices of the features rank ``rank`` holds: shard ``rank`` of every part, in part order."""
    idx: list[int] = []
    offset = 0
    for size in parts:
        chunk = size // ws
        idx.extend(range(offset + rank * chunk, offset + (rank + 1) * chunk))
        offset += size
    return torch.tensor(idx, dtype=torch.long)


def seq_chunk(t: torch.Tensor, dim: int, ws: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s equal chunk of ``t`` along ``dim``."""
    assert t.shape[dim] % ws == 0, "test set-up: sequence length must be divisible"  # noqa: S101
    return t.chunk(ws, dim=dim)[rank]


def case_parts(case: dict) -> tuple[int, ...]:
    return tuple(case["options"].get("parts") or (case["out"],))


def local_input(case: dict, x: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    """What rank ``rank`` passes to the layer (and so the shape of its input gradient)."""
    o = case["options"]
    if case["kind"] == "column":
        return seq_chunk(x, o.get("sequence_dim", -2), ws, rank) if o.get("sequence_parallel") else x
    if o.get("input_is_parallel", True):
        return x.index_select(-1, feature_index((case["in"],), ws, rank))
    return x


def local_output(case: dict, y: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    """What rank ``rank``'s layer returns (and so the upstream gradient it is given)."""
    o = case["options"]
    if case["kind"] == "column":
        return y if o.get("gather_output") else y.index_select(-1, feature_index(case_parts(case), ws, rank))
    return seq_chunk(y, o.get("sequence_dim", -2), ws, rank) if o.get("sequence_parallel") else y


def local_weight(case: dict, w: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    if case["kind"] == "column":
        return w.index_select(0, feature_index(case_parts(case), ws, rank))
    return w.index_select(1, feature_index((case["in"],), ws, rank))


def local_bias(case: dict, b: torch.Tensor, ws: int, rank: int) -> torch.Tensor:
    return b.index_select(0, feature_index(case_parts(case), ws, rank)) if case["kind"] == "column" else b


# ------------------------------------------------------------------ data, oracle, tolerance


def linear_case(kind: str, ws: int, *, bias=True, batch=(5,), dtype="float64", options=None, seed=0,
                in_f=IN_F, out_f=OUT_F) -> dict:
    return {"kind": kind, "in": in_f, "out": out_f, "bias": bias, "batch": tuple(batch), "dtype": dtype,
            "options": dict(options or {}), "seed": seed, "ws": ws}


def make_linear_data(case: dict):
    """Weight, bias, input and upstream gradient, drawn in float64 and rounded to the case's dtype."""
    g = torch.Generator().manual_seed(case["seed"])
    dt = DTYPES[case["dtype"]]

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64).to(dt)

    w = draw(case["out"], case["in"])
    b = draw(case["out"]) if case["bias"] else None
    x = draw(*case["batch"], case["in"])
    gy = draw(*case["batch"], case["out"])
    return w, b, x, gy


def dense_linear(w, b, dtype, device="cpu") -> nn.Linear:
    dense = nn.Linear(w.shape[1], w.shape[0], bias=b is not None, dtype=dtype, device=device)
    with torch.no_grad():
        dense.weight.copy_(w)
        if b is not None:
            dense.bias.copy_(b)
    return dense


def tolerance(magnitude: torch.Tensor, length: int, ws: int, dtype: torch.dtype) -> torch.Tensor:
    """Elementwise bound on |computed - exact| for a sum of ``length`` products, reduced over ``ws`` ranks.

    Rounding a dot product of length K in a dtype with unit roundoff u = eps/2 errs by at most
    gamma_K * sum|a_i b_i| with gamma_K = K u / (1 - K u) <= K eps while K u <= 1/2; summing
    ``ws`` partial results (each rounded) in the same dtype adds at most (ws + 1) eps * that
    magnitude; a bias add, one more rounding. ``magnitude`` is sum|a_i b_i| (+ |bias|).
    """
    return (length + ws + 2) * torch.finfo(dtype).eps * magnitude


def linear_oracle(case: dict) -> dict:
    """Dense float64 nn.Linear forward/backward and the elementwise tolerance of each quantity."""
    w, b, x, gy = (None if t is None else t.double() for t in make_linear_data(case))
    dense = dense_linear(w, b, torch.float64)
    xd = x.clone().requires_grad_()
    y = dense(xd)
    y.backward(gy)
    tokens = x.numel() // case["in"]
    ax, aw, ag = x.abs(), w.abs(), gy.abs()
    ax2, ag2 = ax.reshape(tokens, case["in"]), ag.reshape(tokens, case["out"])
    dt, ws = DTYPES[case["dtype"]], case["ws"]
    out = {
        "y": (y.detach(), tolerance(ax @ aw.T + (0 if b is None else b.abs()), case["in"], ws, dt)),
        "gx": (xd.grad, tolerance(ag @ aw, case["out"], ws, dt)),
        "gw": (dense.weight.grad, tolerance(ag2.T @ ax2, tokens, ws, dt)),
    }
    if b is not None:
        out["gb"] = (dense.bias.grad, tolerance(ag2.sum(0), tokens, ws, dt))
    return out


def expected_local(case: dict, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    ws = case["ws"]
    return {
        "y": lambda t: local_output(case, t, ws, rank),
        "gx": lambda t: local_input(case, t, ws, rank),
        "gw": lambda t: local_weight(case, t, ws, rank),
        "gb": lambda t: local_bias(case, t, ws, rank),
    }[name](full)


def assert_within(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = (actual.double() - expected).abs()
    bad = err > tol
    if bad.any():
        i = int((err - tol).flatten().argmax())
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {err.numel()} elements off; worst |err|={err.flatten()[i]:.3g} "
            f"> tol={tol.flatten()[i]:.3g} (actual {actual.flatten()[i].item():.6g}, "
            f"expected {expected.flatten()[i].item():.6g})"
        )


def check_linear_results(case: dict, per_rank: list[dict]) -> None:
    """Every rank's output and grads against its slice of the dense oracle."""
    oracle = linear_oracle(case)
    dt = DTYPES[case["dtype"]]
    assert len(per_rank) == case["ws"]
    for rank, got in enumerate(per_rank):
        assert set(got) == set(oracle), f"{case}: rank {rank} returned {sorted(got)}, expected {sorted(oracle)}"
        for name, (full, tol) in oracle.items():
            what = f"{name} on rank {rank} of {case}"
            assert got[name].dtype == dt, f"{what}: dtype {got[name].dtype}"
            assert_within(got[name].cpu(), expected_local(case, name, full, rank),
                          expected_local(case, name, tol, rank), what)


def check_replicas_identical(case: dict, per_rank: list[dict]) -> None:
    """Replicated results are the same bits on every rank (no rank drifts from the others)."""
    o, kind = case["options"], case["kind"]
    replicated = []
    if kind == "column":
        if o.get("gather_output"):
            replicated.append("y")
        if not o.get("sequence_parallel"):
            replicated.append("gx")
    else:
        if not o.get("sequence_parallel"):
            replicated.append("y")
        if not o.get("input_is_parallel", True):
            replicated.append("gx")
        if case["bias"]:
            replicated.append("gb")
    for name in replicated:
        for rank, got in enumerate(per_rank[1:], start=1):
            assert torch.equal(got[name], per_rank[0][name]), f"{name} differs between rank 0 and {rank}: {case}"


# ------------------------------------------------------------------ rank functions


def _device(device: str) -> torch.device:
    if device == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device)


def run_linear_case(case: dict, device: str = "cpu", group=None) -> dict:
    """One rank's side of a case: shard a dense layer, run forward and backward, return the results."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    dev = _device(device)
    w, b, x, gy = make_linear_data(case)
    dense = dense_linear(w, b, DTYPES[case["dtype"]], dev)
    cls = ColumnParallelLinear if case["kind"] == "column" else RowParallelLinear
    layer = cls.from_dense(dense, group=group, **case["options"])
    xin = local_input(case, x, ws, rank).to(dev).requires_grad_()
    y = layer(xin)
    y.backward(local_output(case, gy, ws, rank).to(dev))
    out = {"y": y.detach().cpu(), "gx": xin.grad.cpu(), "gw": layer.weight.grad.cpu()}
    if layer.bias is not None:
        out["gb"] = layer.bias.grad.cpu()
    return out


def rank_linear_cases(cases: list[dict], device: str = "cpu") -> list[dict]:
    return [run_linear_case(case, device) for case in cases]


def run_and_check(cases: list[dict], ws: int, backend: str, device: str = "cpu") -> None:
    per_rank = tpsim.run(rank_linear_cases, ws, backend=backend, args=(cases, device))
    for i, case in enumerate(cases):
        results = [per_rank[r][i] for r in range(ws)]
        check_linear_results(case, results)
        check_replicas_identical(case, results)


# ------------------------------------------------------------------ equivalence tests


def _cases(kind_name: str, ws: int, dtype: str, batches=BATCHES) -> list[dict]:
    kind, options = KINDS[kind_name]
    return [
        linear_case(kind, ws, bias=bias, batch=batch, dtype=dtype, options=options, seed=seed)
        for seed, (bias, batch) in enumerate(itertools.product((True, False), batches))
    ]


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("ws", [1, 2, 3, 4, 8])
def test_linear_matches_dense_inproc(ws, kind):
    """Forward, input-grad, weight-grad and bias-grad of every rank equal the dense layer's slice."""
    run_and_check(_cases(kind, ws, "float64"), ws, "inproc")


@pytest.mark.gloo
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("ws", [2, 3])
def test_linear_matches_dense_gloo(ws, kind):
    run_and_check(_cases(kind, ws, "float64", batches=[(), (2, 3)]), ws, "gloo")


def backend_ws_params(inproc_sizes, gloo_sizes=(2,)) -> list:
    """(backend, ws) pairs: the full set in-process, a smaller one on gloo (its runtime)."""
    return [("inproc", ws) for ws in inproc_sizes] + [
        pytest.param("gloo", ws, marks=pytest.mark.gloo) for ws in gloo_sizes]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize(("backend", "ws"), backend_ws_params([2, 4]))
def test_linear_dtypes(backend, ws, dtype):
    """Low-precision dtypes stay within eps x reduction length of the float64 dense result."""
    cases = [c for kind in KINDS for c in _cases(kind, ws, dtype, batches=[(2, 3)])]
    run_and_check(cases, ws, backend)


def test_oracle_catches_a_wrong_shard():
    """The checker itself fails on a rank result from the wrong slice (guards against a vacuous test)."""
    case = linear_case("column", 2)
    good = [run_linear_case_offline(case, r) for r in range(2)]
    check_linear_results(case, good)
    swapped = [good[1], good[0]]
    with pytest.raises(AssertionError, match="off"):
        check_linear_results(case, swapped)


def run_linear_case_offline(case: dict, rank: int) -> dict:
    """The exact expected slices, as a perfect rank would return them (for the checker's self-test)."""
    oracle = linear_oracle(case)
    dt = DTYPES[case["dtype"]]
    return {name: expected_local(case, name, full, rank).to(dt) for name, (full, _) in oracle.items()}


# ------------------------------------------------------------------ initialisation, dense round trips


def rank_init_matches_nn_linear(seed: int, bias: bool) -> dict:
    """A layer built with a seed *is* the nn.Linear built with that seed, sharded."""
    torch.manual_seed(seed)
    dense = nn.Linear(IN_F, OUT_F, bias=bias)
    torch.manual_seed(seed)
    col = ColumnParallelLinear(IN_F, OUT_F, bias=bias)
    torch.manual_seed(seed)
    row = RowParallelLinear(IN_F, OUT_F, bias=bias)
    torch.manual_seed(seed)
    dense_mlp_fc1, dense_mlp_fc2 = nn.Linear(IN_F, OUT_F, bias=bias), nn.Linear(OUT_F, IN_F, bias=bias)
    torch.manual_seed(seed)
    mlp = ParallelMLP(IN_F, OUT_F, bias=bias).to_dense()
    same = {}
    for name, got in (("column", col.to_dense()), ("row", row.to_dense())):
        same[name] = torch.equal(got.weight, dense.weight) and (
            not bias or torch.equal(got.bias, dense.bias))
    same["mlp"] = all(
        torch.equal(getattr(mine, p), getattr(ref, p))
        for mine, ref in ((mlp.fc1, dense_mlp_fc1), (mlp.fc2, dense_mlp_fc2))
        for p in (("weight", "bias") if bias else ("weight",))
    )
    return same


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("ws", [1, 3, 4])
def test_default_init_is_the_seeded_nn_linear(ws, bias):
    for rank, same in enumerate(tpsim.run(rank_init_matches_nn_linear, ws, args=(7, bias))):
        assert same == {"column": True, "row": True, "mlp": True}, f"rank {rank}: {same}"


def rank_dense_round_trip(parts) -> dict:
    """from_dense -> to_dense gives back the very same tensors; a sharded state dict reloads exactly."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(3)
    dense_c = nn.Linear(IN_F, OUT_F)
    dense_r = nn.Linear(OUT_F, IN_F)
    with torch.no_grad():
        for p in (*dense_c.parameters(), *dense_r.parameters()):
            p.copy_(torch.randn(p.shape, generator=g))
    col = ColumnParallelLinear.from_dense(dense_c, parts=parts)
    row = RowParallelLinear.from_dense(dense_r)
    result = {"col_local_weight": col.weight.detach().clone(), "row_local_weight": row.weight.detach().clone()}
    for name, layer, dense in (("col", col, dense_c), ("row", row, dense_r)):
        back = layer.to_dense()
        result[f"{name}_round_trip"] = torch.equal(back.weight, dense.weight) and torch.equal(back.bias, dense.bias)
        # the sharded state dict: save, load into a freshly (differently) initialised layer
        state = {k: v.clone() for k, v in layer.state_dict().items()}
        torch.manual_seed(100 + rank)
        fresh = type(layer)(layer.in_features, layer.out_features, **(
            {"parts": parts} if name == "col" else {}))
        fresh.load_state_dict(state)
        result[f"{name}_state_shapes"] = {k: tuple(v.shape) for k, v in state.items()}
        x = torch.randn(2, layer.in_features, generator=g)
        if name == "row":
            x = x.chunk(ws, dim=-1)[rank]
        result[f"{name}_state_same_output"] = torch.equal(fresh(x), layer(x))
        result[f"{name}_state_same_dense"] = torch.equal(fresh.to_dense().weight, dense.weight)
    result["dense_c_weight"] = dense_c.weight.detach().clone()
    result["dense_r_weight"] = dense_r.weight.detach().clone()
    return result


@pytest.mark.parametrize("parts", [None, (16, 16, 16), (32, 8, 8)], ids=["plain", "equal-parts", "gqa-parts"])
@pytest.mark.parametrize(("backend", "ws"), backend_ws_params([1, 2, 4]))
def test_dense_and_state_dict_round_trip(backend, ws, parts):
    values = tpsim.run(rank_dense_round_trip, ws, backend=backend, args=(parts,))
    layout = parts or (OUT_F,)
    for rank, v in enumerate(values):
        for name in ("col", "row"):
            assert v[f"{name}_round_trip"], f"rank {rank}: {name} to_dense(from_dense(d)) != d"
            assert v[f"{name}_state_same_output"] and v[f"{name}_state_same_dense"], f"rank {rank}: {name} state"
        assert v["col_state_shapes"] == {"weight": (OUT_F // ws, IN_F), "bias": (OUT_F // ws,)}
        assert v["row_state_shapes"] == {"weight": (IN_F, OUT_F // ws), "bias": (IN_F,)}
        # rank r holds shard r of every part (Megatron's partition stride), not a contiguous slice
        expected = v["dense_c_weight"].index_select(0, feature_index(layout, ws, rank))
        assert torch.equal(v["col_local_weight"], expected), f"rank {rank}: column shard layout"
        expected_row = v["dense_r_weight"].chunk(ws, dim=1)[rank]
        assert torch.equal(v["row_local_weight"], expected_row), f"rank {rank}: row shard layout"


# ------------------------------------------------------------------ no communication at world size 1


def rank_everything_once() -> list[str]:
    """Every layer and option, forward and backward and to_dense: at ws=1 none may communicate."""
    torch.manual_seed(0)
    done = []
    x3 = torch.randn(2, 4, 8, requires_grad=True)
    layers = [
        ColumnParallelLinear(8, 8),
        ColumnParallelLinear(8, 8, gather_output=True, parts=(4, 2, 2)),
        ColumnParallelLinear(8, 8, sequence_parallel=True),
        RowParallelLinear(8, 8),
        RowParallelLinear(8, 8, input_is_parallel=False),
        RowParallelLinear(8, 8, sequence_parallel=True),
        ParallelMLP(8, 16),
        ParallelMLP(8, 16, activation="swiglu", sequence_parallel=True),
        LayerNorm(8),
        RMSNorm(8),
    ]
    for layer in layers:
        layer(x3).sum().backward()
        if not getattr(layer, "sequence_parallel", False):  # a 1-D input has no sequence dim
            layer(x3[0, 0]).sum().backward()
        if hasattr(layer, "to_dense"):
            layer.to_dense()
        done.append(type(layer).__name__)
    scatter_to_sequence_parallel_region(x3, None).sum().backward()
    reduce_scatter_to_sequence_parallel_region(x3, None).sum().backward()
    return done


@pytest.mark.parametrize("backend", BACKENDS)
def test_world_size_one_makes_no_collective_call(backend):
    result = tpsim.run_world(rank_everything_once, 1, backend=backend)
    assert len(result.values[0]) == 10
    assert result.trace.of(0) == [], [c.describe() for c in result.trace.of(0)]


# ------------------------------------------------------------------ tp group inside a larger world


def rank_in_subgroup(case: dict) -> dict:
    """A 2x2 mesh: two tp groups {0,1} and {2,3}; each layer must only talk to its own group."""
    rank = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    tp = groups[rank // 2]
    return run_linear_case(case, group=tp)


@pytest.mark.parametrize("kind", ["column", "row", "row-full-input"])
def test_layers_use_only_their_tp_group(kind):
    k, options = KINDS[kind]
    case = linear_case(k, 2, options=options, batch=(2, 3))
    result = tpsim.run_world(rank_in_subgroup, 4, args=(case,))
    for mesh_row in ((0, 1), (2, 3)):
        check_linear_results(case, [result.values[r] for r in mesh_row])
        for r in mesh_row:
            calls = result.trace.of(r)
            assert calls, f"rank {r} made no collective at all"
            assert {c.group_ranks for c in calls} == {mesh_row}, [c.describe() for c in calls]


# ------------------------------------------------------------------ error messages

NOT_DIVISIBLE = "is not divisible by the tensor-parallel world size 4"


def _bad_input_row():
    return RowParallelLinear(8, 8)(torch.zeros(2, 8))


ERROR_CASES = {
    # name: (action run on every rank of a ws=4 world, exception type, exact message)
    "column-out": (
        lambda: ColumnParallelLinear(8, 10), ValueError,
        f"out_features=10 {NOT_DIVISIBLE} (ColumnParallelLinear shards out_features)",
    ),
    "row-in": (
        lambda: RowParallelLinear(10, 8), ValueError,
        f"in_features=10 {NOT_DIVISIBLE} (RowParallelLinear shards in_features)",
    ),
    "mlp-intermediate": (
        lambda: ParallelMLP(8, 10), ValueError,
        f"intermediate=10 {NOT_DIVISIBLE} (ParallelMLP shards intermediate)",
    ),
    # 2*6=12 is divisible by 4, but each part (6) is not: the check must be on F, not 2F
    "gated-mlp-intermediate": (
        lambda: ParallelMLP(8, 6, activation="swiglu"), ValueError,
        f"intermediate=6 {NOT_DIVISIBLE} (ParallelMLP shards intermediate)",
    ),
    # out_features=16 is divisible by 4, one part is not
    "packed-part": (
        lambda: ColumnParallelLinear(8, 16, parts=(12, 2, 2)), ValueError,
        f"parts[1]=2 {NOT_DIVISIBLE} (ColumnParallelLinear shards each packed part on its own; "
        "parts=(12, 2, 2))",
    ),
    "parts-sum": (
        lambda: ColumnParallelLinear(8, 16, parts=(8, 4)), ValueError,
        "ColumnParallelLinear: parts=(8, 4) sum to 12, but out_features=16; "
        "the packed parts must add up to out_features",
    ),
    "parts-zero": (
        lambda: ColumnParallelLinear(8, 16, parts=(0, 16)), ValueError,
        "ColumnParallelLinear: parts[0]=0 must be an int >= 1 (parts=(0, 16))",
    ),
    "parts-type": (
        lambda: ColumnParallelLinear(8, 16, parts="16"), TypeError,
        "ColumnParallelLinear: parts='16' must be a non-empty sequence of ints, e.g. (8, 2, 2)",
    ),
    "in-features-zero": (
        lambda: RowParallelLinear(0, 8), ValueError, "RowParallelLinear: in_features=0 must be >= 1",
    ),
    "in-features-float": (
        lambda: ColumnParallelLinear(8.0, 8), TypeError,
        "ColumnParallelLinear: in_features=8.0 must be an int (got float)",
    ),
    "dtype": (
        lambda: ColumnParallelLinear(8, 8, dtype=torch.int64), ValueError,
        "ColumnParallelLinear: dtype=torch.int64 must be a floating-point torch.dtype (e.g. torch.float32)",
    ),
    "sequence-dim-features": (
        lambda: RowParallelLinear(8, 8, sequence_parallel=True, sequence_dim=-1), ValueError,
        "RowParallelLinear: sequence_dim=-1 is the feature dim; the sequence dim must come before the "
        "features (default -2, the dim just before them)",
    ),
    "activation": (
        lambda: ParallelMLP(8, 8, activation="tanh"), ValueError,
        "ParallelMLP: activation='tanh' is not one of 'gelu', 'relu', 'silu', 'geglu', 'swiglu' "
        "(or an elementwise callable)",
    ),
    "from-dense-type": (
        lambda: ColumnParallelLinear.from_dense(nn.Conv1d(8, 8, 1)), TypeError,
        "ColumnParallelLinear.from_dense: linear must be a torch.nn.Linear, got Conv1d",
    ),
    "from-dense-option": (
        lambda: RowParallelLinear.from_dense(nn.Linear(8, 8), dtype=torch.float32), TypeError,
        "RowParallelLinear.from_dense: unexpected option(s) dtype; the options are input_is_parallel, "
        "sequence_parallel, sequence_dim (sizes, bias, dtype and device come from the dense module)",
    ),
    "column-input": (
        lambda: ColumnParallelLinear(8, 8)(torch.zeros(2, 7)), ValueError,
        "ColumnParallelLinear expected an input with last dim in_features=8, got last dim 7 (input shape (2, 7))",
    ),
    "column-scalar-input": (
        lambda: ColumnParallelLinear(8, 8)(torch.zeros(())), ValueError,
        "ColumnParallelLinear expected an input with last dim in_features=8, got a scalar (input shape ())",
    ),
    "row-input": (
        _bad_input_row, ValueError,
        "RowParallelLinear expected an input with last dim in_features/world_size=8/4=2 (input_is_parallel=True), "
        "got last dim 8 (input shape (2, 8)); pass input_is_parallel=False to give it the full input",
    ),
    "row-full-input": (
        lambda: RowParallelLinear(8, 8, input_is_parallel=False)(torch.zeros(3, 2)), ValueError,
        "RowParallelLinear expected an input with last dim in_features=8 (input_is_parallel=False), "
        "got last dim 2 (input shape (3, 2))",
    ),
    "mlp-input": (
        lambda: ParallelMLP(8, 16)(torch.zeros(2, 4)), ValueError,
        "ParallelMLP expected an input with last dim hidden=8, got last dim 4 (input shape (2, 4))",
    ),
    "sequence-not-divisible": (
        lambda: RowParallelLinear(8, 8, sequence_parallel=True)(torch.zeros(5, 2)), ValueError,
        f"RowParallelLinear: sequence length 5 (dim 0 of input shape (5, 2)) {NOT_DIVISIBLE} "
        "(sequence_parallel=True reduce-scatters the output along the sequence dim)",
    ),
    "sequence-parallel-1d": (
        lambda: ColumnParallelLinear(8, 8, sequence_parallel=True)(torch.zeros(8)), ValueError,
        "ColumnParallelLinear(sequence_parallel=True) needs an input with a sequence dim before the "
        "features, got input shape (8,)",
    ),
    "sequence-dim-out-of-range": (
        lambda: ColumnParallelLinear(8, 8, sequence_parallel=True, sequence_dim=2)(torch.zeros(2, 4, 8)),
        ValueError,
        "ColumnParallelLinear: sequence_dim=2 does not name a dim before the feature dim of input shape (2, 4, 8)",
    ),
    "scatter-sequence": (
        lambda: scatter_to_sequence_parallel_region(torch.zeros(5, 2), None), ValueError,
        f"scatter_to_sequence_parallel_region: dim 0 of input shape (5, 2) has size 5, which {NOT_DIVISIBLE}",
    ),
    "reduce-scatter-sequence": (
        lambda: reduce_scatter_to_sequence_parallel_region(torch.zeros(3, 6, 2), None, dim=1), ValueError,
        f"reduce_scatter_to_sequence_parallel_region: dim 1 of input shape (3, 6, 2) has size 6, "
        f"which {NOT_DIVISIBLE}",
    ),
    "norm-input": (
        lambda: LayerNorm(8)(torch.zeros(2, 4)), ValueError,
        "LayerNorm expected an input whose last dims are normalized_shape=(8,), got input shape (2, 4)",
    ),
    "norm-sequence-dim": (
        lambda: RMSNorm(8, sequence_dim=-1), ValueError,
        "RMSNorm: sequence_dim=-1 is the feature dim; the sequence dim must come before the "
        "features (default -2, the dim just before them)",
    ),
}


def rank_errors(names: list[str]) -> dict:
    return errors_raised(ERROR_CASES, names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_error_message_on_every_rank_before_any_collective(backend):
    result = tpsim.run_world(rank_errors, 4, backend=backend, args=(list(ERROR_CASES),))
    assert_errors_before_any_collective(result, ERROR_CASES, 4)


def rank_sizes_fine_at_ws_one() -> list[str]:
    """At ws=1 every size is divisible: the same constructors build."""
    built = [ColumnParallelLinear(8, 10), RowParallelLinear(10, 8), ParallelMLP(8, 6, activation="swiglu"),
             ColumnParallelLinear(8, 16, parts=(12, 2, 2))]
    RowParallelLinear(8, 8, sequence_parallel=True)(torch.zeros(5, 8))
    return [type(m).__name__ for m in built]


def test_divisibility_errors_depend_on_world_size():
    assert tpsim.run(rank_sizes_fine_at_ws_one, 1) == [
        ["ColumnParallelLinear", "RowParallelLinear", "ParallelMLP", "ColumnParallelLinear"]]


def rank_not_a_member() -> tuple:
    group = dist.new_group([0, 1])
    if dist.get_rank() < 2:
        return ("member", ColumnParallelLinear(8, 8, group=group).tp_world_size)
    try:
        ColumnParallelLinear(8, 8, group=group)
    except ValueError as e:
        return ("error", str(e))
    return ("built", None)


def test_layer_on_a_rank_outside_its_group_raises():
    values = tpsim.run(rank_not_a_member, 4)
    assert values[0] == values[1] == ("member", 2)
    for rank in (2, 3):
        kind, message = values[rank]
        assert kind == "error"
        assert message.startswith(f"ColumnParallelLinear: this process (global rank {rank}) is not a member of group=")
        assert message.endswith("call it only on the ranks of its tensor-parallel group")


# ------------------------------------------------------------------ nccl (skips without GPUs)


@pytest.mark.nccl
@pytest.mark.parametrize("ws", [1, 2])
def test_linear_matches_dense_nccl(ws):
    reason = nccl_unavailable_reason(ws)
    if reason:
        pytest.skip(reason)
    cases = [c for kind in KINDS for dtype in ("float32", "bfloat16")
             for c in _cases(kind, ws, dtype, batches=[(2, 3)])]
    run_and_check(cases, ws, "nccl", device="cuda")
