"""The memory a confirming run needs, and whether the machine has it.

A failure's name is confirmed by running the case again (:meth:`tpsim.props.family.Family.confirm_claims`):
in float64 where the case is narrower, on one rank where the name is a factor of the tp size. At the lab
note's sizes such a run is the size of the first one times the width ratio of the dtypes (a float32 MLP
of 4096 x 11008 grew a process by about 9 GB; its float64 run by about 19 GB): started beside the other
work of the machine, it can be killed by the kernel's OOM killer, and the whole check with it.

So the first run is measured, its observation and then its judging to the end of its explaining (a
failure's traced run beside the observation can be the peak; a confirming run has both): the process's peak
resident set while each ran, Linux's ``VmHWM``, reset through ``/proc/self/clear_refs``; an inproc world's
ranks are threads of this process. The confirming
run's need is estimated from it, and a run that would not fit in what the machine has available
(``MemAvailable``) with :data:`MARGIN` to spare is not started: the name is then not confirmed, and the
failure is reported as ``mismatch`` with the facts and why (a diagnosis is a claim: confirmed, or the
plain property name). Where the peak cannot be measured (no ``/proc``, a world of processes), nothing is
gated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = ["MARGIN", "RunMemory", "available_bytes", "measured", "too_big"]

#: A confirming run is started only where ``need * MARGIN`` fits in the available memory: the estimate
#: scales one measured run, and the rest of the machine keeps working meanwhile.
MARGIN = 1.25
_GB = 1e9


def _status_kb(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def available_bytes() -> int | None:
    """The machine's ``MemAvailable`` in bytes (None where it cannot be read)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class RunMemory:
    """How much one run grew this process (bytes; None: not measured): ``grown`` while its worlds ran
    (the observation), ``judging`` above that while it was judged and its failures explained."""

    grown: int | None = None
    judging: int | None = None


@contextlib.contextmanager
def measured() -> Iterator[RunMemory]:
    """Measure the peak growth of this process's resident set over the ``with`` block."""
    run = RunMemory()
    start = _status_kb("VmRSS")
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident set
    except OSError:
        start = None
    yield run
    peak = _status_kb("VmHWM")
    if start is not None and peak is not None:
        run.grown = max(0, peak - start) * 1024


def too_big(run: RunMemory | None, scale: float) -> str:
    """Why a run whose worlds hold ``scale`` times what the measured ``run``'s held is not started (``""``:
    it may start). Its judging is counted once, unscaled: judging compares in float64 whatever the case's
    dtype (a float32 cross-entropy at vocabulary 32000 grew 1.4 GB while its worlds ran and 7.1 GB more
    while it was judged; in float64, 2.6 GB and 6.3 GB)."""
    if run is None or run.grown is None:
        return ""
    judging = run.judging or 0
    need = run.grown * scale + judging
    have = available_bytes()
    if have is None or need * MARGIN <= have:
        return ""
    return (f"that run would need about {need / _GB:.1f} GB ({scale:g} x the {run.grown / _GB:.1f} GB this one's "
            f"worlds took, and {judging / _GB:.1f} GB to judge it) and {have / _GB:.1f} GB are available")
