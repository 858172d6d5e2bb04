"""Naming how a rank died: :class:`tpsim.RankExited` or :class:`tpsim.RankCrashed`, with rank, phase and cause.

A rank must return a value or raise. Anything else ends the rank's process in a real job, so its
peers wait for it forever; tpsim reports it as a death:

- **exited**: ``sys.exit(n)`` raised in the rank (caught on every backend), or a process that ended
  with an exit status (``os._exit(n)``, ``exit()`` from native code);
- **crashed**: a process killed by a signal (``SIGSEGV``, ``abort()``'s ``SIGABRT``, the
  out-of-memory killer's ``SIGKILL``), or a rank that ran out of memory (``MemoryError``, torch's
  "can't allocate memory" — what an address-space limit turns a runaway allocation into).

:func:`from_exit` builds the error from a process's exit status (the supervisor of an isolated
worker, the gloo pool); :func:`classify` turns a :class:`tpsim.RankError` whose rank raised
``SystemExit`` or ran out of memory into the matching death, keeping every other field.
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Callable

from tpsim.comm.scheduler import text_of
from tpsim.errors import RankCrashed, RankDied, RankError, RankExited

__all__ = ["classify", "describe_signal", "from_exit", "is_out_of_memory", "where"]

_SIGNAL_CAUSES = {
    "SIGSEGV": "segmentation fault: native code read or wrote memory it does not own",
    "SIGBUS": "bus error: native code accessed memory that cannot be backed",
    "SIGABRT": "abort(): a failed native assertion, std::terminate or a fatal Python error",
    "SIGFPE": "arithmetic fault in native code (e.g. an integer division by zero)",
    "SIGILL": "illegal instruction in native code",
    "SIGKILL": "killed: most likely by the kernel's out-of-memory killer (an isolated worker is its "
               "first choice), or by another process",
    "SIGTERM": "terminated by another process",
}

PhaseOf = Callable[[int], "tuple[str | None, int | None]"]


def describe_signal(signum: int) -> str:
    """``SIGSEGV (segmentation fault: ...)`` for a signal number."""
    try:
        name = _signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
    cause = _SIGNAL_CAUSES.get(name)
    if cause is None:
        text = _signal.strsignal(signum) or ""
        cause = text[:1].lower() + text[1:] if text else ""
    return f"{name} ({cause})" if cause else name


def where(phase: str | None, step: int | None) -> str:
    """``during forward (step 0)``, ``during build``, or ``before marking a phase``."""
    if phase is None:
        return "before marking a phase"
    return f"during {phase}" + (f" (step {step})" if step is not None and phase != "build" else "")


def from_exit(rank: int, exitcode: int | None, *, phase: str | None = None, step: int | None = None,
              context: str = "its process", note: str = "") -> RankDied:
    """The death of ``rank`` whose process ended with ``exitcode`` (negative: killed by that signal).

    ``context`` names what ended (``its process``, ``the isolated worker process``); ``note`` is
    appended to the message (what the other ranks were doing, a limit that applies).
    """
    at = where(phase, step)
    tail = f"; {note}" if note else ""
    if exitcode is not None and exitcode < 0:
        cause = describe_signal(-exitcode)
        return RankCrashed(f"rank {rank} crashed {at}: {context} was killed by {cause}{tail}",
                           rank=rank, phase=phase, step=step, cause=f"signal {cause}", signal=-exitcode)
    if exitcode is None:
        cause = "its process ended with an unknown status"
        return RankCrashed(f"rank {rank} crashed {at}: {cause}{tail}", rank=rank, phase=phase, step=step,
                           cause=cause)
    cause = f"os._exit({exitcode}) or exit({exitcode}) from native code"
    return RankExited(
        f"rank {rank} exited {at}: {context} ended with exit status {exitcode} ({cause}) instead of the rank "
        f"returning or raising{tail}",
        rank=rank, phase=phase, step=step, cause=cause, exitcode=exitcode)


_ALLOC_FAILED = ("can't allocate memory", "cannot allocate memory")


def is_out_of_memory(exc: BaseException | None) -> bool:
    """``exc`` (or an exception it was raised from) is a failed allocation."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, MemoryError):
            return True
        text = text_of(exc).lower()
        if isinstance(exc, (RuntimeError, MemoryError)) and any(s in text for s in _ALLOC_FAILED):
            return True
        exc = exc.__cause__ or exc.__context__
        seen += 1
    return False


def _exit_code(exc: SystemExit) -> int | str | None:
    code = exc.code
    return code if code is None or isinstance(code, (int, str)) else repr(code)


def classify(err: RankError, phase_of: PhaseOf | None = None, *, memory_note: str = "") -> RankError:
    """``err`` as a :class:`tpsim.RankExited`/:class:`tpsim.RankCrashed` when its rank raised
    ``SystemExit`` or ran out of memory; ``err`` itself otherwise.

    ``phase_of(rank)`` gives the ``(phase, step)`` that rank marked (an isolated worker's progress);
    ``memory_note`` is added to an out-of-memory message (the limit that applied).
    """
    if isinstance(err, RankDied) or type(err) is not RankError:
        return err  # already a death, or a collective failure (the effect of another rank's)
    r = err.rank
    own = err.errors.get(r)
    phase, step = phase_of(r) if phase_of is not None else (None, None)
    phase = phase if phase is not None else getattr(own, "phase", None)
    if phase is not None and step is None and isinstance(getattr(own, "step", None), int):
        step = own.step  # type: ignore[union-attr]
    at = where(phase, step)
    keep = dict(remote_traceback=err.remote_traceback, errors=err.errors, trace=err.trace,
                faults_fired=err.faults_fired)
    if isinstance(own, SystemExit):
        code = _exit_code(own)
        cause = f"sys.exit({code!r})" if code is not None else "sys.exit()"
        return RankExited(
            f"rank {r} exited {at}: it called {cause} instead of returning or raising (in a real job its "
            f"process ends and its peers wait for it forever)\n{err.summary}",
            rank=r, phase=phase, step=step, cause=cause,
            exitcode=code if isinstance(code, int) else (0 if code is None else 1), **keep)
    if is_out_of_memory(own) or (own is None and is_out_of_memory(err.__cause__)):
        text = str(own).strip() if own is not None else ""
        cause = f"out of memory: {text.splitlines()[0] if text else 'MemoryError'}"
        note = f" ({memory_note})" if memory_note else ""
        return RankCrashed(f"rank {r} crashed {at}: {cause}{note}\n{err.summary}", rank=r, phase=phase,
                           step=step, cause=cause, **keep)
    return err
