"""The session: ``tpsim check`` and ``tpsim replay`` judge in a process the checked code never reaches.

Three kinds of process take part:

- the ``tpsim`` process, the **supervisor**: it parses the command line, writes what the session
  worker sends and decides the exit code;
- the **session worker** (the judge): it runs the search, judges every observation, saves the case
  files and streams the report and, last, its exit code to the supervisor as JSON lines over a pipe
  (:class:`_Channel`). It never imports the target: the target is imported and resolved in a worker
  (:mod:`tpsim.props.described`), and everything that runs the checked code — its ranks, a module's
  dense reference — runs in worker processes (:mod:`tpsim.comm.isolate`, :mod:`tpsim.comm.procs`)
  that send back plain data (:mod:`tpsim.comm.plain`);
- those **workers**, forked from the forker (:mod:`tpsim.comm.forker`).

Nothing the checked code does can change the report or the exit code:

- **patching tpsim**: a target that patches tpsim's compare functions or this channel at import
  patches them in a worker; the judge's own are untouched;
- **exits**: ``SystemExit``, ``KeyboardInterrupt`` or ``os._exit`` while the target is imported are a
  usage error naming what the target did (exit 2); an ``atexit`` hook or a thread left running in a
  worker cannot change the exit code or keep tpsim alive;
- **process state**: what the target does to its process (working directory, environment,
  handlers, ``sys.stdout``) stays in the worker that imported it;
- **what it prints**: the report travels over the pipe; the checked code's own output goes where it
  went before (captured and shown under the failure it belongs to);
- **the process tree**: the session worker leads its own session (``setsid``), and while it runs the
  supervisor is a *child subreaper* (``prctl(PR_SET_CHILD_SUBREAPER)``): when the worker is done its
  whole process group is killed, and every process it started that escaped the group (a fork that
  called ``setsid``) comes back to the supervisor when its parent dies, and is killed too. No
  process the check started outlives it.
- **case files**: the judge writes each case file and tells the supervisor what it holds
  (:func:`saved`); once every process the check started is gone, the supervisor writes again any
  that was removed or changed meanwhile (a process a rank started may delete it).
- **Ctrl-C** reaches the supervisor (the worker is not in the terminal's process group): it is
  forwarded to the worker, which reports what it found so far; a worker that ignores it is killed
  after :data:`INTERRUPT_GRACE` seconds.
- **stdout** that is closed, a broken pipe or a full disk ends the report quietly; the case files
  are saved all the same (the worker saves them before it prints) and the exit code is the check's.

The session worker is a fork of the supervisor, which has imported torch and tpsim already (a fork
costs milliseconds, not an interpreter's start-up); where the supervisor runs other threads (a test
process), it is forked from the forker instead.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import json
import os
import select
import signal
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TextIO

__all__ = ["INTERRUPT_GRACE", "in_worker", "safe_text", "saved", "supervise"]

#: Seconds a worker has to report after Ctrl-C before the supervisor kills it.
INTERRUPT_GRACE = 10.0
#: Seconds a worker that sent its exit code has to end before its process group is killed.
_EXIT_GRACE = 5.0
#: Exit code of a session whose worker ended without saying (the checked code ended it mid-search).
_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37

#: In the session worker: its channel to the supervisor and what the import guard records.
_WORKER: dict[str, Any] = {"channel": None, "signalled": False, "exit": os._exit, "cwd": None}


def in_worker() -> bool:
    """Whether this process is a session worker (its report goes to a supervisor)."""
    channel = _WORKER["channel"]
    return channel is not None and channel.pid == os.getpid()


def saved(path: str) -> None:
    """In the session worker: tell the supervisor that the case file ``path`` was written, with what it
    holds. The supervisor checks every one after the processes the check started are gone, and writes
    again one that is missing or changed (a process a rank started may delete it meanwhile)."""
    if not in_worker():
        return
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError:
        return
    _WORKER["channel"].send(case_file={"path": os.path.abspath(path), "text": text})


def _keep_case_files(files: Mapping[str, str], writer: _Writer) -> None:
    """Write again each case file that is missing or was changed after the worker wrote it."""
    for path, text in files.items():
        try:
            with open(path, encoding="utf-8") as fh:
                if fh.read() == text:
                    continue
        except OSError:
            pass
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            with open(path, "w", encoding="utf-8") as fh:
                fh.write(text)
        except OSError as err:
            writer.write("err", f"tpsim: the case file {path} was removed or changed after it was saved, and cannot be "
                         f"written again ({err.strerror or err}); its case is in the report above\n")


def safe_text(obj: Any, limit: int | None = None) -> str:
    """``str(obj)``, or a description when that raises (a hostile ``__str__``); cut to ``limit`` chars."""
    try:
        text = str(obj)
        if not isinstance(text, str):
            raise TypeError("__str__ returned a non-string")
    except BaseException as err:  # noqa: BLE001 - the object's own code: anything may come out
        name = type(obj).__qualname__ if isinstance(obj, BaseException) else type(obj).__name__
        try:
            why = type(err).__name__
        except BaseException:  # noqa: BLE001
            why = "an error"
        text = f"<{name} object: its __str__ raised {why}>"
    if limit is not None and len(text) > limit:
        text = text[:limit] + f"... [{len(text) - limit} more characters]"
    return text


def raised_at(err: BaseException, basename: bool = False) -> str:
    """`` at FILE:LINE`` of the innermost frame ``err`` was raised in (only the file's name with
    ``basename``), or ``""`` when it carries no traceback."""
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return ""
    path = tb.tb_frame.f_code.co_filename
    return f" at {os.path.basename(path) if basename else path}:{tb.tb_lineno}"


# --- the channel: JSON lines from the worker to the supervisor -------------------------------------


class _Channel:
    """The worker's end of the pipe: one JSON object per line, written whole (a lock per line)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.pid = os.getpid()
        self._lock = threading.Lock()

    def send(self, **event: Any) -> None:
        if os.getpid() != self.pid:  # a process the worker forked: not the worker speaking
            return
        data = (json.dumps(event) + "\n").encode()
        with self._lock:
            view = memoryview(data)
            while view:
                try:
                    view = view[os.write(self.fd, view):]
                except InterruptedError:
                    continue
                except OSError:
                    return  # the supervisor is gone: nothing to tell


class _Stream:
    """A text stream of the worker (``out`` or ``err``) that sends what is written, line by line."""

    def __init__(self, channel: _Channel, name: str, tty: bool) -> None:
        self._channel = channel
        self._name = name
        self._tty = tty
        self._buffer: list[str] = []
        self._size = 0

    def write(self, text: str) -> int:
        self._buffer.append(text)
        self._size += len(text)
        if "\n" in text or "\r" in text or self._size > 65536:
            self.flush()
        return len(text)

    def flush(self) -> None:
        if self._buffer:
            text, self._buffer, self._size = "".join(self._buffer), [], 0
            self._channel.send(**{self._name: text})

    def isatty(self) -> bool:
        return self._tty

    def writable(self) -> bool:
        return True

    @property
    def encoding(self) -> str:
        return "utf-8"


# --- process-tree plumbing ---------------------------------------------------------------------------


def _prctl(option: int, value: int = 0) -> int | None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if option == _PR_GET_CHILD_SUBREAPER:
            out = ctypes.c_int(0)
            if libc.prctl(option, ctypes.byref(out), 0, 0, 0) != 0:
                return None
            return out.value
        return 0 if libc.prctl(option, value, 0, 0, 0) == 0 else None
    except (OSError, AttributeError):
        return None


def _children(pid: int) -> list[int]:
    """Live or zombie child processes of ``pid`` (a ``/proc`` scan)."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return found
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        if len(fields) > 1 and fields[1] == str(pid):
            found.append(int(entry))
    return found


def _reap(pid: int, bound: float) -> None:
    deadline = time.monotonic() + bound
    while True:
        try:
            done, _ = os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            return
        if done or time.monotonic() > deadline:
            return
        time.sleep(0.005)


def _sweep(pgid: int | None, keep: set[int], bound: float = 10.0) -> None:
    """Kill the process group ``pgid`` and every child of this process not in ``keep`` (processes the
    session started that came back to this subreaper), round after round, until none is left."""
    if pgid is not None and pgid != os.getpgrp():  # never this process's own group
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
    deadline = time.monotonic() + bound
    this_pid = os.getpid()
    while time.monotonic() < deadline:
        strays = [p for p in _children(this_pid) if p not in keep]
        if not strays:
            return
        for pid in strays:
            with contextlib.suppress(OSError):
                if os.getpgid(pid) == pid != os.getpgrp():
                    os.killpg(pid, signal.SIGKILL)  # a stray that leads a group takes its group along
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for pid in strays:
            _reap(pid, max(0.0, deadline - time.monotonic()))


def _ensure_std_fds() -> None:
    """Open /dev/null on any of file descriptors 0-2 that is closed (``tpsim ... >&-``): the pipes the
    session opens must not take their numbers, where the checked code's prints would land."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            null = os.open(os.devnull, os.O_RDWR)
            if null != fd:
                os.dup2(null, fd)
                os.close(null)


# --- the worker ------------------------------------------------------------------------------------


def _on_sigint(signum: int, frame: Any) -> None:
    _WORKER["signalled"] = True
    raise KeyboardInterrupt


def _worker_main(fd: int, argv: Sequence[str], tty: tuple[bool, bool], supervisor: int,
                 runner: tuple[str, str]) -> None:
    """Body of the session worker: run the command (``runner(argv, out, err)``, named by module and
    name), send its exit code, end without atexit hooks."""
    from tpsim.comm import forker, lifeline

    real_exit = _WORKER["exit"]
    code = 3
    channel = _Channel(fd)
    _WORKER["channel"] = channel
    try:
        with contextlib.suppress(OSError):
            os.setsid()
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)  # what the ranks orphan comes back here, to be ended with it
        lifeline.arm(pdeathsig=True)  # the kernel's signal only: no watch thread (forks stay cheap)
        if os.getppid() != supervisor:
            real_exit(lifeline.ORPHANED_EXIT)
        signal.signal(signal.SIGINT, _on_sigint)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        # A closed stdout/stderr (``>&-``): Python made them None; the supervisor opened /dev/null there.
        if sys.stdout is None:
            sys.stdout = open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        if sys.stderr is None:
            sys.stderr = open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False)  # noqa: SIM115
        import torch

        from tpsim.comm import _torchrun

        torch.set_num_threads(1)  # a fork: the parent's OpenMP pool, if it had one, is unusable here
        # Whether tpsim runs under a launcher (torchrun mode) is the environment's as tpsim was started
        # with, not what the target sets when it is imported (RANK, WORLD_SIZE, MASTER_ADDR, ...).
        _torchrun.pin_launcher_env()
        run = forker._resolve(runner)
        out, err = _Stream(channel, "out", tty[0]), _Stream(channel, "err", tty[1])
        channel.send(phase="run")
        try:
            code = run(list(argv), out, err)
        except SystemExit as exc:  # raised by the checked code outside the import (e.g. --no-isolate ranks)
            err.write(f"tpsim: error: the checked code raised SystemExit({safe_text(exc.code, 200)}), which "
                      "ended the check\n")
            code = 1
        except KeyboardInterrupt:
            err.write("tpsim: interrupted\n")
            code = 130
        out.flush()
        err.flush()
        channel.send(exit=code)
        _cleanup()
    except BaseException:  # noqa: BLE001 - tpsim's own failure: the supervisor reports the death
        try:
            import traceback

            channel.send(err="tpsim: internal error in the session worker:\n" + traceback.format_exc())
        except BaseException:  # noqa: BLE001
            pass
    finally:
        real_exit(code if isinstance(code, int) else 3)


def _cleanup() -> None:
    """End what the worker started (its pools, isolated worker, forker), without the atexit hooks the
    checked code may have registered; the supervisor kills what is left."""
    from tpsim.comm import forker, isolate, procs

    for stop in (isolate.shutdown, procs.shutdown_pools, forker.shutdown):
        with contextlib.suppress(BaseException):
            stop()
    _sweep(None, set(), bound=2.0)


def _forker_entry(conn: Any, argv: Sequence[str], tty: tuple[bool, bool], supervisor: int,
                  runner: tuple[str, str]) -> None:
    """A session worker forked from the forker (see :func:`_start`): its channel is the forker's socket."""
    _worker_main(conn.fileno(), argv, tty, os.getppid(), runner)


# --- the supervisor --------------------------------------------------------------------------------


class _Handle:
    """The supervisor's view of its worker: pid, the channel's read end, whether it ended, its status."""

    def __init__(self, pid: int, fd: int, child: Any = None) -> None:
        self.pid = pid
        self.fd = fd
        self.child = child  # a forker.Child when forked from the forker
        self.status: int | None = None
        self._pidfd: int | None = None
        if child is None:
            with contextlib.suppress(OSError, AttributeError):
                self._pidfd = os.pidfd_open(pid)

    def waitables(self) -> list[int]:
        if self.child is not None:
            return [self.child.sentinel]
        return [self._pidfd] if self._pidfd is not None else []

    def ended(self) -> bool:
        if self.status is not None:
            return True
        if self.child is not None:
            if self.child.is_alive():
                return False
            self.status = self.child.exitcode
            return True
        try:
            done, status = os.waitpid(self.pid, os.WNOHANG)
        except ChildProcessError:
            self.status = -signal.SIGKILL
            return True
        if not done:
            return False
        self.status = os.waitstatus_to_exitcode(status)
        return True

    def close(self) -> None:
        for fd in (self._pidfd, self.fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._pidfd = None
        if self.child is not None:
            with contextlib.suppress(OSError):
                self.child.close()


def _start(argv: Sequence[str], tty: tuple[bool, bool], runner: tuple[str, str]) -> _Handle:
    """Fork the session worker: from this process when it runs one thread, else from the forker."""
    supervisor = os.getpid()
    if threading.active_count() == 1 and threading.current_thread() is threading.main_thread():
        read, write = os.pipe()
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        pid = os.fork()
        if pid == 0:  # the worker: never returns into the supervisor's stack
            try:
                os.close(read)
                _worker_main(write, argv, tty, supervisor, runner)
            finally:
                _WORKER["exit"](3)
        os.close(write)
        return _Handle(pid, read)
    from tpsim.comm import forker

    z = forker.shared()
    if z is None:
        raise OSError("no way to fork a session worker here")
    try:
        [child] = z.fork(_forker_entry, [(list(argv), tty, supervisor, runner)], ["tpsim-session"])
    except Exception:
        forker.replace()
        z = forker.shared()
        if z is None:
            raise
        [child] = z.fork(_forker_entry, [(list(argv), tty, supervisor, runner)], ["tpsim-session"])
    fd = os.dup(child.conn.fileno())
    child.conn.close()
    return _Handle(child.pid, fd, child)


class _Writer:
    """Writes what the worker sends to the supervisor's stdout and stderr; a broken pipe, a full disk
    or a closed stream ends that stream's output quietly (the rest of the session goes on)."""

    def __init__(self, out: TextIO | None, err: TextIO | None) -> None:
        self.streams = {"out": out, "err": err}
        self.failed: dict[str, str] = {}
        self.wrote_out = False

    def write(self, name: str, text: str) -> None:
        stream = self.streams.get(name)
        if stream is None or not text:
            return
        try:
            stream.write(text)
            stream.flush()
            if name == "out":
                self.wrote_out = True
        except (OSError, ValueError) as exc:
            self.streams[name] = None
            self.failed[name] = getattr(exc, "strerror", None) or type(exc).__name__
            if isinstance(exc, OSError) and exc.errno in (errno.EPIPE, errno.ENOSPC, errno.EBADF):
                _silence(stream)


def _silence(stream: TextIO) -> None:
    """Point a stream that failed at /dev/null, so the interpreter's last flush cannot fail again."""
    try:
        fd = stream.fileno()
    except (OSError, ValueError, AttributeError):
        return
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)


def _describe_status(status: int | None) -> str:
    if status is None:
        return "an unknown status"
    if status < 0:
        try:
            return f"signal {signal.Signals(-status).name}"
        except ValueError:
            return f"signal {-status}"
    return f"exit status {status}"


class _Session:
    """What the supervisor learned from its worker: the exit code it sent, the phase it was in, the
    case files it saved; reads the channel and writes what it carries."""

    def __init__(self, writer: _Writer) -> None:
        self.writer = writer
        self.code: int | None = None
        self.phase = "start"
        #: Case files the worker saved: absolute path -> what it wrote (see :func:`saved`).
        self.case_files: dict[str, str] = {}
        self.eof = False
        self._buffer = b""

    def read(self, fd: int) -> None:
        try:
            data = os.read(fd, 1 << 16)
        except OSError:
            data = b""
        if not data:
            self.eof = True
            return
        self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                self._take(event)

    def _take(self, event: dict[str, Any]) -> None:
        if self.code is not None:
            return  # nothing after the exit code counts
        for name in ("out", "err"):
            if isinstance(event.get(name), str):
                self.writer.write(name, event[name])
        if isinstance(event.get("phase"), str):
            self.phase = event["phase"]
        saved_file = event.get("case_file")
        if isinstance(saved_file, dict) and isinstance(saved_file.get("path"), str) and isinstance(
                saved_file.get("text"), str):
            self.case_files[saved_file["path"]] = saved_file["text"]
        if isinstance(event.get("exit"), int) and not isinstance(event.get("exit"), bool):
            self.code = event["exit"]

    def drain(self, fd: int) -> None:
        """Read what is already in the channel, without waiting (processes the worker left may hold it open)."""
        while not self.eof and select.select([fd], [], [], 0)[0]:
            self.read(fd)


def supervise(argv: Sequence[str], out: TextIO | None, err: TextIO | None, *, runner: Callable[..., int],
              codes: Mapping[str, int], version: str, command: str, subject: str, json_report: bool) -> int:
    """Run the ``tpsim`` command ``argv`` in a session worker; write what it prints; return its exit code.

    ``runner(argv, out, err)``: the top-level function the worker runs (it returns the exit code);
    ``codes``: the exit codes for ``failed``, ``usage``, ``internal`` and ``interrupted``;
    ``version``: tpsim's (a JSON report written here carries it); ``command``: ``check`` or
    ``replay``; ``subject``: the target or case file (messages name it); ``json_report``: whether
    stdout must hold a JSON report (one is written here when the worker could not write its own).
    """
    from tpsim.comm import forker
    from tpsim.comm.forker import _ref

    _ensure_std_fds()
    writer = _Writer(out, err)
    session = _Session(writer)
    keep = set(_children(os.getpid())) | forker.pids()
    was_reaper = _prctl(_PR_GET_CHILD_SUBREAPER)
    if was_reaper == 0:
        _prctl(_PR_SET_CHILD_SUBREAPER, 1)
    handle: _Handle | None = None
    interrupted_at: float | None = None
    sent_at: float | None = None
    try:
        handle = _start(argv, (_isatty(out), _isatty(err)), _ref(runner))
        # What starting it started here (a forker, multiprocessing's resource tracker) is this process's own.
        keep |= (set(_children(os.getpid())) | forker.pids()) - {handle.pid}
        while True:
            try:
                now = time.monotonic()
                if interrupted_at is not None and now - interrupted_at > INTERRUPT_GRACE:
                    break  # it ignored Ctrl-C: the sweep below ends it
                if session.code is not None:
                    sent_at = sent_at or now
                    if handle.ended() or now - sent_at > _EXIT_GRACE:
                        break  # an atexit hook or a thread that keeps it alive changes nothing
                if session.code is None and handle.ended():
                    session.drain(handle.fd)
                    break
                waits = ([] if session.eof else [handle.fd]) + handle.waitables()
                ready, _, _ = select.select(waits, [], [], 0.5)
                if handle.fd in ready:
                    session.read(handle.fd)
            except KeyboardInterrupt:
                if interrupted_at is not None:
                    break  # a second Ctrl-C: stop now
                interrupted_at = time.monotonic()
                with contextlib.suppress(OSError):
                    os.kill(handle.pid, signal.SIGINT)
    except KeyboardInterrupt:
        interrupted_at = interrupted_at or time.monotonic()
    finally:
        if handle is not None:
            handle.ended()
            _sweep(handle.pid, keep)
            handle.ended()
            handle.close()
        if was_reaper == 0:
            _prctl(_PR_SET_CHILD_SUBREAPER, 0)
        # Every process the check started is gone: nothing can remove a case file after this.
        _keep_case_files(session.case_files, writer)
    return _verdict(session, handle, writer, interrupted_at is not None, codes, version, command, subject,
                    json_report)


def _verdict(session: _Session, handle: _Handle | None, writer: _Writer, interrupted: bool,
             codes: Mapping[str, int], version: str, command: str, subject: str, json_report: bool) -> int:
    """The exit code: the worker's own, else what its end says (and the message that explains it)."""

    if session.code is not None:
        return session.code
    status = _describe_status(handle.status if handle is not None else None)
    prog = f"tpsim {command}"
    if interrupted:
        writer.write("err", f"{prog}: interrupted\n")
        return codes["interrupted"]
    if session.phase == "run":
        message = (f"the checked code ended tpsim's session worker process ({status}) during the {command}; "
                   "what was reported before is complete and its case files are saved")
        writer.write("err", f"{prog}: error: {message}\n")
        if json_report and not writer.wrote_out:
            doc = {"tpsim_version": version, "command": command, "target": subject, "passed": False,
                   "interrupted": False, "error": message, "failures": [], "variants": []}
            writer.write("out", json.dumps(doc, indent=2) + "\n")
        return codes["failed"]
    writer.write("err", f"tpsim: internal error: tpsim's session worker process ended with {status} before it "
                 "ran the command (a bug in tpsim; please report it)\n")
    return codes["internal"]


def _isatty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):
        return False
