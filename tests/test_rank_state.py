"""What is per process in a real job stays per rank on inproc: module globals, helper threads, routing.

- A layer that keeps its tensor-parallel group in a module global (fairscale's and Megatron's style,
  written fresh in ``fairscale_style_layer``) fails on inproc with :class:`tpsim.SharedModuleState`
  naming the module, the global and the fix; passes with ``rank_local=(its module,)``; passes on gloo.
- A thread a rank starts belongs to that rank (default group, rank, the groups it made).
- ``threadworld``'s per-thread routing is undone when the world ends.

Rank functions are module-level so gloo workers can import them.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor

import fairscale_style_layer as fsl
import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

import tpsim
from tpsim.comm import modstate, threadworld
from tpsim.props.tolerance import tolerance

BACKENDS = ["inproc", pytest.param("gloo", marks=pytest.mark.gloo)]


def rank_fairscale_style(tp_size: int, guarded: bool = True) -> float:
    """Initialise the tp state, run the layer, compare with the dense layer; return the worst error
    relative to its derived bound (<= 1: within rounding). The rank's matmul is a slice of the dense
    one, computed by other kernels (MKL picks them by shape and CPU), so the two agree to rounding,
    not bit for bit: the bound is the project's (:func:`tpsim.props.tolerance.tolerance`)."""
    init = fsl.initialize_tensor_parallel if guarded else fsl.initialize_tensor_parallel_unguarded
    init(tp_size)
    try:
        gen = torch.Generator().manual_seed(7)
        w = torch.randn(6, 4, dtype=torch.float64, generator=gen)
        b = torch.randn(6, dtype=torch.float64, generator=gen)
        x = torch.randn(3, 4, dtype=torch.float64, generator=gen)
        layer = fsl.ColumnParallelLinear(4, 6, w, b)
        y = layer(x)
        y.sum().backward()
        bound = tolerance(torch.float64, x.abs() @ w.abs().T + b.abs(), reduction_length=x.shape[-1],
                          world_size=tp_size)
        return float(((y - (x @ w.T + b)).abs() / bound).max())
    finally:
        fsl.destroy_tensor_parallel()


# -- module globals --------------------------------------------------------------------------------

def test_a_module_global_group_fails_on_inproc_with_a_named_shared_state_error():
    with pytest.raises(tpsim.SharedModuleState) as info:
        tpsim.run(rank_fairscale_style, 2, args=(2,))
    err = info.value
    assert (err.module, err.attribute, err.ranks) == ("fairscale_style_layer", "_TENSOR_PARALLEL_GROUP", (0, 1))
    assert "--rank-local fairscale_style_layer" in str(err) and "--backend gloo" in str(err)
    assert "rank_local=('fairscale_style_layer',)" in str(err)
    # The failure it caused (rank 1's "already initialized") is kept, not lost.
    assert isinstance(err.cause, tpsim.RankError) and "already initialized" in str(err.cause)
    assert fsl._TENSOR_PARALLEL_GROUP is None  # the process's own module is as it was


def test_two_ranks_rebinding_one_global_are_stopped_at_once():
    with pytest.raises(tpsim.SharedModuleState, match=r"rank 0 rebound the module global "
                       r"fairscale_style_layer._TENSOR_PARALLEL_GROUP, then rank 1 rebound it again") as info:
        tpsim.run(rank_fairscale_style, 4, args=(2, False), timeout=60)
    assert info.value.ranks == (0, 1) and info.value.cause is None


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_same_layer_passes_with_the_module_rank_local_and_on_gloo(backend):
    errors = tpsim.run(rank_fairscale_style, 4, args=(2,), backend=backend, rank_local=("fairscale_style_layer",))
    assert len(errors) == 4 and all(e <= 1.0 for e in errors), errors
    assert fsl._TENSOR_PARALLEL_GROUP is None


def test_rank_local_accepts_module_objects_and_refuses_names_that_do_not_import():
    errors = tpsim.run(rank_fairscale_style, 2, args=(2,), rank_local=(fsl,))
    assert len(errors) == 2 and all(e <= 1.0 for e in errors), errors
    with pytest.raises(tpsim.InvalidArgument, match=r"rank_local: module 'no_such_module_xyz' cannot be imported"):
        tpsim.run(rank_fairscale_style, 2, rank_local=("no_such_module_xyz",))
    with pytest.raises(tpsim.InvalidArgument, match=r"rank_local: 3 must be a module name"):
        tpsim.run(rank_fairscale_style, 2, rank_local=(3,))


counter_state = types.ModuleType("tpsim_test_counter_state")
counter_state.__dict__.update(calls=0, seen=[])
exec(
    "def bump():\n"
    "    global calls\n"
    "    calls += 1\n"
    "    seen.append(calls)\n"
    "    return calls\n",
    counter_state.__dict__,
)
sys.modules[counter_state.__name__] = counter_state


def rank_bumps_twice() -> tuple[int, list[int]]:
    counter_state.bump()
    dist.barrier()  # another rank runs in between
    return counter_state.bump(), list(counter_state.seen)


def test_each_rank_starts_from_the_module_as_it_was_and_the_module_is_put_back():
    counter_state.calls = 10
    out = tpsim.run(rank_bumps_twice, 3, rank_local=(counter_state.__name__,))
    # Every rank counts from 10 on its own, as in its own process; plain containers are its own too.
    assert out == [(12, [11, 12])] * 3
    assert counter_state.calls == 10 and counter_state.seen == []


def test_a_global_rebound_once_and_only_read_after_is_no_alarm():
    # A lazily built cache or a warn-once flag, rebound by the first rank and read by the others,
    # changes nothing on a correct program: no SharedModuleState.
    assert tpsim.run(rank_lazy_cache, 3) == [6.0, 6.0, 6.0]


_CACHE: torch.Tensor | None = None


def _cached() -> torch.Tensor:
    global _CACHE
    if _CACHE is None:
        _CACHE = torch.arange(4.0)
    return _CACHE


def rank_lazy_cache() -> float:
    x = _cached().clone()
    dist.all_reduce(x)
    return float(x[1] * 2)


config_state = types.ModuleType("tpsim_test_config_state")
config_state.__dict__.update(_CONFIG=None)
exec(
    "def configure(tp):\n"
    "    global _CONFIG\n"
    "    _CONFIG = {'tp': tp, 'sizes': (2, 4)}\n",
    config_state.__dict__,
)
sys.modules[config_state.__name__] = config_state


def rank_configures() -> int:
    config_state.configure(2)
    dist.barrier()
    config_state.configure(2)  # every rank rebinds it, to an equal plain value each time
    return config_state._CONFIG["tp"]


def test_every_rank_rebinding_a_global_to_an_equal_plain_value_is_no_alarm():
    assert tpsim.run(rank_configures, 3, watch=(config_state.__name__,)) == [2, 2, 2]


def test_the_watch_finds_the_modules_a_rank_function_reaches():
    watched = modstate.watched_modules(rank_fairscale_style, (), {})
    names = {m.__name__ for m in watched}
    assert {"fairscale_style_layer", __name__} <= names
    assert not any(n.split(".")[0] in ("torch", "tpsim", "pytest") for n in names)
    assert "_TENSOR_PARALLEL_GROUP" in modstate.rebound_names(fsl)


def test_callers_can_add_modules_to_watch():
    # counter_state is reached through a global of this module, but watch= also takes it by name.
    with pytest.raises(tpsim.SharedModuleState, match=r"tpsim_test_counter_state.calls"):
        tpsim.run(rank_bumps_twice, 2, watch=(counter_state.__name__,))


# -- helper threads --------------------------------------------------------------------------------

def rank_helper_thread_collective() -> tuple[int, float]:
    out: dict[str, float] = {}

    def work() -> None:
        t = torch.ones(1) * dist.get_rank()
        dist.all_reduce(t)
        out["sum"] = t.item()

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return dist.get_rank(), out["sum"]


def rank_helper_thread_reads_rank() -> tuple[int, int, int, bool]:
    group = dist.new_group([0, 1])
    with ThreadPoolExecutor(max_workers=1) as pool:
        rank, size, group_rank = pool.submit(lambda: (dist.get_rank(), dist.get_world_size(),
                                                      dist.get_rank(group))).result()
    return rank, size, group_rank, dist.is_initialized()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_helper_thread_issues_a_collective_as_its_rank(backend):
    assert tpsim.run(rank_helper_thread_collective, 3, backend=backend) == [(0, 3.0), (1, 3.0), (2, 3.0)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_helper_thread_reads_its_ranks_world(backend):
    assert tpsim.run(rank_helper_thread_reads_rank, 3, backend=backend) == [
        (0, 3, 0, True), (1, 3, 1, True), (2, 3, -1, True)]


def rank_helper_collective_while_rank_waits() -> None:
    def work() -> None:
        time.sleep(0.3)  # by now rank 0's own thread is blocked in its all_reduce (rank 1 is 1 s late)
        dist.all_reduce(torch.ones(1))

    thread = threading.Thread(target=work)
    if dist.get_rank() == 0:
        thread.start()
    else:
        time.sleep(1.0)
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 0:
        thread.join()


def test_a_helper_collective_while_its_rank_is_blocked_gets_a_clear_error():
    with pytest.raises(tpsim.RankError, match=r"rank 0 raised RuntimeError: a thread started by rank 0 issued "
                                              r"all_reduce while rank 0 itself was not running \(rank 0 is waiting in "
                                              r"all_reduce #1 on group world\).*backend='gloo'"):
        tpsim.run(rank_helper_collective_while_rank_waits, 2, timeout=20)


# -- the per-thread routing is undone ---------------------------------------------------------------

def rank_number() -> int:
    return dist.get_rank()


def _no_world_left_running() -> None:
    """Wait (bounded) for rank threads an earlier test abandoned on purpose (a rank that sleeps past
    its timeout keeps the routing until it ends)."""
    deadline = time.monotonic() + 30
    while threadworld.is_installed() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not threadworld.is_installed()


def test_the_per_thread_routing_is_installed_only_while_a_world_runs():
    _no_world_left_running()
    original_world, original_start = c10d._world, threading.Thread.start
    during = tpsim.run(rank_during_world, 2)
    assert during == [True, True]
    assert not threadworld.is_installed()
    assert c10d._world is original_world and threading.Thread.start is original_start
    # The C++ name registry is process-wide again: a group registered in one thread resolves in another.
    from torch._C._distributed_c10d import (
        _register_process_group,
        _resolve_process_group,
        _unregister_process_group,
    )

    pg = dist.ProcessGroup(0, 1)
    worker = threading.Thread(target=_register_process_group, args=("tpsim-test-shared", pg))
    worker.start()
    worker.join()
    try:
        assert _resolve_process_group("tpsim-test-shared") is not None
    finally:
        _unregister_process_group("tpsim-test-shared")
    # and a failing world undoes it too
    with pytest.raises(tpsim.RankError):
        tpsim.run(rank_raises, 2)
    assert not threadworld.is_installed() and c10d._world is original_world


def rank_during_world() -> bool:
    return threadworld.is_installed() and type(c10d._world).__name__ == "_ThreadRoutedWorld"


def rank_raises() -> None:
    raise ValueError("on purpose")


def test_install_nests_and_uninstall_undoes_the_outermost():
    _no_world_left_running()
    original = c10d._world
    with threadworld.installed():
        with threadworld.installed():
            assert threadworld.is_installed()
        assert threadworld.is_installed()
    assert not threadworld.is_installed() and c10d._world is original


def rank_uses_another_ranks_group(shared: list) -> None:
    if dist.get_rank() == 0:
        shared.append(dist.group.WORLD)  # one list object every rank was handed: nothing makes it per rank
    dist.barrier()
    dist.all_reduce(torch.ones(1), group=shared[0])


def test_a_group_object_that_reaches_another_rank_is_named():
    # (A module-level list would not carry it: the containers module code mutates are per rank.)
    with pytest.raises(tpsim.RankError, match=r"rank 1 raised RuntimeError: rank 1 issued all_reduce on rank 0's "
                                              r"process group object .*--rank-local MODULE"):
        tpsim.run(rank_uses_another_ranks_group, 2, args=([],))
