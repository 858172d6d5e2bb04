"""The ``inproc`` backend: a real torch.distributed process group whose ranks are threads.

``dist.init_process_group("inproc", ...)`` works in any thread that
:func:`run_inproc` started as a rank, so unmodified SPMD code (``dist.get_rank()``,
``dist.all_reduce(t)``, ``dist.new_group``, functional collectives, DTensor) runs here as
under torchrun. Collectives are computed by the last rank to arrive, in rank order, so
results are bit-identical run after run and equal to a single-thread computation done
rank after rank. Scheduling is in :mod:`tpsim.comm.scheduler`; per-thread registries and
process state in :mod:`tpsim.comm.threadworld`.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tpsim.comm import backend_names, modstate, ops, runclock, threadworld
from tpsim.comm._inject import RankFaults, checksum, corrupt_, crash, mismatched_call
from tpsim.comm.modstate import ModuleGlobals
from tpsim.comm.result import WorldResult
from tpsim.comm.scheduler import (
    BLOCKED,
    READY,
    RUNNING,
    Scheduler,
    Wait,
    WorldBroken,
    collective_error,
    format_exception,
    printable,
)
from tpsim.comm.trace import CollectiveCall, Trace
from tpsim.errors import CollectiveError, InvalidArgument
from tpsim.faults import Corrupt, Crash, Delay, Drop, Fault, InjectedCrash, Mismatch, parse_plan

__all__ = ["BACKEND_NAME", "BUFFERED_SENDS_ENV", "InprocProcessGroup", "register", "run_inproc"]

BACKEND_NAME = "inproc"

#: Environment variable that makes point-to-point sends eager (buffered): ``1`` on, anything else off.
BUFFERED_SENDS_ENV = "TPSIM_BUFFERED_SENDS"


# ----------------------------------------------------------------------------------------
# Reductions, in rank order
# ----------------------------------------------------------------------------------------
def _reduce_in_rank_order(tensors: Sequence[torch.Tensor], op: Any, name: str | None = None) -> torch.Tensor:
    """Fold ``tensors`` left to right (rank 0 first): the order a single thread would use.

    ``name``: ``op``'s name (:func:`tpsim.comm.ops.reduce_op_name`) where the caller has it. A sum is
    one ``torch._foreach_add_`` onto the accumulator listed once per term: on CPU it adds them one
    after another in list order, as the loop of ``add_`` calls it replaces did (bit for bit), in one
    call instead of one per rank; a sum of small tensors is :func:`_sum_small`.
    """
    if name is None:
        name = ops.reduce_op_name(op)
    acc = tensors[0].clone()
    n = len(tensors)
    if name == "SUM" or name == "AVG":
        if n > 8 and acc.dtype in _SMALL_DTYPES and acc.numel() <= _SMALL and acc.is_contiguous():
            _sum_small(acc, tensors, n)
        elif n > 1:
            torch._foreach_add_([acc] * (n - 1), tensors[1:] if type(tensors) is list else list(tensors[1:]))
        if name == "AVG":
            if not acc.is_floating_point() and not acc.is_complex():
                raise InvalidArgument(f"ReduceOp.AVG needs a floating-point tensor, got dtype={acc.dtype}")
            acc.div_(n)
    elif name == "PRODUCT":
        for t in tensors[1:]:
            acc.mul_(t)
    elif name == "MAX":
        for t in tensors[1:]:
            torch.maximum(acc, t, out=acc)
    elif name == "MIN":
        for t in tensors[1:]:
            torch.minimum(acc, t, out=acc)
    elif name == "BAND":
        for t in tensors[1:]:
            acc.bitwise_and_(t)
    elif name == "BOR":
        for t in tensors[1:]:
            acc.bitwise_or_(t)
    elif name == "BXOR":
        for t in tensors[1:]:
            acc.bitwise_xor_(t)
    else:
        raise InvalidArgument(f"reduce op {op!r} is not supported by the inproc backend "
                              "(supported: SUM, AVG, PRODUCT, MIN, MAX, BAND, BOR, BXOR)")
    return acc


#: Tensors up to this many elements are summed by :func:`_sum_small`: there the per-op dispatch of one
#: ``add_`` per rank costs more than stacking the terms and adding them element by element does (from
#: about 8 ranks on: measured).
_SMALL = 64
#: The dtypes :func:`_sum_small` takes: those whose ``index_add_`` adds as ``add_`` does, bit for bit
#: (checked; half-precision ones do not, and keep one ``add_`` per rank).
_SMALL_DTYPES = frozenset({torch.float32, torch.float64})
#: Index tensors for :func:`_sum_small` by (terms, elements); a few shapes recur in a run.
_INDEX: dict[tuple[int, int], torch.Tensor] = {}
_INDEX_MAX = 64


def _sum_small(acc: torch.Tensor, tensors: Sequence[torch.Tensor], n: int) -> None:
    """Add ``tensors[1:]`` to ``acc`` (``tensors[0]``'s contiguous copy), in rank order, in two ops.

    One ``index_add_`` of the stacked, flattened terms onto the flat accumulator, term after term
    (index ``0..m-1`` once per term): on CPU a one-dimensional ``index_add_`` is a plain loop of
    ``acc[j] += term[j] * 1`` in index order (``x * 1`` is exact), so ``acc`` ends as the loop of
    ``acc.add_(t)`` leaves it, bit for bit (NaN payloads included: checked for float32 and float64).
    """
    m = acc.numel()
    index = _INDEX.get((n, m))
    if index is None:
        if len(_INDEX) >= _INDEX_MAX:
            _INDEX.clear()
        index = _INDEX[(n, m)] = torch.arange(m).repeat(n - 1)
    stacked = torch.stack(tensors[1:] if type(tensors) is list else list(tensors[1:]))
    acc.view(m).index_add_(0, index, stacked.view(m * (n - 1)))


_dtype_name = ops.dtype_name
_DTYPE_NAMES = ops._DTYPE_NAMES  # read directly on the hot path (a dict lookup, no call)
#: Ops whose signature is not the plain (shapes, dtypes, reduce op, peer): ops.signature builds theirs.
_SPECIAL_SIGNATURES = ops._SPECIAL_SIGNATURES
_get_ident = threading.get_ident


def _sig(tensors: Sequence[torch.Tensor]) -> tuple[tuple[tuple[int, ...], ...], tuple[str, ...]]:
    # torch.Size is already a tuple: no conversion needed on this hot path.
    return tuple([t.shape for t in tensors]), tuple([_dtype_name(t.dtype) for t in tensors])


# ----------------------------------------------------------------------------------------
# One collective instance: the k-th collective of a group, joined by every member
# ----------------------------------------------------------------------------------------
class _Instance(Wait):
    """The ``index``-th collective on a group; completed by the last member to arrive.

    ``index`` counts collectives only (it decides which calls of the members form one
    instance); the call indices in records and messages follow :mod:`tpsim.comm.ops`' rule.
    """

    __slots__ = ("arrived", "calls", "compute", "contrib", "crc", "done", "group", "index", "notes", "op",
                 "payloads", "signature", "sigs")

    def __init__(self, group: _GroupState, index: int, op: str, signature: Any, compute: Callable) -> None:
        self.group = group
        self.index = index
        self.op = op
        self.signature = signature
        self.compute = compute
        self.payloads: dict[int, Any] = {}
        self.calls: dict[int, CollectiveCall] = {}
        self.done = False
        # Only once members disagree: group rank -> (op, signature) of every member so far.
        self.sigs: dict[int, tuple[str, Any]] | None = None
        # Checksum mode only: group rank -> contribution tensors / their CRC at call time.
        self.contrib: dict[int, Sequence[torch.Tensor]] | None = None
        self.crc: dict[int, int] | None = None
        # Group rank -> the fault a plan applied to that member's call (for messages).
        self.notes: dict[int, str] | None = None

    # for the scheduler's messages
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self.group.name

    def describe_wait(self, rank: int) -> str:
        call = self.calls.get(self.group.ranks.index(rank))
        return call.describe() if call is not None else ops.call_name(self.op, None, self.group.name, self.group.ranks)

    def call_index(self) -> int | None:
        """The lowest-ranked arrived member's call index (how messages name the instance)."""
        return self.calls[min(self.calls)].call_index if self.calls else None

    def missing_ranks(self) -> tuple[int, ...]:
        return tuple(g for i, g in enumerate(self.group.ranks) if i not in self.payloads)

    def describe_stuck(self, slots: list) -> str:
        waiting = [self.group.ranks[i] for i in sorted(self.payloads)]
        missing = [slots[g].doing() for g in self.missing_ranks()]
        if self.sigs is not None:
            head = self.mismatch_message()[0]
            return f"{head}; ranks {','.join(map(str, waiting))} waiting; " + "; ".join(missing)
        return ops.departure_message(ops.call_name(self.op, self.call_index(), self.group.name, self.group.ranks),
                                     waiting, missing)

    def suspects(self) -> tuple[int, ...]:
        """Ranks to blame when this instance can never complete: deviating or missing members."""
        deviating = self.mismatch_message()[1] if self.sigs is not None else ()
        return tuple(sorted(set(deviating) | set(self.missing_ranks())))

    def mismatch_message(self) -> tuple[str, tuple[int, ...], ops.Member]:
        """Explain disagreeing members: ``(message, faulty global ranks, the reference member)``."""
        ranks = self.group.ranks
        notes = self.notes or {}
        members = {}
        injected = set()
        for m, (op, sig) in (self.sigs or {}).items():
            call = self.calls[m]
            members[ranks[m]] = ops.Member(op, call.call_index, ops.describe_signature(op, sig), notes.get(m, ""))
            if m in notes:
                injected.add(ranks[m])
        text, faulty, ref = ops.mismatch_message(self.group.label, members, injected)
        return text, faulty, members[ref]


class _Message:
    """One posted ``send``: its data as it was at the call, and the ``recv`` it matched (None until then)."""

    __slots__ = ("data", "dst", "index", "order", "recv", "src", "tag")

    def __init__(self, src: int, dst: int, tag: int, index: int, data: list[torch.Tensor], order: int) -> None:
        self.src = src
        self.dst = dst
        self.tag = tag
        self.index = index
        self.data = data
        self.order = order  # posting order in the group (an any-source recv takes the oldest send)
        self.recv: _Posted | None = None


class _Posted:
    """One posted ``recv``; ``msg`` is the send it matched (None until then)."""

    __slots__ = ("index", "me", "msg", "src", "tag")

    def __init__(self, me: int, src: int | None, tag: int, index: int) -> None:
        self.me = me
        self.src = src
        self.tag = tag
        self.index = index
        self.msg: _Message | None = None


class _P2PWait(Wait):
    """A rank blocked in a point-to-point call (described like collectives in messages).

    A ``recv`` waits for a matching ``send``; a ``send`` waits for its ``recv`` to be posted: a
    blocking send completes only then, on gloo and on NCCL alike, so a cycle of blocking sends is
    a deadlock here too.
    """

    def __init__(self, op: str, group: _GroupState, me: int, peer: int | None, tag: int, index: int) -> None:
        self.op = op
        self.group = group
        self.me = me
        self.peer = peer  # group rank; None: a recv from any rank
        self.tag = tag
        self.index = index
        self.blamed: tuple[int, ...] | None = None  # the ranks of a deadlock cycle, once described

    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self.group.name

    def describe_wait(self, rank: int) -> str:
        peer = "any rank" if self.peer is None else f"rank {self.group.ranks[self.peer]}"
        way = "to" if self.op == "send" else "from"
        tag = f" (tag {self.tag})" if self.tag else ""
        return f"{self.op} #{self.index} {way} {peer}{tag} on group {self.group.label}"

    def call_index(self) -> int | None:
        return self.index

    def missing_ranks(self) -> tuple[int, ...]:
        return () if self.peer is None else (self.group.ranks[self.peer],)

    def _cycle(self, slots: list) -> list[tuple[int, _P2PWait]] | None:
        """The ranks that wait on each other point to point, starting here, when they form a cycle."""
        chain: list[tuple[int, _P2PWait]] = []
        seen: set[int] = set()
        rank = self.group.ranks[self.me]
        while rank not in seen:
            seen.add(rank)
            slot = slots[rank]
            wait = slot.waiting_on
            if slot.state != BLOCKED or not isinstance(wait, _P2PWait) or wait.peer is None:
                return None
            chain.append((rank, wait))
            rank = wait.group.ranks[wait.peer]
        return chain[next(i for i, (r, _) in enumerate(chain) if r == rank):]

    def suspects(self) -> tuple[int, ...]:
        return self.blamed if self.blamed is not None else self.missing_ranks()

    def describe_stuck(self, slots: list) -> str:
        me = self.group.ranks[self.me]
        cycle = self._cycle(slots)
        if cycle:
            self.blamed = tuple(sorted(r for r, _ in cycle))
            who = ", ".join(f"rank {r} in {w.describe_wait(r)}" for r, w in cycle)
            text = f"{self.describe_wait(me)}: deadlock: every rank of the cycle waits for the next one: {who}"
            if any(w.op == "send" for _, w in cycle):
                text += (". A blocking send completes only once its recv is posted (on gloo and NCCL alike): "
                         "post the recv first on one side, or use dist.isend/dist.irecv (or "
                         "dist.batch_isend_irecv) and wait after both are posted")
            return text
        others = [slots[g].doing() for g in self.missing_ranks()]
        return f"{self.describe_wait(me)}: rank {me} waiting; " + ("; ".join(others) or "no sender")


class _GroupState:
    """State shared by the members of one group (one per group name per world)."""

    def __init__(self, name: str, ranks: tuple[int, ...], is_world: bool = False) -> None:
        self.name = name  # as traces show it (ops.group_label)
        self.ranks = ranks
        self.is_world = is_world
        self.size = len(ranks)
        self.seq = [0] * len(ranks)  # collectives issued so far, per group rank (matching)
        self.numbered = [0] * len(ranks)  # calls issued so far, p2p included, per group rank (ops' rule)
        self.pending: dict[int, _Instance] = {}
        # Point to point: posted sends not yet received, per (src, dst, tag), and posted receives not yet
        # matched, per (dst, tag), each in posting order (as MPI matches: non-overtaking).
        self.sends: dict[tuple[int, int, int], deque[_Message]] = {}
        self.recvs: dict[tuple[int, int], deque[_Posted]] = {}
        self.posted = 0  # sends posted so far (their order)

    @property
    def label(self) -> str:
        """The group as messages name it: its name, with its ranks where the name does not list them."""
        return ops.group_words(self.name, self.ranks)


class _SimWorld:
    """Everything one in-process world shares: scheduler, groups, trace, faults."""

    def __init__(self, world_size: int, timeout: float, faults: Sequence[Any], checksum: bool = False,
                 globals: ModuleGlobals | None = None) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.globals = globals
        self.sched = Scheduler(world_size, timeout, torch.get_default_dtype(), globals)
        self.groups: dict[str, _GroupState] = {}
        self.group_lock = threading.Lock()
        self.store = dist.HashStore()
        self.faults = parse_plan(faults)
        # Per rank: its faults (None for a rank without any, so the hot path pays one check).
        self.rank_faults: list[RankFaults | None] = [
            RankFaults(self.faults, r) if any(f.rank == r for f in self.faults) else None
            for r in range(world_size)
        ]
        self.checksum = bool(checksum)
        #: Eager point-to-point: a send completes at once, buffered (TPSIM_BUFFERED_SENDS=1; never the
        #: default: gloo and NCCL complete a blocking send only once its recv is posted).
        self.buffered_sends = os.environ.get(BUFFERED_SENDS_ENV, "0") not in ("", "0")
        self.cpu = _choose_cpu()

    def faults_fired(self) -> list[tuple[Fault, CollectiveCall]]:
        """Every fault that acted, with the call it acted on, in rank order."""
        return [item for rf in self.rank_faults if rf is not None for item in rf.fired]

    def group(self, key: str, ranks: tuple[int, ...], is_world: bool) -> _GroupState:
        with self.group_lock:
            g = self.groups.get(key)
            if g is None:
                g = self.groups[key] = _GroupState(ops.group_label(is_world, None, ranks), ranks, is_world)
            return g


# ----------------------------------------------------------------------------------------
# Work handles
# ----------------------------------------------------------------------------------------
class _Work(dist.Work):
    """Handle returned by every inproc op; ``wait()`` yields the baton until it completes."""

    def __init__(self, pg: InprocProcessGroup, ready: Callable[[], bool], waiting_on: Any,
                 result: list[torch.Tensor], finish: Callable[[], None] | None = None) -> None:
        super().__init__()
        self._pg = pg
        self._ready = ready
        self._waiting_on = waiting_on
        self._result = result
        self._finish = finish
        self._waited = False

    def is_completed(self) -> bool:
        return self._ready()

    def is_success(self) -> bool:
        return self._ready()

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._waited:
            return True
        world = self._pg._world
        try:
            world.sched.wait_until(self._pg._global_rank, self._ready, self._waiting_on)
        except WorldBroken as err:
            raise collective_error(err, self._pg._global_rank) from None
        if self._finish is not None:
            self._finish()
        self._waited = True
        return True

    def result(self) -> list[torch.Tensor]:
        self.wait()
        return self._result

    def get_future(self) -> torch.futures.Future:
        self.wait()
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self._result)
        return fut

    def synchronize(self) -> None:
        self.wait()


class _CollectiveWork(_Work):
    """The handle of a collective: done when its instance is (no closures on the hot path)."""

    def __init__(self, pg: InprocProcessGroup, inst: _Instance, result: list[torch.Tensor]) -> None:
        dist.Work.__init__(self)
        self._pg = pg
        self._inst = inst
        self._result = result
        self._waited = False

    def _ready(self) -> bool:
        return self._inst.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._waited:
            return True
        _wait_for(self._pg, self._inst)
        self._waited = True
        return True


def _wait_for(pg: InprocProcessGroup, inst: _Instance) -> None:
    """Block ``pg``'s rank until ``inst`` completes (Scheduler.wait_until, inlined): a broken world
    fails every waiter first, then a completed instance returns, else the baton goes on and the
    rank looks again when it comes back."""
    sched = pg._sched
    while True:
        if sched.broken is not None:
            raise collective_error(sched.broken, pg._global_rank) from None
        if inst.done:
            return
        try:
            sched.block(pg._slot, inst)
        except WorldBroken as err:
            raise collective_error(err, pg._global_rank) from None


class _Waited(_Work):
    """The handle a synchronous collective returns, already waited for (one per process group).

    torch's ``dist.*`` functions call a collective with ``opts.asyncOp`` False when the caller did not
    ask for a handle, and only ``wait()`` on what it returns ("the backend has sync'ed at CPP level"
    is a case torch provides for). The group then waits inside the call, as the handle's ``wait``
    would have, and returns this handle instead of a new one: no handle object made and freed per
    call. ``result()`` answers the latest such call's tensors.
    """

    def __init__(self, pg: InprocProcessGroup) -> None:
        super().__init__(pg, _always, None, [])
        self._waited = True


def _always() -> bool:
    return True


def _done_work(pg: InprocProcessGroup, result: list[torch.Tensor]) -> _Work:
    return _Work(pg, lambda: True, None, result)


# ----------------------------------------------------------------------------------------
# The process group
# ----------------------------------------------------------------------------------------
class InprocProcessGroup(dist.ProcessGroup):
    """A torch.distributed process group whose members are threads of this process.

    Created by torch through :func:`register`'s backend hook; never construct it yourself.
    ``dist.get_backend()`` says ``gloo`` for it (:mod:`tpsim.comm.backend_names`).
    """

    #: The tpsim backend this group belongs to (:mod:`tpsim.comm.backend_names` reads it).
    tpsim_backend = BACKEND_NAME

    def __init__(self, world: _SimWorld, state: _GroupState, group_rank: int, global_rank: int) -> None:
        super().__init__(group_rank, state.size)
        self._world = world
        self._state = state
        self._group_rank = group_rank
        self._global_rank = global_rank
        self._name = state.name
        self._tpsim_desc: str | None = None
        # Resolved once: the hot path (_join) reads these on every collective.
        self._sched = world.sched
        self._slot = world.sched.slots[global_rank]
        self._rf = world.rank_faults[global_rank]
        self._sync_handle: _Waited | None = None  # made at the first synchronous collective

    # -- identity ----------------------------------------------------------------------
    @property
    def group_name(self) -> str:
        return self._name

    def _set_group_name(self, name: str) -> None:
        self._name = name

    def _set_group_desc(self, desc: str) -> None:
        self._tpsim_desc = desc
        self._state.name = ops.group_label(self._state.is_world, desc, self._state.ranks)

    @property
    def group_desc(self) -> str:
        return self._tpsim_desc or "undefined"

    def getBackendName(self) -> str:
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    def name(self) -> str:
        return BACKEND_NAME

    def __repr__(self) -> str:
        return f"InprocProcessGroup(group={self._state.name}, rank={self._group_rank}, size={self._state.size})"

    def shutdown(self) -> None:  # nothing to release: no sockets, no streams
        pass

    def abort(self) -> None:
        pass

    def _wait_for_pending_works(self) -> None:
        pass

    def _has_hooks(self) -> bool:
        return False

    # -- the core: join a collective --------------------------------------------------
    def _join(self, op: str, tensors: Sequence[torch.Tensor], payload: Any, compute: Callable,
              *, reduce_op: Any = None, peer: int | None = None,
              result: list[torch.Tensor] | None = None, problem: str | None = None,
              strided: tuple[str, torch.Tensor, str] | None = None, op_name: str | None = None,
              opts: Any = None) -> _Work:
        """This member's part of collective ``op``: record the call, check it, add ``payload`` to the
        instance it joins (the last member to arrive computes it) and return its handle.

        ``op_name``: ``reduce_op``'s name where the caller has it. ``opts``: the call's options; when
        they say the call is synchronous (``asyncOp`` False: torch's ``dist.*`` only waits on the
        handle), the rank waits here and gets the group's :class:`_Waited` handle. (Every collective
        of every rank runs this: the rare cases each cost one test here, their work is done elsewhere.)
        """
        slot = self._slot
        if slot.dropped:  # a dropped rank's code may still call (from a finally): it is dead
            raise RankDropped()
        if slot.thread_ident != _get_ident():
            self._check_helper_thread(op)
        state = self._state
        me = self._group_rank
        if len(tensors) == 1:  # the common case, without _sig's list comprehensions
            t = tensors[0]
            dtype = t.dtype
            shapes: Any = (t.shape,)
            dtypes: Any = (_DTYPE_NAMES.get(dtype) or _dtype_name(dtype),)
        else:
            shapes, dtypes = _sig(tensors)
        numbered = state.numbered
        number = numbered[me] = numbered[me] + 1
        if op_name is None and reduce_op is not None:
            op_name = ops.reduce_op_name(reduce_op)
        if peer is not None:
            peer = state.ranks[peer]
        # Positional: CollectiveCall(rank, op, group, group_ranks, call_index, shapes, dtypes,
        # reduce_op, peer), cheaper than keywords on this path.
        call = CollectiveCall(self._global_rank, op, state.name, state.ranks, number, shapes, dtypes, op_name, peer)
        slot.calls.append(call)  # recorded even when it fails below: the rank did issue it
        if self._sched.broken is not None or problem is not None or strided is not None:
            self._refuse(call, problem, strided)
        seq = state.seq
        index = seq[me] = seq[me] + 1
        signature = (shapes, dtypes, op_name, peer) if op not in _SPECIAL_SIGNATURES else ops.signature(
            op, shapes, dtypes, op_name, peer)
        world = self._world
        note = crc = None
        if self._rf is not None or world.checksum:
            crc = checksum(tensors) if world.checksum else 0  # what the caller handed over
            fault = self._rf.next_call(call) if self._rf is not None else None
            if fault is not None:
                note = ops.fault_note(fault, call)
                if isinstance(fault, Mismatch):
                    mismatched_call(fault, call)
                    signature = ops.mismatched_signature(signature, ops.signature_of(call), fault.what)
                    op = call.op
                else:
                    self._inject(fault, call, tensors, slot)
        pending = state.pending
        inst = pending.get(index)
        if inst is None:
            inst = pending[index] = _Instance(state, index, op, signature, compute)
        elif inst.sigs is None and (inst.op != op or inst.signature != signature):
            inst.sigs = {m: (inst.op, inst.signature) for m in inst.payloads}
        if inst.sigs is not None:
            inst.sigs[me] = (op, signature)
        if crc is not None:
            if note is not None:
                if inst.notes is None:
                    inst.notes = {}
                inst.notes[me] = note
            if world.checksum:
                if inst.contrib is None:
                    inst.contrib, inst.crc = {}, {}
                inst.contrib[me] = tensors
                inst.crc[me] = crc  # type: ignore[index]
        payloads = inst.payloads
        payloads[me] = payload
        inst.calls[me] = call
        if len(payloads) == state.size:
            self._complete(inst, call)
        if opts is not None and opts.asyncOp is False:
            _wait_for(self, inst)
            waited = self._sync_handle
            if waited is None:
                waited = self._sync_handle = _Waited(self)
            waited._result = result if result is not None else tensors
            return waited
        return _CollectiveWork(self, inst, result if result is not None else list(tensors))

    def _refuse(self, call: CollectiveCall, problem: str | None,
                strided: tuple[str, torch.Tensor, str] | None) -> None:
        """Raise for ``call`` (just recorded): the world is broken, or this member's buffers are wrong."""
        broken = self._sched.broken
        if broken is not None:
            raise collective_error(broken, self._global_rank)
        if problem is not None:  # this member's own buffers are wrong: it raises, as a real backend does
            raise InvalidArgument(f"{call.describe()}: on rank {self._global_rank}, {problem}")
        if strided is not None:  # a view a real backend computes wrongly or refuses: it raises here
            raise ops.strided_view_error(call, strided)

    def _complete(self, inst: _Instance, call: CollectiveCall) -> None:
        """The last member arrived (``call`` is its): check the instance, compute it, wake its members."""
        state = self._state
        del state.pending[inst.index]
        if inst.sigs is not None:
            self._mismatch(inst)
        if inst.contrib is not None:
            self._verify_checksums(inst)
        # Grad mode off without a context manager (cheaper on this hot path): the copies
        # into users' tensors must not be recorded by autograd, as in a real backend.
        grad_was = torch.is_grad_enabled()
        torch._C._set_grad_enabled(False)
        try:
            inst.compute(inst.payloads)
        except InvalidArgument as err:  # e.g. an unsupported op: every member must hear it
            self._sched.break_world(WorldBroken(
                f"{call.describe()}: {err}", collective=inst.op, call_index=call.call_index,
                group=state.name, faulty_ranks=()))
            raise
        finally:
            torch._C._set_grad_enabled(grad_was)
        inst.done = True
        slots = self._sched.slots
        for g in state.ranks:  # Scheduler.wake, inlined
            s = slots[g]
            if s.state == BLOCKED:
                s.state = READY

    def _check_helper_thread(self, op: str) -> None:
        """A thread the rank started issues ``op``: allowed only while the rank itself runs.

        In a real process the helper and the rank's main thread share one process group; here the
        rank's turn is the baton, so a helper may use it while the main thread waits for it (e.g.
        joins it), never while the main thread is itself blocked in a collective or waits for its
        turn. (A helper issuing collectives while the main thread also does cannot be told apart
        from the first case; the two race, as they would in a real process.)
        """
        slot, sched = self._slot, self._sched
        owner = threadworld.current_owner()
        if isinstance(owner, _Owner) and owner.world is self._world and owner.rank != self._global_rank:
            misuse = RuntimeError(
                f"rank {owner.rank} issued {op} on rank {self._global_rank}'s process group object ({self!r}). A "
                "process group object belongs to the rank that made it; on the inproc backend the ranks are "
                "threads of one process, so a group kept in a module global (or handed from rank to rank) "
                "reaches the other ranks. Make the module that keeps it rank-local (rank_local=(module,) / "
                "--rank-local MODULE), or run on --backend gloo.")
            caller = sched.slots[owner.rank]
            if caller.misuse is None:  # torch's logging wrapper raises its own error over this one
                caller.misuse = misuse
            raise misuse
        if slot.state == RUNNING and sched.holder == self._global_rank:
            return
        doing = slot.doing()
        err = RuntimeError(
            f"a thread started by rank {self._global_rank} issued {op} while rank {self._global_rank} itself "
            f"was not running ({doing}). On the inproc backend a rank's helper threads may issue collectives "
            "only while the rank's own thread waits for them (e.g. in Thread.join or Future.result); "
            "issue the collective from the rank's thread, or run on backend='gloo'.")
        if slot.misuse is None:  # the run fails with it even if the helper swallows it
            slot.misuse = err
        raise err

    def _mismatch(self, inst: _Instance) -> None:
        """Every member arrived but they disagree: blame the minority, break the world."""
        msg, faulty, ref = inst.mismatch_message()
        err = WorldBroken(msg, collective=ref.op, call_index=ref.call_index, group=inst.group.name,
                          faulty_ranks=faulty)
        self._world.sched.break_world(err)
        raise collective_error(err, self._global_rank)

    def _verify_checksums(self, inst: _Instance) -> None:
        """Checksum mode: every member's contribution must still be what its rank handed over."""
        bad = []
        for m in sorted(inst.contrib):
            now = checksum(inst.contrib[m])
            if now != inst.crc[m]:
                bad.append((self._state.ranks[m], inst.crc[m], now, (inst.notes or {}).get(m, "")))
        if not bad:
            return
        index = inst.call_index() or inst.index
        msg = ops.checksum_message(inst.op, index, inst.group.label, bad)
        err = WorldBroken(msg, collective=inst.op, call_index=index, group=inst.group.name,
                          faulty_ranks=tuple(r for r, *_ in bad))
        self._world.sched.break_world(err)
        raise collective_error(err, self._global_rank)

    def _inject(self, fault: Fault, call: CollectiveCall, tensors: Sequence[torch.Tensor], slot: Any) -> None:
        """Apply a Drop, Crash, Delay or Corrupt fault to ``call`` (just recorded) on this rank."""
        slot.planned_fault, slot.planned_call = fault, call
        if isinstance(fault, Drop):
            slot.dropped = True
            slot.planned = ops.DROPPED
            raise RankDropped()
        if isinstance(fault, Crash):
            slot.planned = ops.CRASHED
            raise crash(fault, call)
        if isinstance(fault, Delay):
            # A real stall, holding the baton as a busy rank would; cut short if the world
            # breaks meanwhile (its peers timed out), so the thread never outlives the run.
            # The stall's length is the rank's own time (runclock), the clock the timeout is read on:
            # a machine that deschedules the process stretches both alike, so a Delay below the
            # timeout never looks like a hang and one above it always does.
            slot.stalled_call = call
            sched = self._world.sched
            step = 0.01
            clock = runclock.RunClock(step)
            clock.start(runclock.thread_paths(threading.get_native_id()))
            try:
                while sched.broken is None:
                    left = fault.seconds - clock.sample()
                    if left <= 0:
                        break
                    time.sleep(min(left, step))
            finally:
                slot.stalled_call = None
                sched.restart_clock()  # the stall was the plan, not a hang
            if sched.broken is not None:
                slot.planned = ops.STALLED  # the world gave up while this rank was still stalled
                raise collective_error(sched.broken, self._global_rank)
            return
        if isinstance(fault, Corrupt):
            corrupt_(fault, tensors)

    # -- collectives ---------------------------------------------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        name = ops.reduce_op_name(op)

        def compute(p: dict[int, list[torch.Tensor]]) -> None:
            n = len(p)
            for i in range(len(p[0])):
                mine = [p[r][i] for r in range(n)]
                acc = _reduce_in_rank_order(mine, op, name)
                torch._foreach_copy_(mine, [acc] * n)  # one call: each rank's tensor gets the result

        strided = None if len(tensors) == 1 and tensors[0].is_contiguous() else ops.strided_view("all_reduce", tensors)
        return self._join("all_reduce", tensors, tensors, compute, reduce_op=op, strided=strided, op_name=name, opts=opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> _Work:
        return self.allreduce(tensors, opts)

    def reduce(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        op, root = opts.reduceOp, opts.rootRank

        def compute(p: dict[int, list[torch.Tensor]]) -> None:
            acc = _reduce_in_rank_order([p[r][0] for r in range(len(p))], op)
            p[root][0].copy_(acc)

        return self._join("reduce", tensors, tensors, compute, reduce_op=op, peer=root,
                          strided=ops.strided_view("reduce", tensors), opts=opts)

    def broadcast(self, tensors: list[torch.Tensor], opts: Any) -> _Work:
        root = opts.rootRank

        def compute(p: dict[int, list[torch.Tensor]]) -> None:
            for i, src in enumerate(p[root]):
                for r in range(len(p)):
                    if r != root:
                        p[r][i].copy_(src)

        return self._join("broadcast", tensors, tensors, compute, peer=root,
                          strided=ops.strided_view("broadcast", tensors), opts=opts)

    def _problem(self, op: str, inputs: Any, outputs: Any, root: int | None = None,
                 splits: tuple[Sequence[int], Sequence[int]] | None = None) -> str | None:
        return ops.buffer_problem(op, self._state.size, self._group_rank, root, inputs, outputs, splits)

    def allgather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
                  opts: Any = None) -> _Work:
        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            inputs = [p[r][1][0] for r in range(n)]
            for r in range(n):
                torch._foreach_copy_(list(p[r][0][0]), inputs)

        return self._join("all_gather", input_tensors, (output_tensors, input_tensors), compute,
                          result=[t for lst in output_tensors for t in lst],
                          problem=self._problem("all_gather", input_tensors, output_tensors),
                          strided=ops.strided_view("all_gather", input_tensors, output_tensors), opts=opts)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            flat = torch.cat([p[r][1].reshape(-1) for r in range(n)])
            for r in range(n):
                out = p[r][0]
                out.copy_(flat.view(out.shape))

        return self._join("all_gather_into_tensor", [input], (output, input), compute, result=[output],
                          problem=self._problem("all_gather_into_tensor", input, output),
                          strided=ops.strided_view("all_gather_into_tensor", input, output), opts=opts)

    _allgather_base = all_gather_single

    def allgather_into_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            for i in range(len(p[0][1])):
                flat = torch.cat([p[r][1][i].reshape(-1) for r in range(n)])
                for r in range(n):
                    p[r][0][i].copy_(flat.view(p[r][0][i].shape))

        problem = next((q for o, i in zip(outputs, inputs, strict=False)
                        if (q := self._problem("all_gather_into_tensor", i, o)) is not None), None)
        return self._join("all_gather_into_tensor", inputs, (outputs, inputs), compute, result=list(outputs),
                          problem=problem, strided=ops.strided_view("all_gather_into_tensor", inputs, outputs), opts=opts)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def allgather_coalesced(self, output_lists: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                            opts: Any = None) -> _Work:
        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            for r in range(n):
                outs = p[r][0]
                for src in range(n):
                    torch._foreach_copy_(list(outs[src]), list(p[src][1]))

        return self._join("all_gather", inputs, (output_lists, inputs), compute,
                          result=[t for lst in output_lists for t in lst],
                          strided=ops.strided_view("all_gather", inputs, output_lists), opts=opts)

    def reduce_scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                       opts: Any = None) -> _Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            for r in range(n):
                acc = _reduce_in_rank_order([p[k][1][0][r] for k in range(n)], op)
                p[r][0][0].copy_(acc)

        return self._join("reduce_scatter", [t for lst in input_tensors for t in lst],
                          (output_tensors, input_tensors), compute, reduce_op=op, result=list(output_tensors),
                          problem=self._problem("reduce_scatter", input_tensors, output_tensors),
                          strided=ops.strided_view("reduce_scatter", input_tensors, output_tensors), opts=opts)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> _Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            acc = _reduce_in_rank_order([p[r][1].reshape(-1) for r in range(n)], op)
            m = acc.numel() // n
            for r in range(n):
                out = p[r][0]
                out.copy_(acc[r * m:(r + 1) * m].view(out.shape))

        return self._join("reduce_scatter_tensor", [input], (output, input), compute, reduce_op=op,
                          result=[output], problem=self._problem("reduce_scatter_tensor", input, output),
                          strided=ops.strided_view("reduce_scatter_tensor", input, output), opts=opts)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter_tensor_coalesced(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                                        opts: Any = None) -> _Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM

        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            for i in range(len(p[0][1])):
                acc = _reduce_in_rank_order([p[r][1][i].reshape(-1) for r in range(n)], op)
                m = acc.numel() // n
                for r in range(n):
                    out = p[r][0][i]
                    out.copy_(acc[r * m:(r + 1) * m].view(out.shape))

        problem = next((q for o, i in zip(outputs, inputs, strict=False)
                        if (q := self._problem("reduce_scatter_tensor", i, o)) is not None), None)
        return self._join("reduce_scatter_tensor", inputs, (outputs, inputs), compute, reduce_op=op,
                          result=list(outputs), problem=problem,
                          strided=ops.strided_view("reduce_scatter_tensor", inputs, outputs), opts=opts)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def scatter(self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]],
                opts: Any) -> _Work:
        root = opts.rootRank

        def compute(p: dict[int, tuple]) -> None:
            src = p[root][1][0]
            for r in range(len(p)):
                p[r][0][0].copy_(src[r])

        sent = input_tensors[0] if input_tensors else []
        return self._join("scatter", list(sent) or list(output_tensors), (output_tensors, input_tensors),
                          compute, peer=root, result=list(output_tensors),
                          problem=self._problem("scatter", input_tensors, output_tensors, root),
                          strided=ops.strided_view("scatter", input_tensors, output_tensors), opts=opts)

    def gather(self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor],
               opts: Any) -> _Work:
        root = opts.rootRank

        def compute(p: dict[int, tuple]) -> None:
            outs = p[root][0][0]
            for r in range(len(p)):
                outs[r].copy_(p[r][1][0])

        return self._join("gather", input_tensors, (output_tensors, input_tensors), compute, peer=root,
                          result=[t for lst in output_tensors for t in lst],
                          problem=self._problem("gather", input_tensors, output_tensors, root),
                          strided=ops.strided_view("gather", input_tensors, output_tensors), opts=opts)

    def alltoall(self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor],
                 opts: Any = None) -> _Work:
        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            for r in range(n):
                torch._foreach_copy_(list(p[r][0]), [p[k][1][r] for k in range(n)])

        return self._join("all_to_all", input_tensors, (output_tensors, input_tensors), compute,
                          result=list(output_tensors),
                          problem=self._problem("all_to_all", input_tensors, output_tensors),
                          strided=ops.strided_view("all_to_all", input_tensors, output_tensors), opts=opts)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes: list[int],
                          input_split_sizes: list[int], opts: Any = None) -> _Work:
        def compute(p: dict[int, tuple]) -> None:
            n = len(p)
            chunks = []
            for k in range(n):
                _, inp, _, in_splits = p[k]
                sizes = list(in_splits) if in_splits else [inp.shape[0] // n] * n
                chunks.append(torch.split(inp, sizes, dim=0))
            for r in range(n):
                out = p[r][0]
                out.copy_(torch.cat([chunks[k][r] for k in range(n)], dim=0).view(out.shape))

        splits = (list(output_split_sizes), list(input_split_sizes))
        return self._join("all_to_all_single", [input], (output, input, *splits), compute, result=[output],
                          problem=self._problem("all_to_all_single", input, output, splits=splits),
                          strided=ops.strided_view("all_to_all_single", input, output), opts=opts)

    alltoall_base = all_to_all_single

    def barrier(self, opts: Any = None) -> _Work:
        return self._join("barrier", [], None, lambda p: None, result=[], opts=opts)

    def monitored_barrier(self, timeout: Any = None, wait_all_ranks: bool = False) -> None:
        self.barrier().wait()

    # -- point to point (a send completes when its recv is posted; a recv when its send is) -------
    def _p2p_call(self, op: str, tensors: list[torch.Tensor], peer: int) -> tuple[int, Fault | None]:
        state = self._state
        slot = self._slot
        if slot.dropped:
            raise RankDropped()
        if slot.thread_ident != threading.get_ident():
            self._check_helper_thread(op)
        me = self._group_rank
        index = state.numbered[me] = state.numbered[me] + 1
        shapes, dtypes = _sig(tensors)
        call = CollectiveCall(rank=self._global_rank, op=op, group=state.name,
                              group_ranks=state.ranks, call_index=index, shapes=shapes,
                              dtypes=dtypes, peer=None if peer < 0 else state.ranks[peer])
        slot.calls.append(call)
        if self._sched.broken is not None:
            raise collective_error(self._sched.broken, self._global_rank)
        strided = ops.strided_view(op, tensors)
        if strided is not None:  # gloo refuses a non-contiguous p2p tensor; NCCL sends its storage
            raise ops.strided_view_error(call, strided)
        rf = self._rf
        fault = rf.next_call(call) if rf is not None else None
        if fault is not None and not isinstance(fault, Mismatch):
            if op == "send" or not isinstance(fault, Corrupt):  # a recv buffer is no contribution
                self._inject(fault, call, tensors, slot)
        return index, fault

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int = 0) -> _Work:
        state, me = self._state, self._group_rank
        index, fault = self._p2p_call("send", tensors, dst)
        sent = [t.detach().clone() for t in tensors]  # the data as it was at send time
        if isinstance(fault, Mismatch):  # at a send, a mismatch changes what is sent
            if fault.what == "dtype":
                sent = [t.to(torch.float32 if t.dtype == torch.float64 else torch.float64) for t in sent]
            else:
                sent = [torch.cat([t.reshape(-1), t.reshape(-1)[:1]]) if t.numel() else torch.zeros(1) for t in sent]
        state.posted += 1
        msg = _Message(me, dst, tag, index, sent, state.posted)
        waiting = state.recvs.get((dst, tag))
        posted = next((p for p in waiting if p.src is None or p.src == me), None) if waiting else None
        if posted is not None:  # the receiver is there already: matched now
            waiting.remove(posted)  # type: ignore[union-attr]
            posted.msg, msg.recv = msg, posted
            self._sched.wake(state.ranks[dst])
        else:
            state.sends.setdefault((me, dst, tag), deque()).append(msg)
        if self._world.buffered_sends:  # TPSIM_BUFFERED_SENDS=1: eager sends, complete at once
            return _done_work(self, tensors)
        return _Work(self, lambda: msg.recv is not None, _P2PWait("send", state, me, dst, tag, index), tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int = 0) -> _Work:
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> _Work:
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> _Work:
        state, me = self._state, self._group_rank
        index, _ = self._p2p_call("recv", tensors, -1 if src is None else src)
        posted = _Posted(me, src, tag, index)
        sources = range(state.size) if src is None else (src,)
        queues = [q for s in sources if (q := state.sends.get((s, me, tag)))]
        if queues:  # a send is there already: the oldest one (any source: the first posted)
            queue = min(queues, key=lambda q: q[0].order)
            msg = queue.popleft()
            posted.msg, msg.recv = msg, posted
            self._sched.wake(state.ranks[msg.src])
        else:
            state.recvs.setdefault((me, tag), deque()).append(posted)

        def finish() -> None:
            msg = posted.msg
            for dst, data in zip(tensors, msg.data, strict=False):  # type: ignore[union-attr]
                if dst.shape != data.shape or dst.dtype != data.dtype:
                    sender = f"rank {state.ranks[msg.src]}"  # type: ignore[union-attr]
                    raise CollectiveError(
                        f"recv #{index} on group {state.label}: expected shape {tuple(dst.shape)} "
                        f"dtype {_dtype_name(dst.dtype)}, {sender} sent shape {tuple(data.shape)} "
                        f"dtype {_dtype_name(data.dtype)}",
                        rank=self._global_rank, collective="recv", call_index=index, group=state.name,
                        faulty_ranks=(state.ranks[msg.src],))  # type: ignore[union-attr]
                dst.copy_(data)

        return _Work(self, lambda: posted.msg is not None, _P2PWait("recv", state, me, src, tag, index), tensors,
                     finish)


# ----------------------------------------------------------------------------------------
# Backend registration
# ----------------------------------------------------------------------------------------
_registered = False
_register_lock = threading.Lock()


def _create_pg(opts: Any, backend_options: Any = None) -> InprocProcessGroup:
    owner = threadworld.current_owner()
    if not isinstance(owner, _Owner):
        raise RuntimeError(
            "the 'inproc' backend only works inside a rank started by tpsim.run(..., backend='inproc') "
            "(or a thread such a rank started)")
    world = owner.world
    # The default group is created with an empty rank list: it spans the whole world (and only it is
    # named "world"; a new_group of every rank is another group, named by its ranks or description).
    is_world = not opts.global_ranks_in_group
    ranks = tuple(opts.global_ranks_in_group) or tuple(range(world.world_size))
    state = world.group(str(opts.group_id), ranks, is_world)
    return InprocProcessGroup(world, state, int(opts.group_rank), owner.rank)


def register() -> None:
    """Register the ``inproc`` backend with torch.distributed (idempotent).

    Registering only names the backend; the per-thread routing that lets threads act as ranks
    is installed by each world while it runs (:func:`tpsim.comm.threadworld.installed`).
    """
    global _registered
    with _register_lock:
        if _registered:
            return
        dist.Backend.register_backend(BACKEND_NAME, _create_pg, extended_api=True, devices=["cpu"])
        # dist.get_backend() says "gloo" (a CPU backend, the path code asking "is this gloo?" takes), and
        # a group asked for as gloo or nccl inside a world is an inproc group too.
        backend_names.present_as(BACKEND_NAME, "gloo",
                                 aliases={"gloo": BACKEND_NAME, "nccl": BACKEND_NAME, BACKEND_NAME: BACKEND_NAME})
        _registered = True


# ----------------------------------------------------------------------------------------
# The runner
# ----------------------------------------------------------------------------------------
class _Owner:
    """Which rank of which world a thread acts for (threadworld's per-thread owner)."""

    __slots__ = ("rank", "world")

    def __init__(self, world: _SimWorld, rank: int) -> None:
        self.world = world
        self.rank = rank


class _Outcome:
    __slots__ = ("error", "tb", "value")

    def __init__(self) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.tb = ""


class RankDropped(BaseException):
    """Internal: unwinds a rank that a fault plan drops (it stops, as a dead process would).

    A BaseException so that ``except Exception`` in user code cannot swallow it.
    """


def _choose_cpu() -> int | None:
    """One CPU for all rank threads of a world (None: leave affinity alone).

    Only one rank runs at a time, so nothing is lost by sharing one CPU, and every
    hand-off then stays on it: handing the baton to a thread parked on another
    (possibly idle, on a VM halted) CPU cost ~2x on small ops here, in wake-up latency
    and cold caches. Set ``TPSIM_INPROC_PIN=0`` to turn this off.
    """
    if os.environ.get("TPSIM_INPROC_PIN", "1") == "0" or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = sorted(os.sched_getaffinity(0))
    return cpus[_spread_index() % len(cpus)] if cpus else None


def _spread_index() -> int:
    """Which CPU slot this process's worlds take, so concurrent worlds land on different CPUs.

    Under pytest-xdist each worker is named ``gw0``, ``gw1``, ...: worker k takes CPU k (mod
    the allowed count), so two workers never share one while another idles, as two pids of
    the same parity would. Otherwise the pid spreads unrelated processes.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if worker.startswith("gw") and worker[2:].isdigit():
        return int(worker[2:])
    return os.getpid()


def _pin(cpu: int | None) -> None:
    if cpu is None:
        return
    tid = threading.get_native_id()
    try:
        os.sched_setaffinity(tid, {cpu})
    except OSError:  # not permitted in some sandboxes: run unpinned
        pass
    # SCHED_BATCH: a woken thread does not preempt the running one. At a hand-off the rank
    # that released the baton goes on to block (dropping the GIL) before the next rank runs,
    # instead of that rank waking first, finding the GIL taken and sleeping again: half the
    # context switches per hand-off (measured ~2x cheaper hand-offs at 16-64 ranks).
    # Per thread: the caller's own threads keep their policy. TPSIM_INPROC_BATCH=0 turns it off.
    if os.environ.get("TPSIM_INPROC_BATCH", "1") == "0":
        return
    try:
        os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
    except (OSError, AttributeError):  # not on this platform, or not permitted
        pass


def _rank_main(world: _SimWorld, rank: int, fn: Callable, args: tuple, kwargs: dict,
               outcome: _Outcome) -> None:
    _pin(world.cpu)
    # OpenMP's thread count is per calling thread: without this a rank thread would start
    # its own team, whose workers spin on the same pinned CPU (measured: 100x slower ops).
    torch.set_num_threads(1)
    threadworld.enter_rank_world(_Owner(world, rank))
    sched = world.sched
    sched.slots[rank].thread_ident = threading.get_ident()
    sched.slots[rank].native_id = threading.get_native_id()
    note = "returned"
    try:
        sched.enter(rank)
        hook = sys.excepthook  # init_process_group prefixes the process-wide hook with "[rankN]"
        dist.init_process_group(BACKEND_NAME, rank=rank, world_size=world.world_size, store=world.store,
                                timeout=timedelta(seconds=world.timeout))
        sys.excepthook = hook
        try:
            outcome.value = fn(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except RankDropped:
        note = "was dropped"
    except WorldBroken as err:  # broken while waiting for the first baton
        outcome.error = collective_error(err, rank)
        note = "raised CollectiveError"
    except BaseException as exc:  # report everything, KeyboardInterrupt included
        if sched.slots[rank].dropped:
            note = "was dropped"  # the rank's own finally-blocks raised after the drop: still dead
        else:
            outcome.tb = format_exception(exc)
            outcome.error = printable(exc)  # a hostile __str__ must not break the report
            note = f"raised {type(exc).__name__}"
    finally:
        threadworld.leave_rank_world()
        sched.finish(rank, note)


_freeze_lock = threading.Lock()
_freeze_depth = 0
_froze = False


@contextlib.contextmanager
def _old_objects_frozen() -> Iterator[None]:
    """Keep the cyclic GC off the objects that existed before the world started.

    Rank threads allocate fast (a trace record per collective, autograd graphs), so full
    collections come often, and each one walked every object of the process (torch's modules
    and all): ~10% of a run at 32-64 ranks (measured). ``gc.freeze()`` sets the older objects
    aside for the run; ``gc.unfreeze()`` hands them back after. Nothing is collected later
    than it would be otherwise except cycles among those older objects. A process that froze
    objects itself is left as it is.
    """
    global _freeze_depth, _froze
    with _freeze_lock:
        _freeze_depth += 1
        if _freeze_depth == 1:
            _froze = gc.get_freeze_count() == 0
            if _froze:
                gc.freeze()
    try:
        yield
    finally:
        with _freeze_lock:
            _freeze_depth -= 1
            if _freeze_depth == 0 and _froze:
                gc.unfreeze()
                _froze = False


def run_inproc(fn: Callable[..., Any], world_size: int, *, args: tuple = (), kwargs: dict | None = None,
               timeout: float = 30.0, faults: Sequence[Any] = (), checksum: bool = False,
               rank_local: Sequence[Any] = (), watch: Sequence[Any] = ()) -> WorldResult:
    """Run ``fn`` on ``world_size`` rank threads; see :func:`tpsim.run_world`.

    ``rank_local`` modules get per-rank globals; ``watch`` modules are watched for shared
    globals besides those found from ``fn`` and its arguments (:mod:`tpsim.comm.modstate`).
    """
    register()
    kwargs = kwargs or {}
    local = modstate.resolve_modules(rank_local, "rank_local")
    extra = modstate.resolve_modules(watch, "watch")
    globals = ModuleGlobals(local, modstate.watched_modules(fn, args, kwargs, extra, exclude=local))
    parent_state = threadworld.ProcessLocalState.capture()
    # One intra-op thread while ranks run: the ranks are the parallelism being simulated,
    # and idle OpenMP teams of N rank threads spinning on 2 cores made every small op
    # about 2x slower (measured). Restored afterwards.
    parent_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    world = _SimWorld(world_size, timeout, faults, checksum, globals)
    outcomes = [_Outcome() for _ in range(world_size)]
    threads = [
        threading.Thread(target=_rank_main, args=(world, r, fn, args, kwargs, outcomes[r]),
                         name=f"tpsim-rank-{r}", daemon=True)
        for r in range(world_size)
    ]
    threadworld.install()
    with _old_objects_frozen():
        try:
            for t in threads:
                t.start()
            world.sched.start()
            _supervise(world)
            for t in threads:  # all finished: each is only returning from finish()
                t.join(timeout=world.timeout)
        finally:
            parent_state.restore()
            globals.restore_start()
            torch.set_num_threads(parent_threads)
            if world.sched.finished.is_set():
                threadworld.uninstall()
            else:
                # Rank threads were abandoned (still running): they keep the per-thread routing they
                # were started under, rather than reach this thread's torch.distributed world, until
                # the last of them ends.
                threading.Thread(target=_uninstall_after, args=(threads,), name="tpsim-uninstall-after",
                                 daemon=True).start()
    trace = Trace({s.rank: list(s.calls) for s in world.sched.slots})
    fired = sorted(world.faults_fired(), key=lambda item: item[1].rank)
    _raise_first_failure(outcomes, world, trace, fired)
    return WorldResult(values=[o.value for o in outcomes], trace=trace, backend=BACKEND_NAME,
                       faults_fired=fired)


def _uninstall_after(threads: list[threading.Thread]) -> None:
    for t in threads:
        t.join()
    threadworld.uninstall()


def _supervise(world: _SimWorld) -> None:
    """Wait for the world to finish, judging the running rank on its run clock meanwhile.

    A rank that runs its own code past the timeout while others wait breaks the world
    (:meth:`Scheduler.watch`); one that then still never reaches a collective again (a busy
    loop, a sleep) cannot be killed: its thread is abandoned (daemon) and the error names it.
    Both verdicts count the rank's own time (CPU and sleep, :mod:`tpsim.comm.runclock`), not
    time the machine kept it waiting; the wall-time backstop only ends a wait the machine never
    let the rank use.
    """
    sched = world.sched
    margin = 2.0
    interval = 0.05
    wall_limit = runclock.backstop(world.timeout)
    while not sched.finished.wait(interval):
        own = sched.watch(interval)
        idle = time.monotonic() - sched.last_handoff
        if own <= world.timeout + margin and idle <= wall_limit:
            continue
        running = [s for s in sched.slots if s.state == "running"]
        detail = "; ".join(s.doing() for s in running) or "no rank running"
        # What the ranks did so far, as far as it is known (an abandoned rank may still add to it).
        trace = Trace({s.rank: list(s.calls) for s in sched.slots})
        fired = world.faults_fired()
        if sched.broken is not None:
            err = sched.broken
            raise CollectiveError(
                f"{err.summary} (still running after that: {detail}; its thread is abandoned)",
                rank=running[0].rank if running else 0, collective=err.collective,
                call_index=err.call_index, group=err.group, faulty_ranks=err.faulty_ranks, trace=trace,
                faults_fired=fired)
        raise CollectiveError(
            f"the in-process world made no progress for {own:.1f} s of the running rank's own time "
            f"({idle:.1f} s of wall time; timeout {world.timeout:g} s); "
            f"{detail}. The rank threads are abandoned (daemon threads).",
            rank=running[0].rank if running else 0,
            faulty_ranks=tuple(s.rank for s in running), trace=trace, faults_fired=fired,
        )


def _raise_first_failure(outcomes: list[_Outcome], world: _SimWorld, trace: Trace,
                         fired: list[tuple[Fault, CollectiveCall]]) -> None:
    """Raise the world's error when a rank failed or was dropped (precedence: :func:`tpsim.comm.ops.explain`)."""
    globals = world.globals
    if globals is not None and globals.conflict is not None:  # two ranks rebound one module global
        globals.restore_watched()
        raise globals.conflict
    slots = world.sched.slots
    if not any(o.error is not None for o in outcomes) and not any(s.dropped or s.misuse for s in slots):
        return
    ends: dict[int, ops.RankEnd] = {}
    for r, (outcome, slot) in enumerate(zip(outcomes, slots, strict=True)):
        last = slot.calls[-1] if slot.calls else None
        exc = outcome.error
        if slot.misuse is not None and not isinstance(exc, (RankDropped, InjectedCrash)):
            exc = slot.misuse  # what the rank did wrong, whatever was raised over it or swallowed it
            outcome.tb = format_exception(exc)
        if slot.planned == ops.DROPPED:
            ends[r] = ops.RankEnd(r, ops.DROPPED, slot.planned_call, fault=slot.planned_fault)
        elif slot.planned == ops.CRASHED and isinstance(exc, InjectedCrash):
            ends[r] = ops.RankEnd(r, ops.CRASHED, slot.planned_call, error=exc, error_type=type(exc).__name__,
                                  error_text=str(exc), traceback=outcome.tb, fault=slot.planned_fault)
        elif slot.planned == ops.STALLED:
            ends[r] = ops.RankEnd(r, ops.STALLED, slot.planned_call, error=exc, fault=slot.planned_fault)
        elif exc is None:
            ends[r] = ops.RankEnd(r, ops.FINISHED, last)
        elif isinstance(exc, CollectiveError):
            ends[r] = ops.RankEnd(r, ops.COLLECTIVE, last, error=exc, error_type=type(exc).__name__,
                                  error_text=exc.summary)
        else:
            ends[r] = ops.RankEnd(r, ops.RAISED, last, error=exc, error_type=type(exc).__name__,
                                  error_text=str(exc), traceback=outcome.tb)
    err = ops.explain(ends, world_size=world.world_size, backend=BACKEND_NAME, fired=fired, timeout=world.timeout)
    err.trace = trace
    if globals is not None and not fired:
        shared = globals.exposure_error(err)  # a rank ran on another's rebinding before this failure
        if shared is not None:
            globals.restore_watched()
            raise shared from err
    cause = ends[err.rank].error if err.rank in ends else None
    if isinstance(cause, BaseException) and not isinstance(cause, CollectiveError):
        raise err from cause
    raise err from None
