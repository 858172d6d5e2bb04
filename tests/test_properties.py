"""The property suite's building blocks: strategies, cases and case files, tolerances, the named
property functions, and the search engine's API (tpsim/props/)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import HealthCheck, find, given, settings
from hypothesis import strategies as st

from tpsim import builtin_variants
from tpsim.errors import InvalidArgument
from tpsim.mutants import CATALOG, correct_row
from tpsim.props import (
    PROPERTIES,
    SCHEMA_VERSION,
    Case,
    CaseFileError,
    PropertyFailed,
    bias_grad_equivalence,
    cases,
    check_case,
    divisibility,
    forward_equivalence,
    input_grad_equivalence,
    load_case,
    replica_consistency,
    save_case,
    search,
    training_equivalence,
    weight_grad_equivalence,
)
from tpsim.props.tolerance import FACTOR, eps, floor, subnormal_step, tolerance

MUTANTS = {m.name: m for m in CATALOG}
QUICK = settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck), database=None)


# --- strategies ----------------------------------------------------------------------------------


@QUICK
@given(data=st.data())
def test_cases_respect_the_variant_and_the_options(data: st.DataObject) -> None:
    variant = data.draw(st.sampled_from(builtin_variants.TPSIM_VARIANTS))
    case = data.draw(cases(variant, world_sizes=(1, 3, 5), dtypes=("float32", "bfloat16")))
    assert case.world_size in (1, 3, 5)
    assert case.dtype in ("float32", "bfloat16")
    assert 0 <= len(case.batch_shape) <= 3
    # The sequence dim of a sequence-parallel variant holds k * tp tokens, k = 1..max_per_rank (3):
    # a few per rank; a sequence-sharded output may also get k * tp + r, r = 1..tp-1, which does not
    # divide (the layer must refuse it). Every other batch dim is 1..3.
    seq = variant.sequence_dim_of(len(case.batch_shape) + 1)
    for i, size in enumerate(case.batch_shape):
        if i != seq:
            assert 1 <= size <= 3
            continue
        tp = case.tp_size
        assert tp <= size <= 3 * tp + tp - 1
        if variant.output != "sequence-sharded":
            assert size % tp == 0  # a sequence-sharded input arrives already cut: it always divides
    assert case.variant == variant.name and case.target == variant.target
    sharded = {"in_features": case.in_features, "out_features": case.out_features}
    dim = variant.sharded_features()[0]
    if case.world_size == 1:
        assert sharded[dim] % case.world_size == 0


def _reaches(predicate, **options) -> Case:
    return find(cases(correct_row, **options), predicate, settings=settings(max_examples=2000, database=None))


def test_cases_cover_the_space_the_issue_names() -> None:
    # Every corner of the space is reachable: non-powers of two, world size 8, non-divisible
    # sharded dims, 0 and 3 leading dims, size-1 dims, every dtype, bias on and off.
    assert _reaches(lambda c: c.world_size == 3).world_size == 3
    assert _reaches(lambda c: c.world_size == 8).world_size == 8
    assert _reaches(lambda c: c.in_features % c.world_size != 0).in_features % 2 == 1
    assert _reaches(lambda c: len(c.batch_shape) == 3 and 1 in c.batch_shape)
    assert _reaches(lambda c: c.batch_shape == ()).batch_shape == ()
    for name in ("float64", "float32", "bfloat16", "float16"):
        assert _reaches(lambda c, n=name: c.dtype == n).dtype == name
    assert _reaches(lambda c: c.bias).bias
    assert not _reaches(lambda c: not c.bias).bias


def test_cases_shrink_to_the_smallest_readable_example() -> None:
    # Unsharded dims shrink to a multiple of the world size too (see tpsim.props.strategies).
    minimal = _reaches(lambda c: c.world_size > 2 and c.bias)
    assert minimal == Case(
        world_size=3, in_features=3, out_features=3, batch_shape=(), dtype="float64", bias=True, seed=0,
        target=correct_row.target, variant=correct_row.name,
    )


def test_non_divisible_cases_can_be_turned_off() -> None:
    @QUICK
    @given(cases(correct_row, world_sizes=(2, 3), non_divisible=False))
    def check(case: Case) -> None:
        assert case.in_features % case.world_size == 0

    check()


def test_strategy_options_are_validated() -> None:
    with pytest.raises(InvalidArgument, match=r"world sizes \[0\]"):
        cases(correct_row, world_sizes=(0,))
    with pytest.raises(InvalidArgument, match="float8"):
        cases(correct_row, dtypes=("float8",))


# --- cases and case files ------------------------------------------------------------------------


def test_case_validates_its_fields() -> None:
    with pytest.raises(InvalidArgument, match="world_size=0 must be an int >= 1"):
        Case(world_size=0, in_features=2, out_features=2)
    with pytest.raises(InvalidArgument, match="dtype='int8'"):
        Case(world_size=1, in_features=2, out_features=2, dtype="int8")
    with pytest.raises(InvalidArgument, match="batch_shape entry=0"):
        Case(world_size=1, in_features=2, out_features=2, batch_shape=(0,))


def test_case_file_round_trips(tmp_path) -> None:
    case = Case(world_size=3, in_features=6, out_features=5, batch_shape=(2, 1), dtype="bfloat16", bias=True,
                seed=7, variant="v", target="m:v", property="forward-equivalence", options=(("kind", "row"),))
    path = save_case(case, str(tmp_path), found={"diagnosis": "mismatch"})
    assert save_case(case, str(tmp_path)) == path  # the same case, the same file
    loaded, found = load_case(path)
    assert loaded == case
    assert found == {}  # the second save overwrote the first
    doc = json.loads(open(path).read())
    assert doc["format"] == "tpsim-case" and doc["schema_version"] == SCHEMA_VERSION


def test_missing_corrupt_and_newer_case_files_are_refused_clearly(tmp_path) -> None:
    with pytest.raises(CaseFileError, match="does not exist"):
        load_case(str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(CaseFileError, match=r"is not valid JSON \(line 1"):
        load_case(str(bad))
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"hello": 1}))
    with pytest.raises(CaseFileError, match="is not a tpsim case file"):
        load_case(str(other))
    path = save_case(Case(world_size=2, in_features=2, out_features=2), str(tmp_path))
    doc = json.loads(open(path).read())
    doc["schema_version"] = SCHEMA_VERSION + 1
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(CaseFileError, match=f"schema_version={SCHEMA_VERSION + 1}, newer than this tpsim reads"):
        load_case(path)
    doc["schema_version"] = SCHEMA_VERSION
    doc["case"]["world_size"] = -1
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(CaseFileError, match="is corrupt: world_size=-1"):
        load_case(path)
    doc["case"] = {"world_size": 2, "in_features": 2, "out_features": 2, "colour": "red"}
    open(path, "w").write(json.dumps(doc))
    with pytest.raises(CaseFileError, match=r"unknown case field\(s\) \['colour'\]"):
        load_case(path)


# --- tolerance -----------------------------------------------------------------------------------


def test_tolerance_is_eps_times_sqrt_reduction_length_times_magnitude_plus_a_floor() -> None:
    mag = torch.tensor([0.0, 1.0, 10.0], dtype=torch.float64)
    tol = tolerance(torch.bfloat16, mag, reduction_length=14, world_size=2)
    # bfloat16: eps 2**-7, smallest normal 2**-126, so one subnormal step is 2**-133.
    expected = FACTOR * 2.0**-7 * math.sqrt(16) * mag + FACTOR * math.sqrt(16) * 2.0**-133
    assert torch.allclose(tol, expected, rtol=1e-12, atol=0.0)
    assert eps(torch.float16) == 2.0**-10 and eps(torch.float32) == 2.0**-23
    assert subnormal_step(torch.float16) == 2.0**-24 and subnormal_step(torch.float32) == 2.0**-149


def test_the_floor_admits_a_correctly_rounded_float16_subnormal() -> None:
    # The reported element: a single product g * w whose exact value lies in float16's subnormal
    # range. Rounded correctly it is off by up to half a subnormal step (2**-25), which the bound
    # proportional to the magnitude alone (4 * eps * sqrt(K + ws) * |g w|) does not admit.
    g, w = torch.tensor(-0.0030, dtype=torch.float16), torch.tensor(0.00026, dtype=torch.float16)
    exact = g.double() * w.double()
    rounded = (g * w).double()
    assert rounded.abs() < torch.finfo(torch.float16).tiny and rounded != exact
    without_floor = FACTOR * eps(torch.float16) * math.sqrt(1 + 2) * exact.abs()
    assert (rounded - exact).abs() > without_floor
    assert (rounded - exact).abs() <= tolerance(torch.float16, exact.abs(), reduction_length=1, world_size=2)
    assert floor(torch.float16, reduction_length=1, world_size=2) == FACTOR * math.sqrt(3) * 2.0**-24


def test_tolerance_separates_rounding_from_the_smallest_bug_in_every_dtype() -> None:
    # The bugs tpsim names are off by O(1) x the magnitude; the tolerance must stay far below that
    # for the largest reductions the strategies draw (K = 2 * 3 * 16, world size 16).
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        tol = tolerance(dtype, torch.ones(1, dtype=torch.float64), reduction_length=96, world_size=16)
        assert float(tol) < 0.4


# --- named properties ----------------------------------------------------------------------------

CASE = Case(world_size=2, in_features=4, out_features=6, batch_shape=(2, 3), dtype="float32", bias=True, seed=1)
PER_CASE = [forward_equivalence, input_grad_equivalence, weight_grad_equivalence, bias_grad_equivalence,
            replica_consistency, training_equivalence]


@pytest.mark.parametrize("prop", PER_CASE, ids=lambda f: f.__name__)
@pytest.mark.parametrize("variant", builtin_variants.TPSIM_VARIANTS, ids=lambda v: v.name)
def test_named_properties_hold_for_tpsim_layers(prop, variant) -> None:
    # A packed variant's out_features is a multiple of its part proportions (8:2:2 -> 24 at ws 2).
    prop(variant, CASE.replace(out_features=2 * sum(variant.packed)) if variant.packed else CASE)


def test_a_named_property_raises_property_failed_with_the_diagnosis() -> None:
    with pytest.raises(PropertyFailed, match=r"forward-equivalence failed \(bias-duplication\)") as info:
        forward_equivalence(MUTANTS["row-bias-before-reduce"].variant, CASE)
    assert info.value.failure.diagnosis == "bias-duplication"
    assert isinstance(info.value, AssertionError)  # pytest reports it as a test failure
    # The same case satisfies the properties the bug does not touch.
    weight_grad_equivalence(MUTANTS["row-bias-before-reduce"].variant, CASE)


def test_divisibility_property() -> None:
    odd = CASE.replace(in_features=5)
    divisibility(builtin_variants.row, odd)
    with pytest.raises(PropertyFailed, match="divisibility-unchecked"):
        divisibility(MUTANTS["column-floor-division"].variant, odd.replace(out_features=7))
    with pytest.raises(InvalidArgument, match="needs a case whose sharded sizes do not divide"):
        divisibility(builtin_variants.row, CASE)


def test_an_unclear_refusal_fails_divisibility() -> None:
    # A layer that refuses a non-divisible size with an error that names neither the size nor
    # divisibility leaves its user guessing.
    from tpsim.mutants import master_weight_variant
    from tpsim.mutants.column import CorrectColumn

    class Vague(CorrectColumn):
        def check_sizes(self, in_features: int, out_features: int, ws: int) -> None:
            if out_features % ws:
                raise ValueError("bad configuration")

    variant = master_weight_variant(Vague, "column", name="vague")
    failures = check_case(variant, CASE.replace(out_features=7))
    assert [(f.property, f.diagnosis) for f in failures] == [("divisibility", "divisibility-unchecked")]
    assert "does not say why" in failures[0].message and "bad configuration" in failures[0].message


def test_check_case_reports_one_cause_with_its_consequences() -> None:
    # One run evaluates every property; the replicas' divergence and the wrong training follow from
    # the bias grad reaching rank 0 only, so they are listed under that cause, not beside it.
    (cause,) = check_case(MUTANTS["row-bias-rank0-only"].variant, CASE)
    assert (cause.property, cause.diagnosis) == ("bias-grad-equivalence", "bias-grad-rank0-only")
    # Training compares the grads accumulated over the first optimizer step first: the same mechanism
    # shows there (rank 1's accumulated bias grad is None too). Listed in the order properties are evaluated.
    got = [(f.property, f.diagnosis) for f in cause.consequences]
    assert got == [("replica-consistency", "replica-divergence"), ("training-equivalence", "bias-grad-rank0-only")]
    assert all(f.case == CASE for f in [cause, *cause.consequences])
    assert "consequences of the same cause:\n    replica-consistency: replica-divergence" in cause.describe()
    assert [c["property"] for c in cause.to_json()["consequences"]] == ["replica-consistency", "training-equivalence"]


def test_exception_failures_carry_the_rank_and_its_traceback() -> None:
    (failure,) = check_case(MUTANTS["column-bias-default-dtype"].variant, CASE.replace(dtype="float64"))
    assert failure.diagnosis == "exception" and failure.rank == 0
    assert failure.message.startswith("rank 0 raised during forward (step 0): RuntimeError")
    assert "ranks [1] raised too" in failure.message
    assert "column.py" in failure.traceback and "F.linear" in failure.traceback
    data = failure.to_json()
    assert data["traceback"] == failure.traceback and data["case"] == failure.case.to_dict()
    json.dumps(data)


# --- search --------------------------------------------------------------------------------------


def test_search_passes_a_correct_variant_and_reports_progress() -> None:
    seen = []
    report = search(builtin_variants.column, max_examples=30, seed=1, on_example=lambda n, c: seen.append((n, c)))
    assert report.passed and report.failures == []
    assert report.examples == 30 == len(seen)
    assert [n for n, _ in seen] == list(range(1, 31))
    assert all(isinstance(c, Case) for _, c in seen)
    assert report.seconds > 0 and report.variant == "ColumnParallelLinear"
    assert json.loads(json.dumps(report.to_json()))["passed"] is True


def test_search_shrinks_to_the_minimal_case_and_is_repeatable() -> None:
    mutant = MUTANTS["row-bias-before-reduce"]
    first = search(mutant.variant, max_examples=50, seed=3)
    again = search(mutant.variant, max_examples=50, seed=3)
    assert not first.passed
    (failure,) = first.failures
    assert (failure.property, failure.diagnosis) == ("forward-equivalence", "bias-duplication")
    case = failure.case
    assert (case.world_size, case.batch_shape, case.dtype, case.bias, case.seed) == (2, (), "float64", True, 0)
    assert case.property == "forward-equivalence" and case.variant == mutant.variant.name
    assert failure.found_after is not None and 1 <= failure.found_after <= first.examples
    assert [f.to_json() for f in again.failures] == [f.to_json() for f in first.failures]


def test_search_keeps_each_diagnosis_while_shrinking() -> None:
    # row-half-precision-reduce fails three properties; each shrinks on its own, none turns into
    # another diagnosis on the way.
    report = search(MUTANTS["row-half-precision-reduce"].variant, max_examples=40, seed=0)
    assert {f.diagnosis for f in report.failures} <= {"precision-loss", "mismatch"}
    assert "precision-loss" in {f.diagnosis for f in report.failures}
    props = [f.property for f in report.failures]
    assert props == sorted(props, key=PROPERTIES.index)


def test_search_can_be_limited_to_some_properties() -> None:
    report = search(MUTANTS["column-floor-division"].variant, max_examples=40, seed=0,
                    properties=["forward-equivalence"])
    assert report.passed  # the bug only shows in non-divisible cases, which are not generated now


def test_search_notes_bias_free_variants() -> None:
    from tpsim.variant import Variant

    nobias = Variant(name="nb", kind="row", build=builtin_variants.row.build, bias=False)
    report = search(nobias, max_examples=5, seed=0)
    assert report.passed and report.notes == ["nb has no bias: bias-free cases only"]


def test_search_accepts_a_target_string() -> None:
    report = search("tpsim.mutants:correct_row", max_examples=5, seed=0)
    assert report.passed and report.variant == "correct_row"
    with pytest.raises(InvalidArgument, match=r"names \d+ variants"):
        search("tpsim.layers", max_examples=5)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("max_examples", 0, "max_examples=0 must be an int >= 1"),
        ("backend", "mpi", "backend='mpi'"),
        ("timeout", -1, "timeout=-1 must be a positive number"),
        ("properties", ["speed"], r"properties=\['speed'\]"),
        ("seed", "x", "seed='x' must be an int or None"),
        ("dtypes", ("int8",), "dtypes"),
    ],
)
def test_search_rejects_bad_options(option, value, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        search(builtin_variants.row, **{option: value})


def test_harness_errors_abort_the_search_instead_of_becoming_failures() -> None:
    from tpsim.variant import Variant

    untargeted = Variant(name="local", kind="row", build=builtin_variants.row.build)
    with pytest.raises(InvalidArgument, match="has no target string, so gloo worker processes cannot import it"):
        search(untargeted, backend="gloo", max_examples=3)


# --- one cause, one report ---------------------------------------------------------------------------


def test_the_search_reports_one_cause_with_every_propertys_verdict() -> None:
    report = search(MUTANTS["row-bias-rank0-only"].variant, max_examples=60, seed=0)
    assert [(f.property, f.diagnosis) for f in report.failures] == [("bias-grad-equivalence", "bias-grad-rank0-only")]
    assert report.causes == 1
    verdicts = report.verdicts
    assert verdicts["bias-grad-equivalence"] == {"verdict": "fail", "diagnoses": ["bias-grad-rank0-only"], "cause": None}
    assert verdicts["replica-consistency"]["verdict"] == "fail"
    assert verdicts["replica-consistency"]["cause"] == "bias-grad-equivalence: bias-grad-rank0-only"
    assert verdicts["forward-equivalence"]["verdict"] == "pass"
    data = json.loads(json.dumps(report.to_json()))
    assert data["causes"] == 1 and set(data["verdicts"]) == set(PROPERTIES)


def test_verdicts_say_what_does_not_apply() -> None:
    report = search(correct_row.replace(bias=False, params=None), max_examples=5, seed=0,
                    properties=["forward-equivalence", "bias-grad-equivalence"])
    assert report.passed
    assert report.verdicts["forward-equivalence"]["verdict"] == "pass"
    assert report.verdicts["bias-grad-equivalence"] == {
        "verdict": "not-applicable", "diagnoses": [], "cause": None, "why": "the variant has no bias"}
    assert report.verdicts["divisibility"]["why"] == "not requested (properties=...)"


def test_the_merge_folds_what_follows_from_a_cause_across_cases() -> None:
    from tpsim.diagnosis import Failure
    from tpsim.props.search import _found_type, _merge

    small, other = CASE.replace(world_size=2, tp_size=None), CASE.replace(world_size=3, tp_size=None)
    # A recognised forward cause, and the same property as `mismatch` on another case (e.g. in a dtype
    # where the pattern hides in rounding): one cause, the mismatch listed under it.
    dup = Failure("forward-equivalence", "bias-duplication", "off by bias", case=small)
    mm = Failure("forward-equivalence", "mismatch", "differs", case=other)
    # A shrunk replica divergence that the cause's own minimal case shows as its consequence.
    grad = Failure("input-grad-equivalence", "grad-not-reduced", "summands", case=small)
    grad.consequences.append(Failure("replica-consistency", "replica-divergence", "differs", case=small))
    alone = Failure("replica-consistency", "replica-divergence", "differs", case=other)
    found = [_found_type(f.property, f.diagnosis)(f.case, [f]) for f in (dup, mm, grad, alone)]
    seen = {("forward-equivalence", "bias-duplication"): 3, ("forward-equivalence", "mismatch"): 9,
            ("input-grad-equivalence", "grad-not-reduced"): 4, ("replica-consistency", "replica-divergence"): 4}
    causes = _merge(found, seen)
    assert [(f.property, f.diagnosis) for f in causes] == [
        ("forward-equivalence", "bias-duplication"), ("input-grad-equivalence", "grad-not-reduced")]
    assert causes[0].consequences == [mm] and mm.details["folded_under"] == "forward-equivalence: bias-duplication"
    assert alone in causes[1].consequences
    # An unrelated cause stays a cause.
    other_cause = Failure("weight-grad-equivalence", "grad-scaled", "x0.5", case=other)
    causes = _merge([_found_type("weight-grad-equivalence", "grad-scaled")(other, [other_cause])], seen)
    assert causes == [other_cause]
