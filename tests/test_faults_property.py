"""The fault-detection property (tpsim/props/faults.py) on the built-in layers, and its strategy."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim.errors import InvalidArgument
from tpsim.faults import FAULT_KINDS, Corrupt, Delay, Drop, Fault, Mismatch, parse_plan
from tpsim.props.faults import FaultNotSurfaced, check_faults, fault_detection, fault_plans
from tpsim.props.linear.case import Case
from tpsim.target import resolve_target

COLUMN = "tpsim.builtin_variants:column"
ROW = "tpsim.builtin_variants:row"


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5).flatmap(lambda ws: st.tuples(st.just(ws), fault_plans(ws, max_calls=[3] * ws, max_faults=3))))
def test_generated_plans_are_valid_and_replayable(example):
    ws, plan = example
    assert 1 <= len(plan) <= 3
    assert parse_plan([f.to_json() for f in plan]) == plan  # replays exactly from a case file
    for fault in plan:
        assert isinstance(fault, Fault) and fault.rank < ws and 1 <= fault.at_call <= 3
        assert not (isinstance(fault, Mismatch) and ws == 1)


def test_strategy_refuses_impossible_requests():
    with pytest.raises(InvalidArgument, match=r"a mismatch needs world_size >= 2"):
        fault_plans(1, kinds=["mismatch"])
    with pytest.raises(InvalidArgument, match=r"kinds=\['melt'\]"):
        fault_plans(2, kinds=["melt"])
    with pytest.raises(InvalidArgument, match=r"one int >= 0 per rank \(2 ranks\)"):
        fault_plans(2, max_calls=[1, 2, 3])


@pytest.mark.parametrize("target", [COLUMN, ROW])
def test_every_generated_fault_is_surfaced_on_the_builtin_layers(target):
    variant = resolve_target(target)[0]
    reports = check_faults(variant, world_sizes=(1, 2, 3), max_examples=30, seed=3, timeout=1.0)
    assert len(reports) == 30
    bad = [r.message for r in reports if not r.ok]
    assert bad == []
    kinds = {r.plan[0].kind for r in reports}
    assert kinds == set(FAULT_KINDS)  # the search reached every kind
    assert any(r.caught_by for r in reports)  # some corruption was caught by an equivalence property


def test_faults_run_isolated_report_what_they_report_in_process():
    # What `tpsim check --faults` runs: the worlds in the supervised worker process.
    variant = resolve_target(COLUMN)[0]
    runs = {isolate: check_faults(variant, world_sizes=(2, 3), max_examples=12, seed=5, timeout=1.0, isolate=isolate)
            for isolate in (False, True)}
    assert [r.message for r in runs[True] if not r.ok] == []
    assert [(r.plan, r.outcome, r.caught_by) for r in runs[True]] == [
        (r.plan, r.outcome, r.caught_by) for r in runs[False]]


def test_a_drop_is_reported_with_rank_and_call():
    variant = resolve_target(ROW)[0]
    case = Case(world_size=2, in_features=4, out_features=4, batch_shape=(2,), faults=(Drop(1, 1).to_json(),))
    report = fault_detection(variant, case, timeout=2.0)
    assert report.ok and report.outcome == "error"
    assert "rank 1 was dropped by the fault plan at all_reduce #1 on group world" in report.message
    assert report.to_json()["plan"] == [{"kind": "drop", "rank": 1, "at_call": 1}]


def test_a_corruption_the_properties_cannot_see_is_reported():
    # Flipping the lowest mantissa bit changes the result by far less than any tolerance: the
    # equivalence properties pass it, so the fault-detection property must say so...
    variant = resolve_target(ROW)[0]
    case = Case(world_size=2, in_features=4, out_features=4, batch_shape=(2,))
    subtle = [Corrupt(0, 1, how="bitflip", bit=0)]
    with pytest.raises(FaultNotSurfaced, match=r"changed the result, yet every property passed"):
        fault_detection(variant, case, subtle, timeout=2.0)
    # ...and checksum mode pinpoints it.
    report = fault_detection(variant, case, subtle, timeout=2.0, checksum=True)
    assert "checksum mismatch: rank 0's contribution changed" in report.message


def test_a_short_delay_must_not_change_anything():
    variant = resolve_target(COLUMN)[0]
    case = Case(world_size=3, in_features=6, out_features=6, batch_shape=(2,))
    report = fault_detection(variant, case, [Delay(2, 1, seconds=0.05)], timeout=2.0)
    assert report.ok and report.outcome == "result" and "equals the clean run" in report.message


@pytest.mark.gloo
def test_fault_detection_on_gloo():
    variant = resolve_target(ROW)[0]
    case = Case(world_size=2, in_features=4, out_features=4, batch_shape=(2,))
    for plan in ([Drop(1, 2)], [Mismatch(0, 1, what="shape")]):
        report = fault_detection(variant, case, plan, backend="gloo", timeout=3.0)
        assert report.ok and report.outcome == "error", report.message
