"""The rank progress record: which rank is running and in which phase, readable after the process died.

A worker process that runs ranks may die at any instant (a segfault, ``os._exit``, the OOM killer)
or stop answering (native code holding the interpreter lock). Its supervisor then reads the progress record,
a small array in memory shared with it, to say *which rank* did it and *in which phase*:

- the in-process scheduler writes the running rank at every hand-off of the baton (one rank runs at
  a time, so this is exact), and counts the hand-offs (the supervisor's sign of progress);
- a rank marks its phase with :func:`mark_phase` (``build``, ``forward``, ``backward``, ``step``;
  the property engine's rank function does); the mark lands in the running rank's entry.

Outside a worker nothing is installed and :func:`mark_phase` returns at once, so rank functions may
call it unconditionally on every backend.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

from tpsim.errors import InvalidArgument

__all__ = ["PHASES", "RankProgress", "RankProgressView", "install", "installed", "mark_phase"]

#: The phases a rank function may mark, in the order a training step goes through them.
PHASES = ("build", "forward", "backward", "step")
_CODE = {p: i + 1 for i, p in enumerate(PHASES)}

# Worker states.
IDLE, RUNNING, REPORTING = 0, 1, 2
_STATES = {IDLE: "idle", RUNNING: "running", REPORTING: "reporting"}

# Header slots, then (phase code, step) per rank.
_RUN, _HANDOFFS, _HOLDER, _STATE = 0, 1, 2, 3
_HEADER = 4


@dataclass(frozen=True)
class RankProgressView:
    """A copy of the progress record at one moment (see :meth:`RankProgress.view`)."""

    run_id: int
    handoffs: int
    running: int | None  # the rank holding the baton, None before the first hand-off
    state: str  # "idle", "running" (ranks run), "reporting" (sending the results)
    phases: tuple[tuple[str | None, int | None], ...]  # per rank: (phase, step)

    def phase_of(self, rank: int | None) -> tuple[str | None, int | None]:
        """``(phase, step)`` rank last marked, ``(None, None)`` if it marked none."""
        if rank is None or not 0 <= rank < len(self.phases):
            return None, None
        return self.phases[rank]


class RankProgress:
    """The shared array (``ctypes`` ``c_int64``); see the module docstring."""

    __slots__ = ("buf", "capacity", "_size")

    def __init__(self, buf: Any) -> None:
        self.buf = buf
        self.capacity = (len(buf) - _HEADER) // 2
        self._size = self.capacity

    @staticmethod
    def length(capacity: int) -> int:
        """Slots of a progress record for worlds of up to ``capacity`` ranks."""
        return _HEADER + 2 * capacity

    # -- the worker's side -----------------------------------------------------------------
    def begin(self, run_id: int, world_size: int) -> None:
        """A new run of ``world_size`` ranks: clear the phases, nobody running yet."""
        self._size = min(world_size, self.capacity)
        ctypes.memset(ctypes.addressof(self.buf), 0, ctypes.sizeof(ctypes.c_int64) * self.length(self._size))
        b = self.buf
        b[_HOLDER] = -1
        b[_RUN] = run_id
        b[_STATE] = RUNNING

    def reporting(self) -> None:
        """Every rank is done; the worker is sending the results."""
        self.buf[_STATE] = REPORTING

    def idle(self) -> None:
        self.buf[_STATE] = IDLE

    def handoff(self, rank: int) -> None:
        """The scheduler handed the baton to ``rank`` (called on every hand-off: keep it cheap)."""
        b = self.buf
        b[_HOLDER] = rank
        b[_HANDOFFS] += 1

    def mark(self, code: int, step: int) -> None:
        b = self.buf
        r = b[_HOLDER]
        if 0 <= r < self._size:
            b[_HEADER + 2 * r] = code
            b[_HEADER + 2 * r + 1] = step

    # -- the supervisor's side -------------------------------------------------------------
    def handoffs(self) -> int:
        return int(self.buf[_HANDOFFS])

    def view(self, world_size: int) -> RankProgressView:
        """What the progress record says now about a world of ``world_size`` ranks."""
        b = list(self.buf)
        n = min(world_size, self.capacity)
        phases = []
        for r in range(n):
            code, step = b[_HEADER + 2 * r], b[_HEADER + 2 * r + 1]
            phases.append((PHASES[code - 1], step - 1 if step > 0 else None) if 0 < code <= len(PHASES)
                          else (None, None))
        holder = b[_HOLDER]
        return RankProgressView(run_id=b[_RUN], handoffs=b[_HANDOFFS], running=holder if 0 <= holder < n else None,
                         state=_STATES.get(b[_STATE], "idle"), phases=tuple(phases))


_INSTALLED: list[RankProgress | None] = [None]


def install(progress: RankProgress | None) -> None:
    """Make ``progress`` the one this process's scheduler and :func:`mark_phase` write to (None: off)."""
    _INSTALLED[0] = progress


def installed() -> RankProgress | None:
    """The installed progress, or None outside a worker."""
    return _INSTALLED[0]


def mark_phase(phase: str, step: int | None = None) -> None:
    """Record that the calling rank enters ``phase`` (one of :data:`PHASES`), of SGD step ``step``.

    Cheap, and a no-op outside an isolated worker. When the rank then dies or hangs, the failure
    names this phase.
    """
    progress = _INSTALLED[0]
    code = _CODE.get(phase)
    if code is None:
        raise InvalidArgument(f"phase={phase!r} is not one of {', '.join(PHASES)}")
    if progress is None:
        return
    if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 0):
        raise InvalidArgument(f"step={step!r} must be None or an int >= 0")
    progress.mark(code, 0 if step is None else step + 1)
