"""The parent-death watch: a worker process dies with the process that started it, however that ends.

A checker killed with SIGKILL runs no cleanup, so its workers must notice on their own. Two
mechanisms, so that neither a platform nor a race leaves a worker behind:

- **the kernel** (Linux): ``prctl(PR_SET_PDEATHSIG, SIGKILL)`` asks for SIGKILL the moment the
  parent exits. It is tied to the parent *thread* that forked the worker, so callers arm it only
  when that thread lives as long as the parent (a main thread, a single-threaded fork server);
- **a lifeline** (portable): the worker watches, in a daemon thread, the read end of a pipe whose
  write end only the parent holds; end of file means the parent is gone. Without a pipe the thread
  polls ``os.getppid()`` instead.

Arming happens first thing in the worker; the parent may have died in the meantime, so
:func:`arm` checks once more after arming and exits at once if it did.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from typing import Any

__all__ = ["ORPHANED_EXIT", "arm", "pdeathsig_supported"]

#: Exit status of a worker that found its parent gone (EX_SOFTWARE).
ORPHANED_EXIT = 70
#: How often the fallback watch polls ``os.getppid()`` (seconds).
_POLL_S = 0.5
_PR_SET_PDEATHSIG = 1


def pdeathsig_supported() -> bool:
    """Whether this platform has the kernel's parent-death signal (Linux)."""
    return sys.platform.startswith("linux")


def _set_pdeathsig() -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _orphaned() -> None:
    # No atexit handlers or finalizers: they could block on a world the parent no longer serves.
    os._exit(ORPHANED_EXIT)


def _watch_pipe(lifeline: Any) -> None:
    try:
        lifeline.poll(None)  # returns only at end of file: the parent never writes to it
    except (OSError, EOFError, ValueError):
        pass
    _orphaned()


def _watch_ppid(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(_POLL_S)
    _orphaned()


def arm(*, parent_pid: int | None = None, lifeline: Any = None, pdeathsig: bool = True) -> None:
    """Make this process exit as soon as its parent is gone.

    ``parent_pid``: the pid this process expects as its parent (checked now, and polled when there
    is no ``lifeline``). ``lifeline``: the read end (a ``multiprocessing`` connection) of a pipe
    whose write end only the watched process holds. ``pdeathsig``: also ask the kernel for SIGKILL
    when the parent thread exits (pass False when that thread may end before the parent does).
    """
    if pdeathsig and pdeathsig_supported():
        _set_pdeathsig()
    if parent_pid is not None and os.getppid() != parent_pid:
        _orphaned()  # the parent died before the signal was armed
    if lifeline is not None:
        try:
            gone = lifeline.poll(0)
        except (OSError, EOFError, ValueError):
            gone = True
        if gone:
            _orphaned()
        target, args = _watch_pipe, (lifeline,)
    elif parent_pid is not None:
        target, args = _watch_ppid, (parent_pid,)
    else:
        return
    threading.Thread(target=target, args=args, daemon=True, name="tpsim-lifeline").start()
