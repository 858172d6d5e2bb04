"""One rank's side of a gloo/nccl world: run submitted functions in an initialised world.

:func:`worker_main` is the body of each pool process: it joins the world once, then loops —
receive a pickled ``(fn, args, kwargs)``, run it under a fresh :class:`RankSession`, send back
an :class:`Outcome`. :func:`execute` (one run, value or error, plus the collective trace) is
shared with torchrun mode, where the "worker" is the launched process itself.

Nothing here may outlive the parent: SIGINT is ignored (Ctrl-C is the parent's to handle; it
kills the pool), and the parent-death watch (:mod:`tpsim.comm.lifeline`: the kernel's signal
plus a watch thread) ends the process as soon as the parent is gone.
"""

from __future__ import annotations

import datetime
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from tpsim.comm import lifeline
from tpsim.comm._payload import dumps, load_call
from tpsim.comm._tracing import BACKEND_NAMES, RankSession, StatusSlot, activate, register_backends
from tpsim.comm.board import Board, install
from tpsim.comm.trace import CollectiveCall
from tpsim.errors import CollectiveError

__all__ = ["Outcome", "execute", "failure_outcome", "worker_main"]

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


def failure_outcome(
    rank: int, exc: BaseException, session: RankSession | None, *, tb: str | None = None, prefix: str = ""
) -> Outcome:
    text = tb if tb is not None else "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        pickled: bytes | None = dumps(exc)
        pickle.loads(pickled)  # some exceptions pickle but cannot be rebuilt; find out here
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
    )


def _reset_process_state() -> None:
    """Undo what a previous run may have changed that a fresh process would not have."""
    torch.manual_seed(_FRESH_SEED)
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
) -> Outcome:
    """Run ``fn(*args, **kwargs)`` on this rank in the already-initialised world; never raises.

    The run gets a fresh :class:`RankSession` (call indices from 1, the run's timeout on every
    group) and the process state of a fresh process (RNG seed, default dtype, grad mode).
    """
    session = RankSession(rank, timeout=timeout, faults=faults, status=status, checksum=checksum)
    _reset_process_state()
    with activate(session):
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # SystemExit from fn is a failure of that rank too
            session.status.set("idle", session.last_call)
            return failure_outcome(rank, exc, session)
    session.status.set("idle", session.last_call)
    try:
        value_bytes = dumps(_waited(value))
    except Exception as exc:
        return failure_outcome(
            rank, exc, session,
            prefix=f"fn returned a value of type {type(value).__name__} that cannot be pickled "
            "back to the parent process: ",
        )
    return Outcome(rank=rank, ok=True, value=value_bytes, calls=list(session.calls),
                   fired=list(session.rank_faults.fired))


# -- the pool process ------------------------------------------------------------------------


def _destroy_groups_created_since(before: set[Any]) -> None:
    """Drop subgroups a run made (dist.new_group), so runs do not pile up gloo connections."""
    world = dist.distributed_c10d._world
    for pg in list(world.pg_map):
        if pg not in before and pg is not dist.GroupMember.WORLD:
            dist.destroy_process_group(pg)


def worker_main(
    rank: int,
    world_size: int,
    backend: str,
    store_path: str,
    conn: Any,
    status_buffer: Any,
    parent_pid: int,
    init_timeout: float,
    board_buffer: Any = None,
    pdeathsig: bool = False,
) -> None:
    """Body of one pool process: join the world once, then serve runs until told to stop.

    ``board_buffer``: this rank's :class:`~tpsim.comm.board.Board` (the phase it marks, read by the
    pool if the process dies); ``pdeathsig``: the parent thread lives as long as the parent, so the
    kernel's parent-death signal may be armed (see :mod:`tpsim.comm.lifeline`).
    """
    # First, before anything that takes time: a worker must never outlive the parent.
    lifeline.arm(parent_pid=parent_pid, pdeathsig=pdeathsig)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    board = Board(board_buffer) if board_buffer is not None else None
    install(board)
    status = StatusSlot(status_buffer)
    try:
        # Ranks share this machine's cores; one pool of threads each would oversubscribe them.
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
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
    status.set("idle")
    conn.send(("ready", os.getpid()))
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):  # parent closed its end: nothing more will come
            _exit(0)
        if message[0] == "stop":
            _exit(0)
        _, payload, hints, timeout, faults, checksum = message
        if board is not None:  # this process runs one rank: slot 0 of its board
            board.begin(0, 1)
            board.handoff(0)
        before = set(dist.distributed_c10d._world.pg_map)
        try:
            fn, args, kwargs = load_call(payload, hints)
        except BaseException as exc:
            outcome = failure_outcome(
                rank, exc, None,
                prefix="could not load fn in the worker process (is its module importable there?): ",
            )
        else:
            outcome = execute(rank, fn, args, kwargs, timeout=timeout, faults=faults, status=status,
                              checksum=checksum)
        if outcome.ok or outcome.intact:  # the world lives on: drop this run's subgroups
            try:
                _destroy_groups_created_since(before)
            except BaseException as exc:
                outcome = failure_outcome(rank, exc, None, prefix="could not clean up the groups fn created: ")
        torch.set_num_threads(threads)
        try:
            conn.send(("done", outcome))
        except (EOFError, OSError):
            _exit(0)


def _exit(code: int) -> None:
    """Leave without running atexit/finalizers, which could block on a broken world."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
