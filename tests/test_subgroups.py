"""Tensor-parallel subgroups: a world split into tp groups, each with its own data.

tpsim's own layers and the correct variants of examples/ pass with world 4 / tp 2 and world 8 /
tp 2 and 4 in both layouts; a layer that reduces over the wrong set of ranks is diagnosed
``wrong-group`` with the set named; the strategies, ``search(tp_sizes=...)`` and ``--tp-sizes``.
"""

from __future__ import annotations

import json
import os

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim import builtin_variants
from tpsim.cli import main
from tpsim.errors import InvalidArgument
from tpsim.mutants import CORRECT, correct_row, row_wrong_group
from tpsim.props import check_case
from tpsim.props.groups import candidate_sets, tp_groups
from tpsim.props.linear.case import Case
from tpsim.props.linear.strategies import cases
from tpsim.props.search import search
from tpsim.target import resolve_target

EXAMPLES = os.path.join(os.path.dirname(__file__), os.pardir, "examples")
_LINEAR = [v for v in builtin_variants.TPSIM_VARIANTS if not v.packed and "sequence-sharded" not in (v.input, v.output)]
MESHES = [(4, 2, "consecutive"), (4, 2, "strided"), (8, 2, "consecutive"), (8, 2, "strided"), (8, 4, "consecutive"),
          (8, 4, "strided")]


def _example_variants():
    found = []
    for name in ("tpsim_layers.py", "my_layer.py", "tutorial_convention.py", "skill_convention.py"):
        found += resolve_target(os.path.join(EXAMPLES, name))
    return found


def test_the_two_layouts() -> None:
    assert tp_groups(8, 2, "consecutive") == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert tp_groups(8, 2, "strided") == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert tp_groups(8, 4, "strided") == [[0, 2, 4, 6], [1, 3, 5, 7]]
    names = [name for name, _ in candidate_sets(8, 2, "consecutive")]
    assert names[0].startswith("the whole world") and "data-parallel" in names[1] and "strided" in names[2]
    with pytest.raises(InvalidArgument, match="tp_size=3 must be >= 1 and divide world_size=8"):
        tp_groups(8, 3)
    with pytest.raises(InvalidArgument, match=r"tp_size=3 does not divide world_size=4"):
        Case(world_size=4, tp_size=3, in_features=3, out_features=3)
    with pytest.raises(InvalidArgument, match="tp_layout='diagonal'"):
        Case(world_size=4, tp_size=2, in_features=2, out_features=2, tp_layout="diagonal")


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: f"w{m[0]}-tp{m[1]}-{m[2]}")
@pytest.mark.parametrize("variant", _LINEAR + CORRECT, ids=lambda v: v.name)
def test_correct_variants_pass_with_subgroups(variant, mesh) -> None:
    world, tp, layout = mesh
    case = Case(world_size=world, tp_size=tp, tp_layout=layout, in_features=2 * tp, out_features=2 * tp,
                batch_shape=(2,), bias=variant.bias, seed=7)
    assert check_case(variant, case) == []


def test_every_correct_example_passes_with_subgroups() -> None:
    examples = _example_variants()
    assert len(examples) >= 6
    for variant in examples:
        report = search(variant, world_sizes=(4, 8), tp_sizes=(2, 4), max_examples=15, seed=3, layouts=("contiguous",))
        assert report.passed, (variant.name, [f.describe() for f in report.failures])
    # The skill's convention reads its rank from the default group: it is run on whole-world groups
    # only, and the report says so.
    skill = [v for v in examples if v.name.startswith("skill.")]
    report = search(skill[0], world_sizes=(4,), tp_sizes=(2,), max_examples=3, seed=0)
    assert any("tp groups spanning the whole world only" in n for n in report.notes)


@settings(max_examples=60, deadline=None, database=None)
@given(st.data())
def test_cases_draw_tp_sizes_that_divide_the_world(data) -> None:
    case = data.draw(cases(correct_row, world_sizes=(2, 4, 6, 8), tp_sizes=(2, 4), non_divisible=False))
    assert case.tp_size in (2, 4) and case.world_size % case.tp_size == 0
    assert case.in_features % case.tp_size == 0
    case = data.draw(cases(correct_row, world_sizes=(4, 6), subgroups=True))
    assert case.world_size % case.tp_size == 0
    assert data.draw(cases(correct_row, world_sizes=(4,))).tp_size == 4  # default: one group
    with pytest.raises(InvalidArgument, match=r"tp_sizes=\[3\] divide none of the world sizes \[2, 4\]"):
        cases(correct_row, world_sizes=(2, 4), tp_sizes=(3,))


@pytest.mark.parametrize("layout", ["consecutive", "strided"])
def test_a_reduction_over_the_world_is_a_wrong_group(layout) -> None:
    case = Case(world_size=4, tp_size=2, tp_layout=layout, in_features=4, out_features=3, batch_shape=(2,), bias=True)
    failures = check_case(row_wrong_group, case)
    assert failures[0].property == "forward-equivalence" and failures[0].diagnosis == "wrong-group"
    mine = [0, 1] if layout == "consecutive" else [0, 2]
    assert "the whole world" in failures[0].message and f"(rank 0's: {mine})" in failures[0].message
    assert failures[0].details["used_ranks"] == [0, 1, 2, 3]
    # tp == world: the same layer is correct.
    assert check_case(row_wrong_group, case.replace(world_size=2, tp_size=2)) == []


def test_search_finds_the_wrong_group_with_tp_sizes() -> None:
    report = search(row_wrong_group, world_sizes=(4, 8), tp_sizes=(2,), max_examples=40, seed=0)
    hit = [f for f in report.failures if f.diagnosis == "wrong-group"]
    assert hit and hit[0].case.tp_size == 2 and hit[0].case.world_size == 4
    assert search(row_wrong_group, world_sizes=(1, 2, 3), subgroups=False, max_examples=30, seed=0).passed


def test_a_failing_group_is_named() -> None:
    from tpsim.mutants import CATALOG

    no_reduce = next(m.variant for m in CATALOG if m.name == "column-no-backward-reduce")
    case = Case(world_size=4, tp_size=2, tp_layout="strided", in_features=2, out_features=4, batch_shape=(2,))
    failures = check_case(no_reduce, case)
    f = next(f for f in failures if f.diagnosis == "grad-not-reduced")
    assert f.message.startswith("in tp group 0 (global ranks [0, 2]")
    assert f.details["group_ranks"] == [0, 2]


def test_cli_tp_sizes(capsys, tmp_path) -> None:
    code = main(["check", "tpsim.mutants:row_wrong_group", "--world-sizes", "4", "--tp-sizes", "2", "--max-examples",
                 "20", "--seed", "0", "--report", "json", "--cases-dir", str(tmp_path)])
    report = json.loads(capsys.readouterr().out)
    assert code == 1
    assert report["settings"]["tp_sizes"] == [2]
    failure = report["failures"][0]
    assert failure["diagnosis"] == "wrong-group"
    assert failure["case"]["tp_size"] == 2 and failure["case"]["world_size"] == 4
    assert main(["check", "tpsim.layers", "--world-sizes", "4", "--tp-sizes", "0"]) == 2
    assert "--tp-sizes" in capsys.readouterr().err


@pytest.mark.gloo
def test_subgroups_on_gloo() -> None:
    case = Case(world_size=4, tp_size=2, tp_layout="strided", in_features=4, out_features=4, batch_shape=(2,), bias=True)
    assert check_case(builtin_variants.row, case, backend="gloo", timeout=30) == []
    assert [f.diagnosis for f in check_case(row_wrong_group, case, backend="gloo", timeout=30)][:1] == ["wrong-group"]
