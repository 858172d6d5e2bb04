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
from tpsim.props.case import Case, save_case
from tpsim.props.checks import check_case
from tpsim.props.layouts import INPUT_LAYOUTS, apply_layout, layout_info

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


def test_layouts_needing_a_batch_dim_refuse_a_vector() -> None:
    with pytest.raises(InvalidArgument, match="input_layout='transposed' needs"):
        apply_layout(torch.ones(3), "transposed")
    with pytest.raises(InvalidArgument, match=r"input_layout='expanded' needs at least one batch dim; got batch_shape=\[\]"):
        Case(world_size=1, in_features=2, out_features=2, input_layout="expanded")
    with pytest.raises(InvalidArgument, match="input_layout='diagonal'"):
        Case(world_size=1, in_features=2, out_features=2, input_layout="diagonal")


# --- every collective on non-contiguous views ----------------------------------------------------


def _base(rank: int, rows: int = 4, cols: int = 6) -> torch.Tensor:
    return torch.arange(rows * cols, dtype=torch.float64).reshape(rows, cols) + 100 * rank


def _t(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a transposed (column-major) view of a fresh buffer, same values."""
    return x.t().contiguous().t()


def rank_noncontiguous_collectives() -> dict[str, torch.Tensor]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    out: dict[str, torch.Tensor] = {}
    x = _t(_base(rank))
    dist.all_reduce(x)
    out["all_reduce"] = x.clone()
    x = _t(_base(rank))
    dist.broadcast(x, src=1)
    out["broadcast"] = x.clone()
    x = _t(_base(rank))
    dist.reduce(x, dst=0)
    out["reduce"] = x.clone()
    gathered = [_t(torch.zeros(4, 6, dtype=torch.float64)) for _ in range(ws)]
    dist.all_gather(gathered, _t(_base(rank)))
    out["all_gather"] = torch.stack(gathered)
    target = _t(torch.zeros(4, 6, dtype=torch.float64))
    dist.scatter(target, [_t(_base(r)) for r in range(ws)] if rank == 0 else None, src=0)
    out["scatter"] = target.clone()
    chunks = [_base(rank, 2, 6)[:, ::2] for _ in range(ws)]  # strided slices
    result = torch.zeros(2, 6, dtype=torch.float64)[:, ::2]
    dist.reduce_scatter(result, chunks)
    out["reduce_scatter"] = result.clone()
    src = _t(_base(rank, ws * 2, 3))
    dst = _t(torch.zeros(ws * 2, 3, dtype=torch.float64))
    dist.all_to_all_single(dst, src)
    out["all_to_all_single"] = dst.clone()
    flat = torch.zeros(ws * 4, 6, dtype=torch.float64)
    dist.all_gather_into_tensor(flat, _t(_base(rank)))
    out["all_gather_into_tensor"] = flat
    return out


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_collective_is_correct_on_non_contiguous_views(backend) -> None:
    values = tpsim.run(rank_noncontiguous_collectives, WS, backend=backend, timeout=30)
    total = sum(_base(r) for r in range(WS))
    for rank, got in enumerate(values):
        assert torch.equal(got["all_reduce"], total), backend
        assert torch.equal(got["broadcast"], _base(1)), backend
        assert torch.equal(got["all_gather"], torch.stack([_base(r) for r in range(WS)])), backend
        assert torch.equal(got["scatter"], _base(rank)), backend
        assert torch.equal(got["reduce_scatter"], sum(_base(r, 2, 6)[:, ::2] for r in range(WS))), backend
        expected_a2a = torch.cat([_base(r, WS * 2, 3)[2 * rank:2 * rank + 2] for r in range(WS)])
        assert torch.equal(got["all_to_all_single"], expected_a2a), backend
        assert torch.equal(got["all_gather_into_tensor"], torch.cat([_base(r) for r in range(WS)])), backend
    assert torch.equal(values[0]["reduce"], total), backend


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
