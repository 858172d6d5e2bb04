"""The world runner's edges on gloo/nccl: bad fn, hard deaths, Ctrl-C, timeouts, parallel runs, no CUDA."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.distributed as dist

import tpsim
from tpsim.comm import procs

pytestmark = pytest.mark.gloo

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rank_dies_hard(how: str) -> None:
    dist.barrier()
    if dist.get_rank() == 1:
        if how == "exit":
            os._exit(3)
        os.kill(os.getpid(), signal.SIGSEGV)
    dist.barrier()


@pytest.mark.parametrize("how, status", [("exit", "exit code 3"), ("segv", r"signal SIGSEGV \(exit code -11\)")])
def test_a_worker_dying_hard_is_reported_with_rank_and_exit_code(how, status):
    with pytest.raises(tpsim.RankError, match=rf"rank 1 died with {status}") as info:
        tpsim.run(rank_dies_hard, 2, backend="gloo", args=(how,), timeout=10)
    assert info.value.rank == 1
    assert ("gloo", 2) not in procs.live_worker_pids()  # the broken pool is gone, not reused


def test_an_unpicklable_fn_gets_a_clear_error():
    with pytest.raises(tpsim.InvalidArgument, match=r"cannot be sent to the gloo worker processes .* "
                                                    r"lambdas, closures and nested functions work only on "
                                                    r"backend='inproc'"):
        tpsim.run(lambda: 1, 2, backend="gloo")


def rank_busy(seconds: float) -> None:
    if dist.get_rank() == 0:
        time.sleep(seconds)
    dist.barrier()


def test_a_timeout_leaves_no_process_behind():
    tpsim.run(rank_busy, 2, backend="gloo", args=(0.0,), timeout=10)  # warm
    pids = procs.live_worker_pids()[("gloo", 2)]
    with pytest.raises(tpsim.RankError, match=r"barrier #1 on group world"):
        tpsim.run(rank_busy, 2, backend="gloo", args=(60.0,), timeout=1.0)
    for pid in pids:
        assert not os.path.exists(f"/proc/{pid}") or _zombie(pid)


def _zombie(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except OSError:
        return True


_SCRIPT = textwrap.dedent("""
    import pathlib, sys, time, torch.distributed as dist, tpsim
    from tpsim.comm import procs

    def rank_sleep(s, started=None):
        dist.barrier()
        if started is not None:  # the event the test waits for: this rank is in the run
            pathlib.Path(f"{started}.{dist.get_rank()}").touch()
        time.sleep(s)
        return dist.get_rank()

    if __name__ == "__main__":
        assert tpsim.run(rank_sleep, 2, backend="gloo", args=(0.0,)) == [0, 1]
        print("PIDS", *procs.live_worker_pids()[("gloo", 2)], flush=True)
        if sys.argv[1] == "interrupt":
            tpsim.run(rank_sleep, 2, backend="gloo", args=(120.0, sys.argv[2]), timeout=200)
        print("DONE", flush=True)
""")


def _script(tmp_path):
    path = tmp_path / "world.py"
    path.write_text(_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return path, env


def test_ctrl_c_leaves_no_children(tmp_path):
    path, env = _script(tmp_path)
    started = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, str(path), "interrupt", str(started)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("PIDS"), proc.stderr.read()
        pids = [int(p) for p in line.split()[1:]]
        # The second run is under way once both ranks have said so (an event: a loaded machine only
        # makes it later; the bound is a backstop).
        deadline = time.monotonic() + 300
        while not all((tmp_path / f"started.{rank}").exists() for rank in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, "the second run did not start"
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err
    deadline = time.monotonic() + 60
    while any(os.path.exists(f"/proc/{p}") and not _zombie(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if os.path.exists(f"/proc/{p}") and not _zombie(p)] == []


def test_parallel_worlds_never_collide(tmp_path):
    # Two processes start gloo worlds at the same moment (as pytest-xdist workers do): each
    # rendezvous is a FileStore in its own temp dir, so neither sees the other's ranks or ports.
    path, env = _script(tmp_path)
    runs = [subprocess.Popen([sys.executable, str(path), "once"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env=env, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300) for p in runs]
    for p, (out, err) in zip(runs, outs, strict=True):
        assert p.returncode == 0, err
        assert "DONE" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown where CUDA is missing")
def test_nccl_without_cuda_is_unavailable_with_a_reason():
    reason = procs.nccl_unavailable_reason(2)
    assert reason is not None and "CUDA is not available" in reason
    with pytest.raises(tpsim.BackendUnavailable, match="CUDA is not available") as info:
        tpsim.run(rank_busy, 2, backend="nccl", args=(0.0,))
    assert info.value.reason == reason
    assert ("nccl", 2) not in procs.live_worker_pids()  # nothing was spawned


def rank_number() -> int:
    return dist.get_rank()


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _zombie(pid)


def test_pools_of_several_world_sizes_are_kept_and_bounded(monkeypatch):
    # A search draws world sizes in turn: each size keeps its pool (no restart per draw) while
    # the pool count and the idle worker count stay within their bounds, oldest evicted first.
    monkeypatch.setattr(procs, "MAX_POOLS", 6)
    monkeypatch.setattr(procs, "MAX_POOL_WORKERS", 3)
    assert tpsim.run(rank_number, 1, backend="gloo") == [0]
    assert tpsim.run(rank_number, 2, backend="gloo") == [0, 1]
    live = procs.live_worker_pids()
    assert {("gloo", 1), ("gloo", 2)} <= set(live) and sum(map(len, live.values())) <= 3
    one = live[("gloo", 1)]
    assert tpsim.run(rank_number, 1, backend="gloo") == [0]
    assert procs.live_worker_pids()[("gloo", 1)] == one  # reused, not restarted
    monkeypatch.setattr(procs, "MAX_POOLS", 1)
    assert tpsim.run(rank_number, 2, backend="gloo") == [0, 1]  # reuses size 2, over the new bound
    assert set(procs.live_worker_pids()) == {("gloo", 2)}  # at most one pool: size 1 was evicted
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in one) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in one)


_EXIT_SCRIPT = textwrap.dedent("""
    import torch.distributed as dist, tpsim
    from tpsim.comm import procs

    def rank_number():
        return dist.get_rank()

    if __name__ == "__main__":
        for ws in (1, 2):
            assert tpsim.run(rank_number, ws, backend="gloo") == list(range(ws))
        print("PIDS", *[p for pids in procs.live_worker_pids().values() for p in pids], flush=True)
""")


def test_a_normal_exit_leaves_no_worker_behind(tmp_path):
    path = tmp_path / "pools.py"
    path.write_text(_EXIT_SCRIPT)
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("PIDS"))
    pids = [int(p) for p in line.split()[1:]]
    assert len(pids) == 3  # both pools were alive at exit
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert [p for p in pids if _alive(p)] == []
