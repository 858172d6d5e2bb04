"""inproc is as strict as the stricter of gloo and NCCL, and the gloo path never makes a call right.

What a forgiving backend would pass and a real one fails: a ring of blocking sends (gloo and NCCL
complete a send only when its recv is posted), a collective on a view that is not dense (gloo
computes on the storage, NCCL refuses), state one rank keeps on a class for the others (each
rank is a process on gloo). Each is a layer of ``tests/wild/strict_backends.py`` that ``tpsim
check`` fails on inproc within seconds with a named finding, beside a correct twin that passes;
and the correct code real backends run (``torch.compile``, ``monitored_barrier``, code that asks
``dist.get_backend()``) passes. The same programs on gloo are in tests/test_backend_rules.py.
"""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.distributed as dist
from helpers import ROOT, run_cli

import tpsim
from tpsim.comm import modstate, ops
from tpsim.diagnosis import COLLECTIVE_ON_STRIDED_VIEW, EXCEPTION

LAYERS = "tests/wild/strict_backends.py"
ROW = ["--convention", "master-weight", "--kind", "row", "--output", "reduced"]
COLUMN = ["--convention", "master-weight", "--kind", "column"]
QUICK = ["--max-examples", "10", "--world-sizes", "1,2,3", "--seed", "0", "--dtypes", "float64,float32"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _check(capsys, tmp_path, target: str, *options: str) -> tuple[int, dict]:
    code, out, err = run_cli(capsys, "check", f"{LAYERS}:{target}", *options, *QUICK, "--report", "json",
                             "--cases-dir", str(tmp_path))
    return code, json.loads(out)


def _failures(report: dict) -> list[dict]:
    return report["failures"]


# --- 1. point to point ------------------------------------------------------------------------------

def blocking_ring() -> list[float]:
    r, ws = dist.get_rank(), dist.get_world_size()
    got = torch.empty(2)
    dist.send(torch.full((2,), float(r)), (r + 1) % ws)
    dist.recv(got, (r - 1) % ws)
    return got.tolist()


def posted_ring() -> list[float]:
    r, ws = dist.get_rank(), dist.get_world_size()
    got = torch.empty(2)
    works = [dist.isend(torch.full((2,), float(r)), (r + 1) % ws), dist.irecv(got, (r - 1) % ws)]
    for w in works:
        w.wait()
    return got.tolist()


def batched_ring() -> list[float]:
    r, ws = dist.get_rank(), dist.get_world_size()
    got = torch.empty(2)
    ops_ = [dist.P2POp(dist.isend, torch.full((2,), float(r)), (r + 1) % ws), dist.P2POp(dist.irecv, got, (r - 1) % ws)]
    for w in dist.batch_isend_irecv(ops_):
        w.wait()
    return got.tolist()


def late_receiver() -> float:
    """Rank 0's blocking send waits while rank 1 computes, then rank 1 receives: no deadlock."""
    if dist.get_rank() == 0:
        dist.send(torch.ones(3), 1)
        return 0.0
    x = torch.randn(64, 64)
    for _ in range(5):
        x = x @ x.T / 64
    got = torch.empty(3)
    dist.recv(got, 0)
    return got.sum().item()


def isend_waits_for_its_recv() -> list[bool]:
    """An isend's work is not complete until the peer posts its recv."""
    r = dist.get_rank()
    if r == 0:
        work = dist.isend(torch.ones(1), 1)
        before = work.is_completed()
        dist.barrier()  # rank 1 posts its recv after the barrier
        work.wait()
        return [before, work.is_completed()]
    dist.barrier()
    got = torch.empty(1)
    dist.recv(got, 0)
    return [bool(got.item() == 1.0)]


def test_a_ring_of_blocking_sends_is_a_deadlock_reported_at_once() -> None:
    started = time.monotonic()
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(blocking_ring, 3, timeout=60)
    assert time.monotonic() - started < 10  # known, not timed out (the timeout is 60 s)
    err = info.value
    head = err.summary.splitlines()[0]
    assert head.startswith(
        "send #1 to rank 1 on group world: deadlock: every rank of the cycle waits for the next one: rank 0 in "
        "send #1 to rank 1 on group world, rank 1 in send #1 to rank 2 on group world, rank 2 in send #1 to "
        "rank 0 on group world. A blocking send completes only once its recv is posted")
    assert (err.collective, err.call_index, err.group, err.faulty_ranks) == ("send", 1, "world", (0, 1, 2))


@pytest.mark.parametrize("program", [posted_ring, batched_ring])
def test_posted_sends_and_receives_complete(program) -> None:
    assert tpsim.run(program, 3) == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]


def test_a_blocking_send_waits_for_a_receiver_that_comes_later() -> None:
    assert tpsim.run(late_receiver, 2) == [0.0, 3.0]


def test_an_isend_is_complete_only_once_its_recv_is_posted() -> None:
    assert tpsim.run(isend_waits_for_its_recv, 2) == [[False, True], [True]]


def test_buffered_sends_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TPSIM_BUFFERED_SENDS", "1")
    assert tpsim.run(blocking_ring, 3) == [[2.0, 2.0], [0.0, 0.0], [1.0, 1.0]]
    monkeypatch.setenv("TPSIM_BUFFERED_SENDS", "0")
    with pytest.raises(tpsim.CollectiveError, match="deadlock"):
        tpsim.run(blocking_ring, 3)


def test_check_fails_the_blocking_ring_layer_and_passes_its_twin(capsys, tmp_path) -> None:
    started = time.monotonic()
    code, report = _check(capsys, tmp_path, "RingSendRow", *ROW)
    assert code == 1
    found = _failures(report)
    assert found and found[0]["diagnosis"] == EXCEPTION
    assert "deadlock: every rank of the cycle waits for the next one: rank 0 in send #1 to rank 1" in found[0]["message"]
    assert time.monotonic() - started < 120  # seconds of work; generous for a loaded machine
    code, report = _check(capsys, tmp_path, "RingIsendRow", *ROW)
    assert code == 0, _failures(report)


@pytest.mark.gloo
def test_a_ring_of_blocking_sends_fails_on_gloo_too() -> None:
    # gloo cannot tell a deadlock from a slow peer: it fails once the timeout passes, every rank in its send.
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(blocking_ring, 3, backend="gloo", timeout=3)
    lines = info.value.summary.splitlines()[1:]
    assert len(lines) == 3 and all(line.split(": ", 1)[1] in (
        "failed in send #1 on group world", "was blocked in send #1 on group world when tpsim stopped the world")
        for line in lines), lines


# --- 2. collectives on views ---------------------------------------------------------------------------

def reduce_view(kind: str) -> list[float]:
    r = dist.get_rank()
    base = torch.arange(6, dtype=torch.float64).reshape(2, 3) + r
    if kind == "padded":
        big = torch.zeros(2, 4, dtype=torch.float64)
        big[:, :3] = base
        view = big[:, :3]
    elif kind == "every-other":
        big = torch.zeros(2, 6, dtype=torch.float64)
        big[:, ::2] = base
        view = big[:, ::2]
    elif kind == "expanded":
        view = base[:1].expand(2, 3)
    elif kind == "transposed":
        view = torch.empty(3, 2, dtype=torch.float64).t()
        view.copy_(base)
    elif kind == "channels-last":
        view = base.reshape(1, 2, 3, 1).contiguous(memory_format=torch.channels_last)
    else:
        view = base.clone()
    dist.all_reduce(view)
    return view.flatten().tolist()


@pytest.mark.parametrize("kind, strides", [("padded", (4, 1)), ("every-other", (6, 2)), ("expanded", (0, 1)),
                                           ("transposed", (1, 2))])
def test_a_collective_on_a_view_a_backend_gets_wrong_names_the_rank_the_call_and_the_strides(kind, strides) -> None:
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(reduce_view, 2, args=(kind,))
    err = info.value
    own = err.errors[0]
    assert isinstance(own, tpsim.CollectiveOnStridedView)
    assert own.diagnosis == COLLECTIVE_ON_STRIDED_VIEW
    assert (own.rank, own.collective, own.call_index, own.group, own.strides) == (0, "all_reduce", 1, "world", strides)
    assert err.summary.startswith("rank 0 raised CollectiveOnStridedView: all_reduce #1 on group world: on rank 0, "
                                  "the tensor is a view that is ")
    assert f"strides {strides}" in err.summary
    words = {"padded": "not dense", "every-other": "not dense", "expanded": "overlapping",
             "transposed": "dense but not contiguous"}[kind]
    assert f"is a view that is {words}" in err.summary
    if kind == "transposed":  # gloo gets a dense tensor right; NCCL refuses it
        assert "NCCL refuses it" in err.summary and "gloo" not in err.summary.split("Pass a contiguous")[0]
    else:
        assert "gloo computes on the 6 consecutive elements of its storage" in err.summary


def test_layouts_every_backend_computes_right_pass() -> None:
    expected = [float(2 * v + 1) for v in range(6)]
    assert tpsim.run(reduce_view, 2, args=("contiguous",)) == [expected, expected]
    # NCCL accepts a tensor contiguous in its suggested memory format; gloo reduces it elementwise
    values = tpsim.run(reduce_view, 2, args=("channels-last",))
    assert values[0] == values[1] and sorted(values[0]) == sorted(expected)


def gather_into_columns() -> list[list[float]]:
    """all_gather into the column blocks of one buffer: both backends copy list outputs from a flat one."""
    r, ws = dist.get_rank(), dist.get_world_size()
    out = torch.zeros(2, 2 * ws)
    dist.all_gather(list(out.chunk(ws, dim=1)), torch.full((2, 2), float(r)))
    return out.tolist()


def test_list_outputs_both_backends_copy_may_be_views() -> None:
    assert tpsim.run(gather_into_columns, 2)[0] == [[0.0, 0.0, 1.0, 1.0]] * 2


def scatter_into_transposed() -> list[float]:
    r, ws = dist.get_rank(), dist.get_world_size()
    out = torch.empty(3, 2).t()
    dist.scatter(out, [torch.full((2, 3), float(k)) for k in range(ws)] if r == 0 else None, src=0)
    return out.flatten().tolist()


def test_a_dense_transposed_output_gloo_writes_in_storage_order_is_refused() -> None:
    with pytest.raises(tpsim.RankError, match="scatter #1 on group world: on rank 0, the output is a view that "
                       "is dense but not contiguous .*gloo reads and writes its storage as if it were contiguous"):
        tpsim.run(scatter_into_transposed, 2)


@pytest.mark.parametrize("target", ["PaddedViewRow", "EveryOtherRow"])
def test_check_fails_the_strided_view_layers_with_their_finding(capsys, tmp_path, target) -> None:
    code, report = _check(capsys, tmp_path, target, *ROW)
    assert code == 1
    found = _failures(report)
    assert [f["diagnosis"] for f in found] == [COLLECTIVE_ON_STRIDED_VIEW]
    assert "all_reduce #1 on group world: on rank 0, the tensor is a view that is not dense" in found[0]["message"]


@pytest.mark.gloo
@pytest.mark.parametrize("target, options, words", [
    ("PaddedViewRow", ROW, "collective-on-strided-view"),
    ("ClassAttrColumn", COLUMN, "AttributeError: type object 'ClassAttrColumn' has no attribute 'shards'"),
])
def test_the_same_layers_fail_on_gloo(capsys, tmp_path, target, options, words) -> None:
    code, out, err = run_cli(capsys, "check", f"{LAYERS}:{target}", *options, "--backend", "gloo", "--max-examples", "3",
                             "--world-sizes", "2", "--dtypes", "float64", "--seed", "0", "--cases-dir", str(tmp_path))
    assert code == 1, out + err
    assert words in out


def test_check_passes_the_contiguous_twin(capsys, tmp_path) -> None:
    code, report = _check(capsys, tmp_path, "PaddedContiguousRow", *ROW)
    assert code == 0, _failures(report)


def test_every_op_and_place_of_the_layout_table_is_judged() -> None:
    for op in ops.COLLECTIVE_OPS | ops.P2P_OPS:
        assert op == "barrier" or op in ops._LAYOUT_RULES, op
    for op, places in ops._LAYOUT_RULES.items():
        for place in places:
            if place is not None:
                assert {place.gloo_sparse, place.gloo_dense, place.nccl} <= {ops.OK, ops.STORAGE, ops.RAISES}, op


# --- 3. state shared across thread-ranks ---------------------------------------------------------------

class Registry:
    def __init__(self, w: torch.Tensor | None) -> None:
        if dist.get_rank() == 0:
            Registry.w = w  # rank 0 stores it on the class
        dist.barrier()
        self.w = Registry.w  # the other ranks read it instead of receiving it

    @classmethod
    def remember(cls, value: int) -> None:
        cls.last = value


class Counted:
    made = 0

    def __init__(self) -> None:
        type(self).made += 1


_SEEN: dict[str, int] = {}
_ORDER: list[int] = []


def note(key: str, value: int) -> None:
    _SEEN[key] = value
    _ORDER.append(value)


def calls() -> int:
    calls.count = getattr(calls, "count", 0) + 1
    return calls.count


def stores_on_the_class() -> list[float]:
    return Registry(torch.ones(2) if dist.get_rank() == 0 else None).w.tolist()


def counts_on_the_class() -> int:
    Counted()
    Counted()
    dist.barrier()
    return Counted.made


def fills_a_module_dict() -> int:
    if dist.get_rank() == 0:
        note("w", 7)
    dist.barrier()
    return _SEEN["w"]


def counts_on_a_function() -> int:
    calls()
    dist.barrier()
    return calls()


def remembers_on_cls() -> int:
    Registry.remember(dist.get_rank())
    dist.barrier()
    return Registry.last


def test_a_value_one_rank_stores_on_a_class_is_not_what_another_reads() -> None:
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(stores_on_the_class, 2)
    assert info.value.rank == 1
    assert "raised AttributeError: type object 'Registry' has no attribute 'w'" in info.value.summary
    assert not hasattr(Registry, "w")  # the world's writes do not outlive it (as no process's would)


@pytest.mark.parametrize("program, each", [(counts_on_the_class, 2), (counts_on_a_function, 2),
                                           (remembers_on_cls, None)])
def test_class_and_function_attributes_are_per_rank(program, each) -> None:
    values = tpsim.run(program, 3)
    assert values == ([each] * 3 if each is not None else [0, 1, 2])
    assert Counted.made == 0 and not hasattr(calls, "count") and not hasattr(Registry, "last")


def test_a_module_level_container_is_per_rank() -> None:
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(fills_a_module_dict, 2)
    assert info.value.rank == 1 and "raised KeyError: 'w'" in info.value.summary
    assert _SEEN == {} and _ORDER == []  # its contents are put back, the object kept


def test_the_attributes_and_containers_found_are_the_ones_written() -> None:
    import sys

    writes = modstate.module_writes(sys.modules[__name__])
    assert {(getattr(o, "__name__", o), n) for o, n in writes.attributes} == {
        ("Registry", "w"), ("Registry", "last"), ("Counted", "made"), ("calls", "count")}
    assert set(writes.mutated) == {"_SEEN", "_ORDER"}


def test_check_fails_the_class_attribute_layer_and_passes_its_twin(capsys, tmp_path) -> None:
    code, report = _check(capsys, tmp_path, "ClassAttrColumn", *COLUMN)
    assert code == 1
    found = _failures(report)
    assert "AttributeError: type object 'ClassAttrColumn' has no attribute 'shards'" in found[0]["message"]
    code, report = _check(capsys, tmp_path, "BroadcastColumn", *COLUMN)
    assert code == 0, _failures(report)


# --- 4. correct code real backends run -------------------------------------------------------------

def asks_the_backend() -> tuple[str, str, str]:
    sub = dist.new_group([0, 1])
    cpu = dist.new_group([0, 1], backend="gloo")
    dist.monitored_barrier()
    t = torch.ones(1)
    dist.all_reduce(t, group=cpu)
    return dist.get_backend(), dist.get_backend(sub), f"{type(cpu).__module__}:{t.item()}"


def test_code_asking_for_gloo_sees_gloo_and_monitored_barrier_works() -> None:
    assert tpsim.run(asks_the_backend, 2) == [("gloo", "gloo", "tpsim.comm.inproc:2.0")] * 2


def test_check_passes_a_layer_that_asks_its_backend(capsys, tmp_path) -> None:
    code, report = _check(capsys, tmp_path, "BackendAwareRow", *ROW)
    assert code == 0, _failures(report)


@pytest.mark.slow  # inductor's first compile in a fresh worker: half a minute to minutes
def test_check_passes_a_torch_compiled_layer(capsys, tmp_path) -> None:
    # Inductor's first compile of the layer runs inside the rank and counts as its own run time:
    # a timeout well above it on a loaded machine.
    code, report = _check(capsys, tmp_path, "CompiledColumn", *COLUMN, "--timeout", "300")
    assert code == 0, _failures(report)


def waits_on_three_groups() -> None:
    ws, r = dist.get_world_size(), dist.get_rank()
    everyone = dist.new_group(list(range(ws)))  # every rank, but not the default group
    dist.new_group([0, 1], group_desc="tp")
    tp = dist.new_group([2, 3], group_desc="tp")  # the same description: the ranks tell them apart
    t = torch.ones(1)
    if r == 0:
        dist.all_reduce(t)
    elif r == 1:
        dist.all_reduce(t, group=everyone)
    elif r == 2:
        dist.all_reduce(t, group=tp)


def test_groups_are_named_as_they_are_with_their_ranks() -> None:
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(waits_on_three_groups, 4)
    text = info.value.summary
    assert "rank 0: failed in all_reduce #1 on group world" in text
    assert "rank 1: failed in all_reduce #1 on group [0,1,2,3]" in text
    assert "rank 2: failed in all_reduce #1 on group tp [2,3]" in text
    assert ops.call_name("all_reduce", 2, "tp", (2, 3)) == "all_reduce #2 on group tp [2,3]"
    assert ops.group_label(False, "mesh_tp", (0, 1)) == "mesh_tp"
    assert ops.group_label(True, "default_pg", (0, 1)) == "world"
    assert ops.group_label(False, "undefined", (1, 3)) == "[1,3]"
