"""Memory layouts: the layouts themselves, every collective on non-contiguous views on
inproc and gloo, correct variants on non-contiguous inputs, and the contiguous-twin message.

Rank functions are module-level so gloo worker processes can unpickle them. Expected values are
computed in the test from the same deterministic per-rank inputs.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

import tpsim
from tpsim import builtin_variants
from tpsim.errors import InvalidArgument
from tpsim.mutants import CORRECT, column_view_flatten
from tpsim.props import check_case
from tpsim.props.case import save_case
from tpsim.props.layouts import INPUT_LAYOUTS, apply_layout, cover_bucket, layout_info
from tpsim.props.linear.case import Case

BACKENDS = ["inproc", pytest.param("gloo", marks=pytest.mark.gloo)]
WS = 3


# --- the layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", INPUT_LAYOUTS)
def test_a_layout_keeps_the_values_and_changes_the_memory(layout) -> None:
    t = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4)
    if layout == "expanded":
        t = t[:1].expand(2, 3, 4).clone()  # expanded needs rows equal along the first dim
    v = apply_layout(t, layout)
    assert torch.equal(v, t)
    assert v.is_contiguous() == (layout == "contiguous")


def test_the_documented_strides() -> None:
    assert layout_info((2, 3, 4), "transposed")["strides"] == [4, 8, 1]  # [S, B, H] storage viewed [B, S, H]
    assert layout_info((2, 4), "transposed")["strides"] == [1, 2]  # column-major
    assert layout_info((2, 3, 4), "strided")["strides"] == [96, 16, 2]
    assert layout_info((2, 3, 4), "expanded")["strides"] == [0, 4, 1]
    # The gaps of a strided view hold NaN: code reading storage in memory order gets NaN.
    v = apply_layout(torch.ones(2, 2), "strided")
    assert torch.isnan(v.as_strided((4,), (1,))).sum() == 2


def test_a_transposed_matrix_and_a_transposed_batch_are_two_cover_buckets() -> None:
    # [B, H] transposed is column-major as a whole; [B, S, H] transposed swaps only the leading dims.
    assert cover_bucket("transposed", (3,)) == "transposed matrix"
    assert cover_bucket("transposed", (3, 2)) == cover_bucket("transposed", (2, 2, 2)) == "transposed"
    assert [cover_bucket(layout, (3,)) for layout in ("contiguous", "strided", "expanded")] == [
        "contiguous", "strided", "expanded"]
    matrix, batch = apply_layout(torch.ones(3, 4), "transposed"), apply_layout(torch.ones(3, 2, 4), "transposed")
    assert matrix.stride() == (1, 3) and batch.stride() == (4, 12, 1)


def test_layouts_needing_a_batch_dim_refuse_a_vector() -> None:
    with pytest.raises(InvalidArgument, match="input_layout='transposed' needs"):
        apply_layout(torch.ones(3), "transposed")
    with pytest.raises(InvalidArgument, match=r"input_layout='expanded' needs at least one batch dim; got batch_shape=\[\]"):
        Case(world_size=1, in_features=2, out_features=2, input_layout="expanded")
    with pytest.raises(InvalidArgument, match="input_layout='diagonal'"):
        Case(world_size=1, in_features=2, out_features=2, input_layout="diagonal")


# --- collectives on non-contiguous views ----------------------------------------------------------
# Refused on every backend where gloo or NCCL computes the view wrongly or refuses it (the layout
# table of tpsim.comm.ops, checked against plain gloo below); the gloo path never computes a
# contiguous stand-in instead (it would make the call right where gloo gets it wrong).


def _base(rank: int, rows: int = 4, cols: int = 6) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 100 * rank


def _t(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a transposed (column-major) view of a fresh buffer, same values."""
    return x.t().contiguous().t()


def rank_collective_on_a_view(op: str) -> None:
    """``op`` with a non-contiguous tensor where a real backend gets it wrong (every rank alike)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    x = _t(_base(rank))
    if op == "all_reduce":
        dist.all_reduce(x)
    elif op == "broadcast":
        dist.broadcast(x, src=1)
    elif op == "reduce":
        dist.reduce(x, dst=0)
    elif op == "all_gather":
        dist.all_gather([torch.zeros(4, 6, dtype=torch.float64) for _ in range(ws)], x)
    elif op == "scatter":
        dist.scatter(x, [_base(r) for r in range(ws)] if rank == 0 else None, src=0)
    elif op == "reduce_scatter":
        dist.reduce_scatter(torch.zeros(2, 6, dtype=torch.float64)[:, ::2], [_base(rank, 2, 3) for _ in range(ws)])
    elif op == "all_to_all_single":
        dist.all_to_all_single(_t(torch.zeros(ws * 2, 3, dtype=torch.float64)), _base(rank, ws * 2, 3))
    elif op == "all_gather_into_tensor":
        dist.all_gather_into_tensor(torch.zeros(ws * 4, 6, dtype=torch.float64), x)
    elif op == "reduce_scatter_tensor":
        dist.reduce_scatter_tensor(torch.zeros(4, 6, dtype=torch.float64), _t(_base(rank, ws * 4, 6)))
    elif op == "all_to_all":
        dist.all_to_all([torch.zeros(4, 6, dtype=torch.float64) for _ in range(ws)], [x] * ws)


VIEW_OPS = ["all_reduce", "broadcast", "reduce", "all_gather", "scatter", "reduce_scatter", "all_to_all_single",
            "all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all"]


# Every op on inproc; on gloo (a refused call costs a fresh worker pool) one of each place's rule.
_VIEW_CASES = [(op, "inproc") for op in VIEW_OPS] + [
    pytest.param(op, "gloo", marks=pytest.mark.gloo) for op in ("all_reduce", "scatter", "all_gather_into_tensor")]


@pytest.mark.parametrize("op, backend", _VIEW_CASES)
def test_a_collective_on_a_view_a_backend_gets_wrong_is_refused_on_every_backend(op, backend) -> None:
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(rank_collective_on_a_view, WS, args=(op,), backend=backend, timeout=30)
    err = info.value
    assert err.rank == 0 and isinstance(err.errors[0], tpsim.CollectiveOnStridedView), err
    own = err.errors[0]
    assert (own.rank, own.collective, own.call_index, own.group) == (0, op, 1, "world")
    assert err.summary.startswith(f"rank 0 raised CollectiveOnStridedView: {op} #1 on group world: on rank 0, ")


def rank_gathers_into_views() -> list[torch.Tensor]:
    """all_gather's list outputs may be any layout: gloo and NCCL both copy them from a flat buffer."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    gathered = [_t(torch.zeros(4, 6, dtype=torch.float64)) for _ in range(ws)]
    dist.all_gather(gathered, _base(rank))
    columns = torch.zeros(4, 6 * ws, dtype=torch.float64)
    dist.all_gather(list(columns.chunk(ws, dim=1)), _base(rank))
    return [torch.stack(gathered), columns]


@pytest.mark.parametrize("backend", BACKENDS)
def test_views_both_backends_compute_right_pass(backend) -> None:
    values = tpsim.run(rank_gathers_into_views, WS, backend=backend, timeout=30)
    for stacked, columns in values:
        assert torch.equal(stacked, torch.stack([_base(r) for r in range(WS)])), backend
        assert torch.equal(columns, torch.cat([_base(r) for r in range(WS)], dim=1)), backend


@pytest.mark.gloo
def test_the_layout_table_is_what_plain_gloo_does(tmp_path) -> None:
    """For every op and place the table judges, plain torch gloo (no tpsim) with a slice (not dense) and a
    transposed tensor (dense) gets exactly the outcome the table says: right, wrong (computed on the
    storage) or refused."""
    import json

    import plain_gloo_layouts
    import torch.multiprocessing as mp

    from tpsim.comm import ops

    mp.start_processes(plain_gloo_layouts.probe, args=(2, str(tmp_path)), nprocs=2, start_method="spawn")
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    seen: dict[tuple[str, str, str], str] = {}
    for key in ranks[0]:
        outcomes = {ranks[0][key], ranks[1][key]}
        op, place, layout = key.split("|")
        seen[(op, place, layout)] = ops.RAISES if "raises" in outcomes else (
            ops.STORAGE if "storage" in outcomes else ops.OK)
    wrong = []
    for (op, place, layout), outcome in sorted(seen.items()):
        rule = ops._LAYOUT_RULES[op][0 if place == "input" else 1]
        expected = ops.OK if rule is None else (rule.gloo_sparse if layout == "slice" else rule.gloo_dense)
        if outcome != expected:
            wrong.append(f"{op} {place} {layout}: plain gloo {outcome}, the table says {expected}")
    assert not wrong, "\n".join(wrong)
    assert len(seen) == 2 * 21


# --- variants on non-contiguous inputs -----------------------------------------------------------

_LINEAR = [v for v in builtin_variants.TPSIM_VARIANTS if not v.packed and "sequence-sharded" not in (v.input, v.output)]


@pytest.mark.parametrize("layout", INPUT_LAYOUTS[1:])
@pytest.mark.parametrize("variant", _LINEAR + CORRECT, ids=lambda v: v.name)
def test_correct_variants_pass_on_non_contiguous_inputs(variant, layout) -> None:
    for ws, batch in ((2, (2, 3)), (3, (3,))):
        case = Case(world_size=ws, in_features=2 * ws, out_features=2 * ws, batch_shape=batch, bias=variant.bias,
                    seed=5, input_layout=layout)
        assert check_case(variant, case) == []


def test_a_contiguous_only_variant_is_caught_and_the_message_says_so(tmp_path) -> None:
    case = Case(world_size=2, in_features=2, out_features=4, batch_shape=(2, 3), input_layout="strided",
                variant=column_view_flatten.name, target=column_view_flatten.target)
    failures = check_case(column_view_flatten, case)
    assert [f.diagnosis for f in failures] == ["exception"]
    assert "view size is not compatible" in failures[0].message
    assert "appears only for non-contiguous layouts" in failures[0].message
    assert check_case(column_view_flatten, case.replace(input_layout="contiguous")) == []
    # The shrunk case shows the strides, in its description and in its case file.
    assert "input shape [2, 3, 2] strides [48, 8, 2]" in case.describe()
    doc = json.loads(open(save_case(case, str(tmp_path))).read())
    assert doc["layout"]["input"] == {"shape": [2, 3, 2], "strides": [48, 8, 2], "contiguous": False}
    assert doc["case"]["input_layout"] == "strided"


@pytest.mark.gloo
def test_layouts_on_gloo() -> None:
    case = Case(world_size=2, in_features=4, out_features=4, batch_shape=(2, 2), input_layout="transposed", bias=True)
    assert check_case(builtin_variants.row, case, backend="gloo", timeout=30) == []
    failures = check_case(column_view_flatten, case.replace(bias=False), backend="gloo", timeout=30)
    assert [f.diagnosis for f in failures] == ["exception"]
