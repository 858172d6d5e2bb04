"""Isolated inproc worlds: the ranks run in a supervised worker process, so no rank can take the caller down.

``tpsim.run(fn, world_size, backend="inproc", isolate=True)`` calls :func:`run_isolated`: the same
in-process world (threads as ranks, the baton, bit-identical results), run in a worker process
instead of the caller's. The caller only waits for the worker's answer, so:

* **deaths are named.** A rank's ``os._exit``, segfault, ``abort()`` or out-of-memory kill ends the
  worker, not the caller; the caller reads the :mod:`rank progress record <tpsim.comm.rank_progress>` (shared memory:
  the rank holding the baton, each rank's last marked phase) and raises
  :class:`tpsim.RankExited`/:class:`tpsim.RankCrashed` naming the rank, its phase and the cause
  (:mod:`tpsim.comm.rank_death`); a rank's ``sys.exit`` and ``MemoryError`` become the same errors.
* **hangs are bounded.** A rank that stops handing the baton on is declared stuck by the world
  itself after ``timeout`` (+2 s); if even that cannot run (native code holding the interpreter
  lock), the caller gives up :func:`stall_bound` seconds after the last hand-off. Either way the
  worker, with the abandoned rank and all its memory, is killed and replaced: nothing piles up.
* **the worker is reused** between runs (a run costs a pipe round trip and pickling its arguments
  and results: tensors travel as raw bytes, :mod:`tpsim.comm._wire`), and a replacement is cheap:
  a worker is forked from the forker (:mod:`tpsim.comm.forker`), which imported torch, tpsim and
  the target already. Where no forker serves, it is a fork of the caller (single-threaded) or comes
  from ``multiprocessing``'s fork server, started once with torch and tpsim preloaded (see
  :func:`_context`).
* **no worker outlives the caller** (:mod:`tpsim.comm.lifeline`: the kernel's parent-death signal,
  plus a pipe or the parent pid the worker watches; the forker dies with the caller), and an atexit
  hook ends it.
* **output is forwarded**: a worker's stdout goes to a file the caller copies to its own
  ``sys.stdout`` after each run, so rank output lands where the caller's does (a capture included).
* **memory is bounded**: the worker runs under an address-space limit
  (:func:`tpsim.comm.limits.worker_memory_limit`, ``TPSIM_WORKER_MEMORY``), so a runaway allocation
  fails inside it with "can't allocate memory", and it volunteers to the kernel's out-of-memory
  killer before the caller (``oom_score_adj``).

``fn`` travels by reference and its arguments by pickle, as to gloo workers: ``fn`` must be a
top-level function, its arguments and return value picklable (:class:`tpsim.InvalidArgument` says
so otherwise). One isolated world runs at a time per process (a lock); runs from several threads
take turns.
"""

from __future__ import annotations

import atexit
import copy
import ctypes
import io
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import re
import resource
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpsim.comm import _wire, forker, lifeline, limits, plain, rank_death
from tpsim.comm._payload import dump_call, load_call
from tpsim.comm.rank_progress import RankProgress, RankProgressView, install
from tpsim.comm.result import WorldResult
from tpsim.comm.runclock import RunClock, backstop, process_paths
from tpsim.comm.scheduler import text_of
from tpsim.errors import BackendUnavailable, CollectiveError, InvalidArgument, RankError

__all__ = ["OOM_SCORE_ADJ", "SLOTS", "START_BOUND", "WorkerEnded", "call", "helper_pids", "last_words",
           "live_worker_pid", "run_isolated", "shutdown", "stall_bound"]

#: Seconds a worker may take to start (a cold fork server imports torch first).
START_BOUND = 120.0
#: Added to ``/proc/self/oom_score_adj`` of a worker (the scale is 0-1000: a share of the memory):
#: under memory pressure the kernel kills the worker (reported as a crash) before the caller, which
#: would lose the report, while a much larger unrelated process still goes first.
OOM_SCORE_ADJ = 200
#: A progress record of at least this many ranks is allocated per worker (a larger world gets a new worker).
_MIN_CAPACITY = 256
#: How often the caller looks at the progress record while it waits (seconds); answers wake it at once.
_POLL_S = 0.2
#: Seconds the worker may take to pickle and send the results of a finished world, at least.
_REPORT_BOUND = 60.0

_BACKEND_LABEL = "inproc"


def stall_bound(timeout: float) -> float:
    """Seconds without a hand-off after which the caller kills a worker that did not answer.

    The world's own supervisor reports a stuck rank after ``timeout + 2`` s; this leaves it time to
    do so, and only catches a worker that cannot run Python at all.
    """
    return timeout + 3.0 + 0.1 * timeout


# --- the worker process -----------------------------------------------------------------------


def _mapped_bytes() -> int:
    """This process's address space now (``VmSize``), 0 where unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith("VmSize:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _limit_memory(limit: int | None) -> None:
    """Let the ranks map ``limit`` bytes beyond what this worker starts with (a forked worker starts
    with its caller's address space), and volunteer to the out-of-memory killer."""
    if limit is not None:
        try:
            _, hard = resource.getrlimit(resource.RLIMIT_AS)
            soft = _mapped_bytes() + limit
            soft = soft if hard == resource.RLIM_INFINITY else min(soft, hard)
            resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
        except (ValueError, OSError):  # not permitted here: the OOM score below still applies
            pass
    try:
        with open("/proc/self/oom_score_adj", "r+", encoding="ascii") as fh:
            current = int(fh.read().strip() or 0)
            fh.seek(0)
            fh.write(str(min(1000, current + OOM_SCORE_ADJ)))
    except (OSError, ValueError):
        pass


def _memory_note(limit: int | None) -> str:
    if limit is None:
        return f"the isolated worker has no address-space limit ({limits.WORKER_MEMORY_ENV} sets one)"
    return (f"the isolated worker's ranks may map {limit / 2**30:.1f} GiB beyond what it started with; "
            f"{limits.WORKER_MEMORY_ENV} changes that")


def _pickles(obj: Any, plain_data: bool = False) -> bool:
    try:
        if plain_data:
            plain.loads(plain.dumps(obj))
        else:
            pickle.loads(_wire.dumps(obj))
        return True
    except Exception:
        return False


def _stand_in(exc: BaseException, rank: int) -> RankError:
    """A picklable error carrying what ``exc`` said (its class may not exist in the caller)."""
    import traceback

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return RankError(f"{type(exc).__module__}.{type(exc).__qualname__}: {text_of(exc)}", rank=rank, remote_traceback=tb)


def _portable(exc: BaseException, plain_data: bool = False) -> BaseException:
    """``exc`` if it survives pickling (as plain data, with ``plain_data``); else a copy whose
    unpicklable parts are replaced by text (a usage error stays one)."""
    if _pickles(exc, plain_data):
        return exc
    if isinstance(exc, InvalidArgument):
        return InvalidArgument(text_of(exc))
    if isinstance(exc, RankError):
        err = copy.copy(exc)
        err.errors = {r: e if _pickles(e) else _stand_in(e, r) for r, e in exc.errors.items()}
        for name, value in list(vars(err).items()):
            if not _pickles(value):
                setattr(err, name, None)
        if _pickles(err):
            return err
        return _stand_in(exc, exc.rank)
    return RuntimeError(f"{type(exc).__module__}.{type(exc).__qualname__}: {text_of(exc)}")


def _unpicklable_value(values: list[Any]) -> RankError:
    for rank, value in enumerate(values):
        try:
            _wire.dumps(value)
        except Exception as exc:
            return RankError(
                f"rank {rank} returned a value of type {type(value).__name__} that cannot be pickled back from the "
                f"isolated worker process ({type(exc).__name__}: {exc}); return plain data (tensors, numbers, "
                "lists, dicts), or run with isolate=False",
                rank=rank,
            )
    return RankError("the world's values cannot be pickled back from the isolated worker process", rank=0)


def _note_abandoned(err: RankError, view: RankProgressView) -> None:
    """Say in ``err`` (a world that timed out) what its stuck ranks were doing, and that they are gone."""
    stuck = [r for r in (getattr(err, "faulty_ranks", ()) or (view.running,)) if r is not None]
    doing = "; ".join(f"rank {r} was stuck {rank_death.where(*view.phase_of(r))}" for r in stuck)
    note = (f" [{doing + ' when abandoned; ' if doing else ''}the isolated worker process was replaced, "
            "so nothing the abandoned ranks hold lingers]")
    first, _, rest = err.summary.partition("\n")
    summary = first + note + ("\n" + rest if rest else "")
    if err.args and isinstance(err.args[0], str):
        err.args = (err.args[0].replace(err.summary, summary, 1),) + tuple(err.args[1:])
    err.summary = summary


def _run_one(progress: RankProgress, memory_note: str, message: tuple[Any, ...]) -> tuple[bytes, bool]:
    """Run one world; return the pickled answer and whether the worker must be replaced."""
    from tpsim.comm.inproc import run_inproc
    from tpsim.comm.modstate import expand_watch, resolve_modules

    _, run_id, payload, hints, world_size, timeout, faults, checksum, modules, context, plain_data = message
    dumps = plain.dumps if plain_data else _wire.dumps
    progress.begin(run_id, world_size)
    _take_context(context)
    before = set(threading.enumerate())
    answer: tuple[Any, ...]
    try:
        fn, args, kwargs = load_call(payload, hints)
        rank_local = resolve_modules(modules[0], "rank_local")
        watch = resolve_modules(expand_watch(modules[1], [m.__name__ for m in rank_local]), "watch")
    except BaseException as exc:
        answer = ("raise", _portable(InvalidArgument(
            f"could not load fn and its arguments in the isolated worker process (is its module importable "
            f"there?): {type(exc).__name__}: {exc}")))
    else:
        # Threads that loading the call started (a module that starts one when it is imported, such as
        # the target's) are this process's, as each rank's process has its own on gloo: not rank threads
        # the world abandoned.
        before = set(threading.enumerate())
        try:
            result = run_inproc(fn, world_size, args=args, kwargs=kwargs, timeout=timeout, faults=faults,
                                checksum=checksum, rank_local=rank_local, watch=watch)
        except RankError as err:
            progress.reporting()
            view = progress.view(world_size)
            answer = ("error", _portable(rank_death.classify(err, view.phase_of, memory_note=memory_note), plain_data))
        except BaseException as exc:  # refused arguments or a harness bug: the caller raises it as it is
            progress.reporting()
            answer = ("raise", _portable(exc, plain_data))
        else:
            progress.reporting()
            try:  # each rank's value on its own: one the caller cannot load is named by its rank
                values = [dumps(v) for v in result.values]
            except Exception:
                answer = ("error", _portable(_unpicklable_value(result.values)))
            else:
                answer = ("ok", values, result.trace, result.faults_fired)
    # A rank thread (or a thread a rank started) still running was abandoned: replace this worker.
    tainted = any(t.is_alive() for t in threading.enumerate() if t not in before)
    if tainted and answer[0] == "error" and isinstance(answer[1], RankError):
        _note_abandoned(answer[1], progress.view(world_size))
    try:
        data = dumps((run_id, tainted) + answer)
    except Exception as exc:
        data = _wire.dumps((run_id, True, "raise", RuntimeError(f"the isolated worker could not send its answer: {exc}")))
    progress.idle()
    return data, tainted


def _take_context(context: tuple[str, dict[str, str], list[str]] | None) -> None:
    """Take the caller's working directory, environment and ``sys.path`` (None: unchanged since last time)."""
    if context is None:
        return
    cwd, env, path = context
    try:
        os.chdir(cwd)
    except OSError:  # gone meanwhile: relative paths then fail in fn, as they would in the caller
        pass
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path


#: While :func:`_call_one` runs: the connection and run id its last words go to (:func:`last_words`).
_CALLING: dict[str, Any] = {}


def last_words(text: str) -> None:
    """In the worker, during a :func:`call`: tell the caller, before this process ends itself, what
    ended it (``os._exit(3)`` called by an imported module), so the caller names it. No-op elsewhere."""
    conn, run_id = _CALLING.get("conn"), _CALLING.get("run")
    if conn is not None:
        try:
            conn.send_bytes(_wire.dumps((run_id, True, "ended", text)))
        except (OSError, ValueError):
            pass


def _call_one(conn: Any, message: tuple[Any, ...]) -> tuple[bytes, bool]:
    """Run one function call in this worker's main thread (importing a target is not a rank's job:
    a module may install signal handlers or start threads at import); return the pickled answer."""
    _, run_id, payload, hints, context, plain_data = message
    dumps = plain.dumps if plain_data else _wire.dumps
    _take_context(context)
    _CALLING.update(conn=conn, run=run_id)
    try:
        fn, args, kwargs = load_call(payload, hints)
        answer: tuple[Any, ...] = ("ok", fn(*args, **kwargs))
    except BaseException as exc:  # noqa: BLE001 - the caller raises it, as a call in its own process would
        answer = ("raise", _portable(exc, plain_data))
    finally:
        _CALLING.clear()
    try:
        return dumps((run_id, False) + answer), False
    except Exception as exc:  # noqa: BLE001
        return _wire.dumps((run_id, True, "raise", RuntimeError(f"the isolated worker could not send its answer: "
                                                                f"{type(exc).__name__}: {exc}"))), True


_LIBC: list[Any] = []

# Python-level writes of the worker are framed with the writing rank's label, so the caller can
# file them under that rank (a failure shows what *its* ranks printed); native writes to file
# descriptor 1 arrive unframed and are the worker process's own. Control characters no layer prints.
_OPEN, _SEP, _CLOSE = "\x1e", "\x1f", "\x1d"
_FRAMED = re.compile("\x1e([^\x1f\x1d]*)\x1f(.*?)\x1d", re.S)
#: The label of output no rank can be named for (native writes, the worker's own prints).
PROCESS_LABEL = "process"


def _writer_label() -> str:
    """``rank N`` inside a rank thread of the world this worker runs; ``process`` elsewhere."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_initialized():
            return f"rank {dist.get_rank()}"
    except Exception:  # noqa: BLE001 - a label is never worth failing a write for
        pass
    return PROCESS_LABEL


class _RankFramedStdout(io.TextIOBase):
    """The worker's ``sys.stdout``: every write framed with its rank's label (see :data:`_FRAMED`)."""

    def __init__(self, raw: Any) -> None:
        super().__init__()
        self._raw = raw

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        if text:
            self._raw.write(f"{_OPEN}{_writer_label()}{_SEP}{text}{_CLOSE}")
        return len(text)

    def flush(self) -> None:
        self._raw.flush()

    def isatty(self) -> bool:
        return False

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"


def split_labelled(text: str) -> list[tuple[str, str]]:
    """``(label, text)`` pieces of what a worker wrote, in order (unframed text: ``process``)."""
    pieces: list[tuple[str, str]] = []
    pos = 0
    for match in _FRAMED.finditer(text):
        if match.start() > pos:
            pieces.append((PROCESS_LABEL, text[pos:match.start()]))
        pieces.append((match.group(1), match.group(2)))
        pos = match.end()
    rest = text[pos:]
    if rest:  # a frame cut off by a kill: keep its text, drop the markers
        pieces.append((PROCESS_LABEL, re.sub("\x1e[^\x1f\x1d]*\x1f|\x1d", "", rest)))
    return pieces


def _flush_stdout() -> None:
    try:
        sys.stdout.flush()
    except (OSError, ValueError, AttributeError):
        pass
    try:
        if not _LIBC:
            _LIBC.append(ctypes.CDLL(None))
        _LIBC[0].fflush(None)  # native code's buffered printf output
    except (OSError, AttributeError):
        pass


def _serve_forked(conn: Any, progress_path: str, capacity: int, memory_limit: int | None, out_path: str,
                  parent_pid: int) -> None:
    """Body of a worker forked from the forker (:mod:`tpsim.comm.forker`): its progress record is a file both
    sides map, and it dies with the forker (which dies with the caller)."""
    buf = (ctypes.c_int64 * RankProgress.length(capacity)).from_buffer(_map(progress_path, capacity))
    _serve(conn, None, buf, memory_limit, True, out_path, parent_pid=parent_pid)


def _map(path: str, capacity: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, RankProgress.length(capacity) * ctypes.sizeof(ctypes.c_int64))
    finally:
        os.close(fd)


def _serve(conn: Any, lifeline_end: Any, progress_buf: Any, memory_limit: int | None, pdeathsig: bool,
           out_path: str | None = None, parents: tuple[Any, ...] = (), parent_pid: int | None = None) -> None:
    """Body of the worker process: arm the parent-death watch, then run worlds until told to stop.

    ``out_path``: a file that takes this process's stdout (file descriptor 1); the caller copies
    what each run wrote to its own ``sys.stdout``, so rank output goes where the caller's goes.
    ``parents``: the caller's ends of the pipes (a forked worker inherits them): closed here, or the
    worker would keep its own lifeline open. ``parent_pid``: watched instead of a lifeline pipe.
    """
    for end in parents:
        end.close()
    forker.own_group()  # what the ranks fork dies with this worker (kill_group)
    lifeline.arm(lifeline=lifeline_end, parent_pid=parent_pid, pdeathsig=pdeathsig)
    torch.set_num_threads(1)  # a forked worker: OpenMP's pool did not survive the fork (ranks use one anyway)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the caller's to handle (it kills us)
    if out_path is not None:
        fd = os.open(out_path, os.O_WRONLY | os.O_APPEND)
        os.dup2(fd, 1)
        os.close(fd)
    # A forked worker inherits the caller's sys.stdout/stderr objects, which may be a capture of the
    # caller's (pytest's, tpsim check's): writing there would be lost with the worker. Use its own.
    sys.stdout = _RankFramedStdout(open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False))  # noqa: SIM115
    sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", buffering=1, closefd=False)  # noqa: SIM115
    _limit_memory(memory_limit)
    progress = RankProgress(progress_buf)
    install(progress)
    note = _memory_note(memory_limit)
    import tpsim.comm.inproc  # before "ready": the first run must not pay for it

    # The CPU this worker's rank threads will run on (inproc pins them all to one): its main thread
    # and the caller's waiting thread go there too, so a hand-over between the processes never waits
    # for an idle CPU to wake up (on a VM: a halted vCPU), measured ~0.2 ms per world otherwise.
    choose = getattr(tpsim.comm.inproc, "_choose_cpu", None)  # inproc's own rule (no public name)
    cpu = choose() if callable(choose) else None
    _pin_thread(cpu)
    conn.send_bytes(_wire.dumps(("ready", os.getpid(), cpu)))
    while True:
        try:
            message = pickle.loads(conn.recv_bytes())
        except (EOFError, OSError):
            _exit(0)
        if message[0] == "stop":
            _exit(0)
        data, tainted = _call_one(conn, message) if message[0] == "call" else _run_one(progress, note, message)
        _flush_stdout()  # before the answer: the caller forwards the output when it gets it
        try:
            conn.send_bytes(data)
        except (EOFError, OSError):
            _exit(0)
        if tainted:
            _exit(0)  # abandoned threads may still run; the caller starts a fresh worker


def _exit(code: int) -> None:
    """Leave without atexit handlers or finalizers (they could wait on abandoned rank threads)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


# --- the caller's side ------------------------------------------------------------------------


def _preload(extra: Sequence[str] = ()) -> list[str]:
    # The fork server imports these once; every worker forked from it starts with them. Only
    # torch and tpsim's own modules: user code is imported by each worker, never by the server.
    names = ["torch", "torch.distributed", "tpsim", "tpsim.comm.inproc", "tpsim.comm.isolate"]
    names += sorted({n for n in [*sys.modules, *extra] if n.startswith("tpsim.")} - set(names))
    return names


_SERVER: list[Any] = []


def _context(preload: Sequence[str] = ()) -> tuple[Any, bool]:
    """The multiprocessing context to start a worker from, and whether its parent thread lives as
    long as its parent process (so the kernel's parent-death signal may be armed).

    This process itself, forked, when that is safe: torch is imported already, so a worker costs a
    fork (~tens of ms), not an interpreter importing torch (seconds). Safe means the only thread is
    the main thread — another thread could hold a lock the child would inherit locked — and the
    worker then runs torch single-threaded, as DataLoader workers do (OpenMP's thread pool does not
    survive a fork). Otherwise: multiprocessing's fork server, started once, with torch and tpsim
    preloaded (``preload`` adds tpsim modules to what it imports; the first start decides).
    """
    methods = mp.get_all_start_methods()
    if "fork" in methods and threading.current_thread() is threading.main_thread() and threading.active_count() == 1:
        return mp.get_context("fork"), True
    if not _SERVER:
        if "forkserver" in methods:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_preload(preload))  # no effect if this process's fork server already runs
            _SERVER.append((ctx, True))  # the fork server is single-threaded
        else:
            _SERVER.append((mp.get_context("spawn"), False))
    ctx, single = _SERVER[0]
    # A spawned worker's parent is the thread starting it: arm the signal only from the main thread.
    return ctx, single or threading.current_thread() is threading.main_thread()


class _Worker:
    """One worker process: its pipe, its progress record and whether it said it is ready."""

    def __init__(self, capacity: int, preload: Sequence[str] = ()) -> None:
        self.owner = os.getpid()
        self.capacity = capacity
        self.slot = "ranks"
        fd, self.out_path = tempfile.mkstemp(prefix="tpsim-isolated-", suffix=".stdout")
        os.close(fd)
        self.out_offset = 0
        self.ready = False
        self.cpu: int | None = None  # where its rank threads run (it says when ready)
        self.context: tuple[str, dict[Any, Any], list[str]] | None = None
        if not self._fork():
            self._start(preload)

    def _fork(self) -> bool:
        """Fork the worker from the forker (pre-imported: torch, tpsim, the target); False where none
        can serve (then :meth:`_start`)."""
        z = forker.shared()
        if z is None:
            return False
        fd, self.progress_path = tempfile.mkstemp(prefix="tpsim-isolated-", suffix=".progress")
        try:
            os.ftruncate(fd, RankProgress.length(self.capacity) * ctypes.sizeof(ctypes.c_int64))
            with os.fdopen(fd, "r+b") as fh:
                self.progress = RankProgress((ctypes.c_int64 * RankProgress.length(self.capacity)).from_buffer(
                    mmap.mmap(fh.fileno(), 0)))
            z.wait_ready()
            if not z.safe:
                forker.replace()
                raise BackendUnavailable(_BACKEND_LABEL, "the forker is no longer safe to fork")
            [self.proc] = z.fork(_serve_forked, [(self.progress_path, self.capacity, limits.worker_memory_limit(),
                                                  self.out_path, z.pid)], ["tpsim-isolated"])
        except BackendUnavailable:
            self._unlink_progress()
            return False
        self.conn = self.proc.conn
        return True

    def _unlink_progress(self) -> None:
        """Remove the progress record's file once both sides mapped it (the mapping outlives the name)."""
        path, self.progress_path = getattr(self, "progress_path", None), None
        if path is not None:
            try:
                os.unlink(path)
            except OSError:
                pass

    def _start(self, preload: Sequence[str]) -> None:
        """Start the worker as a fork of this process or from ``multiprocessing``'s fork server."""
        ctx, pdeathsig = _context(preload)
        buf = ctx.RawArray(ctypes.c_int64, RankProgress.length(self.capacity))
        self.progress = RankProgress(buf)
        self.conn, child_end = ctx.Pipe(duplex=True)
        reader, writer = _lifeline(ctx)
        _flush_stdout()  # a forked child must not inherit unwritten output (it would be written twice)
        self.proc = ctx.Process(
            target=_serve,
            args=(child_end, reader, buf, limits.worker_memory_limit(), pdeathsig, self.out_path, (self.conn, writer)),
            name="tpsim-isolated-inproc",
            daemon=False,  # a rank may start processes of its own (daemons cannot)
        )
        self.proc.start()
        child_end.close()

    def await_ready(self) -> None:
        """Wait (bounded by :data:`START_BOUND`) for the worker's "ready"; raise if it cannot start."""
        if self.ready:
            return
        ready = mpc.wait([self.conn, self.proc.sentinel], START_BOUND)
        if self.conn in ready:
            try:
                kind, _, self.cpu = pickle.loads(self.conn.recv_bytes())
            except (EOFError, OSError):
                kind = None
            if kind == "ready":
                self.ready = True
                self._unlink_progress()  # the worker maps it first thing: it has it now
                return
        self.kill()
        if not ready:
            why = f"it did not start within {START_BOUND:.0f} s (the machine may be overloaded)"
        else:
            why = (f"it ended with {_describe_exit(self.proc.exitcode)} while starting (its stderr says why; a "
                   "script that calls tpsim at import time must guard its entry point with "
                   "`if __name__ == '__main__':`, because worker processes import the main module)")
        raise BackendUnavailable(_BACKEND_LABEL, f"the isolated inproc worker process could not start: {why}")

    def alive(self) -> bool:
        return os.getpid() == self.owner and self.proc.is_alive()

    def context_update(self) -> tuple[str, dict[str, str], list[str]] | None:
        """The caller's working directory, environment and ``sys.path`` when they changed since the
        worker last got them (None otherwise): a run sees them as a world run here would."""
        raw = getattr(os.environ, "_data", None)  # the undecoded mapping: copied and compared in microseconds
        key = (os.getcwd(), dict(raw) if isinstance(raw, dict) else dict(os.environ), list(sys.path))
        if key == self.context:
            return None
        self.context = key
        return key[0], dict(os.environ), key[2]

    def forward_output(self) -> None:
        """Copy what the worker wrote to its stdout since last time to this process's ``sys.stdout``."""
        try:
            if os.stat(self.out_path).st_size <= self.out_offset:
                return  # nothing new (the common case: one stat per run)
            with open(self.out_path, "rb") as fh:
                fh.seek(self.out_offset)
                data = fh.read()
        except OSError:
            return
        if data and sys.stdout is not None:
            self.out_offset += len(data)
            # A capture that files output by rank takes the labels; any other stream gets the text.
            labelled = getattr(sys.stdout, "write_labelled", None)
            for label, text in split_labelled(data.decode("utf-8", errors="replace")):
                if labelled is not None:
                    labelled(label, text)
                else:
                    sys.stdout.write(text)
            sys.stdout.flush()

    def kill(self) -> None:
        """Kill the process and reap it (bounded); forward its last output; close the pipe."""
        if os.getpid() != self.owner:
            return  # inherited through fork: not ours
        if self.proc.is_alive():
            forker.kill_group(self.proc.pid)  # with whatever its ranks forked
        self.proc.join(5.0)  # SIGKILL cannot be ignored; the bound only guards a wedged kernel
        self.conn.close()
        if isinstance(self.proc, forker.Child):
            self.proc.close()
        self._unlink_progress()
        self.forward_output()
        try:
            os.unlink(self.out_path)
        except OSError:
            pass


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "an unknown exit status"
    if code < 0:
        return f"signal {rank_death.describe_signal(-code)}"
    return f"exit status {code}"


_LOCK = threading.RLock()
#: ``workers``: this process's isolated workers by slot (:data:`SLOTS`).
_STATE: dict[str, Any] = {"workers": {}, "run": 0, "lifeline": None, "atexit": False}
#: The slots a caller's worlds run in, each its own worker process: ``ranks`` (the worlds under test)
#: and ``reference`` (a module's dense reference and its twin: nothing the ranks did to their process
#: can reach the oracle).
SLOTS = ("ranks", "reference")


def _lifeline(ctx: Any) -> tuple[Any, Any]:
    """This process's lifeline: a worker watches the read end; only this process keeps the write end."""
    pair = _STATE["lifeline"]
    if pair is None or pair[2] != os.getpid():
        reader, writer = ctx.Pipe(duplex=False)
        pair = _STATE["lifeline"] = (reader, writer, os.getpid())
    return pair[0], pair[1]


def shutdown() -> None:
    """Kill this process's isolated workers, if any (also run at interpreter exit)."""
    with _LOCK:
        workers = list(_STATE["workers"].values())
        _STATE["workers"] = {}
        for worker in workers:
            worker.kill()


def helper_pids() -> set[int]:
    """PIDs of the processes tpsim keeps alive between runs besides pooled gloo/nccl ranks: the isolated
    worker, the fork server it was forked from, and the forker (:mod:`tpsim.comm.forker`). They
    outlive a run on purpose; checks for processes a run left behind skip them."""
    pids = {pid for slot in SLOTS if (pid := live_worker_pid(slot)) is not None}
    pids |= forker.pids()
    if _SERVER and _SERVER[0][0].get_start_method() == "forkserver":
        from multiprocessing import forkserver

        server = getattr(forkserver._forkserver, "_forkserver_pid", None)  # no public accessor
        if isinstance(server, int):
            pids.add(server)
    return pids


def live_worker_pid(slot: str = "ranks") -> int | None:
    """PID of this process's isolated worker of ``slot`` while it lives (tests check it goes away)."""
    with _LOCK:
        worker = _STATE["workers"].get(slot)
        return worker.proc.pid if worker is not None and worker.alive() else None


def _start(capacity: int, slot: str, preload: Sequence[str] = ()) -> _Worker:
    if not _STATE["atexit"]:
        atexit.register(shutdown)
        _STATE["atexit"] = True
    worker = _Worker(capacity, preload)
    worker.slot = slot
    _STATE["workers"][slot] = worker
    return worker


def _replace(worker: _Worker) -> None:
    """Kill ``worker`` and start its successor now (it gets ready while the caller reports)."""
    worker.kill()
    _STATE["workers"].pop(worker.slot, None)
    try:
        _start(worker.capacity, worker.slot)
    except Exception:  # the next run starts one (and reports why it cannot)
        _STATE["workers"].pop(worker.slot, None)


def _worker_for(world_size: int, slot: str, preload: Sequence[str] = ()) -> _Worker:
    if slot not in SLOTS:
        raise InvalidArgument(f"slot={slot!r}; expected one of {', '.join(SLOTS)}")
    worker: _Worker | None = _STATE["workers"].get(slot)
    if worker is not None and (not worker.alive() or worker.capacity < world_size):
        worker.kill()
        worker = None
        _STATE["workers"].pop(slot, None)
    if worker is None:
        worker = _start(max(_MIN_CAPACITY, world_size), slot, preload)
    worker.await_ready()
    return worker


def _died(worker: _Worker, view: RankProgressView) -> RankError:
    worker.proc.join(5.0)
    code = worker.proc.exitcode
    notes = []
    if view.state == "reporting":
        notes.append("every rank had finished; the worker died while sending the results")
    elif view.running is None:
        notes.append("no rank had started yet: the worker died while loading fn and its arguments")
    if code == -signal.SIGKILL:
        notes.append(_memory_note(limits.worker_memory_limit()))
    rank = view.running if view.running is not None else 0
    phase, step = view.phase_of(view.running)
    return rank_death.from_exit(rank, code, phase=phase, step=step, context="the isolated worker process",
                            note="; ".join(notes))


def _hung(view: RankProgressView, idle: float, timeout: float) -> RankError:
    rank = view.running
    if view.state == "reporting":
        return RankError(
            f"the isolated worker did not deliver the results of a finished world within {idle:.0f} s; it was "
            "killed and replaced", rank=rank if rank is not None else 0)
    if rank is None:
        return RankError(
            f"the isolated worker did not start the world within {idle:.0f} s (it was loading fn and its "
            "arguments: does importing their module block?); it was killed and replaced", rank=0)
    at = rank_death.where(*view.phase_of(rank))
    return CollectiveError(
        f"the in-process world made no progress for {idle:.1f} s of the worker's own run time (timeout {timeout:g} s): rank {rank} kept "
        f"running {at} without handing on the baton or returning to Python (native code holding the "
        "interpreter lock?); the isolated worker process was killed with it and replaced",
        rank=rank, faulty_ranks=(rank,))


def _pin_thread(cpu: int | None) -> set[int] | None:
    """Pin the calling thread to ``cpu``; return its previous CPU set (None: not pinned, e.g. not permitted)."""
    if cpu is None or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        before = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {cpu})
    except OSError:
        return None
    return before


def _answer(worker: _Worker, plain_data: bool) -> Any:
    """The answer waiting on ``worker``'s pipe; None at its end (the worker died)."""
    try:
        return (plain.loads if plain_data else pickle.loads)(worker.conn.recv_bytes())
    except (EOFError, OSError):
        return None


def _await(worker: _Worker, run_id: int, world_size: int, timeout: float, plain_data: bool = False) -> tuple[Any, ...]:
    """The worker's answer to run ``run_id``; raises the error of a death or a hang (never waits unboundedly).

    After a death or a hang the worker is replaced before the error is raised."""
    stall = stall_bound(timeout)
    # Judged on the worker's own time (runclock), not wall time: on a loaded machine the worker can
    # sit descheduled for seconds, and a hang declared on wall time would blame correct code. The
    # wall-time backstop still ends the wait on a machine that never lets it run.
    clock = RunClock(_POLL_S)
    paths = process_paths(worker.proc.pid)
    clock.start(paths)
    last = worker.progress.handoffs()
    since = time.monotonic()
    reporting_since: float | None = None
    while True:
        ready = mpc.wait([worker.conn, worker.proc.sentinel], _POLL_S)
        if worker.conn in ready:
            answer = _answer(worker, plain_data)
            if answer is not None:
                if answer[0] == run_id:
                    return answer
                continue  # an answer to an earlier run (cannot happen: one run at a time)
        if ready:  # end of file, or the process ended: the worker is dead
            err = _died(worker, worker.progress.view(world_size))
            _replace(worker)
            raise err
        now = time.monotonic()
        handoffs = worker.progress.handoffs()
        if handoffs != last:
            last, since = handoffs, now
            paths = process_paths(worker.proc.pid)  # its threads come and go with the worlds
            clock.start(paths)
            continue
        own = clock.sample(paths)
        view = worker.progress.view(world_size)
        if now - since > backstop(max(stall, START_BOUND)):
            pass  # the machine never let the worker run: end the wait all the same
        elif view.state == "reporting":
            reporting_since = reporting_since if reporting_since is not None else own
            if own - reporting_since <= max(_REPORT_BOUND, timeout):
                continue
        elif own <= (stall if handoffs else max(stall, START_BOUND)):
            continue  # before the first hand-off the worker may be importing fn's module: allow for that
        err = _hung(view, own, timeout)
        _replace(worker)
        raise err


def _check_picklable(fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[bytes, dict[str, str]]:
    try:
        return dump_call(fn, args, kwargs, "inproc")
    except InvalidArgument as err:
        cause = err.__cause__
        why = f"{type(cause).__name__}: {cause}" if cause is not None else str(err)
        name = f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', repr(fn))}"
        raise InvalidArgument(
            f"isolate=True runs the inproc world in a worker process, so fn={name} and its arguments must be "
            f"picklable ({why}); pass a top-level function (importable by reference) and picklable arguments, or "
            "isolate=False to run the world in this process (closures and lambdas work there)"
        ) from cause


def run_isolated(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float,
    faults: Sequence[Any] = (),
    checksum: bool = False,
    rank_local: Sequence[str] = (),
    watch: Sequence[str] = (),
    plain_data: bool = False,
    slot: str = "ranks",
) -> WorldResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` inproc ranks in the isolated worker; see the module docstring.

    ``rank_local``/``watch``: names of modules, as ``tpsim.run_world`` takes them (the worker imports
    them). ``plain_data``: the values and errors come back as plain data (:mod:`tpsim.comm.plain`).
    ``slot``: which of this process's workers runs it (:data:`SLOTS`).

    Returns the :class:`tpsim.WorldResult` the same world returns in-process. Raises what it raises
    in-process, plus :class:`tpsim.RankExited`/:class:`tpsim.RankCrashed` for a rank that ended the
    worker, a :class:`tpsim.CollectiveError` for a rank stuck beyond the bounds (its worker is
    replaced), :class:`tpsim.InvalidArgument` for an unpicklable ``fn`` or arguments, and
    :class:`tpsim.BackendUnavailable` when no worker can start.
    """
    if getattr(mp.current_process(), "_inheriting", False):
        raise RuntimeError(
            "tpsim.run(..., isolate=True) was called while a worker process was importing the main module; "
            "guard the script's entry point with `if __name__ == '__main__':`"
        )
    args = tuple(args)
    kwargs = dict(kwargs or {})
    payload, hints = _check_picklable(fn, args, kwargs)
    with _LOCK:
        worker = _worker_for(world_size, slot, preload=(getattr(fn, "__module__", None) or "",))
        _STATE["run"] += 1
        run_id = _STATE["run"]
        try:
            saved = _pin_thread(worker.cpu)  # beside the ranks while it waits (see _serve)
            try:
                worker.conn.send_bytes(_wire.dumps(("run", run_id, payload, hints, world_size, float(timeout),
                                                    tuple(faults), bool(checksum), (tuple(rank_local), tuple(watch)),
                                                    worker.context_update(), bool(plain_data))))
                answer = _await(worker, run_id, world_size, float(timeout), plain_data)
            finally:
                if saved is not None:
                    os.sched_setaffinity(0, saved)
            worker.forward_output()
        except RankError:
            raise  # a death or a hang: the worker was replaced already (its output forwarded)
        except BaseException:  # Ctrl-C or a broken pipe mid-run: the world is in an unknown state
            worker.kill()
            _STATE["workers"].pop(slot, None)
            raise
        _, tainted, kind, *rest = answer
        if tainted:
            _replace(worker)
    if kind == "ok":
        pickled, trace, fired = rest
        return WorldResult(values=[_load_value(r, v, plain_data) for r, v in enumerate(pickled)], trace=trace,
                           backend=_BACKEND_LABEL, faults_fired=list(fired))
    raise rest[0]


class WorkerEnded(RuntimeError):
    """A :func:`call` whose worker ended itself: ``what`` says how, as the worker said before it ended
    (``os._exit(3)``), or as its exit status shows."""

    def __init__(self, what: str, said: bool) -> None:
        super().__init__(what)
        self.what = what
        self.said = said


def call(fn: Callable[..., Any], *args: Any, timeout: float, slot: str = "ranks", plain_data: bool = True) -> Any:
    """``fn(*args)`` in the main thread of this process's isolated worker of ``slot``; its value (as
    plain data, unless ``plain_data=False``), or the exception it raised. A worker that ends while it
    runs (``os._exit``, a crash) raises :class:`WorkerEnded`; one that takes longer than ``timeout``
    seconds of wall time is killed and replaced, and :class:`TimeoutError` is raised. The worker is
    replaced after either."""
    payload, hints = _check_picklable(fn, tuple(args), {})
    with _LOCK:
        worker = _worker_for(1, slot, preload=(getattr(fn, "__module__", None) or "",))
        _STATE["run"] += 1
        run_id = _STATE["run"]
        try:
            worker.conn.send_bytes(_wire.dumps(("call", run_id, payload, hints, worker.context_update(),
                                                bool(plain_data))))
            deadline = time.monotonic() + timeout
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    _replace(worker)
                    raise TimeoutError(f"the isolated worker did not finish within {timeout:g} s; it was killed "
                                       "and replaced")
                ready = mpc.wait([worker.conn, worker.proc.sentinel], min(left, _POLL_S))
                got = _answer(worker, plain_data) if worker.conn in ready else None
                if got is not None:
                    if got[0] == run_id:
                        answer = got
                        break
                    continue  # an answer to an earlier run (cannot happen: one run at a time)
                if ready:  # end of file, or the process ended: the worker is dead
                    worker.proc.join(5.0)
                    code = worker.proc.exitcode
                    _replace(worker)
                    raise WorkerEnded(f"the worker process ended with {_describe_exit(code)}", False)
            worker.forward_output()
        except (WorkerEnded, TimeoutError):
            raise
        except BaseException:
            worker.kill()
            _STATE["workers"].pop(slot, None)
            raise
    _, tainted, kind, value = answer
    if kind == "ended":
        worker.proc.join(5.0)
        _replace(worker)
        raise WorkerEnded(value, True)
    if tainted:
        _replace(worker)
    if kind == "ok":
        return value
    raise value


def _load_value(rank: int, data: bytes, plain_data: bool = False) -> Any:
    try:
        return (plain.loads if plain_data else pickle.loads)(data)
    except Exception as exc:
        raise RankError(
            f"rank {rank} returned a value that cannot be unpickled in this process ({type(exc).__name__}: {exc}); "
            "return plain data (tensors, numbers, lists) or instances of importable classes",
            rank=rank,
        ) from exc
