"""Hostile ranks: a rank can't take the checker down, hang it, fool it into a pass, or outlive it.

The rank functions below exit, segfault, abort, run out of memory or sleep in native code. Run on an
isolated inproc world (``isolate=True``: the ranks live in a supervised worker process) each must
become a named failure while the checker carries on with a fresh worker; on gloo the same deaths
get the same names. World sizes beyond a backend's limit are refused before anything starts, and no
worker outlives a checker killed with SIGKILL.
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

import tpsim
from tpsim.comm import isolate, limits
from tpsim.comm.rank_progress import PHASES, mark_phase

ROOT = Path(__file__).resolve().parents[1]

# --- hostile rank functions (module level: the isolated worker imports them by reference) ---------


def _segfault() -> None:
    ctypes.string_at(0)


_DEATHS: dict[str, Callable[[], Any]] = {
    "os._exit(0)": lambda: os._exit(0),
    "os._exit(1)": lambda: os._exit(1),
    "sys.exit(3)": lambda: sys.exit(3),
    "segfault": _segfault,
    "abort": os.abort,
    "SIGKILL": lambda: os.kill(os.getpid(), signal.SIGKILL),
}


def rank_dies(how: str, victim: int = 1, phase: str = "forward", step: int = 0) -> list[float]:
    """Every rank all-reduces once, marks ``phase``; rank ``victim`` then dies as ``how`` says."""
    t = torch.ones(2)
    dist.all_reduce(t)
    mark_phase(phase, step)
    if dist.get_rank() == victim:
        _DEATHS[how]()
    dist.all_reduce(t)
    return t.tolist()


def rank_values(seed: int) -> dict[str, Any]:
    """A deterministic SPMD program: per-rank random data, a reduction and a gather."""
    torch.manual_seed(seed + dist.get_rank())
    x = torch.randn(3, 5, dtype=torch.float32)
    summed = x.clone()
    dist.all_reduce(summed)
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, x)
    return {"x": x, "sum": summed, "gathered": torch.stack(parts), "view": summed.t()[1:], "rank": dist.get_rank()}


def rank_stuck_in_native_code(hold_gil: bool, megabytes: int) -> int:
    """Rank 1 takes ``megabytes`` of memory, then sleeps in C (with or without the interpreter lock)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    mark_phase("backward", 2)
    if dist.get_rank() == 1:
        hoard = torch.ones(megabytes << 18)  # float32: megabytes MiB, touched
        libc = ctypes.PyDLL(None) if hold_gil else ctypes.CDLL(None)
        libc.sleep(600)
        return int(hoard.numel())
    dist.all_reduce(t)
    return 0


def rank_allocates(gib: int) -> int:
    """Rank 1 asks for ``gib`` GiB at once (a runaway allocation)."""
    if dist.get_rank() == 1:
        return int(torch.empty(gib << 30, dtype=torch.uint8).numel())
    return 0


def rank_raises() -> None:
    if dist.get_rank() == 1:
        raise ValueError("rank 1 refuses")
    dist.barrier()


def rank_returns_a_lambda() -> Any:
    return lambda: dist.get_rank()


def rank_sleeps(seconds: float, started: str | None = None) -> int:
    """Sleep ``seconds``; with ``started``, first create the file ``STARTED.RANK``: the event a test
    waits for to know that the world is running (a sleep of the test's own would only guess)."""
    if started is not None:
        Path(f"{started}.{dist.get_rank()}").touch()
    time.sleep(seconds)
    return dist.get_rank()


def rank_trivial() -> int:
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return int(t.item())


# --- helpers -------------------------------------------------------------------------------------


def _alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_gone(pids: list[int], bound: float) -> list[int]:
    """Poll until none of ``pids`` lives, at most ``bound`` seconds; return the survivors."""
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat", encoding="ascii") as fh:
                    ppid = int(fh.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            if ppid == pid:
                out.append(int(entry))
    return out


def _wait_started(parent: subprocess.Popen[str], started: Path, bound: float = 300) -> None:
    """Wait until rank 0 of the parent's world created its ``started`` file (see :func:`rank_sleeps`;
    on inproc one rank runs at a time, so rank 0 sleeping is the world running): the event, not a
    guessed delay, so a loaded machine only makes it later."""
    deadline = time.monotonic() + bound
    while not Path(f"{started}.0").exists():
        if parent.poll() is not None:
            raise AssertionError(f"the parent exited with {parent.returncode} before its world started")
        if time.monotonic() > deadline:
            raise AssertionError(f"the parent's world did not start within {bound:.0f} s")
        time.sleep(0.05)


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        for child in _children(todo.pop()):
            found.append(child)
            todo.append(child)
    return found


def _ranks(pids: list[int]) -> list[int]:
    """The processes among ``pids`` that are gloo ranks: forked from tpsim's forker (named
    ``tpsim-gloo-rN``) or, where no forker serves, spawned by multiprocessing."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/comm", "rb") as fh:
                forked = fh.read().startswith(b"tpsim-gloo-r")
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if forked or b"spawn_main" in fh.read():
                    out.append(pid)
        except OSError:
            pass
    return out


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


@pytest.fixture(autouse=True, scope="module")
def _no_worker_left() -> Any:
    """Tests elsewhere in the session count this process's children: leave no worker behind."""
    yield
    isolate.shutdown()


@pytest.fixture
def worker_reset() -> Any:
    """A test that changes the worker's environment (its memory limit) gets fresh workers around it."""
    isolate.shutdown()
    yield
    isolate.shutdown()


# --- isolated inproc: same results, named deaths -------------------------------------------------


def test_isolated_world_returns_what_the_in_process_world_returns() -> None:
    plain = tpsim.run_world(rank_values, 3, args=(7,))
    isolated = tpsim.run_world(rank_values, 3, args=(7,), isolate=True)
    assert isolated.trace == plain.trace
    assert len(plain.values) == len(isolated.values) == 3
    for a, b in zip(plain.values, isolated.values, strict=True):
        assert a["rank"] == b["rank"]
        for key in ("x", "sum", "gathered", "view"):
            assert torch.equal(a[key], b[key]), key  # bit for bit
            assert a[key].stride() == b[key].stride(), key
    assert isolate.live_worker_pid() not in (None, os.getpid())


DEATHS = [
    # how, error class, exit status, signal
    ("os._exit(0)", tpsim.RankExited, 0, None),
    ("os._exit(1)", tpsim.RankExited, 1, None),
    ("sys.exit(3)", tpsim.RankExited, 3, None),
    ("segfault", tpsim.RankCrashed, None, signal.SIGSEGV),
    ("abort", tpsim.RankCrashed, None, signal.SIGABRT),
    ("SIGKILL", tpsim.RankCrashed, None, signal.SIGKILL),
]


@pytest.mark.parametrize(("how", "cls", "exitcode", "signum"), DEATHS, ids=[d[0] for d in DEATHS])
def test_a_rank_that_dies_is_named_and_the_checker_goes_on(how: str, cls: type, exitcode: int | None,
                                                           signum: int | None) -> None:
    tpsim.run(rank_trivial, 2, isolate=True)
    before = isolate.live_worker_pid()
    with pytest.raises(cls) as info:
        tpsim.run(rank_dies, 3, args=(how, 1, "backward", 1), isolate=True, timeout=10)
    err = info.value
    assert (err.rank, err.phase, err.step) == (1, "backward", 1)
    assert err.exitcode == exitcode and err.signal == signum
    assert str(err).startswith("rank 1 ") and "during backward (step 1)" in str(err)
    if signum is not None:
        assert signal.Signals(signum).name in err.cause
    assert tpsim.run(rank_trivial, 4, isolate=True) == [6, 6, 6, 6]  # the checker carries on
    if how.startswith("sys.exit"):  # raised and caught in the rank: the worker itself lives on
        assert isolate.live_worker_pid() == before
    else:  # the worker died with the rank; the next world ran in a fresh one
        assert before is not None and _wait_gone([before], 60) == []
        assert isolate.live_worker_pid() not in (None, before)


def test_sys_exit_in_process_is_a_rank_exit_too() -> None:
    with pytest.raises(tpsim.RankExited) as info:
        tpsim.run(rank_dies, 2, args=("sys.exit(3)",), timeout=10)
    assert (info.value.rank, info.value.exitcode, info.value.cause) == (1, 3, "sys.exit(3)")
    assert info.value.phase is None  # phases are recorded where there is a worker to outlive the rank


def test_a_rank_exception_reads_the_same_isolated_or_not() -> None:
    errors = []
    for isolated in (False, True):
        with pytest.raises(tpsim.RankError) as info:
            tpsim.run(rank_raises, 3, isolate=isolated, timeout=10)
        errors.append(info.value)
    plain, iso = errors
    assert type(iso) is type(plain) and iso.rank == plain.rank == 1
    assert isinstance(iso.errors[1], ValueError) and str(iso.errors[1]) == "rank 1 refuses"
    assert iso.summary.splitlines()[0] == plain.summary.splitlines()[0]


def test_a_runaway_allocation_fails_inside_the_worker(worker_reset: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(limits.WORKER_MEMORY_ENV, "2G")  # beyond what the worker starts with; rank 1 asks for 4
    with pytest.raises(tpsim.RankCrashed) as info:
        tpsim.run(rank_allocates, 2, args=(4,), isolate=True, timeout=30)
    err = info.value
    assert err.rank == 1 and err.cause.startswith("out of memory")
    assert "may map 2.0 GiB beyond" in str(err) and limits.WORKER_MEMORY_ENV in str(err)
    assert tpsim.run(rank_trivial, 2, isolate=True) == [1, 1]  # the same worker carries on


@pytest.mark.slow
@pytest.mark.parametrize("hold_gil", [True, False], ids=["holding-the-GIL", "releasing-the-GIL"])
def test_a_rank_stuck_in_native_code_is_abandoned_with_its_worker(hold_gil: bool) -> None:
    tpsim.run(rank_trivial, 2, isolate=True)
    stuck = isolate.live_worker_pid()
    rss = _rss_mb()
    timeout = 3.0  # short, yet long enough that a busy machine does not make a healthy rank look stuck
    started = time.monotonic()
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(rank_stuck_in_native_code, 3, args=(hold_gil, 300), isolate=True, timeout=timeout)
    took = time.monotonic() - started
    # Abandoned, not waited out: the rank sleeps 600 s in C. (A bound near stall_bound would measure
    # the machine's load, not the abandonment: 26 s were seen beside a busy test suite.)
    assert took < 300, took
    assert 1 in info.value.faulty_ranks and "during backward (step 2)" in str(info.value)
    assert "replaced" in str(info.value)
    # No pile-up: the stuck process and its 300 MB are gone, not parked in the checker.
    assert stuck is not None and _wait_gone([stuck], 60) == []
    assert _rss_mb() - rss < 100
    assert tpsim.run(rank_trivial, 3, isolate=True) == [3, 3, 3]


@pytest.mark.slow
def test_a_rank_that_outlives_the_world_timeout_in_python_is_reported_not_waited_for() -> None:
    with pytest.raises(tpsim.CollectiveError):
        tpsim.run(rank_sleeps, 2, args=(30.0,), isolate=True, timeout=1.0)
    assert tpsim.run(rank_trivial, 2, isolate=True) == [1, 1]


def test_what_cannot_travel_to_the_worker_is_refused_clearly() -> None:
    def local() -> int:
        return 1

    with pytest.raises(tpsim.InvalidArgument, match=r"isolate=True .* must be picklable .* top-level function"):
        tpsim.run(local, 2, isolate=True)
    with pytest.raises(tpsim.InvalidArgument, match=r"isolate=True"):
        tpsim.run(rank_sleeps, 2, args=(lambda: 0,), isolate=True)
    with pytest.raises(tpsim.InvalidArgument, match=r"isolate='yes' must be True or False"):
        tpsim.run(rank_trivial, 2, isolate="yes")  # type: ignore[arg-type]


def test_a_value_that_cannot_travel_back_names_its_rank() -> None:
    with pytest.raises(tpsim.RankError, match=r"rank 0 returned a value of type function that cannot be pickled"):
        tpsim.run(rank_returns_a_lambda, 2, isolate=True)
    assert tpsim.run(rank_trivial, 2, isolate=True) == [1, 1]


def test_rank_output_goes_where_the_callers_stdout_goes(capsys: pytest.CaptureFixture[str]) -> None:
    capsys.readouterr()
    with pytest.raises(tpsim.RankExited):
        tpsim.run(_print_then_exit, 2, isolate=True)
    assert capsys.readouterr().out == "rank 0 speaks\nrank 1 speaks\n"


def _print_then_exit() -> None:
    print(f"rank {dist.get_rank()} speaks", flush=True)
    if dist.get_rank() == 1:
        os._exit(0)
    dist.barrier()


def test_mark_phase_checks_its_arguments_and_is_free_outside_a_worker() -> None:
    mark_phase("forward", 3)  # no worker here: nothing to record, no error
    with pytest.raises(tpsim.InvalidArgument, match=r"phase='fwd' is not one of build, forward, backward, step"):
        mark_phase("fwd")
    assert PHASES == ("build", "forward", "backward", "step")


def test_tensors_travel_to_and_from_the_worker_exactly() -> None:
    import pickle

    from tpsim.comm import _wire
    from tpsim.comm.trace import CollectiveCall

    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    sent = {
        "contiguous": base, "transposed": base.t(), "view": base[1:3, 2:], "expanded": torch.ones(3, 1).expand(3, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float64), "empty": torch.zeros(0, 3), "bool": torch.tensor([True, False]),
        "bfloat16": torch.randn(5).to(torch.bfloat16), "float16": torch.randn(2, 2).half(), "int": torch.arange(3),
        "leaf": torch.ones(2, requires_grad=True), "nan": torch.tensor([float("nan"), 1.0]),
        "call": CollectiveCall(rank=1, op="all_reduce", group="world", group_ranks=(0, 1), call_index=3,
                               shapes=((2,),), dtypes=("float32",), reduce_op="sum"),
    }
    back = pickle.loads(_wire.dumps(sent))
    assert back["call"] == sent["call"]
    for key, t in sent.items():
        if key == "call":
            continue
        got = back[key]
        assert (type(got), got.dtype, got.shape, got.stride(), got.requires_grad) == (
            torch.Tensor, t.dtype, t.shape, t.stride(), t.requires_grad), key
        assert torch.equal(torch.nan_to_num(got.detach().float()), torch.nan_to_num(t.detach().float())), key
    back["contiguous"].add_(1)  # writable, and not shared with the sender's tensor
    assert torch.equal(sent["contiguous"], torch.arange(24, dtype=torch.float32).reshape(4, 6))
    # What the fast path does not cover goes through torch's own pickling, with its own rules.
    assert type(pickle.loads(_wire.dumps(torch.nn.Parameter(torch.ones(2))))) is torch.nn.Parameter
    nonleaf = pickle.loads(_wire.dumps(torch.ones(2, requires_grad=True) * 2))
    assert nonleaf.requires_grad and nonleaf.is_leaf and nonleaf.tolist() == [2.0, 2.0]


# --- the property engine: deaths are failures with a diagnosis -----------------------------------

HOSTILE_LAYERS = '''
"""Column-parallel layers (master-weight convention) whose rank 1 misbehaves."""
import ctypes, os
import torch
import torch.distributed as dist
from torch import nn


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, crash_in_backward):
        ctx.crash = crash_in_backward
        out = [torch.empty_like(y) for _ in range(dist.get_world_size())]
        dist.all_gather(out, y.contiguous())
        return torch.cat(out, -1)

    @staticmethod
    def backward(ctx, g):
        if ctx.crash and dist.get_rank() == 1:
            ctypes.string_at(0)
        return g.chunk(dist.get_world_size(), -1)[dist.get_rank()].contiguous(), None


class _Column(nn.Module):
    exit_in_forward = False
    crash_in_backward = False
    sleep_in_forward = False

    def __init__(self, in_features, out_features, bias, master_weight):
        super().__init__()
        ws, r = dist.get_world_size(), dist.get_rank()
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={ws}")
        self.weight = nn.Parameter(master_weight.chunk(ws, 0)[r].clone())
        self.bias = nn.Parameter(torch.zeros(out_features // ws, dtype=master_weight.dtype)) if bias else None

    def forward(self, x):
        if self.exit_in_forward and dist.get_rank() == 1:
            os._exit(0)
        if self.sleep_in_forward and dist.get_rank() == 1:
            ctypes.CDLL(None).sleep(600)  # native code, past any timeout
        y = x @ self.weight.t()
        if self.bias is not None:
            y = y + self.bias
        return _Gather.apply(y, self.crash_in_backward)


class ExitColumnParallelLinear(_Column):
    exit_in_forward = True


class CrashColumnParallelLinear(_Column):
    crash_in_backward = True


class StuckColumnParallelLinear(_Column):
    sleep_in_forward = True
'''


@pytest.fixture
def hostile(tmp_path: Path) -> Callable[[str], Any]:
    path = tmp_path / "hostile_layers.py"
    path.write_text(HOSTILE_LAYERS)

    def variant(name: str) -> Any:
        from tpsim.target import resolve_target

        return resolve_target(f"{path}:{name}", input_grad="partial", output="gathered")[0]

    return variant


@pytest.mark.parametrize(("name", "diagnosis", "prop", "phase"), [
    ("ExitColumnParallelLinear", "rank-exited", "forward-equivalence", "forward"),
    ("CrashColumnParallelLinear", "rank-crashed", "input-grad-equivalence", "backward"),
])
def test_the_property_engine_names_a_dead_rank(hostile: Callable[[str], Any], name: str, diagnosis: str, prop: str,
                                               phase: str) -> None:
    from tpsim.props import check_case
    from tpsim.props.linear.case import Case

    case = Case(world_size=2, in_features=2, out_features=4, batch_shape=(3,), dtype="float32", bias=True, seed=1)
    failures = check_case(hostile(name), case, isolate=True)
    assert [(f.property, f.diagnosis, f.rank) for f in failures] == [(prop, diagnosis, 1)]
    assert failures[0].details["phase"] == phase and failures[0].details["step"] == 0
    # The correct sibling passes on the same case, in the same (replaced) worker.
    assert check_case(hostile("_Column"), case, isolate=True) == []


def test_an_isolated_search_reports_and_shrinks_a_dead_rank(hostile: Callable[[str], Any]) -> None:
    from tpsim.props.search import search

    report = search(hostile("ExitColumnParallelLinear"), world_sizes=(1, 2, 3), dtypes=("float32",), max_examples=8,
                    seed=0, isolate=True, properties=("forward-equivalence",), subgroups=False)
    assert not report.passed
    found = [f for f in report.failures if f.diagnosis == "rank-exited"]
    assert found and found[0].rank == 1 and found[0].case.world_size == 2  # the smallest world with a rank 1


def test_an_isolated_search_needs_a_target(hostile: Callable[[str], Any]) -> None:
    from tpsim.props.search import search

    anonymous = dataclasses.replace(hostile("_Column"), target=None)
    with pytest.raises(tpsim.InvalidArgument, match=r"isolate=True: variant '_Column' has no target string"):
        search(anonymous, isolate=True, max_examples=1)


def test_tpsim_check_isolates_by_default_and_never_passes_a_dead_rank(hostile: Callable[[str], Any], tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str],
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from tpsim.cli import main

    monkeypatch.chdir(tmp_path)  # replay imports target files from the current directory
    target = "hostile_layers.py:ExitColumnParallelLinear"
    code = main(["check", target, "--input-grad", "partial", "--output", "gathered", "--world-sizes", "2",
                 "--dtypes", "float32", "--max-examples", "3", "--seed", "0", "--report", "json",
                 "--cases-dir", str(tmp_path / "cases")])
    out = capsys.readouterr().out
    assert code == 1, out
    report = json.loads(out)
    diagnoses = {f["diagnosis"] for v in report["variants"] for f in v["failures"]} if "variants" in report else {
        f["diagnosis"] for f in report["failures"]}
    assert "rank-exited" in diagnoses
    case_files = sorted((tmp_path / "cases").glob("*.json"))
    assert case_files
    assert main(["replay", str(case_files[0])]) == 1
    assert "rank-exited" in capsys.readouterr().out


@pytest.mark.slow
def test_tpsim_check_ends_cleanly_when_a_rank_sleeps_in_native_code(hostile: Callable[[str], Any], tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from tpsim.cli import main

    monkeypatch.chdir(tmp_path)
    others = set(_children(os.getpid())) - {isolate.live_worker_pid()}  # e.g. gloo pools of other tests
    code = main(["check", "hostile_layers.py:StuckColumnParallelLinear", "--input-grad", "partial", "--output",
                 "gathered", "--world-sizes", "2", "--dtypes", "float32", "--max-examples", "1", "--seed", "0",
                 "--timeout", "3", "--cases-dir", str(tmp_path / "cases")])
    out = capsys.readouterr().out
    # (Which rank the timeout names depends on who waited first; on a busy machine, rank 0's start-up.)
    assert code == 1 and "FAILED forward-equivalence" in out and "has been running for over 3 s" in out, out
    # Each attempt to shrink it hangs again: shrinking stops once the hung runs took 4 timeouts.
    assert "shrinking stopped after" in out and "the 3 s timeout" in out, out
    # Only the current (fresh) worker is left: each stuck one went with its rank.
    assert set(_children(os.getpid())) - others <= isolate.helper_pids()  # the worker (and a fork server)


def test_tpsim_check_no_isolate_runs_in_process(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    from tpsim.cli import main

    assert main(["check", "--help"]) == 0
    assert "--no-isolate" in capsys.readouterr().out
    isolate.shutdown()
    code = main(["check", "tpsim.layers:ColumnParallelLinear", "--no-isolate", "--world-sizes", "2",
                 "--dtypes", "float32", "--max-examples", "2", "--seed", "0", "--cases-dir", str(tmp_path)])
    assert code == 0
    assert isolate.live_worker_pid() is None  # no worker was started


# --- bounded worlds --------------------------------------------------------------------------------


def test_world_size_limits_name_the_limit_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(limits.MAX_WORLD_SIZE_ENV, raising=False)
    gloo, why = limits.max_world_size("gloo")
    assert gloo == limits.RANKS_PER_CPU * limits.usable_cpus() and "per CPU" in why
    with pytest.raises(tpsim.InvalidArgument) as info:
        limits.check_world_size(gloo + 1, "gloo")
    text = str(info.value)
    assert f"world_size={gloo + 1}" in text and f"limit of {gloo} ranks" in text
    assert f"{limits.MAX_WORLD_SIZE_ENV}={gloo + 1}" in text
    inproc, _ = limits.max_world_size("inproc")
    assert limits.INPROC_FLOOR <= inproc <= limits.INPROC_CAP
    limits.check_world_size(inproc, "inproc")
    monkeypatch.setenv(limits.MAX_WORLD_SIZE_ENV, "2000")
    limits.check_world_size(1000, "gloo")  # the override lifts the limit
    monkeypatch.setenv(limits.MAX_WORLD_SIZE_ENV, "lots")
    with pytest.raises(tpsim.InvalidArgument, match=r"TPSIM_MAX_WORLD_SIZE='lots' must be a whole number"):
        limits.check_world_size(2, "gloo")


def test_worker_memory_limit_reads_its_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(limits.WORKER_MEMORY_ENV, "512M")
    assert limits.worker_memory_limit() == 512 << 20
    monkeypatch.setenv(limits.WORKER_MEMORY_ENV, "unlimited")
    assert limits.worker_memory_limit() is None
    monkeypatch.setenv(limits.WORKER_MEMORY_ENV, "a lot")
    with pytest.raises(tpsim.InvalidArgument, match=r"TPSIM_WORKER_MEMORY='a lot'"):
        limits.worker_memory_limit()
    monkeypatch.delenv(limits.WORKER_MEMORY_ENV)
    assert (limits.worker_memory_limit() or 0) >= 8 << 30


def test_a_world_of_1000_gloo_ranks_is_refused_before_anything_starts(monkeypatch: pytest.MonkeyPatch,
                                                                       tmp_path: Path) -> None:
    from tpsim.cli import main
    from tpsim.comm import procs
    from tpsim.props.search import search

    monkeypatch.delenv(limits.MAX_WORLD_SIZE_ENV, raising=False)
    children = set(_children(os.getpid()))
    started = time.monotonic()
    with pytest.raises(tpsim.InvalidArgument, match=r"world_size=1000 is above the gloo limit"):
        tpsim.run(rank_trivial, 1000, backend="gloo")
    with pytest.raises(tpsim.InvalidArgument, match=r"world_size=1000 is above the gloo limit"):
        search("tpsim.layers:ColumnParallelLinear", backend="gloo", world_sizes=(2, 1000), max_examples=1)
    assert main(["check", "tpsim.layers:ColumnParallelLinear", "--backend", "gloo", "--world-sizes", "1000",
                 "--cases-dir", str(tmp_path)]) == 2
    with pytest.raises(tpsim.InvalidArgument, match=r"world_size=5000 is above the inproc limit"):
        tpsim.run(rank_trivial, 5000)
    assert time.monotonic() - started < 10
    assert ("gloo", 1000) not in procs.live_worker_pids()
    assert set(_children(os.getpid())) <= children  # not one process started


# --- nothing outlives the checker ----------------------------------------------------------------

_ISOLATED_PARENT = """
import sys, tpsim
from tpsim.comm import isolate
sys.path.insert(0, {tests!r})
from test_isolation import rank_sleeps, rank_trivial

if __name__ == "__main__":
    tpsim.run(rank_trivial, 2, isolate=True)
    print(isolate.live_worker_pid(), flush=True)
    tpsim.run(rank_sleeps, 2, args=(300.0, {started!r}), isolate=True, timeout=600)
"""

_INTERRUPTED_PARENT = """
import sys, tpsim
from tpsim.comm import isolate
sys.path.insert(0, {tests!r})
from test_isolation import rank_sleeps, rank_trivial

if __name__ == "__main__":
    tpsim.run(rank_trivial, 2, isolate=True)
    print(isolate.live_worker_pid(), flush=True)
    try:
        tpsim.run(rank_sleeps, 2, args=(300.0, {started!r}), isolate=True, timeout=600)
    except KeyboardInterrupt:
        print("interrupted", isolate.live_worker_pid(), flush=True)
        sys.exit(130)
"""

_GLOO_PARENT = """
import sys, tpsim
sys.path.insert(0, {tests!r})
from test_isolation import rank_sleeps

if __name__ == "__main__":
    print("starting", flush=True)
    tpsim.run(rank_sleeps, 4, args=(300.0,), backend="gloo", timeout=600)
"""


def _start_parent(tmp_path: Path, source: str) -> subprocess.Popen[str]:
    script = tmp_path / "parent.py"
    script.write_text(textwrap.dedent(source.format(tests=str(ROOT / "tests"), started=str(tmp_path / "started"))))
    return subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path)


def _readline(parent: subprocess.Popen[str], bound: float = 120) -> str:
    """The parent's next line of output, waiting at most ``bound`` seconds (a test never hangs)."""
    import select

    assert parent.stdout is not None
    ready, _, _ = select.select([parent.stdout], [], [], bound)
    if not ready:
        raise AssertionError(f"the parent printed nothing within {bound:.0f} s")
    return parent.stdout.readline()


def _kill(parent: subprocess.Popen[str]) -> None:
    """SIGKILL: the parent runs no cleanup at all."""
    parent.kill()
    parent.wait(30)
    if parent.stdout is not None:
        parent.stdout.close()


def test_an_isolated_worker_dies_with_a_checker_killed_mid_run(tmp_path: Path) -> None:
    parent = _start_parent(tmp_path, _ISOLATED_PARENT)
    try:
        assert parent.stdout is not None
        worker = int(_readline(parent, 300))
        _wait_started(parent, tmp_path / "started")  # the sleeping world is running in the worker now
        family = _descendants(parent.pid)
        assert worker in family
    finally:
        _kill(parent)
    assert _wait_gone(family, 60) == []


@pytest.mark.slow
def test_ctrl_c_mid_run_reaches_the_caller_and_ends_the_worker(tmp_path: Path) -> None:
    parent = _start_parent(tmp_path, _INTERRUPTED_PARENT)
    try:
        assert parent.stdout is not None
        worker = int(_readline(parent, 300))
        _wait_started(parent, tmp_path / "started")  # Ctrl-C mid-run: the world is running in the worker
        parent.send_signal(signal.SIGINT)
        assert _readline(parent).split() == ["interrupted", "None"]
        assert parent.wait(120) == 130
    finally:
        _kill(parent)
    assert _wait_gone([worker], 60) == []


@pytest.mark.gloo
def test_gloo_workers_die_with_a_checker_killed_while_they_start(tmp_path: Path) -> None:
    parent = _start_parent(tmp_path, _GLOO_PARENT)
    try:
        assert parent.stdout is not None
        assert _readline(parent, 300).strip() == "starting"
        deadline = time.monotonic() + 300  # a bound, not a delay: the loop ends when the ranks exist
        family: list[int] = []
        # the four ranks are being started (forked from the forker: at once; spawned: importing torch)
        while time.monotonic() < deadline and len(_ranks(family)) < 4:
            time.sleep(0.05)
            family = _descendants(parent.pid)
        assert len(_ranks(family)) == 4
        family = _descendants(parent.pid)  # with multiprocessing's helpers, just before the kill
    finally:
        _kill(parent)
    # Each worker may finish importing torch first (seconds on a loaded machine), then sees its parent
    # gone at once; none is left running.
    assert _wait_gone(family, 120) == []


# --- gloo: the same deaths get the same names ----------------------------------------------------


@pytest.mark.gloo
@pytest.mark.parametrize(("how", "cls"), [("os._exit(0)", tpsim.RankExited), ("segfault", tpsim.RankCrashed),
                                          ("sys.exit(3)", tpsim.RankExited)])
def test_a_gloo_rank_that_dies_is_named_with_its_phase(how: str, cls: type) -> None:
    with pytest.raises(cls) as info:
        tpsim.run(rank_dies, 2, args=(how, 1, "step", 0), backend="gloo", timeout=20)
    assert (info.value.rank, info.value.phase, info.value.step) == (1, "step", 0)
    assert str(info.value).startswith("rank 1 ") and "during step (step 0)" in str(info.value)


def test_worker_output_is_split_by_the_rank_that_wrote_it() -> None:
    # Python-level writes arrive framed with their rank; native writes and a frame cut off by a kill
    # are the process's own.
    from tpsim.comm.isolate import split_labelled

    text = "\x1erank 1\x1fhello\n\x1dnative\n\x1erank 0\x1fa\x1d\x1erank 0\x1fb\x1d\x1erank 2\x1fcut o"
    assert split_labelled(text) == [
        ("rank 1", "hello\n"), ("process", "native\n"), ("rank 0", "a"), ("rank 0", "b"), ("process", "cut o"),
    ]
