"""The variant description (tpsim/variant.py): defaults follow Megatron, bad descriptions are
refused with clear messages, and the generic loader puts master values where the placements say."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.placement import Replicate, Shard
from tpsim.variant import LayoutError, ParamSpec, Variant, load_master


def _build(*args, **kwargs) -> nn.Module:
    return nn.Linear(1, 1)


def test_defaults_follow_megatron() -> None:
    column = Variant(name="c", kind="column", build=_build)
    row = Variant(name="r", kind="row", build=_build)
    assert (column.input, column.output, column.input_grad) == ("replicated", "sharded", "complete")
    assert (row.input, row.output) == ("sharded", "reduced")
    assert column.param("weight").placement == Shard(0) and column.param("bias").placement == Shard(0)
    assert row.param("weight").placement == Shard(1) and row.param("bias").placement == Replicate()
    assert column.sharded_features() == ("out_features",) and row.sharded_features() == ("in_features",)
    assert row.describe() == (
        "r: row, input sharded S(-1) -> output reduced R; weight S(1), bias R; input grad complete"
    )
    nobias = Variant(name="n", kind="row", build=_build, bias=False)
    assert nobias.param("bias") is None and nobias.describe().endswith("no bias (bias-free cases only)")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"kind": "diagonal"}, "Variant(kind='diagonal'): expected one of column, row"),
        ({"kind": "column", "output": "partial"}, "output='partial' is not valid for a column layer"),
        ({"kind": "column", "input": "sharded"}, "input='sharded' is not valid for a column layer"),
        ({"kind": "row", "input_grad": "half"}, "input_grad='half'"),
        ({"kind": "row", "build": 3}, "expected a callable builder"),
        ({"kind": "row", "params": (ParamSpec("w", "weight", Shard(1)),)}, "bias=True but params name 0 biases"),
    ],
)
def test_bad_descriptions_are_refused(kwargs, message) -> None:
    kwargs = {"name": "v", "build": _build, **kwargs}
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        Variant(**kwargs)


def test_param_spec_validation() -> None:
    with pytest.raises(InvalidArgument, match="master='gamma'"):
        ParamSpec("g", "gamma", Replicate())
    with pytest.raises(InvalidArgument, match="only a weight can be stored transposed"):
        ParamSpec("b", "bias", Replicate(), transposed=True)
    assert ParamSpec("weight", "weight", Shard(0), transposed=True).describe() == "weight S(0) stored transposed"


class _Transposed(nn.Module):
    def __init__(self, shape: tuple[int, int], bias: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(shape))
        self.bias = nn.Parameter(torch.zeros(bias))


def test_loader_shards_transposes_and_replicates() -> None:
    master_w = torch.arange(24.0).reshape(4, 6)  # [out, in]
    master_b = torch.arange(4.0)
    variant = Variant(
        name="t", kind="row", build=_build,
        params=(ParamSpec("weight", "weight", Shard(1), transposed=True), ParamSpec("bias", "bias", Replicate())),
    )
    module = _Transposed((3, 4), 4)  # [in/ws, out]
    load_master(module, variant, rank=1, world_size=2, masters={"weight": master_w, "bias": master_b})
    assert torch.equal(module.weight, master_w[:, 3:].t())
    assert torch.equal(module.bias, master_b)


def test_loader_names_the_parameter_and_both_shapes() -> None:
    variant = Variant(name="c", kind="column", build=_build)
    module = _Transposed((4, 3), 2)  # split along the wrong dim
    with pytest.raises(LayoutError, match=r"parameter 'weight' has shape \[4, 3\], expected \[2, 6\] \(S\(0\) of the "
                                          r"master weight \[4, 6\] over world_size=2\)") as info:
        load_master(module, variant, rank=0, world_size=2, masters={"weight": torch.zeros(4, 6), "bias": None})
    assert (info.value.param, info.value.shape, info.value.expected) == ("weight", (4, 3), (2, 6))
    with pytest.raises(LayoutError, match="the built layer has no tensor at 'proj.weight'"):
        load_master(nn.Module(), variant.replace(params=(ParamSpec("proj.weight", "weight", Shard(0)),), bias=False),
                    rank=0, world_size=1, masters={"weight": torch.zeros(2, 2)})
