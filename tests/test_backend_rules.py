"""One set of rules on every backend: the same SPMD program gives the same trace and the same words.

Each program below runs on ``inproc`` and on ``gloo``; the test asserts identical values, identical
traces (every field of every :class:`tpsim.CollectiveCall` of every rank) and, for the failing
ones, an identical error: type, rank, collective, call index, group, faulty ranks, the summary
text and every rank's line. Only what is inherently backend-specific is normalised, each with
its reason next to it (see :func:`_normalised`).

The rules themselves (call numbering, signatures, message texts, precedence, blame) live in
:mod:`tpsim.comm.ops`; inproc-only checks of them are at the end.
"""

from __future__ import annotations

import pickle
import re

import pytest
import torch
import torch.distributed as dist
from helpers import steps_loop

import tpsim
from tpsim.comm import ops
from tpsim.faults import Corrupt, Crash, Delay, Drop, Mismatch

WS = 3
TIMEOUT = 3.0
_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


# -- the programs (module-level: gloo workers import them by name) -----------------------------------

def every_collective() -> list[torch.Tensor]:
    r, ws = dist.get_rank(), dist.get_world_size()
    x = torch.arange(6, dtype=torch.float64).reshape(2, 3) + 10 * r + 1
    out = []
    lst = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(lst, x)
    out += lst
    flat = torch.empty(2 * ws, 3, dtype=x.dtype)
    dist.all_gather_into_tensor(flat, x)
    out.append(flat)
    rs = torch.empty_like(x)
    dist.reduce_scatter(rs, [x * (k + 1) for k in range(ws)], op=dist.ReduceOp.MAX)
    out.append(rs)
    b = x.clone()
    dist.broadcast(b, src=ws - 1)
    out.append(b)
    sc = torch.empty_like(x)
    dist.scatter(sc, [x * (k + 1) for k in range(ws)] if r == 0 else None, src=0)
    out.append(sc)
    ga = [torch.empty_like(x) for _ in range(ws)] if r == 1 else None
    dist.gather(x, ga, dst=1)
    out += ga or []
    a2a = [torch.empty_like(x) for _ in range(ws)]
    dist.all_to_all(a2a, [x + k for k in range(ws)])
    out += a2a
    red = x.clone()
    dist.reduce(red, dst=0, op=dist.ReduceOp.PRODUCT)
    if r == 0:  # a non-root member's buffer is unspecified after reduce (gloo uses it as scratch)
        out.append(red)
    dist.barrier()
    return out


def p2p_then_collectives() -> list[float]:
    """A ring of sends, then a message only rank 0 sends: call indices count point-to-point calls."""
    r, ws = dist.get_rank(), dist.get_world_size()
    got = torch.empty(2)
    if r % 2 == 0:
        dist.send(torch.full((2,), float(r)), (r + 1) % ws)
        dist.recv(got, (r - 1) % ws)
    else:
        dist.recv(got, (r - 1) % ws)
        dist.send(torch.full((2,), float(r)), (r + 1) % ws)
    if r == 0:
        dist.send(torch.ones(1), 1)
    elif r == 1:
        dist.recv(torch.empty(1), 0)
    t = got.clone()
    dist.all_reduce(t)  # rank 0 and 1: their call #4 on the world; rank 2: its call #3
    return t.tolist()


def wrong_gather_list() -> None:
    """Rank 0 passes an output list one tensor short."""
    r, ws = dist.get_rank(), dist.get_world_size()
    x = torch.ones(2)
    dist.all_reduce(x)
    outs = [torch.empty(2) for _ in range(ws - 1 if r == 0 else ws)]
    dist.all_gather(outs, x)


def reduce_in_a_padded_view() -> None:
    """all_reduce on ``big[..., :n]``: gloo would reduce the storage's first elements; both refuse it."""
    r = dist.get_rank()
    big = torch.zeros(2, 4, dtype=torch.float64)
    big[:, :3] = r + 1
    dist.all_reduce(big)  # call #1: the whole buffer is fine
    dist.all_reduce(big[:, :3])


def reduce_every_other() -> None:
    x = torch.arange(8, dtype=torch.float64).reshape(2, 4) + dist.get_rank()
    dist.all_reduce(x[..., ::2])


def gathers_into_views() -> list[torch.Tensor]:
    """List outputs of any layout are fine on both real backends (they copy from a flat buffer)."""
    r, ws = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(2, 2 * ws, dtype=torch.float64)
    dist.all_gather(list(out.chunk(ws, dim=1)), torch.full((2, 2), float(r), dtype=torch.float64))
    return [out]


def named_groups() -> list[float]:
    """A group of every rank that is not the default one, a described group, an undescribed one."""
    r, ws = dist.get_rank(), dist.get_world_size()
    everyone = dist.new_group(list(range(ws)))
    tp = dist.new_group([0, 1], group_desc="tp")
    pair = dist.new_group([1, 2])
    t = torch.ones(1, dtype=torch.float64)
    dist.all_reduce(t)
    dist.all_reduce(t, group=everyone)
    if r in (0, 1):
        dist.all_reduce(t, group=tp)
    if r in (1, 2):
        dist.all_reduce(t, group=pair)
    return [t.item()]


def asks_the_backend() -> list[str]:
    cpu = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    dist.monitored_barrier()
    t = torch.ones(1)
    dist.all_reduce(t, group=cpu)
    return [dist.get_backend(), dist.get_backend(cpu), str(t.item())]


class _Holder:
    pass


def state_on_a_class() -> None:
    """Rank 0 keeps a tensor on a class; the other ranks read it there (each rank is a process on gloo)."""
    if dist.get_rank() == 0:
        _Holder.weight = torch.ones(2)
    dist.barrier()
    _Holder.weight.sum()


# -- running one program on both backends ------------------------------------------------------------

def _run(backend: str, fn, **kw):
    kw = {"timeout": TIMEOUT, **kw}
    try:
        return tpsim.run_world(fn, WS, backend=backend, **kw), None
    except tpsim.RankError as err:
        return None, err


def _normalised(text: str, backend: str) -> str:
    # The backend's own name is in every world error.
    text = text.replace(f"[backend {backend},", "[backend BACKEND,")
    # A process backend's dropped rank really exits, so its line adds the process's exit status;
    # an inproc rank is a thread that simply ends.
    text = re.sub(r": its process exited with [^\n]*", "", text)
    # A process backend may stop a rank blocked in a collective before that rank's own report of
    # the failure arrives (it never can arrive in some cases); on inproc every blocked rank is woken
    # with its error. Both mean: this rank was in that collective when the world failed.
    text = re.sub(r"was blocked in (.*) when tpsim stopped the world", r"failed in \1", text)
    return text


def _lines(err: tpsim.RankError, backend: str) -> list[str]:
    return _normalised(err.summary, backend).splitlines()


def _assert_same_error(a: tpsim.RankError, b: tpsim.RankError, *, compare_waiting_lines: bool = True) -> None:
    assert type(a) is type(b), (a, b)
    for field in ("rank", "collective", "call_index", "group", "faulty_ranks"):
        assert getattr(a, field, None) == getattr(b, field, None), (field, a, b)
    la, lb = _lines(a, "inproc"), _lines(b, "gloo")
    assert la[0] == lb[0]
    if compare_waiting_lines:
        assert la == lb
    assert [f for f, _ in a.faults_fired] == [f for f, _ in b.faults_fired]
    # A dead or stopped gloo rank never reports its records: the parent rebuilds the call a fault
    # acted on from the rank's status slot, which holds the op, call index and group only.
    assert [_where(c) for _, c in a.faults_fired] == [_where(c) for _, c in b.faults_fired]
    for r in sorted(set(a.errors) & set(b.errors)):
        ea, eb = a.errors[r], b.errors[r]
        if isinstance(ea, tpsim.CollectiveError) and isinstance(eb, tpsim.CollectiveError):
            assert (ea.collective, ea.call_index, ea.faulty_ranks) == (eb.collective, eb.call_index, eb.faulty_ranks)


def _where(call: tpsim.CollectiveCall) -> tuple:
    return (call.rank, call.op, call.call_index, call.group)


def _assert_same_trace_before(a: tpsim.Trace, b: tpsim.Trace, upto: int) -> None:
    """Every rank both traces hold issued the same calls before call ``upto``.

    (A gloo rank that died or was stopped never reports its trace; on inproc a straggler holds the
    only turn, so its peers may not have issued the call it stalls before.)
    """
    common = set(a.calls) & set(b.calls)
    assert common, "no rank reported on both backends"
    for r in common:
        assert [c for c in a.of(r) if c.call_index < upto] == [c for c in b.of(r) if c.call_index < upto], r


SUCCEEDING = {
    # name: (program, run options, reductions of float32 values behind each result)
    "every-collective": (every_collective, {}, 0),  # float64 integers: every order sums exactly
    "p2p-then-collectives": (p2p_then_collectives, {}, 0),
    "short-delay": (steps_loop, {"faults": [Delay(rank=2, at_call=2, seconds=0.2)]}, 3),
    "corrupt-unchecked": (steps_loop, {"faults": [Corrupt(rank=1, at_call=2, how="scale")]}, 3),
    "gather-into-views": (gathers_into_views, {}, 0),
    "named-groups": (named_groups, {"timeout": 30.0}, 0),  # making gloo groups: slow on a busy machine
}

FAILING = {
    "drop": (steps_loop, {"faults": [Drop(rank=1, at_call=3)]}, 3),
    "crash": (steps_loop, {"faults": [Crash(rank=1, at_call=4)]}, 4),
    "delay-past-timeout": (steps_loop, {"faults": [Delay(rank=1, at_call=3, seconds=TIMEOUT + 4)]}, 3),
    "corrupt-checksum": (steps_loop, {"faults": [Corrupt(rank=1, at_call=3, how="bitflip", bit=0)],
                                      "checksum": True}, 3),
    "mismatch-op": (steps_loop, {"faults": [Mismatch(rank=1, at_call=4, what="op")]}, 4),
    "mismatch-shape": (steps_loop, {"faults": [Mismatch(rank=1, at_call=3, what="shape")]}, 3),
    "mismatch-dtype": (steps_loop, {"faults": [Mismatch(rank=1, at_call=4, what="dtype")]}, 4),
    "wrong-buffer": (wrong_gather_list, {}, 2),
    "padded-view": (reduce_in_a_padded_view, {}, 2),
    "every-other-view": (reduce_every_other, {}, 1),
    "state-on-a-class": (state_on_a_class, {}, 1),
}


@pytest.mark.gloo
@pytest.mark.parametrize("name", list(SUCCEEDING))
def test_same_program_same_values_and_trace_on_inproc_and_gloo(name):
    fn, kw, reductions = SUCCEEDING[name]
    a, err_a = _run("inproc", fn, **kw)
    b, err_b = _run("gloo", fn, **kw)
    assert err_a is None and err_b is None, (err_a, err_b)
    # inproc sums in rank order; gloo's ring sums in its own order, which float32 rounds differently:
    # each all_reduce of WS terms may differ by WS rounding steps, and they compound over the steps.
    rtol = reductions * WS * torch.finfo(torch.float32).eps
    for va, vb in zip(a.values, b.values, strict=True):
        torch.testing.assert_close(va, vb, rtol=rtol, atol=0)
    assert a.trace.calls == b.trace.calls
    assert a.faults_fired == b.faults_fired


@pytest.mark.gloo
@pytest.mark.parametrize("name", list(FAILING))
def test_same_failure_same_words_on_inproc_and_gloo(name):
    fn, kw, at = FAILING[name]
    _run("gloo", steps_loop)  # a warm pool, so a slow start cannot pass for the fault's timeout
    _, err_a = _run("inproc", fn, **kw)
    _, err_b = _run("gloo", fn, **kw)
    assert err_a is not None and err_b is not None
    # On inproc a straggler holds the only turn: its peers wait for their turn after their last
    # call instead of inside the next one, so their own lines name different calls. The headline,
    # the fields and the straggler's own line are still identical.
    straggler = name.startswith("delay")
    _assert_same_error(err_a, err_b, compare_waiting_lines=not straggler)
    if straggler:
        assert _lines(err_a, "inproc")[2] == _lines(err_b, "gloo")[2]  # rank 1, the straggler
    _assert_same_trace_before(err_a.trace, err_b.trace, at)


# -- the rules, checked on inproc ------------------------------------------------------------------------

def test_call_numbering_counts_point_to_point_calls():
    result = tpsim.run_world(p2p_then_collectives, WS)
    assert [c.describe() for c in result.trace.of(0)] == [
        "send #1 on group world", "recv #2 on group world", "send #3 on group world", "all_reduce #4 on group world"]
    assert [c.describe() for c in result.trace.of(2)] == [
        "send #1 on group world", "recv #2 on group world", "all_reduce #3 on group world"]


def test_a_wrong_buffer_is_blamed_on_the_rank_that_passed_it():
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(wrong_gather_list, WS)
    err = info.value
    assert err.rank == 0 and not isinstance(err, tpsim.CollectiveError)
    assert err.summary.splitlines()[0] == (
        "rank 0 raised InvalidArgument: all_gather #2 on group world: on rank 0, the output list has 2 tensors, "
        "expected 3 (one per member of the group) [backend inproc, world_size=3]")
    assert isinstance(err.errors[0], tpsim.InvalidArgument)


def wrong_flat_output() -> None:
    out = torch.empty(5 if dist.get_rank() == 2 else 6, dtype=torch.float64 if dist.get_rank() == 1 else torch.float32)
    _GATHER(out, torch.ones(2))


def test_every_bad_member_is_named_with_what_is_wrong():
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(wrong_flat_output, WS)
    err = info.value
    assert err.rank == 1  # the lowest of the two ranks with a wrong buffer
    assert "on rank 1, the output tensor has dtype float64, expected the input's dtype float32" in err.summary
    assert "rank 2: raised InvalidArgument: all_gather_into_tensor #1 on group world: on rank 2, the output tensor " \
           "has 5 elements, expected 3 x 2 = 6 (group size x the input's elements)" in err.summary


def test_errors_have_declared_fields_and_survive_pickling():
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(steps_loop, WS, faults=[Drop(rank=1, at_call=3)])
    err = info.value
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is tpsim.CollectiveError
    for field in ("rank", "summary", "collective", "call_index", "group", "faulty_ranks", "world_intact",
                  "faults_fired", "remote_traceback"):
        assert getattr(back, field) == getattr(err, field), field
    assert back.trace.calls == err.trace.calls
    assert str(back) == str(err)
    assert set(back.errors) == set(err.errors)


def test_messages_never_print_an_unknown_call_index_as_none():
    assert ops.call_name("all_reduce", None, "world") == "all_reduce (call index unknown) on group world"
    end = ops.RankEnd(1, ops.STOPPED, None)
    assert "#None" not in end.line()


def test_a_rank_tpsim_stopped_is_never_the_one_an_error_is_about():
    # Rank 0 reported its own collective failure; rank 2 was only stopped while blocked: the error
    # is about rank 0, and rank 2 is not blamed.
    call = tpsim.CollectiveCall(0, "all_reduce", "world", (0, 1, 2), 2)
    failed = tpsim.CollectiveError("all_reduce #2 on group world failed on rank 0: timed out", rank=0,
                                   collective="all_reduce", call_index=2, group="world")
    ends = {
        0: ops.RankEnd(0, ops.COLLECTIVE, call, error=failed),
        1: ops.RankEnd(1, ops.STOPPED, tpsim.CollectiveCall(1, "all_reduce", "world", (0, 1, 2), 1)),
        2: ops.RankEnd(2, ops.STOPPED, tpsim.CollectiveCall(2, "all_reduce", "world", (0, 1, 2), 2), blocked=True),
    }
    err = ops.explain(ends, world_size=3, backend="gloo", fired=[], timeout=1.0, timed_out=True)
    assert err.rank == 0
    assert 2 not in getattr(err, "faulty_ranks", ())
    assert "#None" not in str(err)


@pytest.mark.gloo
def test_code_asking_the_backend_sees_the_same_on_inproc_and_gloo():
    a, err_a = _run("inproc", asks_the_backend, timeout=30.0)
    b, err_b = _run("gloo", asks_the_backend, timeout=30.0)
    assert err_a is None and err_b is None, (err_a, err_b)
    assert a.values == b.values == [["gloo", "gloo", "3.0"]] * WS


def test_groups_are_named_by_their_own_names_with_ranks_listed():
    trace = tpsim.run_world(named_groups, WS).trace
    assert [c.describe() for c in trace.of(1)] == [
        "all_reduce #1 on group world", "all_reduce #1 on group [0,1,2]", "all_reduce #1 on group tp [0,1]",
        "all_reduce #1 on group [1,2]"]
    assert [c.group for c in trace.of(1)] == ["world", "[0,1,2]", "tp", "[1,2]"]
