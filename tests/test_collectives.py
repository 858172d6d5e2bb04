"""Every collective on every backend, checked against plain torch arithmetic.

The same module runs on ``inproc`` and ``gloo`` (parametrised): rank functions are
module-level so gloo workers can unpickle them. Expected values are computed in the
parent from the per-rank inputs, rank after rank.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.distributed as dist

import tpsim

BACKENDS = ["inproc", pytest.param("gloo", marks=pytest.mark.gloo)]
WORLD_SIZES = [1, 2, 3, 4]


def _rank_input(rank: int, shape=(2, 3), dtype=torch.float64) -> torch.Tensor:
    # distinct, exactly representable values per rank so sums are exact in any order
    return (torch.arange(6, dtype=dtype).reshape(shape) + 10 * rank + 1)


def rank_all_reduce(op_name: str) -> torch.Tensor:
    t = _rank_input(dist.get_rank())
    dist.all_reduce(t, op=getattr(dist.ReduceOp, op_name))
    return t


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ws", WORLD_SIZES)
@pytest.mark.parametrize("op", ["SUM", "AVG", "MAX", "MIN", "PRODUCT"])
def test_all_reduce_ops(backend, ws, op):
    if backend == "gloo" and op == "AVG":
        pytest.skip("gloo does not implement ReduceOp.AVG (torch raises); inproc does")
    out = tpsim.run(rank_all_reduce, ws, backend=backend, args=(op,))
    inputs = torch.stack([_rank_input(r) for r in range(ws)])
    expected = {
        "SUM": inputs.sum(0), "AVG": inputs.sum(0) / ws, "MAX": inputs.max(0).values,
        "MIN": inputs.min(0).values, "PRODUCT": inputs.prod(0),
    }[op]
    for r in range(ws):
        torch.testing.assert_close(out[r], expected, rtol=0, atol=0)


def rank_gathers() -> dict:
    r, ws = dist.get_rank(), dist.get_world_size()
    x = _rank_input(r)
    lst = [torch.empty_like(x) for _ in range(ws)]
    dist.all_gather(lst, x)
    flat = torch.empty(ws * x.shape[0], x.shape[1], dtype=x.dtype)
    dist.all_gather_into_tensor(flat, x)
    big = torch.cat([_rank_input(r) * (k + 1) for k in range(ws)])  # [ws*2, 3]
    rs_list_out = torch.empty_like(x)
    dist.reduce_scatter(rs_list_out, list(big.chunk(ws)))
    rs_out = torch.empty_like(x)
    dist.reduce_scatter_tensor(rs_out, big)
    b = x.clone()
    dist.broadcast(b, src=ws - 1)
    sc = torch.empty_like(x)
    dist.scatter(sc, [x * (k + 1) for k in range(ws)] if r == 0 else None, src=0)
    ga = [torch.empty_like(x) for _ in range(ws)] if r == ws - 1 else None
    dist.gather(x, ga, dst=ws - 1)
    a2a_out = [torch.empty_like(x) for _ in range(ws)]
    dist.all_to_all(a2a_out, [x + k for k in range(ws)])
    a2a_single = torch.empty(ws * 2, 3, dtype=x.dtype)
    dist.all_to_all_single(a2a_single, torch.cat([x[:1] + k for k in range(ws)] * 1 + [x[1:] + k for k in range(ws)]))
    red = x.clone()
    dist.reduce(red, dst=0)
    dist.barrier()
    return {
        "all_gather": torch.stack(lst), "all_gather_into_tensor": flat, "reduce_scatter": rs_list_out,
        "reduce_scatter_tensor": rs_out, "broadcast": b, "scatter": sc,
        "gather": None if ga is None else torch.stack(ga), "all_to_all": torch.stack(a2a_out),
        "all_to_all_single": a2a_single, "reduce": red if r == 0 else None,
    }


@pytest.mark.smoke  # its gloo runs stay in the fast tier: every collective on a real process group
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ws", WORLD_SIZES)
def test_every_collective_matches_torch_arithmetic(backend, ws):
    out = tpsim.run(rank_gathers, ws, backend=backend)
    xs = [_rank_input(r) for r in range(ws)]
    for r in range(ws):
        o = out[r]
        torch.testing.assert_close(o["all_gather"], torch.stack(xs), rtol=0, atol=0)
        torch.testing.assert_close(o["all_gather_into_tensor"], torch.cat(xs), rtol=0, atol=0)
        expected_rs = sum(xs[k] * (r + 1) for k in range(ws))
        torch.testing.assert_close(o["reduce_scatter"], expected_rs, rtol=0, atol=0)
        torch.testing.assert_close(o["reduce_scatter_tensor"], expected_rs, rtol=0, atol=0)
        torch.testing.assert_close(o["broadcast"], xs[ws - 1], rtol=0, atol=0)
        torch.testing.assert_close(o["scatter"], xs[0] * (r + 1), rtol=0, atol=0)
        torch.testing.assert_close(o["all_to_all"], torch.stack([xs[k] + r for k in range(ws)]), rtol=0, atol=0)
        rows = [(torch.cat([xs[k][:1] + j for j in range(ws)] + [xs[k][1:] + j for j in range(ws)])) for k in range(ws)]
        expected_a2a = torch.cat([rows[k][2 * r:2 * r + 2] for k in range(ws)])
        torch.testing.assert_close(o["all_to_all_single"], expected_a2a, rtol=0, atol=0)
    torch.testing.assert_close(out[ws - 1]["gather"], torch.stack(xs), rtol=0, atol=0)
    torch.testing.assert_close(out[0]["reduce"], sum(xs), rtol=0, atol=0)


def rank_p2p_and_async() -> list:
    r, ws = dist.get_rank(), dist.get_world_size()
    got = []
    # a ring: every rank sends to the next and receives from the previous
    t = torch.full((3,), float(r))
    buf = torch.empty(3)
    reqs = [dist.isend(t, (r + 1) % ws), dist.irecv(buf, (r - 1) % ws)]
    for q in reqs:
        q.wait()
    got.append(buf.clone())
    w = dist.all_reduce(torch.ones(2) * r, async_op=True)
    w.wait()
    x = torch.ones(2) * r
    h = dist.all_reduce(x, async_op=True)
    h.wait()
    got.append(x)
    return got


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("ws", [2, 3])
def test_send_recv_ring_and_async_handles(backend, ws):
    out = tpsim.run(rank_p2p_and_async, ws, backend=backend)
    for r in range(ws):
        torch.testing.assert_close(out[r][0], torch.full((3,), float((r - 1) % ws)))
        torch.testing.assert_close(out[r][1], torch.full((2,), float(sum(range(ws)))))


def rank_subgroups() -> tuple:
    r, ws = dist.get_rank(), dist.get_world_size()
    # consecutive tp groups of 2 and strided dp groups, as in a tp x dp mesh
    tp = [dist.new_group([2 * i, 2 * i + 1]) for i in range(ws // 2)]
    dp = [dist.new_group(list(range(i, ws, 2))) for i in range(2)]
    mine_tp, mine_dp = tp[r // 2], dp[r % 2]
    a = torch.tensor([float(r)])
    dist.all_reduce(a, group=mine_tp)
    b = torch.tensor([float(r)])
    dist.all_reduce(b, group=mine_dp)
    return a.item(), b.item(), dist.get_rank(mine_tp), dist.get_world_size(mine_dp)


@pytest.mark.parametrize("backend", BACKENDS)
def test_subgroups_reduce_over_their_own_ranks(backend):
    out = tpsim.run(rank_subgroups, 4, backend=backend)
    assert out == [(1.0, 2.0, 0, 2), (1.0, 4.0, 1, 2), (5.0, 2.0, 0, 2), (5.0, 4.0, 1, 2)]


def rank_seeded_draw() -> torch.Tensor:
    torch.manual_seed(0)
    w = torch.randn(4, 3)
    dist.barrier()  # other ranks run and draw meanwhile
    return torch.cat([w.reshape(-1), torch.randn(2)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_each_rank_has_its_own_rng_like_a_process(backend):
    out = tpsim.run(rank_seeded_draw, 3, backend=backend)
    torch.manual_seed(0)
    expected = torch.cat([torch.randn(4, 3).reshape(-1), torch.randn(2)])
    for r in range(3):
        torch.testing.assert_close(out[r], expected, rtol=0, atol=0)


def rank_default_dtype() -> str:
    if dist.get_rank() == 1:
        torch.set_default_dtype(torch.float64)
    dist.barrier()
    return str(torch.empty(1).dtype)


def test_default_dtype_is_per_rank_and_restored():
    before = torch.get_default_dtype()
    assert tpsim.run(rank_default_dtype, 3) == ["torch.float32", "torch.float64", "torch.float32"]
    assert torch.get_default_dtype() == before


def rank_float_sum(n: int) -> torch.Tensor:
    torch.manual_seed(1234 + dist.get_rank())
    t = torch.randn(n, dtype=torch.float32) * 10 ** torch.randint(-3, 4, (n,)).float()
    dist.all_reduce(t)
    return t


def test_inproc_is_bit_identical_and_equals_rank_order_sum():
    ws, n = 7, 1000
    a = tpsim.run(rank_float_sum, ws, args=(n,))
    b = tpsim.run(rank_float_sum, ws, args=(n,))
    inputs = []
    for r in range(ws):
        torch.manual_seed(1234 + r)
        inputs.append(torch.randn(n, dtype=torch.float32) * 10 ** torch.randint(-3, 4, (n,)).float())
    acc = inputs[0].clone()
    for t in inputs[1:]:
        acc += t
    for r in range(ws):
        assert torch.equal(a[r], b[r])
        assert torch.equal(a[r], acc)


def _small_input(rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(99 + rank)
    t = (torch.randn(shape, generator=g, dtype=torch.float64)
         * 10.0 ** torch.randint(-3, 4, shape, generator=g).double()).to(dtype)
    flat = t.view(-1)
    if rank == 2 and flat.numel() > 1:  # a signed zero and a NaN among the terms, bits and all
        flat[0], flat[1] = -0.0, float("nan")
    return t


def rank_small_sum(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    t = _small_input(dist.get_rank(), shape, dtype)
    dist.all_reduce(t)
    return t


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("shape", [(), (1,), (7,), (4, 4)])
def test_inproc_sums_small_tensors_of_many_ranks_in_rank_order_bit_for_bit(shape, dtype):
    # past 8 ranks a sum of small float tensors is one index_add_ instead of one add_ per rank: the
    # same additions in the same order, so every bit (NaN payloads included) is what the loop gives
    ws = 12
    out = tpsim.run(rank_small_sum, ws, args=(shape, dtype))
    acc = _small_input(0, shape, dtype)
    for r in range(1, ws):
        acc.add_(_small_input(r, shape, dtype))
    bits = torch.int32 if dtype == torch.float32 else torch.int64
    for r in range(ws):
        assert out[r].shape == acc.shape and out[r].dtype == dtype
        assert torch.equal(out[r].reshape(-1).view(bits), acc.reshape(-1).view(bits)), r


# -- failures: never a hang, and the message says why ---------------------------------
def rank_exits_early() -> None:
    x = torch.ones(2)
    dist.all_gather_into_tensor(torch.empty(2 * dist.get_world_size()), x)
    dist.all_gather_into_tensor(torch.empty(2 * dist.get_world_size()), x)
    if dist.get_rank() == 1:
        return
    dist.all_reduce(x)


def test_inproc_names_the_rank_that_exited():
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(rank_exits_early, 4, timeout=30)
    err = info.value
    assert err.collective == "all_reduce"
    assert err.call_index == 3
    assert err.faulty_ranks == (1,)
    assert "all_reduce #3 on group world: ranks 0,2,3 waiting; rank 1 returned after all_gather_into_tensor #2" in str(err)


def rank_mismatched_op() -> None:
    if dist.get_rank() == 2:
        dist.all_gather_into_tensor(torch.empty(3), torch.ones(1))
    else:
        dist.all_reduce(torch.ones(1))


def rank_mismatched_shape() -> None:
    dist.all_reduce(torch.ones(2 if dist.get_rank() == 1 else 3))


def test_inproc_mismatched_collectives_are_named():
    with pytest.raises(tpsim.CollectiveError, match=r"all_reduce #1 on group world: mismatched collective: "
                       r"rank 2 called all_gather_into_tensor #1 while rank 0 called all_reduce #1"):
        tpsim.run(rank_mismatched_op, 3)
    with pytest.raises(tpsim.CollectiveError, match=r"rank 1 passed shapes \[\[2\]\].*while rank 0 passed shapes \[\[3\]\]"):
        tpsim.run(rank_mismatched_shape, 3)


def rank_raises() -> None:
    dist.all_reduce(torch.ones(1))
    if dist.get_rank() == 2:
        raise ValueError("boom on purpose")
    dist.all_reduce(torch.ones(1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_raising_rank_is_reported_with_its_traceback(backend):
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(rank_raises, 3, backend=backend, timeout=20)
    err = info.value
    assert err.rank == 2
    assert "ValueError: boom on purpose" in str(err)
    assert "rank_raises" in str(err)  # the rank's own traceback is in the message
    assert not isinstance(err, tpsim.CollectiveError)


def rank_waits_forever_on_recv() -> None:
    if dist.get_rank() == 0:
        dist.recv(torch.empty(1), src=1)


def test_inproc_deadlock_on_recv_is_reported_at_once():
    import time

    t0 = time.monotonic()
    with pytest.raises(tpsim.CollectiveError, match=r"recv #1 from rank 1 on group world: rank 0 waiting; rank 1 returned"):
        tpsim.run(rank_waits_forever_on_recv, 2, timeout=60)
    assert time.monotonic() - t0 < 10  # detected, not timed out (the timeout is 60 s)


def rank_computes_too_long(seconds: float) -> None:
    import time

    if dist.get_rank() == 1:
        time.sleep(seconds)
    dist.barrier()


def test_inproc_timeout_names_the_busy_rank():
    with pytest.raises(tpsim.CollectiveError, match=r"rank 1 has been running for over 0.5 s"):
        tpsim.run(rank_computes_too_long, 2, timeout=0.5, args=(3.0,))


def test_trace_records_every_call():
    result = tpsim.run_world(rank_subgroups, 4)
    calls = result.trace.of(0)
    assert [c.op for c in calls] == ["all_reduce", "all_reduce"]
    assert calls[0].group_ranks == (0, 1) and calls[1].group_ranks == (0, 2)
    assert calls[0].call_index == 1 and calls[0].shapes == ((1,),) and calls[0].dtypes == ("float32",)
    assert calls[0].reduce_op == "SUM"


def test_bad_arguments_get_clear_errors():
    with pytest.raises(tpsim.InvalidArgument, match=r"world_size=0 must be >= 1"):
        tpsim.run(rank_raises, 0)
    with pytest.raises(tpsim.InvalidArgument, match=r"backend='mpi' is not one of inproc, gloo, nccl"):
        tpsim.run(rank_raises, 2, backend="mpi")
    with pytest.raises(tpsim.InvalidArgument, match=r"timeout=-1 must be a positive number"):
        tpsim.run(rank_raises, 2, timeout=-1)


def test_no_rank_thread_is_left_behind():
    before = set(threading.enumerate())  # an earlier test may have abandoned a sleeping rank
    tpsim.run(rank_gathers, 4)
    with pytest.raises(tpsim.RankError):
        tpsim.run(rank_raises, 3)
    assert not [t for t in set(threading.enumerate()) - before if t.name.startswith("tpsim-rank-")]


def rank_functional_and_world_info() -> tuple:
    import torch.distributed._functional_collectives as fc

    r = dist.get_rank()
    y = fc.all_reduce(torch.ones(2) * r, "sum", dist.group.WORLD)
    g = fc.all_gather_tensor(torch.ones(1) * r, 0, dist.group.WORLD)
    return dist.get_world_size(), dist.is_initialized(), y.tolist(), torch.as_tensor(g).tolist()


def test_functional_collectives_run_on_inproc():
    out = tpsim.run(rank_functional_and_world_info, 3)
    for v in out:
        assert v == (3, True, [3.0, 3.0], [0.0, 1.0, 2.0])
    assert not dist.is_initialized()  # the main thread's world is untouched


def test_world_size_256_works():
    out = tpsim.run(rank_all_reduce, 256, args=("SUM",))
    torch.testing.assert_close(out[255], sum(_rank_input(r) for r in range(256)), rtol=0, atol=0)


def test_inproc_sets_old_objects_aside_from_the_gc_only_while_it_runs():
    import gc

    def rank_freeze_count():
        dist.barrier()
        return gc.get_freeze_count()

    gc.collect()
    assert gc.get_freeze_count() == 0
    during = tpsim.run(rank_freeze_count, 2)
    assert min(during) > 1000  # the process's objects (torch's modules and all) were set aside
    assert gc.get_freeze_count() == 0  # and handed back afterwards
    # a process that froze objects itself keeps exactly its own freeze
    gc.freeze()
    try:
        mine = gc.get_freeze_count()
        # (frozen objects can still be freed: the count may drop, never grow)
        assert max(tpsim.run(rank_freeze_count, 2)) <= mine
        assert 0 < gc.get_freeze_count() <= mine
    finally:
        gc.unfreeze()
    # and an error inside the world hands them back too
    with pytest.raises(tpsim.RankError):
        tpsim.run(rank_raises, 3)
    assert gc.get_freeze_count() == 0
