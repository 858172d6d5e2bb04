"""One rank's side of a gloo/nccl world: run submitted functions in an initialised world.

:func:`worker_main` is the body of each pool process: it joins the world once, then loops —
receive a pickled ``(fn, args, kwargs)``, run it under a fresh :class:`RankSession`, send back
an :class:`Outcome`; after a run that every rank refused with its own error, the pool asks each
rank to reset its world (:func:`reset_world`: the run's subgroups destroyed, the default group
checked by a collective) before the next run. :func:`execute` (one run, value or error, plus the collective trace) is
shared with torchrun mode, where the "worker" is the launched process itself.

Nothing here may outlive the parent: SIGINT is ignored (Ctrl-C is the parent's to handle; it
kills the pool), and the parent-death watch (:mod:`tpsim.comm.lifeline`: the kernel's signal
plus a watch thread) ends the process as soon as the parent is gone.
"""

from __future__ import annotations

import ctypes
import datetime
import mmap
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch._C._distributed_c10d as _c10d
import torch.distributed as dist

from tpsim.comm import _wire, lifeline, plain
from tpsim.comm._payload import dumps, load_call
from tpsim.comm._tracing import BACKEND_NAMES, RankSession, StatusSlot, activate, register_backends
from tpsim.comm.rank_progress import RankProgress, install
from tpsim.comm.trace import CollectiveCall
from tpsim.errors import CollectiveError
from tpsim.seeding import manual_seed

__all__ = ["Outcome", "RANK_MEMORY_BYTES", "execute", "failure_outcome", "rank_memory", "reset_world", "worker_main"]

#: Seed of torch's default generator in a fresh process; reset before every run so a pooled
#: worker draws exactly what a newly started process would.
_FRESH_SEED = torch.initial_seed()

@dataclass
class Outcome:
    """What one rank reports about one run.

    ``value`` is the pickled return value (kept as bytes so that a value the parent cannot
    unpickle is reported as that rank's problem, not as a broken pipe). On failure ``error``
    is the pickled exception when it pickles, and ``error_type``/``error_text``/``traceback``
    always describe it. ``collective`` says the failure came out of a collective (a peer died,
    raised or timed out) rather than from the rank's own code.
    """

    rank: int
    ok: bool
    value: bytes | None = None
    error: bytes | None = None
    error_type: str = ""
    error_text: str = ""
    traceback: str = ""
    collective: bool = False
    failed_call: CollectiveCall | None = None
    calls: list[CollectiveCall] = field(default_factory=list)
    #: ``(fault, call)`` for every fault of the plan that acted on this rank.
    fired: list[Any] = field(default_factory=list)
    #: The failure left the world usable (every member refused the same verified collective).
    intact: bool = False
    #: The run destroyed the default group (or left this process without one): the world is gone.
    world_lost: bool = False
    #: ``value`` and ``error`` are plain data for a judge that never imports user code (:mod:`tpsim.comm.plain`).
    plain: bool = False


def failure_outcome(
    rank: int, exc: BaseException, session: RankSession | None, *, tb: str | None = None, prefix: str = "",
    plain_data: bool = False,
) -> Outcome:
    text = tb if tb is not None else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    from tpsim.comm.scheduler import printable

    exc = printable(exc)  # a hostile __str__ must not break the report
    try:
        pickled: bytes | None = plain.dumps(exc) if plain_data else dumps(exc)
        (plain.loads if plain_data else pickle.loads)(pickled)  # some pickle but cannot be rebuilt; find out here
    except Exception:
        pickled = None
    collective = isinstance(exc, CollectiveError) or (session is not None and session.failed_call is not None)
    return Outcome(
        rank=rank,
        ok=False,
        error=pickled,
        error_type=type(exc).__name__,
        error_text=prefix + str(exc),
        traceback=text,
        collective=collective,
        failed_call=session.failed_call if session is not None else None,
        calls=list(session.calls) if session is not None else [],
        fired=list(session.rank_faults.fired) if session is not None else [],
        intact=isinstance(exc, CollectiveError) and exc.world_intact,
        plain=plain_data,
    )


def _reset_process_state() -> None:
    """Undo what a previous run may have changed that a fresh process would not have."""
    manual_seed(_FRESH_SEED)  # every generator this process can draw from (tpsim.seeding)
    torch.set_default_dtype(torch.float32)
    torch.set_grad_enabled(True)


def _waited(value: Any) -> Any:
    """``value`` with every functional-collective result waited for.

    DTensor and ``torch.distributed._functional_collectives`` return ``AsyncCollectiveTensor``s,
    and view ops such as ``detach()`` keep them un-waited. Pickling reads the storage without
    going through torch's dispatcher, so it would ship the buffer before the collective wrote
    it; in a process of its own the rank would have waited as soon as it read the data.
    """
    fc = sys.modules.get("torch.distributed._functional_collectives")
    act = getattr(fc, "AsyncCollectiveTensor", None)
    if act is None:  # never imported: nothing can be pending
        return value
    from torch.utils._pytree import tree_map_only

    return tree_map_only(act, lambda t: t.wait(), value)


def execute(
    rank: int,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    *,
    timeout: float,
    faults: tuple[Any, ...] = (),
    status: StatusSlot | None = None,
    checksum: bool = False,
    plain_data: bool = False,
) -> Outcome:
    """Run ``fn(*args, **kwargs)`` on this rank in the already-initialised world; never raises.

    The run gets a fresh :class:`RankSession` (call indices from 1, the run's timeout on every
    group) and the process state of a fresh process (RNG seed, default dtype, grad mode).
    ``plain_data``: the value or error is sent as plain data (:mod:`tpsim.comm.plain`).
    """
    session = RankSession(rank, timeout=timeout, faults=faults, status=status, checksum=checksum)
    _reset_process_state()
    with activate(session):
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit from fn is a failure of that rank too
            session.status.set("idle", session.last_call)
            return failure_outcome(rank, exc, session, plain_data=plain_data)
    session.status.set("idle", session.last_call)
    try:
        # Tensors as raw bytes (plain pickle.loads reads it); plain data: nothing of the user's either.
        value_bytes = (plain.dumps if plain_data else _wire.dumps)(_waited(value))
    except Exception as exc:
        return failure_outcome(
            rank, exc, session,
            prefix=f"fn returned a value of type {type(value).__name__} that cannot be pickled "
            "back to the parent process: ", plain_data=plain_data,
        )
    return Outcome(rank=rank, ok=True, value=value_bytes, calls=list(session.calls),
                   fired=list(session.rank_faults.fired), plain=plain_data)


# -- the pool process ------------------------------------------------------------------------

#: Bytes of each rank's status slot (see tpsim.comm._tracing.StatusSlot).
_STATUS_BYTES = 192
_PROGRESS_WORDS = RankProgress.length(1)
#: Bytes of shared memory per rank: its status slot, then its progress record (one rank), 64-byte aligned.
RANK_MEMORY_BYTES = -(-(_STATUS_BYTES + 8 * _PROGRESS_WORDS) // 64) * 64


def rank_memory(buffer: Any, rank: int) -> tuple[Any, Any]:
    """Rank ``rank``'s status slot (a ``c_char`` array) and progress (``c_int64``) in ``buffer``, the
    pool's shared memory (an mmap of ``world_size * RANK_MEMORY_BYTES`` bytes)."""
    offset = rank * RANK_MEMORY_BYTES
    slot = (ctypes.c_char * _STATUS_BYTES).from_buffer(buffer, offset)
    progress = (ctypes.c_int64 * _PROGRESS_WORDS).from_buffer(buffer, offset + _STATUS_BYTES)
    return slot, progress


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)



def _destroy_groups_created_since(before: set[Any]) -> None:
    """Drop subgroups a run made (dist.new_group), so runs do not pile up gloo connections."""
    world = dist.distributed_c10d._world
    for pg in list(world.pg_map):
        if pg not in before and pg is not dist.GroupMember.WORLD:
            dist.destroy_process_group(pg)


def reset_world(rank: int, world: Any, before: set[Any], nonce: int, timeout: float) -> str | None:
    """Make this rank's world as a fresh pool's after a run its ranks refused; None when it is healthy,
    else why it is not (the pool is then replaced).

    The run's subgroups are destroyed, and the default group is checked with one all_gather on the
    real backend (bounded by ``timeout``): every member must contribute exactly ``(nonce, rank)``.
    A collective a rank left unmatched would take that all_gather's place, deliver other data or
    never complete: either way the check fails.
    """
    if not dist.is_initialized() or dist.GroupMember.WORLD is not world:
        return "the run destroyed the default group"
    try:
        _destroy_groups_created_since(before)
    except Exception as exc:  # noqa: BLE001 - said in the replacement's reason
        return f"could not destroy the run's subgroups ({type(exc).__name__}: {exc})"
    inner = getattr(world, "inner", world)
    size = world.size()
    device = torch.device("cuda", torch.cuda.current_device()) if getattr(world, "_device_type", "cpu") == "cuda" else None
    mine = torch.tensor([nonce, rank], dtype=torch.int64, device=device)
    everyone = [torch.empty_like(mine) for _ in range(size)]
    try:
        inner.set_timeout(datetime.timedelta(seconds=timeout))
        inner.allgather([everyone], [mine], _c10d.AllgatherOptions()).wait()
    except Exception as exc:  # noqa: BLE001 - said in the replacement's reason
        return f"the default group failed its check ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
    got = [tuple(int(v) for v in t.tolist()) for t in everyone]
    if got != [(nonce, r) for r in range(size)]:
        return f"the default group's check delivered {got}, not each rank's own (nonce, rank)"
    return None


def worker_main(
    conn: Any,
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    memory_path: str,
    parent_pid: int,
    init_timeout: float,
    pdeathsig: bool = False,
    threads: int = 0,
) -> None:
    """Body of one pool process: join the world once, then serve runs until told to stop.

    ``memory_path``: the pool's shared memory (:func:`rank_memory`: this rank's status slot, and its
    :class:`~tpsim.comm.rank_progress.RankProgress`, the phase it marks, read by the pool if the process dies);
    ``pdeathsig``: the parent thread lives as long as the parent, so the kernel's parent-death signal
    may be armed (see :mod:`tpsim.comm.lifeline`); ``threads``: torch's intra-op threads (0: this
    machine's cores shared among the ranks; 1 for a process forked from one whose OpenMP pool may
    have started, which a forked process cannot use).
    """
    # First, before anything that takes time: a worker must never outlive the parent.
    from tpsim.comm.forker import own_group

    own_group()  # what this rank forks ends with it (procs kills the group)
    lifeline.arm(parent_pid=parent_pid, pdeathsig=pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    shared = _map(memory_path, world_size * RANK_MEMORY_BYTES)
    status_buffer, progress_buffer = rank_memory(shared, rank)
    progress = RankProgress(progress_buffer)
    install(progress)
    status = StatusSlot(status_buffer)
    try:
        # Ranks share this machine's cores; one pool of threads each would oversubscribe them.
        torch.set_num_threads(threads or max(1, (os.cpu_count() or 1) // world_size))
        register_backends(loopback=True)
        if backend == "nccl":
            torch.cuda.set_device(rank)
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            BACKEND_NAMES[backend],
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=init_timeout),
        )
    except BaseException as exc:
        conn.send(("init-error", failure_outcome(rank, exc, None)))
        _exit(1)
    threads = torch.get_num_threads()
    world = dist.GroupMember.WORLD
    before: set[Any] = set(dist.distributed_c10d._world.pg_map)
    status.set("idle")
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # parent closed its end: nothing more will come
            _exit(0)
        if message[0] == "stop":
            _exit(0)
        if message[0] == "reset":
            why = reset_world(rank, world, before, message[1], message[2])
            torch.set_num_threads(threads)
            try:
                conn.send(("reset", why))
            except (EOFError, OSError):
                _exit(0)
            continue
        _, payload, hints, timeout, faults, checksum, plain_data = message
        progress.begin(0, 1)  # this process runs one rank: slot 0 of its progress record
        progress.handoff(0)
        before = set(dist.distributed_c10d._world.pg_map)
        try:
            fn, args, kwargs = load_call(payload, hints)
        except BaseException as exc:
            outcome = failure_outcome(
                rank, exc, None,
                prefix="could not load fn in the worker process (is its module importable there?): ",
                plain_data=plain_data,
            )
        else:
            outcome = execute(rank, fn, args, kwargs, timeout=timeout, faults=faults, status=status,
                              checksum=checksum, plain_data=plain_data)
        outcome.world_lost = not dist.is_initialized() or dist.GroupMember.WORLD is not world
        if (outcome.ok or outcome.intact) and not outcome.world_lost:  # the world lives on: drop this run's subgroups
            try:
                _destroy_groups_created_since(before)
            except BaseException as exc:
                outcome = failure_outcome(rank, exc, None, prefix="could not clean up the groups fn created: ",
                                          plain_data=plain_data)
        torch.set_num_threads(threads)
        try:
            conn.send_bytes(_wire.dumps(("done", outcome)))  # read by conn.recv(): plain pickle
        except (EOFError, OSError):
            _exit(0)


def _exit(code: int) -> None:
    """Leave without running atexit/finalizers, which could block on a broken world."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
