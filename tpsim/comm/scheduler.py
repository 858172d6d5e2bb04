"""The in-process scheduler: threads as ranks, one rank running at a time.

Ranks hand a *baton* to each other. The running rank keeps it until it must wait (a
collective whose peers have not arrived yet, a ``recv`` with no message) or finishes;
then it passes the baton to the next ready rank in rank order. Consequences, all wanted:

- determinism: the interleaving depends only on the program, never on the OS scheduler;
- per-rank process state (RNG, default dtype) can be swapped exactly at each hand-off;
- a deadlock is *known*, not guessed: when the running rank must wait and no other rank
  is ready, no rank can ever proceed — every waiting rank gets an error at once, naming
  what each rank is doing;
- the cost of a collective is a few lock operations, not a wake-up storm of N threads.

Every wait is bounded. A rank that runs its own code for longer than the world's timeout
without reaching a collective makes the others time out with a message saying so; that time is
the rank's own (:mod:`tpsim.comm.runclock`: CPU time it used and time it slept by choice), never
wall time that includes stretches the process was descheduled, so a busy machine does not make a
correct rank look stuck. The world's supervisor (:meth:`Scheduler.watch`) is the one judge; a
waiting rank only wakes now and then to see whether the world broke (or, past the wall-time
:func:`~tpsim.comm.runclock.backstop`, ends the wait itself).
"""

from __future__ import annotations

import builtins
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from tpsim.comm import board, ops, runclock
from tpsim.comm.modstate import ModuleGlobals
from tpsim.comm.threadworld import ProcessLocalState
from tpsim.comm.trace import CollectiveCall
from tpsim.errors import CollectiveError, SharedModuleState

__all__ = ["RankSlot", "Scheduler", "Wait", "WorldBroken"]

# Bound once: read on every hand-off (each a module-global lookup instead of two attribute lookups).
_get_rng_state = torch.default_generator.get_state
_set_rng_state = torch.default_generator.set_state
_get_default_dtype = torch.get_default_dtype
_monotonic = time.monotonic

# Rank states.
NEW, RUNNING, READY, BLOCKED, DONE = "new", "running", "ready", "blocked", "done"


class WorldBroken(Exception):
    """Internal: the world can no longer make progress; carries the explanation."""

    def __init__(self, summary: str, *, collective: str | None, call_index: int | None,
                 group: str | None, faulty_ranks: tuple[int, ...]) -> None:
        super().__init__(summary)
        self.summary = summary
        self.collective = collective
        self.call_index = call_index
        self.group = group
        self.faulty_ranks = faulty_ranks


class Wait:
    """What a blocked rank waits for (a collective instance, a receive), as messages describe it."""

    __slots__ = ()
    op: str = ""
    group_name: str = ""

    def describe_wait(self, rank: int) -> str:
        """``all_reduce #3 on group world`` as ``rank`` issued it."""
        raise NotImplementedError

    def call_index(self) -> int | None:
        """The call index messages name this wait by."""
        raise NotImplementedError

    def describe_stuck(self, slots: list[RankSlot]) -> str:
        """Why this wait can never end, naming what each missing rank does."""
        raise NotImplementedError

    def suspects(self) -> tuple[int, ...]:
        """Ranks to blame when this wait can never end."""
        raise NotImplementedError


@dataclass(slots=True)  # slots: attribute access on every hand-off
class RankSlot:
    """Scheduler-side record of one rank."""

    rank: int
    baton: Any = field(default_factory=threading.Lock)
    state: str = NEW
    waiting_on: Wait | None = None  # while BLOCKED
    calls: list[CollectiveCall] = field(default_factory=list)
    exit_note: str = ""  # how the rank ended: "returned", "raised ValueError", "was dropped"
    saved: ProcessLocalState | None = None
    # The rank's own thread (its helper threads may issue collectives only while it runs), and
    # the first misuse of the backend the rank was refused for (a helper's collective out of turn,
    # another rank's group object): the run reports it even if something else was raised over it.
    thread_ident: int = 0
    native_id: int = 0  # the OS thread id, for the run clock (0 until the thread has started)
    misuse: BaseException | None = None
    # Set by a fault plan: the kind of end it gave the rank (ops.DROPPED, ops.CRASHED,
    # ops.STALLED), the fault and the call; stalled_call while a Delay fault sleeps.
    planned: str = ""
    planned_fault: Any = None
    planned_call: CollectiveCall | None = None
    dropped: bool = False
    stalled_call: CollectiveCall | None = None

    def last_call(self) -> str:
        return self.calls[-1].describe() if self.calls else "before its first collective"

    def doing(self) -> str:
        """What this rank is doing, for messages about other ranks."""
        planned = self.planned_call.describe() if self.planned_call is not None else ""
        if self.state == DONE and self.planned == ops.DROPPED:
            return f"rank {self.rank} {ops.dropped_text(planned, self.planned_fault)}"
        if self.state == DONE and self.planned == ops.CRASHED:
            return f"rank {self.rank} {ops.crashed_text(planned, self.planned_fault)}"
        if self.stalled_call is not None:
            return f"rank {self.rank} {ops.stalled_text(self.stalled_call.describe(), self.planned_fault)}"
        if self.state == DONE:
            after = f"after {self.last_call()}" if self.calls else "before its first collective"
            return f"rank {self.rank} {self.exit_note or 'exited'} {after}"
        if self.state == BLOCKED and self.waiting_on is not None:
            return f"rank {self.rank} is waiting in {self.waiting_on.describe_wait(self.rank)}"
        return f"rank {self.rank} is running (last: {self.last_call()})"


class Scheduler:
    """Hands the baton between the rank threads of one world."""

    def __init__(self, world_size: int, timeout: float, dtype: Any, globals: ModuleGlobals | None = None) -> None:
        self.world_size = world_size
        self.timeout = timeout
        self.slots = [RankSlot(r) for r in range(world_size)]
        #: Rank-local module globals and the shared-state watch; None when neither has work.
        self.globals = globals if globals is not None and globals.active else None
        # The two halves, each None when it has nothing to do (read on every hand-off).
        self._local = self.globals if self.globals is not None and self.globals.has_local else None
        self._watch = self.globals if self.globals is not None and self.globals.has_watch else None
        for s in self.slots:
            s.baton.acquire()  # every baton starts taken: a rank runs only when handed one
            s.saved = ProcessLocalState.fresh(dtype, self.globals.fresh() if self.globals is not None else None)
        self.broken: WorldBroken | None = None
        self.holder: int | None = None
        self.finished = threading.Event()
        self.last_handoff = time.monotonic()
        #: Counts hand-offs (and planned stalls that ended): the run clock restarts when it moves.
        self.handoffs = 0
        self._watched = -1  # the hand-off count the run clock was started at
        self._clock: runclock.RunClock | None = None
        self._lock = threading.Lock()  # only contended after a timeout (two threads awake)
        #: The rank board of an isolated worker (None elsewhere): told of every hand-off, so the
        #: worker's supervisor can name the running rank if the process dies.
        self.board = board.installed()

    # -- entering and leaving --------------------------------------------------------
    def start(self) -> None:
        """Hand the first baton to rank 0."""
        self.slots[0].state = READY
        for s in self.slots[1:]:
            s.state = READY
        self._give(0)

    def enter(self, rank: int) -> None:
        """Called by a rank thread before it runs anything: wait for the baton."""
        self._wait_baton(self.slots[rank])

    def finish(self, rank: int, note: str) -> None:
        """The rank's function ended; pass the baton on (or detect that nobody can move)."""
        slot = self.slots[rank]
        if self._watch is not None:
            self._shared_state(self._watch.leave(rank))
        slot.state = DONE
        slot.exit_note = note
        slot.saved = None
        nxt = self._next_ready(rank)
        if nxt is None:
            if any(s.state == BLOCKED for s in self.slots):
                self._declare_stuck(None)
                nxt = self._next_ready(rank)
        if nxt is None:
            if all(s.state == DONE for s in self.slots):
                self.finished.set()
            return
        self._give(nxt)

    # -- waiting ---------------------------------------------------------------------
    def wait_until(self, rank: int, ready: Callable[[], bool], waiting_on: Any) -> None:
        """Block ``rank`` until ``ready()``; other ranks run meanwhile. Raises WorldBroken."""
        slot = self.slots[rank]
        while True:
            if self.broken is not None:
                raise self.broken
            if ready():
                return
            self.block(slot, waiting_on)

    def block(self, slot: RankSlot, waiting_on: Any) -> None:
        """Park ``slot``'s rank once: hand the baton on and wait until it comes back.

        The caller re-checks its condition afterwards (a rank is woken for any change).
        Raises WorldBroken when no other rank can run.
        (The hot path of every collective: _next_ready, _give, _wait_baton and _restore are inlined
        here, and the rank's process-local state is saved into its slot's own record, not a new one.)
        """
        slot.state = BLOCKED
        slot.waiting_on = waiting_on
        # The next READY rank after this one in ring order.
        slots = self.slots
        n = self.world_size
        r = slot.rank
        for _ in range(n - 1):
            r += 1
            if r == n:
                r = 0
            nxt = slots[r]
            if nxt.state == READY:
                break
        else:
            self._declare_stuck(slot)
            raise self.broken  # type: ignore[misc]
        watch = self._watch
        if watch is not None:
            conflict = watch.leave(slot.rank)
            if conflict is not None:  # this rank is the second to rebind a shared global: stop here
                slot.state, slot.waiting_on = RUNNING, None
                self._shared_state(conflict)
                raise self.broken  # type: ignore[misc]
        # Save this rank's process-local state (ProcessLocalState.capture, into the slot's record).
        saved = slot.saved
        saved.rng = _get_rng_state()  # type: ignore[union-attr]
        saved.dtype = _get_default_dtype()  # type: ignore[union-attr]
        local = self._local
        if local is not None:
            saved.globals = local.save()  # type: ignore[union-attr]
        # Hand the baton to the next rank (_give).
        nxt.state = RUNNING
        self.holder = r
        self.last_handoff = _monotonic()
        self.handoffs += 1
        if self.board is not None:
            self.board.handoff(r)
        try:
            nxt.baton.release()
        except RuntimeError:  # already released: only after a timeout broke the world
            pass
        # Wait for it to come back (_wait_baton): the common case is one acquire that succeeds.
        if not slot.baton.acquire(True, self.timeout):
            self._wait_longer(slot)
        self.holder = slot.rank
        # This rank's state is the process's again (_restore).
        _set_rng_state(saved.rng)  # type: ignore[union-attr]
        if _get_default_dtype() is not saved.dtype:  # type: ignore[union-attr]
            torch.set_default_dtype(saved.dtype)  # type: ignore[union-attr]
        if local is not None:
            local.restore(saved.globals)  # type: ignore[union-attr]
        if watch is not None:
            watch.enter(slot.rank)
        slot.waiting_on = None

    def wake(self, rank: int) -> None:
        """Mark a blocked rank ready (it runs when the baton reaches it)."""
        slot = self.slots[rank]
        if slot.state == BLOCKED:
            slot.state = READY

    def _shared_state(self, conflict: SharedModuleState | None) -> None:
        """Two ranks rebound one module global: the run is meaningless from here; stop it at once."""
        if conflict is not None:
            self.break_world(WorldBroken(str(conflict), collective=None, call_index=None, group=None,
                                         faulty_ranks=conflict.ranks))

    def break_world(self, err: WorldBroken) -> None:
        """Poison the world: every waiting rank wakes and raises ``err``."""
        if self.broken is None:
            self.broken = err
        for s in self.slots:
            if s.state == BLOCKED:
                s.state = READY

    # -- internals -------------------------------------------------------------------
    def _next_ready(self, rank: int) -> int | None:
        n = self.world_size
        for k in range(1, n + 1):
            r = (rank + k) % n
            if self.slots[r].state == READY:
                return r
        return None

    def _give(self, rank: int) -> None:
        slot = self.slots[rank]
        slot.state = RUNNING
        self.holder = rank
        self.last_handoff = time.monotonic()
        self.handoffs += 1
        if self.board is not None:
            self.board.handoff(rank)
        try:
            slot.baton.release()
        except RuntimeError:  # already released: only after a timeout broke the world
            pass

    def _wait_baton(self, slot: RankSlot) -> None:
        if not slot.baton.acquire(True, self.timeout):
            self._wait_longer(slot)
        self.holder = slot.rank
        self._restore(slot)

    def _wait_longer(self, slot: RankSlot) -> None:
        """The baton did not come within the timeout: keep waiting until it does or the world breaks.

        No verdict here: the supervisor judges the rank holding the baton on its run clock
        (watch). A waiter wakes now and then only to see whether the world broke meanwhile, or
        to end the wait itself past the wall-time backstop (a supervisor that cannot run)."""
        while True:
            if self.broken is not None:
                raise self.broken
            if time.monotonic() - self.last_handoff > runclock.backstop(self.timeout):
                with self._lock:
                    self._overrun(self._clock.own if self._clock is not None else 0.0, backstop=True)
                raise self.broken  # type: ignore[misc]
            if slot.baton.acquire(True, self.timeout):
                return

    def _restore(self, slot: RankSlot) -> None:
        """``slot``'s rank got the baton: make its process-local state the process's again."""
        saved = slot.saved
        if saved is not None:
            _set_rng_state(saved.rng)
            if _get_default_dtype() is not saved.dtype:
                torch.set_default_dtype(saved.dtype)
            if self._local is not None:
                self._local.restore(saved.globals)
        if self._watch is not None:
            self._watch.enter(slot.rank)

    # -- judging a rank that keeps the baton ---------------------------------------------
    def restart_clock(self) -> None:
        """The running rank's planned stall ended: its own time counts afresh (the stall was the plan)."""
        self.last_handoff = time.monotonic()
        self.handoffs += 1

    def watch(self, interval: float) -> float:
        """The running rank's own time (:mod:`tpsim.comm.runclock`) since it last got the baton.

        The supervisor calls this every ``interval`` s. Once that time passes the timeout while
        another rank waits, the world is broken naming the running rank (or the planned stall that
        holds it), and the waiters are woken to raise.
        """
        handoffs = self.handoffs
        holder = self.holder
        if holder is None or self.slots[holder].state != RUNNING:
            # The world broke and woken waiters finished: watch a rank still running its code.
            holder = next((s.rank for s in self.slots if s.state == RUNNING), None)
            if holder is None:
                return 0.0
        key = handoffs * self.world_size + holder
        clock = self._clock
        if key != self._watched or clock is None:
            native = self.slots[holder].native_id
            if not native:  # its thread has not started yet
                return 0.0
            self._watched = key
            clock = self._clock = runclock.RunClock(interval)
            clock.start(runclock.thread_paths(native))
            return 0.0
        own = clock.sample()
        if own > self.timeout and self.broken is None and any(s.state in (BLOCKED, READY) for s in self.slots):
            with self._lock:
                self._overrun(own)
        return own

    def _overrun(self, own: float, *, backstop: bool = False) -> None:
        """Break the world: the running rank kept the baton past the timeout (``own``: its own time)."""
        if self.broken is not None:
            return
        holder = self.holder
        held = self.slots[holder] if holder is not None else None
        waiters = [s for s in self.slots if s.state in (BLOCKED, READY)]  # every rank waiting for the baton
        waiter = next((s for s in waiters if s.waiting_on is not None), waiters[0] if waiters else None)
        if held is not None and held.stalled_call is not None:
            # A fault plan stalls the running rank: name it and the call it stalls before.
            call = held.stalled_call
            self.break_world(WorldBroken(
                ops.stall_message(call.describe(), self.timeout, held.rank, held.planned_fault),
                collective=call.op, call_index=call.call_index, group=call.group,
                faulty_ranks=(held.rank,)))
        else:
            who = f"rank {waiter.rank} waited for its turn: " if waiter is not None else ""
            if held is None:
                note = f"{who}no rank made progress"
            elif backstop:
                wall = time.monotonic() - self.last_handoff
                note = (f"{who}rank {held.rank} kept the baton for {wall:.0f} s of wall time without reaching a "
                        f"collective (last: {held.last_call()}), of which it ran or slept for {own:.1f} s; the "
                        "machine may have been too busy to let it run")
            else:
                note = (f"{who}rank {held.rank} has been running for over {self.timeout:g} s without reaching a "
                        f"collective (last: {held.last_call()}; its own CPU and sleep time, not counting time "
                        "the machine kept it waiting)")
            waiting = waiter.waiting_on if waiter is not None else None
            self.break_world(WorldBroken(
                f"timed out: {note}",
                collective=waiting.op if waiting is not None else None,
                call_index=waiting.call_index() if waiting is not None else None,
                group=waiting.group_name if waiting is not None else None,
                faulty_ranks=(held.rank,) if held is not None else (),
            ))
        # Wake one waiter; each rank that raises hands the baton to the next (finish).
        nxt = next((s.rank for s in self.slots if s.state == READY), None)
        if nxt is not None:
            self._give(nxt)

    def _declare_stuck(self, me: RankSlot | None) -> None:
        """No rank can proceed: explain the first unfinished wait and what every rank does."""
        blocked = [s for s in self.slots if s.state == BLOCKED]
        if me is not None and me not in blocked:
            blocked.insert(0, me)
        first = min(blocked, key=lambda s: s.rank)
        waiting = first.waiting_on
        if waiting is None:
            self.break_world(WorldBroken("no rank can proceed", collective=None, call_index=None, group=None,
                                         faulty_ranks=()))
            return
        self.break_world(WorldBroken(
            waiting.describe_stuck(self.slots),
            collective=waiting.op,
            call_index=waiting.call_index(),
            group=waiting.group_name,
            faulty_ranks=waiting.suspects(),
        ))


def collective_error(err: WorldBroken, rank: int) -> CollectiveError:
    """The error a rank raises when the world it waits in is broken."""
    return CollectiveError(
        err.summary,
        rank=rank,
        collective=err.collective,
        call_index=err.call_index,
        group=err.group,
        faulty_ranks=err.faulty_ranks,
    )


#: Formatted stack frames by where the frames stood (code, line, instruction of each frame).
_FRAMES: dict[tuple[Any, ...], str] = {}
#: Beyond this many entries the cache starts over (a bound on the code objects it keeps alive).
_FRAMES_MAX = 4096
#: Exception groups (Python 3.11+) keep the standard layout of their nested tracebacks.
_GROUPS: tuple[type, ...] = tuple(t for t in (getattr(builtins, "BaseExceptionGroup", None),) if t)
_CAUSE = "\nThe above exception was the direct cause of the following exception:\n\n"
_CONTEXT = "\nDuring handling of the above exception, another exception occurred:\n\n"


def format_exception(exc: BaseException) -> str:
    """``traceback.format_exception(exc)`` as one string, the stack frames of each traceback formatted
    once per place they stood. Every rank that refuses a size raises from the same lines, at every
    such case of a search: the standard formatter re-reads (``stat``) each frame's source file every
    time, about a tenth of a search's time on tpsim's own layers (measured)."""
    if isinstance(exc, _GROUPS):  # nested tracebacks: the standard layout
        return "".join(traceback.format_exception(exc))
    chain: list[tuple[BaseException, str]] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    link = ""
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        chain.append((e, link))
        if e.__cause__ is not None:
            e, link = e.__cause__, _CAUSE
        elif e.__context__ is not None and not e.__suppress_context__:
            e, link = e.__context__, _CONTEXT
        else:
            e = None
    out: list[str] = []
    for e, link in reversed(chain):
        if e.__traceback__ is not None:
            out.append("Traceback (most recent call last):\n")
            out.append(_frames(e.__traceback__))
        out.extend(traceback.format_exception_only(type(e), e))
        out.append(link)
    return "".join(out)


def _frames(tb: Any) -> str:
    key = []
    t = tb
    while t is not None:
        key.append((t.tb_frame.f_code, t.tb_lineno, t.tb_lasti))
        t = t.tb_next
    k = tuple(key)
    text = _FRAMES.get(k)
    if text is None:
        text = "".join(traceback.extract_tb(tb).format())
        if len(_FRAMES) >= _FRAMES_MAX:
            _FRAMES.clear()
        _FRAMES[k] = text
    return text


class UnprintableError(Exception):
    """Stands in for a rank's exception that cannot be turned into text (its ``__str__`` raises):
    names its class and what ``str()`` raised; the rank's traceback is kept."""


def text_of(exc: BaseException) -> str:
    """``str(exc)``, or a description of it when its ``__str__`` raises."""
    try:
        return str(exc)
    except BaseException as err:  # noqa: BLE001 - the exception's own code: anything may come out
        return f"<{type(exc).__qualname__}: its __str__ raised {type(err).__name__}>"


def printable(exc: BaseException) -> BaseException:
    """``exc``, or an :class:`UnprintableError` in its place when ``str(exc)`` raises: every report
    formats a rank's exception, and a hostile ``__str__`` must not take the report down with it."""
    try:
        str(exc)
        return exc
    except BaseException as err:  # noqa: BLE001 - the exception's own code: anything may come out
        try:
            why = f"{type(err).__name__}: {str(err)[:200]}"
        except BaseException:  # noqa: BLE001
            why = type(err).__name__
        cls = type(exc)
        stand_in = UnprintableError(f"{cls.__module__}.{cls.__qualname__} (its __str__ raised {why})")
        stand_in.__traceback__ = exc.__traceback__
        return stand_in
