"""How long a thread (or a process) had to run: the clock every "stuck" verdict is read on.

Wall time is no evidence against a rank: on a shared machine (two cores, ``pytest -n auto``, a
VM whose CPU is taken away) a correct rank can sit descheduled for seconds, and a verdict built
on wall time then blames correct code, the worst mistake a checker can make. This clock credits a
watched thread, between two samples, with

- the CPU time it used (it ran its own code), and
- the time it was neither running nor waiting for a CPU (it slept by choice: ``time.sleep``, a
  lock, native code waiting), but at most :data:`SAMPLE_CAP` times the sampling interval
  asked for: a sampler that woke much later than asked was itself kept off the CPU, or the whole
  machine stood still (a stopped or stolen VM), and such a stretch is credited to no one.

Time spent runnable but waiting for a CPU is never credited. The numbers come from Linux's
``/proc/<pid>/task/<tid>/schedstat`` (CPU time and run-queue delay, in ns); where that cannot be
read the clock credits capped wall time, which still ignores a sampler's long absences.

Every verdict also keeps a wall-time :func:`backstop`, so that a machine that never lets the rank
run still ends the wait (its message says how much of it the rank had).
"""

from __future__ import annotations

import os
import time

__all__ = ["SAMPLE_CAP", "RunClock", "backstop", "schedstat"]

#: A sample interval is credited up to this many times the interval the sampler asked for.
SAMPLE_CAP = 2.0


def backstop(timeout: float) -> float:
    """Wall seconds after which a wait ends whatever the evidence (a machine that starves the rank).

    Far beyond any load seen in practice: ten times the timeout, and at least a minute more.
    """
    return 10.0 * timeout + 60.0


def schedstat(paths: list[str]) -> tuple[float, float] | None:
    """Summed (CPU time, run-queue delay) in seconds of the tasks at ``paths``; None if none is readable."""
    cpu = delay = 0.0
    seen = False
    for path in paths:
        try:
            with open(path, "rb") as fh:
                fields = fh.read().split()
        except OSError:  # the thread ended, or no /proc
            continue
        if len(fields) >= 2:
            cpu += int(fields[0]) / 1e9
            delay += int(fields[1]) / 1e9
            seen = True
    return (cpu, delay) if seen else None


def thread_paths(native_id: int, pid: int | None = None) -> list[str]:
    """The schedstat file of thread ``native_id`` of process ``pid`` (this one by default)."""
    return [f"/proc/{pid if pid is not None else os.getpid()}/task/{native_id}/schedstat"]


def process_paths(pid: int) -> list[str]:
    """The schedstat files of every thread of process ``pid`` (read afresh: threads come and go)."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    return [f"/proc/{pid}/task/{tid}/schedstat" for tid in tids]


class RunClock:
    """Own time of one watched task since :meth:`start`, advanced by :meth:`sample`.

    ``interval`` is how often the caller means to sample (it bounds what one sample may credit).
    ``paths`` gives the schedstat files to read at each sample (a callable, so a process's thread
    list can be read afresh); for a process, the summed times work because the process is expected
    to have one task doing the work at a time (the others sleep and add nothing).
    """

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.own = 0.0
        self._paths: list[str] = []
        self._wall = 0.0
        self._stat: tuple[float, float] | None = None

    def start(self, paths: list[str]) -> None:
        """Watch the tasks at ``paths`` from now, from zero."""
        self._paths = paths
        self.own = 0.0
        self._wall = time.monotonic()
        self._stat = schedstat(paths)

    def sample(self, paths: list[str] | None = None) -> float:
        """Credit the time since the last sample (see the module's doc); returns the total own time."""
        now = time.monotonic()
        wall = now - self._wall
        self._wall = now
        stat = schedstat(paths if paths is not None else self._paths)
        cap = SAMPLE_CAP * self.interval
        if stat is None or self._stat is None:
            self.own += min(wall, cap)
        else:
            cpu = max(0.0, stat[0] - self._stat[0])
            delay = max(0.0, stat[1] - self._stat[1])
            asleep = max(0.0, wall - cpu - delay)
            self.own += min(cpu, wall) + min(asleep, cap)
        self._stat = stat
        return self.own
