"""The forker: one pre-imported, single-threaded process from which worker processes are forked.

A worker process that imports torch costs seconds on a small machine (a library such as
Megatron-core adds seconds more), and a gloo world of N ranks needs N of them. The forker pays
that once per caller, and forks a worker for every request (:meth:`Forker.fork`): a world of 4
ranks starts in tens of milliseconds.

* **Born pre-imported.** When the caller runs no thread but its main one, the forker is a fork of
  the caller (``multiprocessing``'s *fork*, as the isolated inproc worker is): it has everything the
  caller imported — torch, tpsim, the target — at no cost. Otherwise it is *spawned* (a fresh
  interpreter, none of the caller's threads or locks) and imports torch, what every rank's first
  backward imports, tpsim's modules the caller had loaded, and the target's modules when asked
  (:meth:`Forker.call`).
* **Fork-safe.** The forker runs no thread of its own and no torch op: a child starts as a copy of a
  quiet, single-threaded process. If code the forker ran (a target's import) left a Python thread
  running, or initialised CUDA, :attr:`Forker.safe` turns False and callers start their workers
  another way (and a fresh forker replaces this one). A forker forked from the caller may carry the
  caller's OpenMP thread pool, which no forked process can use: its children then run torch's
  intra-op work on one thread (:attr:`Forker.inherited`), as the isolated inproc worker does.
* **A child sees the caller's present, not the forker's past.** Every fork request carries the
  caller's current standard output and error (so a capture of the caller's stdout catches the
  child's prints, as it would a spawned process's), working directory, environment and
  ``sys.path``, which the child takes before it runs anything.
* **Children are watched like ``multiprocessing`` processes.** :class:`Child` has the API the
  pools use (``pid``, ``sentinel``, ``is_alive``, ``join``, ``kill``, ``exitcode``): the forker
  reaps each child as it ends (``SIGCHLD``) and writes its exit status to a pipe whose read end is
  the child's sentinel, as ``multiprocessing``'s fork server does.
* **Nothing outlives the caller.** The forker watches the caller (end of file on its control
  socket, the kernel's parent-death signal when the caller's main thread started it, and the
  parent pid) and kills its children before it exits; each child dies with the forker
  (:mod:`tpsim.comm.lifeline`). An atexit hook ends the forker with the caller.

The forker runs user code only through :meth:`Forker.call` (a target's import), never a world:
it is a worker, not the process that decides a check's verdict.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import select
import signal
import socket
import struct
import sys
import threading
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from tpsim.errors import BackendUnavailable

__all__ = ["START_BOUND", "Child", "Forker", "kill_group", "own_group", "pid", "pids", "preload", "replace", "shared",
           "shutdown"]

#: Seconds the forker may take to start (it imports torch: seconds on a loaded machine).
START_BOUND = 120.0
#: Largest request or reply (bytes): one packet, within a Unix socket's default buffer. Requests hold
#: names, small arguments and the caller's environment, never tensors.
_MAX_MESSAGE = 200_000
#: How often the forker checks that its parent still lives, when nothing else wakes it (seconds).
_WATCH_S = 0.5
#: Modules every forker imports before it says it is ready: torch, what every rank's first backward
#: imports (``Tensor.backward(grad)`` imports symbolic shapes, hence sympy: seconds per process), and
#: tpsim's worker side.
BASE_MODULES = ("torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "tpsim",
                "tpsim.comm._worker", "tpsim.comm.inproc", "tpsim.comm.isolate")

_STATUS = struct.Struct("<i")
_PR_SET_NAME = 15


# --- process groups: a worker and everything it starts end together -----------------------------------


def own_group() -> None:
    """Make this process the leader of a process group of its own: what it forks (a rank's child
    processes) joins that group, and :func:`kill_group` ends them all with it."""
    try:
        if os.getpgid(0) != os.getpid():
            os.setpgid(0, 0)
    except OSError:  # not permitted here (a session leader): killing it alone is what remains
        pass


def kill_group(pid: int) -> None:
    """SIGKILL ``pid`` and, when it leads a process group (:func:`own_group`), everything in that group."""
    try:
        if os.getpgid(pid) == pid:
            os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass
    try:
        os.kill(pid, signal.SIGKILL)
    except OSError:
        pass


# --- framing: one pickled message per SOCK_SEQPACKET packet, file descriptors alongside --------------


def _send(sock: socket.socket, obj: Any, fds: Sequence[int] = ()) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) > _MAX_MESSAGE:
        raise ValueError(f"a forker message of {len(data)} bytes exceeds {_MAX_MESSAGE} bytes")
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def _recv(sock: socket.socket) -> tuple[Any, list[int]]:
    """One message and the descriptors that came with it (at most two); EOFError when the peer is gone."""
    data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, 2)
    if not data:
        for fd in fds:
            os.close(fd)
        raise EOFError("the forker's peer closed its socket")
    return pickle.loads(data), list(fds)


def _ref(fn: Callable[..., Any]) -> tuple[str, str]:
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", None)
    if not module or not name or "<" in name:
        raise ValueError(f"fn={fn!r} must be a top-level function (the forker imports it by name)")
    return module, name


def _resolve(ref: tuple[str, str]) -> Callable[..., Any]:
    obj: Any = importlib.import_module(ref[0])
    for part in ref[1].split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]


def _context() -> tuple[str, dict[str, str], list[str]]:
    return os.getcwd(), dict(os.environ), list(sys.path)


# --- the forker process ------------------------------------------------------------------------------


def _safe() -> bool:
    """Whether forking this process is safe: its only Python thread is this one, and CUDA is untouched."""
    cuda = sys.modules.get("torch.cuda")
    initialised = bool(cuda is not None and getattr(cuda, "is_initialized", lambda: False)())
    return threading.active_count() == 1 and not initialised


def _set_name(name: str) -> None:
    """Name this process in ``/proc/PID/comm`` (what ps and top show; at most 15 bytes)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _child(sock: socket.socket, wake: tuple[int, int], statuses: dict[int, int], end: socket.socket,
           stdio: tuple[int, int], context: tuple[str, dict[str, str], list[str]], ref: tuple[str, str],
           args: tuple[Any, ...], name: str) -> None:
    """In a freshly forked child: drop the forker's descriptors and signal set-up, take the caller's
    stdio and context, run ``fn(conn, *args)``, and exit (never return into the forker's loop)."""
    code = 1
    try:
        own_group()
        _set_name(name)
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        sock.close()
        for fd in (*wake, *statuses.values()):
            os.close(fd)
        os.dup2(stdio[0], 1)
        os.dup2(stdio[1], 2)
        for fd in stdio:
            if fd > 2:
                os.close(fd)
        cwd, env, path = context
        try:
            os.chdir(cwd)
        except OSError:  # gone meanwhile: relative paths fail in fn, as they would in the caller
            pass
        os.environ.clear()
        os.environ.update(env)
        sys.path[:] = path
        conn = mpc.Connection(end.detach())
        _resolve(ref)(conn, *args)
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - reported on the child's stderr; its exit status says it failed
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _reap(statuses: dict[int, int]) -> None:
    """Collect every ended child; write its exit status to its sentinel pipe and close that."""
    while statuses:
        try:
            child, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if child == 0:
            return
        fd = statuses.pop(child, None)
        if fd is not None:
            try:
                os.write(fd, _STATUS.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass
            os.close(fd)


def _fork(sock: socket.socket, wake: tuple[int, int], statuses: dict[int, int], specs: list[Any],
          stdio: list[int], context: tuple[str, dict[str, str], list[str]]) -> None:
    """Fork one child per spec; send the caller each child's pid, socket end and sentinel."""
    try:
        if not _safe():
            _send(sock, ("refused", "the forker is no longer single-threaded"))
            return
        _send(sock, ("forking", len(specs)))
        for ref, args, name in specs:
            try:
                mine, theirs = socket.socketpair()
                status_r, status_w = os.pipe()
                sys.stdout.flush()
                sys.stderr.flush()
                child = os.fork()
            except OSError as exc:  # out of processes or memory: the caller kills what was forked and spawns
                _send(sock, ("failed", f"fork failed: {exc}"))
                return
            if child == 0:
                os.close(status_r)
                mine.close()
                os.close(status_w)
                _child(sock, wake, statuses, theirs, (stdio[0], stdio[1]), context, ref, args, name)
            theirs.close()
            try:
                os.setpgid(child, child)  # also here: no kill may find it still in the forker's group
            except OSError:
                pass
            statuses[child] = status_w
            try:
                _send(sock, ("child", child), [mine.fileno(), status_r])
            finally:
                mine.close()
                os.close(status_r)
    finally:
        for fd in stdio:
            os.close(fd)


def _call(sock: socket.socket, ref: tuple[str, str], args: tuple[Any, ...], stdio: list[int]) -> None:
    """Run ``fn(*args)`` here (a target's import), its output where the caller's goes now."""
    saved = (os.dup(1), os.dup(2))
    error = None
    try:
        os.dup2(stdio[0], 1)
        os.dup2(stdio[1], 2)
        _resolve(ref)(*args)
    except BaseException as exc:  # noqa: BLE001 - the caller decides; the forker lives on
        error = f"{type(exc).__name__}: {exc}"
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, *stdio):
            os.close(fd)
    _send(sock, ("called", error, _safe()))


def _main(sock: socket.socket, parent_pid: int, pdeathsig: bool, modules: Sequence[str],
          callers: socket.socket | None = None) -> None:
    """Body of the forker: import, say ready, then serve fork and call requests until the caller goes.

    ``callers``: the caller's end of the control socket, which a forker forked from the caller
    inherited: closed here, or the forker would never see end of file when the caller dies."""
    from tpsim.comm import lifeline

    if callers is not None:
        callers.close()
    _set_name("tpsim-forker")
    lifeline.arm(pdeathsig=pdeathsig)  # the kernel's signal only: a watch thread would make forking unsafe
    if os.getppid() != parent_pid:
        os._exit(lifeline.ORPHANED_EXIT)  # the caller died before the signal was armed
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle (it kills us)
    # A forker forked from the caller inherited its sys.stdout/stderr objects, which may be a capture
    # of the caller's (tpsim check's, pytest's): writing there would be lost. Use the descriptors.
    sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    import torch

    torch.set_num_threads(1)  # never an OpenMP pool here: a forked child could not use it
    failed = []
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:  # noqa: BLE001 - a child importing it again reports it properly
            failed.append(f"{name}: {type(exc).__name__}: {exc}")
    statuses: dict[int, int] = {}
    wake = os.pipe()
    os.set_blocking(wake[0], False)
    os.set_blocking(wake[1], False)
    signal.set_wakeup_fd(wake[1])
    signal.signal(signal.SIGCHLD, lambda *_: None)  # the wake-up pipe makes select() return
    try:
        _send(sock, ("ready", os.getpid(), failed, _safe()))
    except OSError:  # the caller ended while this forker started (a usage error): nothing to serve
        os._exit(0)
    try:
        while True:
            ready, _, _ = select.select([sock, wake[0]], [], [], _WATCH_S)
            if os.getppid() != parent_pid:
                break  # the caller is gone
            if wake[0] in ready:
                try:
                    while os.read(wake[0], 512):
                        pass
                except BlockingIOError:
                    pass
            _reap(statuses)
            if sock not in ready:
                continue
            try:
                message, fds = _recv(sock)
            except (EOFError, OSError):
                break  # the caller closed its end (or died): nothing more will come
            if message[0] == "fork":
                _fork(sock, wake, statuses, message[1], fds, message[2])
            elif message[0] == "call":
                _call(sock, message[1], message[2], fds)
            else:
                for fd in fds:
                    os.close(fd)
                break  # "stop"
    finally:
        for child in list(statuses):
            kill_group(child)
        os._exit(0)


# --- the caller's side -------------------------------------------------------------------------------


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):
            pass


class Child:
    """A process the forker forked: the part of ``multiprocessing.Process``'s API the pools use, plus
    ``conn``, the caller's end of a duplex connection to it."""

    def __init__(self, pid: int, conn: mpc.Connection, sentinel: int) -> None:
        self.pid = pid
        self.conn = conn
        self.sentinel = sentinel
        self.owner = os.getpid()
        self._exitcode: int | None = None
        self._ended = False

    @property
    def exitcode(self) -> int | None:
        self._poll(0.0)
        return self._exitcode

    def _poll(self, timeout: float) -> bool:
        """Whether the child has ended (its exit status read from the sentinel, if the forker sent one)."""
        if self._ended:
            return True
        if not mpc.wait([self.sentinel], timeout):
            return False
        try:
            data = os.read(self.sentinel, _STATUS.size)
        except OSError:
            data = b""
        self._ended = True
        if len(data) == _STATUS.size:
            self._exitcode = _STATUS.unpack(data)[0]
        else:  # the forker died first: the child died with it (parent-death signal)
            self._exitcode = -signal.SIGKILL
        return True

    def is_alive(self) -> bool:
        return not self._poll(0.0)

    def join(self, timeout: float | None = None) -> None:
        self._poll(timeout if timeout is not None else None)  # type: ignore[arg-type]

    def kill(self) -> None:
        """Kill the child and every process it started in its process group."""
        if os.getpid() == self.owner and not self._poll(0.0):
            kill_group(self.pid)

    def close(self) -> None:
        """Close the caller's descriptors (after the child ended or was killed)."""
        self.conn.close()
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1


class Forker:
    """The caller's handle on one forker process (see the module docstring)."""

    def __init__(self, modules: Sequence[str] = ()) -> None:
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        main = threading.current_thread() is threading.main_thread()
        #: The forker is a fork of the caller (see the module docstring): its children run torch's
        #: intra-op work on one thread.
        self.inherited = main and threading.active_count() == 1
        ctx = mp.get_context("fork" if self.inherited else "spawn")
        self.owner = os.getpid()
        self.modules = tuple(dict.fromkeys([*BASE_MODULES, *modules]))
        _flush()  # a forked forker must not inherit unwritten output (it would be written twice)
        self.proc = ctx.Process(target=_main, name="tpsim-forker", daemon=False,  # its children may start processes
                                args=(theirs, os.getpid(), main, self.modules, self._sock if self.inherited else None))
        self.proc.start()
        theirs.close()
        self.pid: int | None = None
        #: Whether forking the forker is still safe (one Python thread, CUDA untouched).
        self.safe = True
        #: Modules of ``modules`` the forker could not import (workers import them again and report).
        self.failed: list[str] = []
        self._lock = threading.Lock()
        self._ready = False

    def _await(self, bound: float) -> Any:
        ready = mpc.wait([self._sock, self.proc.sentinel], bound)
        if self._sock in ready:
            try:
                return _recv(self._sock)
            except (EOFError, OSError):
                pass
        self.kill()
        why = (f"it did not answer within {bound:.0f} s (the machine may be overloaded)" if not ready else
               f"it ended with exit status {self.proc.exitcode} (its stderr says why; a script that calls tpsim at "
               "import time must guard its entry point with `if __name__ == '__main__':`, because worker processes "
               "import the main module)")
        raise BackendUnavailable("gloo", f"tpsim's forker process (the parent of its worker processes) failed: {why}")

    def wait_ready(self, bound: float = START_BOUND) -> None:
        """Wait (bounded) until the forker has imported its modules; raise :class:`tpsim.BackendUnavailable`
        when it cannot start."""
        with self._lock:
            if self._ready:
                return
            (kind, self.pid, self.failed, self.safe), _ = self._await(bound)
            self._ready = kind == "ready"

    def alive(self) -> bool:
        return os.getpid() == self.owner and self.proc.is_alive()

    def fork(self, fn: Callable[..., Any], args_per_child: Sequence[tuple[Any, ...]],
             names: Sequence[str] = ()) -> list[Child]:
        """Fork one child per argument tuple; each runs ``fn(conn, *args)`` (``fn`` top-level, ``args``
        picklable), ``conn`` its end of the connection whose other end is :attr:`Child.conn`.
        ``names``: each child's process name (``/proc/PID/comm``; default ``tpsim-worker``).

        Raises :class:`tpsim.BackendUnavailable` when the forker cannot fork (dead, or no longer safe:
        :attr:`safe` then says so)."""
        self.wait_ready()
        ref = _ref(fn)
        specs = [(ref, tuple(args), names[i] if i < len(names) else "tpsim-worker")
                 for i, args in enumerate(args_per_child)]
        with self._lock:
            if not self.safe:
                raise BackendUnavailable("gloo", "tpsim's forker process is no longer single-threaded")
            try:
                _send(self._sock, ("fork", specs, _context()), [1, 2])
            except (OSError, ValueError) as exc:  # gone, or a request too large for one packet
                raise BackendUnavailable("gloo", f"tpsim's forker process cannot fork ({exc})") from exc
            (kind, detail), _ = self._await(START_BOUND)
            if kind == "refused":
                self.safe = False
                raise BackendUnavailable("gloo", f"tpsim's forker process refused to fork: {detail}")
            children = []
            for _ in range(detail):
                (kind, child_pid), fds = self._await(START_BOUND)
                if kind == "failed":
                    for child in children:
                        child.kill()
                        child.join(5.0)
                        child.close()
                    raise BackendUnavailable("gloo", f"tpsim's forker process could not fork: {child_pid}")
                children.append(Child(child_pid, mpc.Connection(fds[0]), fds[1]))
            return children

    def call(self, fn: Callable[..., Any], args: tuple[Any, ...], bound: float) -> str | None:
        """Run ``fn(*args)`` in the forker (e.g. import a target, so every child starts with it); the
        error it raised as text, or None. Waits at most ``bound`` seconds: past it the forker is killed
        (a :class:`tpsim.BackendUnavailable` says so)."""
        self.wait_ready()
        with self._lock:
            try:
                _send(self._sock, ("call", _ref(fn), tuple(args)), [1, 2])
            except (OSError, ValueError) as exc:
                raise BackendUnavailable("gloo", f"tpsim's forker process cannot run {fn.__name__} ({exc})") from exc
            (_, error, self.safe), _ = self._await(bound)
            return error  # type: ignore[no-any-return]

    def kill(self) -> None:
        """End the forker (its children die with it) and reap it (bounded)."""
        if os.getpid() != self.owner:
            return  # inherited through fork: not ours
        try:
            self._sock.close()  # end of file: the forker kills its children and exits
        except OSError:
            pass
        self.proc.join(2.0)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(5.0)


_LOCK = threading.Lock()
#: ``forker``: the one that forks; ``retired``: former ones no longer safe to fork, kept alive while
#: children they forked (pooled ranks, the isolated worker) still serve; ended at exit;
#: ``unsafe``: the calls (:func:`preload`) that left a forker unsafe to fork, never made again here.
_STATE: dict[str, Any] = {"forker": None, "retired": [], "atexit": False, "unsafe": set()}


def shared(modules: Sequence[str] = ()) -> Forker | None:
    """This process's forker, started (not waited for) on first use and after it died; None where
    ``fork`` does not exist (callers then spawn). ``modules``: more modules to import at its start
    (only a fresh forker takes them; :meth:`Forker.call` imports into a running one)."""
    if "fork" not in mp.get_all_start_methods() or not hasattr(socket, "send_fds"):
        return None
    with _LOCK:
        forker: Forker | None = _STATE["forker"]
        if forker is not None and forker.owner != os.getpid():  # inherited through fork: not ours
            _STATE["retired"] = []
            forker = None
        elif forker is not None and not forker.alive():
            forker.kill()
            forker = None
        if forker is None:
            if not _STATE["atexit"]:
                atexit.register(shutdown)
                _STATE["atexit"] = True
            loaded = sorted(n for n in sys.modules if n.startswith("tpsim."))
            forker = _STATE["forker"] = Forker([*modules, *loaded])
        return forker


def preload(fn: Callable[..., Any], args: tuple[Any, ...], bound: float) -> str | None:
    """Run ``fn(*args)`` (e.g. import a target) in this process's forker, so that every child it forks
    later starts with what that imported; the error it raised as text, or None (nothing is done where
    no forker serves).

    A call that leaves the forker unsafe to fork (the import started a thread, or initialised CUDA)
    retires it (:func:`replace`): the next forker is a fresh one without that import, and its children
    import what they need themselves. Such a call is remembered and never made again in this process:
    each try would cost another fresh forker (an interpreter importing torch), for nothing.
    """
    z = shared()
    if z is None:
        return None
    key = repr((_ref(fn), args))
    if key in _STATE["unsafe"]:
        return None
    try:
        z.wait_ready()
        if not z.safe:  # unsafe before this call (its own start-up): not the call's doing
            replace()
            return None
        error = z.call(fn, args, bound)
    except BackendUnavailable as err:
        return str(err)
    if not z.safe:
        _STATE["unsafe"].add(key)
        replace()
    return error


def replace() -> None:
    """Retire this process's forker (once it is no longer safe to fork): the next use starts a fresh
    one; the retired one lives on, unused, for the children it forked, until :func:`shutdown`."""
    with _LOCK:
        forker = _STATE["forker"]
        _STATE["forker"] = None
        if forker is not None and forker.owner == os.getpid():
            _STATE["retired"].append(forker)


def shutdown() -> None:
    """Kill this process's forkers and their children (also run at interpreter exit)."""
    with _LOCK:
        ended = [z for z in [_STATE["forker"], *_STATE["retired"]] if z is not None]
        _STATE["forker"], _STATE["retired"] = None, []
    for forker in ended:
        forker.kill()


def pid() -> int | None:
    """PID of this process's forker while it lives (it outlives runs on purpose)."""
    forker = _STATE["forker"]
    return forker.proc.pid if forker is not None and forker.alive() else None


def pids() -> set[int]:
    """PIDs of this process's live forkers, the current one and retired ones."""
    with _LOCK:
        found = [z for z in [_STATE["forker"], *_STATE["retired"]] if z is not None]
    return {z.proc.pid for z in found if z.owner == os.getpid() and z.alive()}
