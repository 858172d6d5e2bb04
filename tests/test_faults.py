"""Fault plans (tpsim.faults) injected beneath the process group, on inproc and on gloo.

The guarantee under test, for every fault kind and both backends: within a bounded time the run
ends; every surviving rank ends with a ``tpsim.CollectiveError`` naming the faulty rank, the
collective and its call index (or, for a short delay, the right result); no process or rank
thread is left behind; a corrupted contribution never passes silently (the result differs from
the clean run, and checksum mode names the corrupting rank).

Rank functions are module-level so gloo workers can unpickle them. Bounds are generous
(``timeout + 10 s``): latency is measured by the benchmark, not asserted here.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist
from helpers import steps_loop

import tpsim
from tpsim.comm import isolate, procs
from tpsim.faults import (
    FAULT_KINDS,
    Corrupt,
    Crash,
    Delay,
    Drop,
    Fault,
    InjectedCrash,
    Mismatch,
    parse_plan,
    plan_from_json,
    plan_to_json,
)

BACKENDS = ["inproc", pytest.param("gloo", marks=pytest.mark.gloo)]
WS = 3
TIMEOUT = 3.0
#: Whole-run bound the tests allow: the timeout plus a generous margin (pool start on gloo
#: is not part of it: the pool is warmed before timing).
BOUND = TIMEOUT + 10.0

GATHER_OP = "all_gather_into_tensor"


def _clean(backend: str) -> list[torch.Tensor]:
    return tpsim.run(steps_loop, WS, backend=backend, timeout=30)


def _child_pids() -> set[int]:
    """Live child processes of this process (a /proc scan: no psutil needed)."""
    me = os.getpid()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                stat = fh.read()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[-1].split()
        if len(fields) > 1 and int(fields[1]) == me and fields[0] != "Z":
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as fh:
                    cmdline = fh.read()
            except OSError:
                continue
            if b"resource_tracker" in cmdline:  # multiprocessing's own helper, one per parent
                continue
            found.add(int(entry))
    return found


def _assert_nothing_left_behind() -> None:
    # Pooled gloo workers and an isolated inproc worker (and its fork server) outlive runs on purpose.
    pooled = {pid for pids in procs.live_worker_pids().values() for pid in pids} | isolate.helper_pids()
    deadline = time.monotonic() + 5.0  # killed children may take a moment to be reaped
    while _child_pids() - pooled and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _child_pids() - pooled == set()
    assert not [t for t in threading.enumerate() if t.name.startswith("tpsim-rank-") and t.is_alive()]


def _expect_named(err: tpsim.CollectiveError, faulty: int, op: str, index: int) -> None:
    """``err`` and every surviving rank's own error name the faulty rank, op and call index."""
    assert isinstance(err, tpsim.CollectiveError)
    assert err.faulty_ranks == (faulty,)
    assert (err.collective, err.call_index) == (op, index)
    text = str(err)
    assert f"rank {faulty}" in text and f"{op} #{index}" in text
    for r in range(WS):
        if r == faulty:
            continue
        own = err.errors.get(r)
        assert isinstance(own, tpsim.CollectiveError), f"rank {r} ended with {own!r}"
        assert own.faulty_ranks == (faulty,)
        assert own.collective == op and own.call_index == index
        assert f"rank {faulty}" in str(own) and f"{op} #{index}" in str(own)


# -- the guarantee, per fault kind and backend -----------------------------------------------------

FAILING = {
    # kind: (plan, op of call 3 as the survivors see it)
    "drop": (Drop(rank=1, at_call=3), GATHER_OP),
    "crash": (Crash(rank=1, at_call=4), "all_reduce"),
    "delay-past-timeout": (Delay(rank=1, at_call=3, seconds=TIMEOUT + 5), GATHER_OP),
    "mismatch-op": (Mismatch(rank=1, at_call=4, what="op"), "all_reduce"),
    "mismatch-shape": (Mismatch(rank=1, at_call=3, what="shape"), GATHER_OP),
    "mismatch-dtype": (Mismatch(rank=1, at_call=4, what="dtype"), "all_reduce"),
    "corrupt-checksum": (Corrupt(rank=1, at_call=3, how="bitflip", bit=0), GATHER_OP),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(FAILING))
def test_every_survivor_gets_an_error_naming_rank_collective_and_call(backend, name):
    fault, op = FAILING[name]
    _clean(backend)  # warm the gloo pool: its start-up is not part of the bound
    t0 = time.monotonic()
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(steps_loop, WS, backend=backend, faults=[fault], timeout=TIMEOUT,
                  checksum=name.startswith("corrupt"))
    elapsed = time.monotonic() - t0
    assert elapsed < BOUND
    _expect_named(info.value, 1, op, fault.at_call)
    fired = info.value.faults_fired if backend == "inproc" or not isinstance(fault, (Drop, Delay)) else None
    if fired is not None:
        assert [f for f, _ in fired] == [fault]
    _assert_nothing_left_behind()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_short_delay_gives_the_right_result(backend):
    expected = _clean(backend)
    result = tpsim.run_world(steps_loop, WS, backend=backend, faults=[Delay(rank=2, at_call=2, seconds=0.3)],
                             timeout=TIMEOUT)
    for r in range(WS):
        torch.testing.assert_close(result.values[r], expected[r], rtol=0, atol=0)
    assert [(f.kind, c.op, c.call_index) for f, c in result.faults_fired] == [("delay", "all_reduce", 2)]
    _assert_nothing_left_behind()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("how", ["nan", "bitflip", "scale"])
def test_a_corrupted_contribution_never_passes_silently(backend, how):
    expected = _clean(backend)
    fault = Corrupt(rank=1, at_call=2, how=how)
    result = tpsim.run_world(steps_loop, WS, backend=backend, faults=[fault], timeout=TIMEOUT)
    # Without checksums the run "succeeds", but every rank's result differs from the clean run:
    # the equivalence properties (forward_equivalence & co.) fail on it.
    for r in range(WS):
        assert not torch.equal(result.values[r], expected[r])
    assert [f for f, _ in result.faults_fired] == [fault]
    # With checksums, the collective itself fails on every member, naming the corrupting rank.
    with pytest.raises(tpsim.CollectiveError, match=r"all_reduce #2 on group world: checksum mismatch: "
                                                    r"rank 1's contribution changed"):
        tpsim.run(steps_loop, WS, backend=backend, faults=[fault], timeout=TIMEOUT, checksum=True)
    _assert_nothing_left_behind()


def test_checksum_mode_can_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("TPSIM_CHECKSUM", "1")
    with pytest.raises(tpsim.CollectiveError, match="checksum mismatch") as info:
        tpsim.run(steps_loop, WS, faults=[Corrupt(rank=2, at_call=1)])
    assert info.value.faults_fired[0][0] == Corrupt(rank=2, at_call=1)
    assert info.value.faulty_ranks == (2,)


# -- what a user sees ------------------------------------------------------------------------------

def test_a_dropped_rank_report_reads_at_a_glance_on_inproc():
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(steps_loop, 4, faults=[Drop(rank=1, at_call=4)], timeout=30)
    assert str(info.value).splitlines() == [
        "all_reduce #4 on group world: ranks 0,2,3 waiting; rank 1 was dropped by the fault plan "
        "at all_reduce #4 on group world (Drop(rank=1, at_call=4)) "
        "[fault plan: Drop(rank=1, at_call=4) at all_reduce #4 on group world] [backend inproc, world_size=4]",
        "  rank 0: failed in all_reduce #4 on group world",
        "  rank 1: was dropped by the fault plan at all_reduce #4 on group world (Drop(rank=1, at_call=4))",
        "  rank 2: failed in all_reduce #4 on group world",
        "  rank 3: failed in all_reduce #4 on group world",
    ]
    assert info.value.rank == 0  # the lowest rank that waited for it


@pytest.mark.gloo
def test_a_dropped_rank_really_dies_on_gloo_and_the_pool_is_replaced():
    _clean("gloo")
    before = procs.live_worker_pids()[("gloo", WS)]
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(steps_loop, WS, backend="gloo", faults=[Drop(rank=1, at_call=3)], timeout=TIMEOUT)
    text = str(info.value)
    assert "rank 1: was dropped by the fault plan at all_gather_into_tensor #3 on group world " \
           "(Drop(rank=1, at_call=3)): its process exited with exit code 87" in text
    assert not any(p in pids for pids in procs.live_worker_pids().values() for p in before)
    # The next run gets fresh workers and the right answer: inproc's, up to the order of the sums
    # (inproc adds in rank order, gloo's ring in its own, which float32 rounds differently: each of
    # the 3 all_reduces of WS terms may differ by WS rounding steps, compounding over the steps).
    torch.testing.assert_close(_clean("gloo")[0], _clean("inproc")[0], rtol=3 * WS * torch.finfo(torch.float32).eps,
                               atol=0)
    after = procs.live_worker_pids()[("gloo", WS)]
    assert not set(after) & set(before)


def rank_only_rank_zero_sends() -> None:
    if dist.get_rank() == 0:
        dist.send(torch.ones(2), dst=1)


def test_a_dropped_rank_never_yields_a_silent_value():
    # Rank 1 is dropped at its only call; nobody waits for it, yet the run must not return None.
    with pytest.raises(tpsim.CollectiveError, match=r"rank 0 was dropped by the fault plan at send #1 on group "
                                                    r"world and returned no value"):
        tpsim.run(rank_only_rank_zero_sends, 2, faults=[Drop(rank=0, at_call=1)])


def test_a_mismatch_in_a_two_rank_world_blames_the_injected_rank():
    # With two ranks there is no majority: the plan breaks the tie (rank 0 is the one tampered with).
    with pytest.raises(tpsim.CollectiveError, match=r"rank 0 called barrier #1 while rank 1 called "
                                                    r"all_gather_into_tensor #1") as info:
        tpsim.run(steps_loop, 2, faults=[Mismatch(rank=0, at_call=1)])
    assert info.value.faulty_ranks == (0,)


def test_group_scoped_faults_count_calls_on_that_group():
    # 4 ranks, tp groups [0,1] and [2,3]; a fault at the 1st call on group "[2,3]" hits rank 3's
    # 1st tp all_reduce, not its 1st call overall (a world barrier).
    with pytest.raises(tpsim.CollectiveError, match=r"all_reduce #1 on group \[2,3\]: ranks 2 waiting; "
                                                    r"rank 3 was dropped") as info:
        tpsim.run(rank_world_then_tp, 4, faults=[Drop(rank=3, at_call=1, group="[2,3]")])
    assert info.value.faulty_ranks == (3,)


def rank_world_then_tp() -> float:
    r = dist.get_rank()
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dist.barrier()
    t = torch.ones(1) * r
    dist.all_reduce(t, group=groups[r // 2])
    return t.item()


def test_a_fault_whose_call_never_comes_does_nothing():
    result = tpsim.run_world(steps_loop, WS, faults=[Crash(rank=0, at_call=99)])
    assert result.faults_fired == []
    torch.testing.assert_close(result.values[0], _clean("inproc")[0], rtol=0, atol=0)


def test_an_injected_crash_is_an_injected_crash_on_its_rank():
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(steps_loop, WS, faults=[Crash(rank=2, at_call=1)])
    assert info.value.rank == 2
    assert isinstance(info.value.errors[2], InjectedCrash)
    assert "rank 2 crashed on purpose (fault plan: Crash(rank=2, at_call=1) at all_gather_into_tensor #1" \
           in str(info.value)


# -- plans as data ---------------------------------------------------------------------------------

ALL = [Drop(0, 1), Crash(1, 2), Delay(2, 3, 0.5), Corrupt(3, 4, "bitflip", index=2, bit=5),
       Corrupt(0, 5, "scale", factor=-1.0), Mismatch(1, 6, "dtype"), Drop(2, 7, group="tp")]


def test_plans_round_trip_through_json():
    text = json.dumps(plan_to_json(ALL))
    assert plan_from_json(json.loads(text)) == tuple(ALL)
    assert Drop(1, 3).to_json() == {"kind": "drop", "rank": 1, "at_call": 3}
    assert {f.kind for f in ALL} == set(FAULT_KINDS)


def test_run_accepts_json_dicts_as_a_plan():
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(steps_loop, WS, faults=[{"kind": "drop", "rank": 2, "at_call": 2}])
    assert info.value.faulty_ranks == (2,)


@pytest.mark.parametrize("make, message", [
    (lambda: Drop(rank=-1, at_call=1), r"Drop: rank=-1 must be >= 0"),
    (lambda: Drop(rank=0, at_call=0), r"Drop: at_call=0 must be >= 1 \(at_call is 1-based"),
    (lambda: Crash(rank=True, at_call=1), r"Crash: rank=True must be an int >= 0 \(got bool\)"),
    (lambda: Delay(0, 1, seconds=-2), r"Delay: seconds=-2 must be a finite number >= 0"),
    (lambda: Corrupt(0, 1, how="zero"), r"Corrupt: how='zero' must be one of nan, bitflip, scale"),
    (lambda: Corrupt(0, 1, how="scale", factor=1), r"Corrupt: factor=1 must be a finite number other than 1"),
    (lambda: Mismatch(0, 1, what="rank"), r"Mismatch: what='rank' must be one of op, shape, dtype"),
    (lambda: Fault.from_json({"kind": "melt", "rank": 0, "at_call": 1}),
     r"fault kind='melt' is not one of drop, crash, delay, corrupt, mismatch"),
    (lambda: Fault.from_json({"kind": "drop", "rank": 0}), r"missing field\(s\) \['at_call'\]"),
    (lambda: Fault.from_json({"kind": "drop", "rank": 0, "at_call": 1, "seconds": 2}),
     r"unknown field\(s\) \['seconds'\]"),
    (lambda: parse_plan([Drop(0, 1), Crash(0, 1)]), r"act on the same call of rank 0"),
    (lambda: parse_plan(Drop(0, 1)), r"must be a list of faults"),
    (lambda: tpsim.run(steps_loop, 2, faults=[Drop(5, 1)]), r"rank=5 is not a rank of a world of world_size=2"),
    (lambda: tpsim.run(steps_loop, 2, checksum="yes"), r"checksum='yes' must be True, False or None"),
])
def test_bad_plans_get_clear_errors(make, message):
    with pytest.raises(tpsim.InvalidArgument, match=message):
        make()
