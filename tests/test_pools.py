"""gloo worker pools that live: ranks forked from the forker, pools kept through clean refusals and
replaced (and counted) only when the world is no longer sound."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

import tpsim
from tpsim.comm import forker, procs

pytestmark = pytest.mark.gloo

WS = 2


def rank_sum() -> float:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return t.item()


def rank_refuses() -> None:
    raise ValueError(f"rank {dist.get_rank()} refuses: 7 does not divide by {dist.get_world_size()}")


def rank_refuses_after_a_subgroup() -> int:
    dist.new_group([0, 1])
    raise ValueError("refused after making a subgroup")


def groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def rank_leaves_a_collective_pending() -> None:
    # Rank 0 issues an all_reduce it never waits for, then refuses; rank 1 refuses at once: the world
    # holds a collective one rank started and the other never will.
    if dist.get_rank() == 0:
        dist.all_reduce(torch.ones(1), async_op=True)
    raise ValueError("refused")


def rank_destroys_the_world() -> int:
    dist.destroy_process_group()
    return 1


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


@pytest.fixture
def fresh_pool() -> list[int]:
    """A started pool of WS ranks; its pids."""
    procs.shutdown_pools()
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]
    return procs.live_worker_pids()[("gloo", WS)]


def test_ranks_are_forked_from_the_forker(fresh_pool: list[int]) -> None:
    z = forker.pid()
    assert z is not None and z != os.getpid()
    assert [_ppid(p) for p in fresh_pool] == [z] * WS
    for rank, pid in enumerate(fresh_pool):
        with open(f"/proc/{pid}/comm", encoding="ascii") as fh:
            assert fh.read().strip() == f"tpsim-gloo-r{rank}"


def test_a_run_every_rank_refused_keeps_its_pool(fresh_pool: list[int]) -> None:
    before = procs.replacements()
    with pytest.raises(tpsim.RankError, match="refuses: 7 does not divide by 2") as info:
        tpsim.run(rank_refuses, WS, backend="gloo")
    assert set(info.value.errors) == {0, 1}
    assert procs.live_worker_pids()[("gloo", WS)] == fresh_pool  # the same processes
    assert procs.replacements() == before
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]  # and the world still works


def test_a_refused_runs_subgroups_are_destroyed_before_the_next_run(fresh_pool: list[int]) -> None:
    clean = tpsim.run(groups, WS, backend="gloo")
    with pytest.raises(tpsim.RankError, match="refused after making a subgroup"):
        tpsim.run(rank_refuses_after_a_subgroup, WS, backend="gloo")
    assert procs.live_worker_pids()[("gloo", WS)] == fresh_pool
    assert tpsim.run(groups, WS, backend="gloo") == clean


def test_a_collective_left_pending_replaces_the_pool_as_corrupted(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without the fingerprint exchange (which would hold rank 0 in the call: a hang) the async
    # all_reduce is really issued and left pending when rank 0 returns.
    monkeypatch.setenv("TPSIM_VERIFY_COLLECTIVES", "0")
    procs.shutdown_pools()
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]
    fresh_pool = procs.live_worker_pids()[("gloo", WS)]
    before = procs.replacements()
    with pytest.raises(tpsim.RankError):
        tpsim.run(rank_leaves_a_collective_pending, WS, backend="gloo", timeout=5)
    after = procs.replacements()
    assert after.get(procs.CORRUPTED, 0) == before.get(procs.CORRUPTED, 0) + 1
    assert not set(procs.live_worker_pids().get(("gloo", WS), [])) & set(fresh_pool)
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]  # a fresh pool answers


def test_a_destroyed_default_group_replaces_the_pool(fresh_pool: list[int]) -> None:
    before = procs.replacements()
    assert tpsim.run(rank_destroys_the_world, WS, backend="gloo") == [1, 1]  # the run itself is fine
    assert procs.replacements().get(procs.DESTROYED, 0) == before.get(procs.DESTROYED, 0) + 1
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]
    assert not set(procs.live_worker_pids()[("gloo", WS)]) & set(fresh_pool)


def test_a_dead_rank_is_counted_as_a_death(fresh_pool: list[int]) -> None:
    before = procs.replacements()
    os.kill(fresh_pool[1], 9)
    deadline = time.monotonic() + 10
    while os.path.exists(f"/proc/{fresh_pool[1]}") and time.monotonic() < deadline:
        time.sleep(0.05)  # reaped by the forker
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]  # a fresh pool
    assert procs.replacements().get(procs.DEATH, 0) == before.get(procs.DEATH, 0) + 1


def start_a_thread() -> None:
    threading.Thread(target=time.sleep, args=(3600,), daemon=True, name="left-behind").start()


def test_a_forker_left_multi_threaded_is_replaced_and_never_forks_again() -> None:
    procs.shutdown_pools()
    old = forker.shared()
    assert old is not None
    old.wait_ready()
    assert procs.preload(start_a_thread, (), 30.0) is None  # ran without error...
    assert not old.safe  # ...but left a thread behind: forking it is no longer safe
    assert forker.pid() != old.proc.pid  # it was retired...
    assert old.proc.pid in forker.pids()  # ...not killed: children it forked may still serve
    assert tpsim.run(rank_sum, WS, backend="gloo") == [3.0, 3.0]
    pids = procs.live_worker_pids()[("gloo", WS)]
    assert all(_ppid(p) == forker.pid() for p in pids)  # forked from the new forker


def test_unmatched_collectives_and_sends_are_found_in_the_traces() -> None:
    from tpsim.comm._worker import Outcome
    from tpsim.comm.trace import CollectiveCall

    def call(rank: int, op: str, index: int, peer: int | None = None) -> CollectiveCall:
        return CollectiveCall(rank=rank, op=op, group="world", group_ranks=(0, 1), call_index=index, peer=peer)

    def outcomes(*calls: list[CollectiveCall]) -> dict[int, Outcome]:
        return {r: Outcome(rank=r, ok=False, calls=c) for r, c in enumerate(calls)}

    assert procs._unmatched(outcomes([call(0, "all_reduce", 1)], [call(1, "all_reduce", 1)]).values(), 2) is None
    assert "different numbers of collectives on group world: {0: 2, 1: 1}" in procs._unmatched(
        outcomes([call(0, "all_reduce", 1), call(0, "all_reduce", 2)], [call(1, "all_reduce", 1)]).values(), 2)
    assert procs._unmatched(outcomes([call(0, "send", 1, peer=1)], [call(1, "recv", 1, peer=0)]).values(), 2) is None
    assert "sends and receives do not match" in procs._unmatched(
        outcomes([call(0, "send", 1, peer=1)], []).values(), 2)


def test_a_forker_child_reports_its_exit_status_and_takes_the_callers_context(tmp_path) -> None:
    z = forker.shared()
    assert z is not None
    [child] = z.fork(child_reports_its_context, [("probe",)], ["tpsim-probe"])
    try:
        os.environ["TPSIM_FORKER_PROBE"] = "1"  # too late for this child: it has its context already
        assert child.conn.recv() == ("probe", os.getcwd(), None)
        child.conn.send(5)
        child.join(10)
        assert child.exitcode == 5
    finally:
        os.environ.pop("TPSIM_FORKER_PROBE", None)
        child.kill()
        child.close()


def child_reports_its_context(conn, tag: str) -> None:
    conn.send((tag, os.getcwd(), os.environ.get("TPSIM_FORKER_PROBE")))
    os._exit(conn.recv())
