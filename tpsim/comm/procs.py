"""Worlds of real processes: the ``gloo`` and ``nccl`` backends of the world runner.

``run_processes(fn, world_size, backend=...)`` runs ``fn(*args, **kwargs)`` on every rank of a
world of ``world_size`` processes and returns a :class:`tpsim.WorldResult`.

* **A pool, not a world per call.** The processes of a world are kept: a pool per
  ``(backend, world_size)`` initialises ``torch.distributed`` once (rendezvous through a
  ``FileStore`` in a fresh temp dir: no port, so parallel pytest-xdist workers never collide) and
  then runs one submitted function after another. At most :data:`MAX_POOLS` pools and
  :data:`MAX_POOL_WORKERS` idle worker processes live at once (least recently used pools go first;
  a single pool larger than the worker bound is still kept, alone); an atexit hook ends them all.
* **Start-up paid once.** Ranks are forked from the :mod:`forker <tpsim.comm.forker>`, a process
  that imported torch and tpsim once (and the target, see :func:`preload`): a world of N ranks
  starts in tens of milliseconds, not N imports of torch. Where no forker can serve (no ``fork`` on
  this platform, an import left it multi-threaded, CUDA initialised in it) ranks are spawned.
* **Pools live through refusals.** A run in which every rank raised its own exception (a clean
  refusal, e.g. a shape that does not divide) keeps its pool: every rank destroys the run's
  subgroups and the default group is checked by a collective before the next run
  (:func:`tpsim.comm._worker.reset_world`). A pool is replaced only after a death, a hang (a rank
  stuck or a collective timed out), a destroyed default group or a corrupted state (collectives
  left unmatched, a failed check); :func:`replacements` counts them by reason.
* **Replacing is prompt.** The broken pool is killed and reaped at once — not at gloo's timeout —
  and the next call starts a fresh one.
* **Every wait is bounded**: joining a world by :func:`startup_bound`, a run by ``timeout``
  (also every backend collective's timeout) plus :func:`margin`.
* **Under torchrun** (the environment already describes a launched world) nothing is spawned:
  see :mod:`tpsim.comm._torchrun`.

Each rank's collectives are recorded by the tracing process group of
:mod:`tpsim.comm._tracing` (``TracingProcessGroup.intercept`` is the per-call hook point).
"""

from __future__ import annotations

import atexit
import collections
import mmap
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import random
import shutil
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from multiprocessing.reduction import ForkingPickler
from typing import Any

from tpsim.comm import _torchrun, forker, rank_death
from tpsim.comm._payload import dump_call, import_hinted
from tpsim.comm._tracing import parse_status
from tpsim.comm._verdict import Unfinished, describe_exit, margin, values_or_raise
from tpsim.comm._worker import RANK_MEMORY_BYTES, Outcome, rank_memory, worker_main
from tpsim.comm.limits import nccl_unavailable_reason
from tpsim.comm.ops import P2P_OPS
from tpsim.comm.rank_progress import RankProgress
from tpsim.comm.result import WorldResult
from tpsim.errors import BackendUnavailable, InvalidArgument, RankError

__all__ = [
    "MAX_POOLS",
    "MAX_POOL_WORKERS",
    "PROCESS_BACKENDS",
    "live_worker_pids",
    "ensure_pool",
    "margin",
    "nccl_unavailable_reason",
    "preload",
    "replacements",
    "run_processes",
    "shutdown_pools",
    "startup_bound",
]

#: Backends served by real processes.
PROCESS_BACKENDS = ("gloo", "nccl")


def _env_count(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if raw == "":
        return default
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise InvalidArgument(f"environment variable {name}={raw!r} must be a whole number >= 1")
    return value


#: Pools kept alive at once (environment: ``TPSIM_MAX_POOLS``). A search draws several world
#: sizes in turn; with fewer pools than sizes each draw restarted a pool (seconds, instead of
#: ~0.02 s per example on a reused one).
MAX_POOLS = _env_count("TPSIM_MAX_POOLS", 6)
#: Worker processes kept alive at once over all pools (environment: ``TPSIM_MAX_POOL_WORKERS``);
#: each has torch loaded (~300 MB resident), so this bounds the memory idle pools hold. The
#: default holds, e.g., the pools of world sizes 1-4 (10 workers) plus one of size 6.
MAX_POOL_WORKERS = _env_count("TPSIM_MAX_POOL_WORKERS", 16)

#: After a rank failed, the world is stopped once every unreported rank is provably stuck (blocked in
#: a collective no reported rank went past, or held by a planned stall) and its status stayed so,
#: unchanged, this long: a rank that has just finished a collective (its peer failed only after it)
#: may not have updated its status yet, and would be reported in the wrong call. Ranks still running
#: their own code are waited for (they may be about to report their own error, and a busy machine
#: may keep them descheduled for seconds), up to the run's bound.
STUCK_S = 0.1

#: Seconds the ranks of a pool kept after a refusal get to reset their world (destroy the run's
#: subgroups, one all_gather on the default group); past it the pool is replaced.
RESET_S = 10.0

#: Why pools were replaced in this process so far: reason -> count (see :func:`replacements`).
_REPLACED: collections.Counter[str] = collections.Counter()
DEATH, HANG, DESTROYED, CORRUPTED, INTERRUPTED = (
    "death", "hang", "destroyed group", "corrupted state", "interrupted")


def replacements() -> dict[str, int]:
    """How many worker pools this process replaced so far, by reason: ``death`` (a rank's process
    ended), ``hang`` (a rank stuck, or a collective timed out), ``destroyed group`` (a run destroyed
    the default group), ``corrupted state`` (collectives left unmatched, a failed world check) and
    ``interrupted`` (Ctrl-C or a broken pipe mid-run). A correct layer's check replaces none."""
    with _LOCK:
        return dict(_REPLACED)


def startup_bound(world_size: int) -> float:
    """Seconds a fresh pool may take to start its processes and join the world.

    Starting is not part of a run's ``timeout``: ranks forked from the forker start in milliseconds,
    but a spawned rank imports torch, which takes a few seconds per process on a small machine.
    """
    return 60.0 + 5.0 * world_size


class _Pool:
    """``world_size`` worker processes that joined one world and run submitted functions."""

    def __init__(self, backend: str, world_size: int) -> None:
        self.backend = backend
        self.world_size = world_size
        self.owner_pid = os.getpid()
        self.procs: list[Any] = []
        self.conns: list[Any] = []
        self.slots: list[Any] = []
        #: Each rank's progress record (its marked phase), read when its process dies (tpsim.comm.rank_progress).
        self.progress: list[RankProgress] = []
        self.tmpdir = tempfile.mkdtemp(prefix=f"tpsim-{backend}-w{world_size}-")
        # Every rank's status slot and progress, shared with the ranks through a file both sides map.
        self.memory_path = os.path.join(self.tmpdir, "ranks")
        size = world_size * RANK_MEMORY_BYTES
        with open(self.memory_path, "wb") as fh:
            fh.truncate(size)
        with open(self.memory_path, "r+b") as fh:
            self.memory = mmap.mmap(fh.fileno(), size)
        for rank in range(world_size):
            slot, progress = rank_memory(self.memory, rank)
            self.slots.append(slot)
            self.progress.append(RankProgress(progress))

    # -- life cycle ------------------------------------------------------------------------
    def _fork(self, store_path: str, bound: float, hints: dict[str, str]) -> bool:
        """Fork the ranks from the forker, after it imported the modules ``hints`` names (a payload's:
        each rank would import them otherwise); False when it cannot serve this pool (then spawn)."""
        if forker.shared() is None:
            return False
        try:
            if hints:
                forker.preload(import_hinted, (hints,), bound)
            z = forker.shared()  # a fresh one if that import left threads in the last one
            if z is None:
                return False
            z.wait_ready()
            if not z.safe:
                forker.replace()  # a later pool gets a fresh one
                return False
            # A child of the forker: its parent is the forker's single thread, so the parent-death
            # signal may be armed; the forker in turn dies with this process.
            children = z.fork(worker_main, [
                (rank, self.world_size, self.backend, store_path, self.memory_path, z.pid, bound, True,
                 1 if z.inherited else 0)
                for rank in range(self.world_size)], [f"tpsim-{self.backend}-r{rank}" for rank in range(self.world_size)])
        except BackendUnavailable:
            return False
        self.procs = list(children)
        self.conns = [c.conn for c in children]
        return True

    def _spawn(self, store_path: str, bound: float) -> None:
        ctx = mp.get_context("spawn")  # fork would copy this process's threads and torch state
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(
                target=worker_main,
                args=(child_end, rank, self.world_size, self.backend, store_path, self.memory_path, os.getpid(), bound,
                      # the parent-death signal follows the starting thread: arm it only for the main one
                      threading.current_thread() is threading.main_thread()),
                name=f"tpsim-{self.backend}-rank{rank}",
                daemon=False,  # fn may start processes of its own (daemons cannot)
            )
            proc.start()
            child_end.close()
            self.procs.append(proc)
            self.conns.append(parent_end)

    def start(self, hints: dict[str, str] | None = None) -> None:
        """Start the ranks (forked from the forker, else spawned) and wait (bounded) until every one
        has joined the world. ``hints``: the modules of the first payload (see :meth:`_fork`)."""
        store_path = os.path.join(self.tmpdir, "store")
        bound = startup_bound(self.world_size)
        if not self._fork(store_path, bound, hints or {}):
            self._spawn(store_path, bound)
        deadline = time.monotonic() + bound
        waiting = set(range(self.world_size))
        while waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                ranks = ", ".join(map(str, sorted(waiting)))
                raise RankError(
                    f"rank(s) {ranks} did not join the {self.backend} world within {bound:.0f}s "
                    f"(world_size={self.world_size}); the machine may be overloaded",
                    rank=min(waiting),
                )
            ready = mpc.wait([self.conns[r] for r in waiting] + [self.procs[r].sentinel for r in waiting], left)
            for rank in sorted(waiting):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        message = conn.recv()
                    except (EOFError, OSError):
                        message = ("exit", None)
                    if message[0] == "ready":
                        waiting.discard(rank)
                        continue
                    if message[0] == "init-error":
                        outcome: Outcome = message[1]
                        raise RankError(
                            f"rank {rank} could not join the {self.backend} world: "
                            f"{outcome.error_type}: {outcome.error_text}",
                            rank=rank,
                            remote_traceback=outcome.traceback,
                        )
                if proc.sentinel in ready:
                    proc.join(1.0)
                    raise RankError(
                        f"rank {rank} died with {describe_exit(proc.exitcode)} while joining the "
                        f"{self.backend} world (its stderr says why; a script that calls tpsim at "
                        "import time must guard its entry point with `if __name__ == '__main__':`, "
                        "because worker processes import the main module)",
                        rank=rank,
                    )

    def healthy(self) -> bool:
        """Whether every process is alive and belongs to this (not a forked) process."""
        return os.getpid() == self.owner_pid and all(p.is_alive() for p in self.procs)

    def kill(self) -> None:
        """Kill every process, reap it (bounded), close the pipes and remove the temp dir."""
        if os.getpid() != self.owner_pid:
            return  # a forked copy of the registry: these processes are not ours to kill
        for proc in self.procs:
            if proc.is_alive():
                forker.kill_group(proc.pid)  # with whatever the rank forked (its own process group)
        for proc in self.procs:
            proc.join(5.0)  # SIGKILL cannot be ignored; the bound only guards a wedged kernel
        for conn in self.conns:
            conn.close()
        for proc in self.procs:
            if isinstance(proc, forker.Child):
                proc.close()
        shutil.rmtree(self.tmpdir, ignore_errors=True)
        # The progress records stay readable (a death is named from them after the kill); the mapping goes with them.
        self.procs, self.conns, self.slots = [], [], []

    def reset(self, timeout: float) -> str | None:
        """After a run every rank refused: have every rank reset its world (bounded); None when the
        pool may be reused, else why not."""
        nonce = random.getrandbits(62)
        bound = min(timeout, RESET_S)
        for conn in self.conns:
            try:
                conn.send(("reset", nonce, bound))
            except OSError:
                return "a rank's process is gone"
        deadline = time.monotonic() + bound + margin(bound)
        pending = set(range(self.world_size))
        why: str | None = None
        while pending:
            left = deadline - time.monotonic()
            ready = mpc.wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], max(0, left))
            if not ready:
                return f"ranks {sorted(pending)} did not reset their world within {bound + margin(bound):.0f} s"
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        _, answer = conn.recv()
                    except (EOFError, OSError):
                        return f"rank {rank}'s process ended while resetting its world"
                    pending.discard(rank)
                    why = why or (f"rank {rank}: {answer}" if answer else None)
                elif proc.sentinel in ready:
                    return f"rank {rank}'s process ended while resetting its world"
        return why

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def status(self, rank: int) -> Unfinished:
        state, op, index, group = parse_status(bytes(self.slots[rank].value))
        return Unfinished(state=state, op=op, call_index=index, group=group)

    # -- one run ---------------------------------------------------------------------------
    def run(
        self, payload: bytes, hints: dict[str, str], timeout: float, faults: tuple[Any, ...],
        checksum: bool = False, plain_data: bool = False,
    ) -> tuple[dict[int, Outcome], dict[int, int | None], dict[int, Unfinished], float, bool]:
        """Run one call on every rank; return what values_or_raise() needs. Never waits unboundedly.

        For ranks whose process ended, ``unfinished`` also holds what their status slot said
        last (e.g. ``dropped`` by the fault plan, and in which call).
        """
        limit = timeout + margin(timeout) + sum(getattr(f, "seconds", 0.0) for f in faults)
        message = bytes(ForkingPickler.dumps(("run", payload, hints, timeout, faults, checksum, plain_data)))
        outcomes: dict[int, Outcome] = {}
        exits: dict[int, int | None] = {}
        start = time.monotonic()
        for conn in self.conns:
            try:
                conn.send_bytes(message)
            except OSError:  # the process is gone; its sentinel tells how below
                pass
        pending = set(range(self.world_size))
        failed_at: float | None = None
        seen: dict[int, bytes] = {}  # the unreported ranks' status slots, and since when unchanged
        seen_at = start
        refused = False
        timed_out = False
        while pending:
            now = time.monotonic()
            if now - start >= limit:
                timed_out = True
                break
            if failed_at is not None:
                # The world is lost. Wait only for ranks that may still report their own error.
                # A verified refusal (mismatch, checksum) is raised by every member at once: wait
                # for the others' reports rather than taking "in a collective" for "stuck".
                states = {r: bytes(self.slots[r].value) for r in pending}
                if states != seen:
                    seen, seen_at = states, now
                # A rank "in" a collective that a reported rank has already gone past on the same
                # group is only slow to return from it: it will reach the next one.
                passed: dict[str | None, int] = {}
                for o in outcomes.values():
                    for c in o.calls:
                        passed[c.group] = max(passed.get(c.group, 0), c.call_index)
                statuses = [self.status(r) for r in pending]
                held = all(st.state == "stalled" or (
                    st.state == "collective" and (st.call_index or 0) >= passed.get(st.group, 0)) for st in statuses)
                if not refused and held and now - seen_at >= STUCK_S:
                    break
                wake = min(start + limit, now + 0.02)
            else:
                wake = start + limit
            handles = [self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending]
            ready = mpc.wait(handles, max(0.0, wake - now))
            for rank in sorted(pending):
                conn, proc = self.conns[rank], self.procs[rank]
                if conn in ready or (proc.sentinel in ready and conn.poll()):
                    try:
                        kind, outcome = conn.recv()
                    except (EOFError, OSError):
                        kind, outcome = "exit", None
                    if kind == "done":
                        outcomes[rank] = outcome
                        pending.discard(rank)
                        if not outcome.ok and failed_at is None:
                            failed_at = time.monotonic()
                            refused = outcome.intact
                        continue
                if proc.sentinel in ready:
                    proc.join(1.0)
                    exits[rank] = proc.exitcode
                    pending.discard(rank)
                    if failed_at is None:
                        failed_at = time.monotonic()
        unfinished = {rank: self.status(rank) for rank in sorted(pending) if rank not in exits}
        unfinished.update({rank: self.status(rank) for rank in exits})
        return outcomes, exits, unfinished, limit, timed_out


_POOLS: OrderedDict[tuple[str, int], _Pool] = OrderedDict()
# One run at a time per process: a pool's pipes carry one conversation.
_LOCK = threading.RLock()
_ATEXIT_REGISTERED = [False]


def shutdown_pools() -> None:
    """Kill every worker pool of this process (also run at interpreter exit)."""
    with _LOCK:
        while _POOLS:
            _, pool = _POOLS.popitem(last=False)
            pool.kill()


def live_worker_pids() -> dict[tuple[str, int], list[int]]:
    """PIDs of the worker processes of each live pool, keyed by ``(backend, world_size)``."""
    with _LOCK:
        return {key: pool.pids() for key, pool in _POOLS.items()}


def ensure_pool(backend: str, world_size: int) -> None:
    """Start (bounded) the worker pool a run of ``world_size`` ranks on ``backend`` would use.

    Lets callers that time runs (fault-detection bounds, benchmarks) keep the pool's start-up
    out of the measurement. Under torchrun there is no pool: nothing happens.
    """
    if backend not in PROCESS_BACKENDS or _torchrun.launched_world() is not None:
        return
    if backend == "nccl":
        reason = nccl_unavailable_reason(world_size)
        if reason is not None:
            raise BackendUnavailable("nccl", reason)
    with _LOCK:
        _pool_for(backend, world_size)


def _discard(key: tuple[str, int], reason: str) -> None:
    """Kill the pool of ``key`` and count its replacement under ``reason``."""
    pool = _POOLS.pop(key, None)
    if pool is not None:
        _REPLACED[reason] += 1
        pool.kill()


def preload(fn: Callable[..., Any], args: tuple[Any, ...], bound: float) -> str | None:
    """Run ``fn(*args)`` (top-level; e.g. resolve a target) in the forker the ranks are forked from, so
    every rank of every later pool starts with what it imported; the error it raised as text, or
    None. Does nothing (None) where ranks are not forked from a forker."""
    if _torchrun.launched_world() is not None:
        return None
    # An import that leaves threads behind retires the forker: ranks then come from a fresh one
    # without it, and import it themselves (forker.preload).
    return forker.preload(fn, args, bound)


def _trim(pools: int, workers: int) -> None:
    """End least recently used pools until ``pools`` more pools and ``workers`` more workers
    fit within MAX_POOLS and MAX_POOL_WORKERS. With ``pools=0`` (a pool was just reused) the
    most recent pool, the one in use, always stays."""
    while len(_POOLS) > 1 or (pools and _POOLS):
        if (len(_POOLS) + pools <= MAX_POOLS
                and sum(k[1] for k in _POOLS) + workers <= MAX_POOL_WORKERS):
            return
        _, oldest = _POOLS.popitem(last=False)
        oldest.kill()


def _pool_for(backend: str, world_size: int, hints: dict[str, str] | None = None) -> _Pool:
    key = (backend, world_size)
    pool = _POOLS.get(key)
    if pool is not None:
        if pool.healthy():
            _POOLS.move_to_end(key)
            _trim(0, 0)  # the bounds may have been lowered since (tests, a caller's config)
            return pool
        if os.getpid() != pool.owner_pid:
            _POOLS.clear()  # inherited through fork: forget the parent's pools, never touch them
        else:
            _discard(key, DEATH)  # a rank's process ended between runs
    _trim(1, world_size)  # room for the new pool and its workers
    if not _ATEXIT_REGISTERED[0]:
        atexit.register(shutdown_pools)
        _ATEXIT_REGISTERED[0] = True
    pool = _Pool(backend, world_size)
    try:
        pool.start(hints)
    except BaseException:  # including Ctrl-C while starting: leave no process behind
        pool.kill()
        raise
    _POOLS[key] = pool
    return pool


def run_processes(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str,
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float,
    faults: Sequence[Any] = (),
    checksum: bool = False,
    plain_data: bool = False,
) -> WorldResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks of a ``backend`` world of processes.

    ``backend`` is ``"gloo"`` (CPU processes on this machine) or ``"nccl"`` (one process per
    GPU, rank r on ``cuda:r``). Under torchrun the launched world is used instead of spawning
    one (``world_size`` must then equal ``WORLD_SIZE``). ``fn`` must be picklable by reference
    (a top-level function), and its return value picklable.

    Returns a :class:`tpsim.WorldResult` whose ``values[r]`` is rank r's return value and whose
    ``trace`` holds every rank's collective calls.

    Raises :class:`tpsim.InvalidArgument` (bad backend, unpicklable fn/args),
    :class:`tpsim.BackendUnavailable` (nccl without enough GPUs; nothing is spawned),
    :class:`tpsim.RankError` when a rank raised or its process died (the lowest such rank, its
    traceback in the message, every failed rank in ``errors``), or
    :class:`tpsim.CollectiveError` when ranks could not complete their collectives within
    ``timeout`` (every backend wait is bounded by it; the whole run by ``timeout + margin``).
    """
    if backend not in PROCESS_BACKENDS:
        raise InvalidArgument(f"backend={backend!r} is not a process backend; expected one of {PROCESS_BACKENDS}")
    faults = tuple(faults)
    args = tuple(args)
    kwargs = dict(kwargs or {})

    if _torchrun.launched_world() is not None:
        return _torchrun.run_launched(fn, world_size, backend=backend, args=args, kwargs=kwargs, timeout=timeout,
                                      faults=faults, checksum=checksum)

    if getattr(mp.current_process(), "_inheriting", False):
        # We are a freshly spawned process re-importing the parent's main module, which called
        # tpsim at import time: starting a world from here would recurse.
        raise RuntimeError(
            f"tpsim.run(..., backend={backend!r}) was called while a worker process was importing the main "
            "module; guard the script's entry point with `if __name__ == '__main__':`"
        )
    if backend == "nccl":
        reason = nccl_unavailable_reason(world_size)
        if reason is not None:
            raise BackendUnavailable("nccl", reason)
    payload, hints = dump_call(fn, args, kwargs, backend)

    with _LOCK:
        key = (backend, world_size)
        pool = _pool_for(backend, world_size, hints)
        try:
            outcomes, exits, unfinished, limit, timed_out = pool.run(payload, hints, timeout, faults, checksum,
                                                                     plain_data)
        except BaseException:  # Ctrl-C or a broken pipe mid-run: the world is in an unknown state
            _discard(key, INTERRUPTED)
            raise
        fired = [item for o in outcomes.values() for item in o.fired]
        fired += _fired_in_dead_ranks(faults, exits, unfinished)
        fired.sort(key=lambda item: item[1].rank)
        progress = list(pool.progress)
        reason, detail = _after_run(outcomes, exits, unfinished, timed_out, world_size)
        if detail == "refused":  # every rank refused with its own error: reuse the pool if its world is sound
            why = pool.reset(timeout)
            reason = None if why is None else CORRUPTED
        if reason is not None:
            _discard(key, reason)  # kill and reap now, before building the report
        try:
            values, trace = values_or_raise(
                world_size=world_size,
                backend=backend,
                outcomes=outcomes,
                exits=exits,
                unfinished=unfinished,
                limit=limit,
                timed_out=timed_out,
                fired=fired,
                timeout=timeout,
            )
        except RankError as err:
            death = _named_death(err, exits, unfinished, progress)
            if death is err:
                raise
            raise death from err

    return WorldResult(values=values, trace=trace, backend=backend, faults_fired=fired)


def _after_run(outcomes: dict[int, Outcome], exits: dict[int, int | None], unfinished: dict[int, Unfinished],
               timed_out: bool, world_size: int) -> tuple[str | None, str]:
    """``(reason, detail)``: why the pool must be replaced after this run (None: it may live on), and
    ``"refused"`` when every rank raised its own exception with no collective left unmatched (the pool
    then lives on if its world passes a check, :meth:`_Pool.reset`)."""
    if exits:
        return DEATH, "a rank's process ended"
    if unfinished or timed_out:
        return HANG, "a rank did not finish"
    if any(o.world_lost for o in outcomes.values()):
        return DESTROYED, "the run destroyed the default group"
    failed = [o for o in outcomes.values() if not o.ok and not o.intact]
    if not failed:
        return None, ""
    if any(o.collective for o in failed):
        return HANG, "a collective failed (timed out, or a peer failed in it)"
    unmatched = _unmatched(outcomes.values(), world_size)
    if unmatched:
        return CORRUPTED, unmatched
    return None, "refused"


def _unmatched(outcomes: Any, world_size: int) -> str | None:
    """A collective or send/recv some rank issued that its peers did not (a run that ended in
    refusals may leave one pending in the backend), or None when every one was matched."""
    counts: dict[tuple[str, tuple[int, ...]], collections.Counter[int]] = {}
    sent: collections.Counter[tuple[int, int]] = collections.Counter()
    received: collections.Counter[tuple[int, int]] = collections.Counter()
    for outcome in outcomes:
        for call in outcome.calls:
            if call.op in P2P_OPS:
                if call.peer is None:
                    return f"rank {call.rank}'s {call.describe()} names no peer"
                (sent if call.op == "send" else received)[
                    (call.rank, call.peer) if call.op == "send" else (call.peer, call.rank)] += 1
            else:
                counts.setdefault((call.group, call.group_ranks), collections.Counter())[call.rank] += 1
    for (group, ranks), per_rank in counts.items():
        members = ranks or tuple(range(world_size))
        issued = {r: per_rank.get(r, 0) for r in members}
        if len(set(issued.values())) > 1:
            return f"ranks issued different numbers of collectives on group {group}: {issued}"
    if sent != received:
        return f"sends and receives do not match: sent {dict(sent)}, received {dict(received)}"
    return None


def _named_death(err: RankError, exits: dict[int, int | None], unfinished: dict[int, Unfinished],
                 progress: list[RankProgress]) -> RankError:
    """``err`` as a :class:`tpsim.RankExited`/:class:`tpsim.RankCrashed` when it blames a rank whose
    process ended on its own (not one a fault plan dropped), naming the phase the rank marked."""
    def phase_of(rank: int) -> tuple[str | None, int | None]:
        return progress[rank].view(1).phase_of(0) if rank < len(progress) else (None, None)

    rank = err.rank
    if type(err) is not RankError or rank not in exits:
        return rank_death.classify(err, phase_of)  # a rank's sys.exit / MemoryError, with its phase
    state = unfinished.get(rank)
    if state is not None and state.state == "dropped":
        return err
    phase, step = phase_of(rank)
    death = rank_death.from_exit(rank, exits[rank], phase=phase, step=step)
    return type(death)(f"{death.summary}\n{err.summary}", rank=rank, phase=phase, step=step, cause=death.cause,
                       exitcode=death.exitcode, signal=death.signal, errors=err.errors, trace=err.trace,
                       faults_fired=err.faults_fired)


def _fired_in_dead_ranks(faults: tuple[Any, ...], exits: dict[int, int | None],
                         unfinished: dict[int, Unfinished]) -> list[tuple[Any, Any]]:
    """Faults that acted in ranks that never reported (a Drop ended the process; a stall was cut)."""
    from tpsim.faults import Delay, Drop

    fired = []
    for rank, state in sorted(unfinished.items()):
        kind = {"dropped": Drop, "stalled": Delay}.get(state.state)
        call = state.call(rank)
        if kind is None or call is None:
            continue
        for fault in faults:
            if isinstance(fault, kind) and fault.rank == rank:
                fired.append((fault, call))
                break
    return fired
