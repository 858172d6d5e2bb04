"""ParallelAttention (packed Q/K/V column-parallel, GQA with replicated K/V heads, row-parallel
out-projection, optional sequence parallelism) against the dense attention and its twin.

The reference is the attention family's (:func:`tpsim.props.attention.reference.attention_reference`):
:class:`DenseAttention` in float64, every tensor bounded by how far the same attention run in the
case's precision strays from it (the dense twin). The expected piece of every rank
(:func:`qkv_rows`, :func:`expected_local`) is written out here, independently of the layer code;
the candidate attentions a buggy layer computes (another softmax scale, another pairing of query and
key/value heads) are checked against the dense attention built that way by hand.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from helpers import assert_errors_before_any_collective, errors_raised, forward_backward
from test_layers import BACKENDS, DTYPES, assert_within, seq_chunk

import tpsim
from tpsim.layers import DenseAttention, ParallelAttention, QKVParallelLinear
from tpsim.mutants import attention as attention_mutants
from tpsim.props.attention.case import AttentionCase
from tpsim.props.attention.reference import attention_reference, attention_run


def attn_case(ws, heads, kv_heads, *, head_dim=4, hidden=12, batch=(2,), seq=4, causal=True, bias=True,
              sp=False, dtype="float64", seed=0) -> dict:
    return {"ws": ws, "h": heads, "g": kv_heads, "d": head_dim, "hidden": hidden, "batch": tuple(batch),
            "seq": seq, "causal": causal, "bias": bias, "sp": sp, "dtype": dtype, "seed": seed}


def make_attn_data(case: dict) -> dict:
    g = torch.Generator().manual_seed(case["seed"])
    dt = DTYPES[case["dtype"]]
    h, kv, d, hid = case["h"], case["g"], case["d"], case["hidden"]

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale).to(dt)

    rows = (h + 2 * kv) * d
    data = {"w_qkv": draw(rows, hid, scale=hid**-0.5), "w_o": draw(hid, h * d, scale=(h * d) ** -0.5),
            "x": draw(*case["batch"], case["seq"], hid), "gy": draw(*case["batch"], case["seq"], hid)}
    data["b_qkv"] = draw(rows) if case["bias"] else None
    data["b_o"] = draw(hid) if case["bias"] else None
    return data


def dense_module(case: dict, data: dict) -> DenseAttention:
    dense = DenseAttention(case["hidden"], case["h"], case["g"], head_dim=case["d"], bias=case["bias"],
                           causal=case["causal"], dtype=DTYPES[case["dtype"]])
    with torch.no_grad():
        dense.qkv.weight.copy_(data["w_qkv"])
        dense.proj.weight.copy_(data["w_o"])
        if case["bias"]:
            dense.qkv.bias.copy_(data["b_qkv"])
            dense.proj.bias.copy_(data["b_o"])
    return dense


# ------------------------------------------------------------------ expected layout, written out here


def qkv_rows(case: dict, rank: int) -> torch.Tensor:
    """Rows of the packed [Q; K; V] rank ``rank`` holds: its query heads, and the key/value heads
    those queries use (a block of them, or the one replicated head when there are fewer than ranks)."""
    ws, h, g, d = case["ws"], case["h"], case["g"], case["d"]
    q_per_rank = h // ws
    q_heads = range(rank * q_per_rank, (rank + 1) * q_per_rank)
    kv_heads = sorted({i // (h // g) for i in q_heads})  # the groups of its query heads
    rows = [r for i in q_heads for r in range(i * d, (i + 1) * d)]
    for offset in (h * d, (h + g) * d):
        rows += [offset + r for j in kv_heads for r in range(j * d, (j + 1) * d)]
    return torch.tensor(rows)


def expected_local(case: dict, name: str, full: torch.Tensor, rank: int) -> torch.Tensor:
    ws = case["ws"]
    if name in ("y", "gx"):
        return seq_chunk(full, -2, ws, rank) if case["sp"] else full
    if name in ("qkv.weight", "qkv.bias"):
        return full.index_select(0, qkv_rows(case, rank))
    if name == "proj.weight":
        return full.chunk(ws, dim=1)[rank]
    return full  # proj.bias: replicated


# ------------------------------------------------------------------ the reference and its twin's bounds


def _reference_inputs(case: dict) -> tuple[AttentionCase, dict, torch.Tensor, torch.Tensor]:
    data = make_attn_data(case)
    masters = {"qkv.weight": data["w_qkv"], "qkv.bias": data["b_qkv"], "proj.weight": data["w_o"],
               "proj.bias": data["b_o"]}
    acase = AttentionCase(case["ws"], case["hidden"], case["h"], case["g"], case["d"], case["seq"], case["batch"],
                          causal=case["causal"], bias=case["bias"], dtype=case["dtype"], seed=case["seed"])
    return acase, masters, data["x"], data["gy"]


def attention_oracle(case: dict, scale_factor: float = 1.0, kv_map: list[int] | None = None) -> dict:
    """Float64 forward/backward and the twin's tolerances; ``gx`` is the input's grad. With
    ``scale_factor``/``kv_map``: the output of the attention a buggy layer computes instead."""
    acase, masters, x, gy = _reference_inputs(case)
    out = attention_reference(acase, masters, x, gy)
    if scale_factor != 1.0 or kv_map is not None:
        y = attention_run(acase, masters, x, gy, scale=scale_factor / math.sqrt(case["d"]), kv_map=kv_map)["y"]
        out["y"] = (y, out["y"][1])
    out["gx"] = out.pop("x")
    return out


def test_the_candidate_attentions_are_the_attention_a_buggy_layer_computes():
    """The reference's other scale and other pairing are DenseAttention with that scale, and with the
    key/value heads each query head uses copied to it (float64, built by hand here)."""
    case = attn_case(1, 4, 2)
    acase, masters, x, gy = _reference_inputs(case)
    base = attention_run(acase, masters, x, gy)
    same = attention_run(acase, masters, x, gy, scale=1 / math.sqrt(case["d"]), kv_map=[0, 0, 1, 1])
    for name, value in base.items():
        torch.testing.assert_close(same[name] if name == "y" else value, value, rtol=0, atol=0, msg=name)
    d, h, g = case["d"], case["h"], case["g"]
    sharp = DenseAttention(case["hidden"], h, g, head_dim=d, causal=case["causal"], softmax_scale=2 / math.sqrt(d),
                           dtype=torch.float64)
    swapped = DenseAttention(case["hidden"], h, h, head_dim=d, causal=case["causal"], dtype=torch.float64)
    w, b = masters["qkv.weight"], masters["qkv.bias"]
    kv_map = [1, 0, 1, 0]
    rows = list(range(h * d)) + [(h + j) * d + r for j in kv_map for r in range(d)] + \
        [(h + g + j) * d + r for j in kv_map for r in range(d)]
    with torch.no_grad():
        for dense, qkv_w, qkv_b in ((sharp, w, b), (swapped, w[rows], b[rows])):
            dense.qkv.weight.copy_(qkv_w)
            dense.qkv.bias.copy_(qkv_b)
            dense.proj.weight.copy_(masters["proj.weight"])
            dense.proj.bias.copy_(masters["proj.bias"])
    torch.testing.assert_close(attention_run(acase, masters, x, gy, scale=2 / math.sqrt(d))["y"], sharp(x).detach())
    torch.testing.assert_close(attention_run(acase, masters, x, gy, kv_map=kv_map)["y"], swapped(x).detach())


# ------------------------------------------------------------------ the rank side


def run_attn_case(case: dict, cls_name: str = "") -> dict:
    ws, rank = dist.get_world_size(), dist.get_rank()
    cls = getattr(attention_mutants, cls_name) if cls_name else ParallelAttention
    data = make_attn_data(case)
    layer = cls.from_dense(dense_module(case, data), sequence_parallel=case["sp"])
    x, gy = data["x"], data["gy"]
    if case["sp"]:
        x, gy = seq_chunk(x, -2, ws, rank), seq_chunk(gy, -2, ws, rank)
    return forward_backward(layer, x, gy)


def rank_attn_cases(cases: list[dict], cls_name: str = "") -> list[dict]:
    return [run_attn_case(c, cls_name) for c in cases]


def check_attn(case: dict, per_rank: list[dict], oracle: dict | None = None) -> None:
    oracle = oracle or attention_oracle(case)
    dt = DTYPES[case["dtype"]]
    for rank, got in enumerate(per_rank):
        assert set(got) == set(oracle), f"rank {rank}: {sorted(got)} != {sorted(oracle)}"
        for name, (full, tol) in oracle.items():
            what = f"{name} on rank {rank} of {case}"
            assert got[name].dtype == dt, f"{what}: dtype {got[name].dtype}"
            assert_within(got[name], expected_local(case, name, full, rank), expected_local(case, name, tol, rank),
                          what)
    check_replicas(case, per_rank)


def check_replicas(case: dict, per_rank: list[dict]) -> None:
    """Replicated results are the same bits on every rank: the output and input grad (without SP),
    the out-projection's bias grad, and the grads of K/V rows replicated on several ranks."""
    names = ["proj.bias"] if case["bias"] else []
    if not case["sp"]:
        names += ["y", "gx"]
    for name in names:
        for rank in range(1, case["ws"]):
            assert torch.equal(per_rank[rank][name], per_rank[0][name]), f"{name}: rank 0 vs {rank} ({case})"
    ws, g = case["ws"], case["g"]
    if g < ws:  # ranks r and r' with the same key/value head hold the same K/V rows and grads
        q_rows = case["h"] // ws * case["d"]
        for rank in range(ws):
            first = rank - rank % (ws // g)
            for name in ("qkv.weight", "qkv.bias") if case["bias"] else ("qkv.weight",):
                assert torch.equal(per_rank[rank][name][q_rows:], per_rank[first][name][q_rows:]), (
                    f"{name} K/V rows: rank {first} vs {rank} ({case})")


HEADS = [(4, 4), (8, 2), (4, 1), (8, 4)]  # multi-head, grouped-query, multi-query, 2 kv heads per rank at ws 2


def attn_cases(ws: int, dtype: str = "float64") -> list[dict]:
    cases = []
    seed = 0
    for h, g in HEADS:
        if h % ws or (g % ws and ws % g):
            continue
        for causal, bias, sp, batch in ((True, True, False, (2,)), (False, False, False, ()),
                                        (True, True, True, (2,)), (True, False, True, (1, 2))):
            seed += 1
            cases.append(attn_case(ws, h, g, head_dim=3, hidden=10, batch=batch, seq=2 * ws, causal=causal,
                                   bias=bias, sp=sp, dtype=dtype, seed=seed))
    return cases


@pytest.mark.parametrize("ws", [1, 2, 4, 8])
def test_attention_matches_dense_inproc(ws):
    """Output, input grad and every parameter grad equal the float64 attention's (each rank its
    heads' slice); GQA with K/V heads sharded (g >= ws) and replicated (g < ws); causal or not;
    sequence parallelism on and off."""
    cases = attn_cases(ws)
    per_rank = tpsim.run(rank_attn_cases, ws, args=(cases,))
    for i, case in enumerate(cases):
        check_attn(case, [per_rank[r][i] for r in range(ws)])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(("backend", "ws"), [("inproc", 2), ("inproc", 4), pytest.param("gloo", 2, marks=pytest.mark.gloo)])
def test_attention_low_precision(backend, ws, dtype):
    cases = attn_cases(ws, dtype)[::2]
    per_rank = tpsim.run(rank_attn_cases, ws, backend=backend, args=(cases,))
    for i, case in enumerate(cases):
        check_attn(case, [per_rank[r][i] for r in range(ws)])


@pytest.mark.gloo
@pytest.mark.parametrize(("ws", "heads"), [(2, [(4, 4), (4, 1)]), (3, [(6, 3), (6, 1)])])
def test_attention_matches_dense_gloo(ws, heads):
    cases = [attn_case(ws, h, g, seq=ws, sp=sp, seed=i) for i, (h, g) in enumerate(heads) for sp in (False, True)]
    per_rank = tpsim.run(rank_attn_cases, ws, backend="gloo", args=(cases,))
    for i, case in enumerate(cases):
        check_attn(case, [per_rank[r][i] for r in range(ws)])


def test_oracle_rejects_a_wrong_head_mapping():
    """The check itself fails on a rank that pairs its query heads with another group's K/V heads."""
    case = attn_case(2, 4, 4)
    good = tpsim.run(rank_attn_cases, 2, args=([case],))
    check_attn(case, [good[0][0], good[1][0]])
    bad = tpsim.run(rank_attn_cases, 2, args=([case], "AttentionKVHeadsRoundRobin"))
    with pytest.raises(AssertionError, match="off"):
        check_attn(case, [bad[0][0], bad[1][0]])


# ------------------------------------------------------------------ init, round trip, collectives


def rank_init_and_round_trip(seed: int, h: int, g: int) -> dict:
    torch.manual_seed(seed)
    dense = DenseAttention(12, h, g)
    torch.manual_seed(seed)
    layer = ParallelAttention(12, h, g)
    back = layer.to_dense()
    again = ParallelAttention.from_dense(back)
    same = lambda a, b: all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))  # noqa: E731
    return {"init": same(back, dense), "round_trip": same(again, layer),
            "state": {k: tuple(v.shape) for k, v in layer.state_dict().items()}}


@pytest.mark.parametrize(("h", "g"), [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize(("backend", "ws"), [("inproc", 1), ("inproc", 4), pytest.param("gloo", 2, marks=pytest.mark.gloo)])
def test_init_is_the_seeded_dense_attention(backend, ws, h, g):
    """A seed gives DenseAttention's parameters, sharded, at every world size; to_dense/from_dense round-trip."""
    d = 12 // h
    kv_local = g // ws if g >= ws else 1
    for rank, got in enumerate(tpsim.run(rank_init_and_round_trip, ws, backend=backend, args=(3, h, g))):
        assert got["init"] and got["round_trip"], f"rank {rank}: {got}"
        assert got["state"] == {"qkv.weight": ((h // ws + 2 * kv_local) * d, 12), "qkv.bias": ((h // ws + 2 * kv_local) * d,),
                                "proj.weight": (12, h * d // ws), "proj.bias": (12,)}


def rank_forward_backward(sp: bool, g: int) -> None:
    ws = dist.get_world_size()
    torch.manual_seed(0)
    layer = ParallelAttention(8, 4, g, sequence_parallel=sp)
    x = torch.randn(2, 8 // (ws if sp else 1), 8, requires_grad=True)
    layer(x).sum().backward()


@pytest.mark.parametrize(("sp", "g", "expected"), [
    (False, 4, ["all_reduce", "all_reduce"]),  # proj's reduction; the input grad's
    (False, 1, ["all_reduce", "all_reduce", "all_reduce", "all_reduce"]),  # + the K/V replicas' weight and bias grads
    # SP: gather the sequence, reduce-scatter it; backward: proj bias grad, then the conjugates
    (True, 4, ["all_gather", "reduce_scatter", "all_reduce", "all_gather", "reduce_scatter"]),
])
def test_collectives_per_step(sp, g, expected):
    """Exactly the collectives tensor parallelism needs (order of issue on rank 0)."""
    result = tpsim.run_world(rank_forward_backward, 4, args=(sp, g))
    ops = [c.op for c in result.trace.of(0)]
    normalise = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
                 "_allgather_base": "all_gather", "_reduce_scatter_base": "reduce_scatter"}
    assert [normalise.get(o, o) for o in ops] == expected, ops


# ------------------------------------------------------------------ errors


def _attention(*args, **kwargs):
    return lambda: ParallelAttention(*args, **kwargs)


ERROR_CASES = {
    "heads-not-divisible": (_attention(12, 6), ValueError,
                            "ParallelAttention: num_heads=6 is not divisible by the tensor-parallel world size 4 "
                            "(query heads are sharded over the group)"),
    "kv-heads-neither": (_attention(24, 12, 6), ValueError,
                         "ParallelAttention: num_kv_heads=6 and the tensor-parallel world size 4 must divide one "
                         "another (key/value heads are sharded when there are at least as many as ranks, else replicated)"),
    "gqa-groups": (_attention(24, 8, 3), ValueError,
                   "ParallelAttention: num_heads=8 is not divisible by num_kv_heads=3 (each key/value head serves "
                   "an equal group of query heads)"),
    "hidden-heads": (_attention(10, 4), ValueError,
                     "ParallelAttention: hidden=10 is not divisible by num_heads=4; pass head_dim explicitly"),
    "scale": (_attention(8, 4, softmax_scale=0.0), ValueError,
              "ParallelAttention: softmax_scale=0.0 must be a positive float (default 1/sqrt(head_dim))"),
    "input-features": (lambda: ParallelAttention(8, 4)(torch.zeros(2, 3, 7)), ValueError,
                       "ParallelAttention expected an input with last dim hidden=8, got last dim 7 (input shape (2, 3, 7))"),
    "input-no-sequence": (lambda: ParallelAttention(8, 4)(torch.zeros(8)), ValueError,
                          "ParallelAttention expected an input [..., sequence, hidden=8], got shape (8,)"),
    "qkv-shard-shape": (lambda: QKVParallelLinear(8, 4).shard(torch.zeros(10, 8)), ValueError,
                        "QKVParallelLinear.shard: expected 24 packed rows ((num_heads=4 + 2*num_kv_heads=4) * "
                        "head_dim=2), got shape (10, 8)"),
    "from-dense-type": (lambda: ParallelAttention.from_dense(torch.nn.Linear(2, 2)), TypeError,
                        "ParallelAttention.from_dense: attention must be a DenseAttention, got Linear"),
}


def rank_errors(names: list[str]) -> dict:
    return errors_raised(ERROR_CASES, names)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_error_on_every_rank_before_any_collective(backend):
    result = tpsim.run_world(rank_errors, 4, backend=backend, args=(list(ERROR_CASES),))
    assert_errors_before_any_collective(result, ERROR_CASES, 4)


# ------------------------------------------------------------------ the mutants differ as diagnosed


def _mutant_run(name: str, case: dict) -> list[dict]:
    return [values[0] for values in tpsim.run(rank_attn_cases, case["ws"], args=([case], name))]


def test_round_robin_kv_heads_attend_with_other_groups():
    """qkv-head-mismatch: the output is the attention in which query head i uses the K/V head the
    mutant's rank holds (head j on rank j % ws), not its own group's."""
    case = attn_case(2, 4, 4)  # 2 kv heads per rank: rank 0 holds kv heads {0, 2} for q heads {0, 1}
    got = _mutant_run("AttentionKVHeadsRoundRobin", case)
    # rank 0: q heads 0,1 use kv heads 0,2; rank 1: q heads 2,3 use kv heads 1,3
    wrong = attention_oracle(case, kv_map=[0, 2, 1, 3])
    assert_within(got[0]["y"], *wrong["y"], "output of the round-robin mutant")
    right = attention_oracle(case)["y"][0]
    assert (got[0]["y"] - right).abs().max() > 1e-3


def test_kv_heads_not_replicated_use_the_wrong_head():
    """kv-heads-not-replicated: with 2 kv heads on 4 ranks, rank r keeps head r % 2, so ranks 1
    and 2 attend with the other group's head."""
    case = attn_case(4, 4, 2)  # q head i on rank i; correct kv head i // 2; mutant's: i % 2
    got = _mutant_run("AttentionKVNotReplicated", case)
    wrong = attention_oracle(case, kv_map=[0, 1, 0, 1])
    assert_within(got[0]["y"], *wrong["y"], "output of the not-replicated mutant")
    assert (got[0]["y"] - attention_oracle(case)["y"][0]).abs().max() > 1e-3


@pytest.mark.parametrize("ws", [2, 4])
def test_local_head_dim_scale_sharpens_the_softmax_by_sqrt_ws(ws):
    """attention-scale: the output is the attention with its scale multiplied by sqrt(ws)."""
    case = attn_case(ws, 4, 4)
    got = _mutant_run("AttentionLocalHeadDimScale", case)
    sharp = attention_oracle(case, scale_factor=math.sqrt(ws))
    for rank in range(ws):
        assert_within(got[rank]["y"], *sharp["y"], f"output on rank {rank}")
    assert (got[0]["y"] - attention_oracle(case)["y"][0]).abs().max() > 1e-3
