"""Sequence parallelism in the variant description and the properties: sequence-sharded inputs and
outputs, their cases, the SP mutants, sequence-parallel norms (checked as whole modules), the CLI
options."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim import builtin_variants
from tpsim.cli import main
from tpsim.errors import InvalidArgument
from tpsim.mutants import CATALOG, CORRECT_NORMS, CORRECT_PACKED_AND_SEQUENCE, norm_variant
from tpsim.mutants.sequence import CorrectSequenceNorm
from tpsim.placement import Shard
from tpsim.props import check_case
from tpsim.props.linear.case import Case
from tpsim.props.linear.strategies import cases
from tpsim.props.linear.world import is_divisible
from tpsim.props.search import search

MUTANTS = {m.name: m for m in CATALOG}
SP_ROW = builtin_variants.row_sequence_parallel
SP_COLUMN = builtin_variants.column_sequence_parallel


def test_variant_sequence_placements() -> None:
    assert SP_COLUMN.input_placement == Shard(-2) and SP_ROW.output_placement == Shard(-2)
    assert SP_ROW.sequence_dim_of(2) == 0 and SP_ROW.sequence_dim_of(3) == 1 and SP_ROW.sequence_dim_of(1) is None
    assert SP_ROW.replace(sequence_dim=0).sequence_dim_of(3) == 0
    with pytest.raises(InvalidArgument, match="sequence_dim=-1"):
        SP_ROW.replace(sequence_dim=-1)
    with pytest.raises(InvalidArgument, match="not valid for a column layer"):
        builtin_variants.column.replace(output="sequence-sharded")


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_cases_have_a_sequence_dim_of_both_ranks_and_both_divisibilities(data) -> None:
    row = data.draw(cases(SP_ROW))
    assert len(row.batch_shape) >= 1  # 2-D inputs (sequence dim 0) or more
    col = data.draw(cases(SP_COLUMN))
    seq = col.batch_shape[-1]
    assert seq % col.world_size == 0  # a sequence-sharded input always arrives evenly cut


def test_the_strategy_reaches_2d_3d_and_non_divisible_sequences() -> None:
    seen = set()

    @settings(max_examples=300, deadline=None, database=None)
    @given(cases(SP_ROW))
    def collect(case):
        seq = case.batch_shape[-1]
        feature_ok = case.in_features % case.world_size == 0
        seen.add((len(case.batch_shape) + 1, seq % case.world_size == 0 or not feature_ok))

    collect()
    assert {(2, True), (3, True), (2, False)} <= seen or {(2, True), (3, True), (3, False)} <= seen


@pytest.mark.parametrize("variant", [SP_COLUMN, SP_ROW, CORRECT_PACKED_AND_SEQUENCE[2]], ids=lambda v: v.name)
def test_correct_sequence_parallel_variants_pass(variant) -> None:
    report = search(variant, max_examples=60, seed=5)
    assert report.passed, [f.describe() for f in report.failures]


def test_non_divisible_sequence_is_refused_by_the_row_layer() -> None:
    case = Case(world_size=2, in_features=2, out_features=3, batch_shape=(2, 3), bias=True, seed=0)
    assert not is_divisible(SP_ROW, case)
    assert check_case(SP_ROW, case) == []


@pytest.mark.parametrize("name", ["sequence-scatter-batch-dim", "sequence-bias-grad-not-reduced"])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.thorough)])  # seed 1: thorough tier
def test_sequence_mutant_is_caught_with_its_intended_diagnosis(name, seed) -> None:
    mutant = MUTANTS[name]
    report = search(mutant.variant, max_examples=200, seed=seed)
    hits = [f for f in report.failures if f.diagnosis == mutant.diagnosis]
    assert hits, (name, [(f.property, f.diagnosis) for f in report.failures])
    if name == "sequence-scatter-batch-dim":
        assert all(len(f.case.batch_shape) >= 2 for f in hits)  # only visible with 3-D input
        assert "dim 0 instead of dim 1" in hits[0].message
    else:
        assert hits[0].details["param"] == "bias" and "'bias'" in hits[0].message


def test_batch_dim_scatter_with_equal_shapes_is_still_wrong_shard_dim() -> None:
    # [2, 2, in] at ws=2: the batch slice has the sequence slice's shape; the values tell them apart.
    case = Case(world_size=2, in_features=2, out_features=2, batch_shape=(2, 2), seed=4)
    failures = check_case(MUTANTS["sequence-scatter-batch-dim"].variant, case)
    assert failures[0].diagnosis == "wrong-shard-dim"


#: The mutant's correct twin: each replicated parameter enters through a copy whose backward all-reduces it.
CORRECT_NORM = norm_variant(CorrectSequenceNorm, name="correct_sequence_norm")


@pytest.mark.parametrize("variant", [*CORRECT_NORMS, CORRECT_NORM], ids=lambda v: v.name)
def test_sequence_parallel_norms_pass_as_whole_modules(variant) -> None:
    # The module family bounds layer_norm and rms_norm (tpsim.props.module.magnitude): float64 and
    # float32, 2-D and 3-D inputs, world sizes up to 4.
    report = search(variant, max_examples=40, seed=0)
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 40


def test_sequence_parallel_norm_grads_must_be_all_reduced() -> None:
    report = search(MUTANTS["sequence-norm-no-grad-reduce"].variant, max_examples=40, seed=0)
    assert [(f.property, f.diagnosis, f.details["param"]) for f in report.failures] == [
        ("weight-grad-equivalence", "grad-not-reduced", "weight"),
        ("bias-grad-equivalence", "grad-not-reduced", "bias"),
    ]
    assert "NeMo #7184" in report.failures[0].message


@pytest.mark.gloo
def test_norm_check_on_gloo() -> None:
    report = search(MUTANTS["sequence-norm-no-grad-reduce"].variant, world_sizes=(2,), max_examples=4, seed=0,
                    backend="gloo")
    assert report.failures[0].diagnosis == "grad-not-reduced"


def test_cli_sequence_options(tmp_path, capsys) -> None:
    args = ["--world-sizes", "2", "--max-examples", "30", "--seed", "0", "--cases-dir", str(tmp_path)]
    assert main(["check", "tpsim.mutants:correct_row", "--output", "sequence-sharded", *args]) == 1
    out = capsys.readouterr().out
    assert "FAILED forward-equivalence" in out  # the plain row layer returns the whole reduced output
    assert main(["check", "tpsim.mutants:correct_sequence_row", "--sequence-dim", "-2", *args]) == 0
    assert main(["check", "tpsim.layers:RowParallelLinear", "--sequence-dim", "-1"]) == 2
    assert "-1 is the feature dim" in capsys.readouterr().err


@pytest.mark.gloo
def test_sequence_mutant_caught_on_gloo() -> None:
    case = Case(world_size=2, in_features=2, out_features=3, batch_shape=(4,), bias=True, seed=2)
    failures = check_case(MUTANTS["sequence-bias-grad-not-reduced"].variant, case, backend="gloo")
    assert ("bias-grad-equivalence", "grad-not-reduced") in [(f.property, f.diagnosis) for f in failures]
    assert check_case(SP_ROW, case, backend="gloo") == []
