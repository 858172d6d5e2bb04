"""``ModuleVariant(tp="world")`` (a module whose tp group is always the whole world, as a DTensor mesh
over every rank) and its batch-dim limits (styles that take inputs of one batch dim only): the cases
drawn honour them, the search passes with them, and bad values are refused by name."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from tests.module_targets import packed_declared
from tpsim.errors import InvalidArgument
from tpsim.props.module.strategies import module_cases
from tpsim.props.search import search


def _world_variant():
    import dataclasses

    return dataclasses.replace(packed_declared, name="PackedGateUpMLP(world, 1 batch dim)", tp="world",
                               min_batch_dims=1, max_batch_dims=1)


@settings(max_examples=60, deadline=None)
@given(module_cases(_world_variant(), world_sizes=(1, 2, 4, 6), dtypes=("float64",), tp_sizes=(2,)))
def test_cases_have_one_world_sized_group_and_one_batch_dim(case) -> None:
    assert case.tp_size in (None, case.world_size)
    assert len(case.batch_shape) == 1


def test_without_them_the_search_draws_subgroups() -> None:
    from hypothesis import find

    find(module_cases(packed_declared, world_sizes=(4,), dtypes=("float64",)),
         lambda c: c.tp_size is not None and c.tp_size < c.world_size and len(c.batch_shape) != 1)


def test_the_search_passes_with_the_limits() -> None:
    # (PackedGateUpMLP truncates sizes that do not divide: that is its own finding, not the limits')
    report = search(_world_variant(), max_examples=10, seed=0, world_sizes=(1, 2, 4), dtypes=("float64",),
                    properties=("forward-equivalence", "input-grad-equivalence", "weight-grad-equivalence"))
    assert report.passed, [(f.property, f.diagnosis, f.message) for f in report.failures]


@pytest.mark.parametrize("change, message", [
    ({"tp": "all"}, r"tp='all'; expected 'world'"),
    ({"min_batch_dims": -1}, r"min_batch_dims=-1; expected an int >= 0"),
    ({"min_batch_dims": 2, "max_batch_dims": 1}, r"max_batch_dims=1; expected None or an int >= min_batch_dims=2"),
])
def test_bad_limits_are_refused_by_name(change, message) -> None:
    import dataclasses

    with pytest.raises(InvalidArgument, match=message):
        dataclasses.replace(packed_declared, **change)
