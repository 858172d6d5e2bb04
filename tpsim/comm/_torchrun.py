"""torchrun mode: use the world a launcher already made instead of spawning one.

When this process was started by ``torchrun`` (or anything that sets ``RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT``), every rank calls ``tpsim.run(fn, world_size, backend=...)``
itself. Each runs ``fn`` once on its own rank, in the default group (initialised here from the
environment through the tracing backend when the script has not done so), and all ranks
return the same list of every rank's value.

Outcomes travel through the rendezvous store, not a collective: a rank whose ``fn`` raised
must be able to report while its peers are still blocked in a collective it never joined
(a collective would be matched against theirs). Every wait is bounded by the run's timeout.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import pickle
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from tpsim.comm._payload import dumps
from tpsim.comm._tracing import BACKEND_NAMES, register_backends
from tpsim.comm._verdict import Unfinished, margin, values_or_raise
from tpsim.comm._worker import Outcome, execute, failure_outcome
from tpsim.comm.limits import nccl_unavailable_reason
from tpsim.comm.result import WorldResult
from tpsim.errors import BackendUnavailable, InvalidArgument

__all__ = ["LAUNCHER_ENV", "launched_world", "pin_launcher_env", "run_launched"]

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
#: What a launcher sets for each rank: the variables that say a world was launched, and LOCAL_RANK.
LAUNCHER_ENV = (*_ENV, "LOCAL_RANK")

#: Runs made by this process so far; every rank makes the same runs in the same order (SPMD),
#: so the counter names the same run on every rank.
_RUNS = [0]
#: The launcher's variables as :func:`pin_launcher_env` found them (None: read the environment).
_PINNED: list[dict[str, str | None] | None] = [None]


def pin_launcher_env() -> None:
    """Decide torchrun mode from the launcher's variables as they are now, whatever this process sets later.

    ``tpsim check`` calls it before it imports the target: a module that sets ``RANK``/``WORLD_SIZE``
    (or ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) when it is imported describes no world this
    process was launched into, and must not turn tpsim's own worlds into a launched one."""
    _PINNED[0] = {name: os.environ.get(name) for name in LAUNCHER_ENV}


def _launcher(name: str) -> str | None:
    pinned = _PINNED[0]
    return pinned.get(name) if pinned is not None else os.environ.get(name)


@contextlib.contextmanager
def _launcher_environment() -> Iterator[None]:
    """The launcher's variables in ``os.environ`` while torch reads them (``env://``), as pinned."""
    pinned = _PINNED[0]
    if pinned is None:
        yield
        return
    saved = {name: os.environ.get(name) for name in LAUNCHER_ENV}
    _set_env(pinned)
    try:
        yield
    finally:
        _set_env(saved)


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def launched_world() -> tuple[int, int] | None:
    """``(rank, world_size)`` of the launched world this process belongs to, or None (read from the
    environment, or from what :func:`pin_launcher_env` pinned)."""
    if not all(_launcher(name) for name in _ENV):
        return None
    try:
        return int(_launcher("RANK") or ""), int(_launcher("WORLD_SIZE") or "")
    except ValueError:
        return None


def _key(run: int, rank: int) -> str:
    return f"tpsim/run/{run}/rank{rank}"


def run_launched(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    timeout: float,
    faults: tuple[Any, ...] = (),
    checksum: bool = False,
) -> WorldResult:
    """Run ``fn`` on this rank of the launched world; return every rank's value (see module doc)."""
    launched = launched_world()
    if launched is None:
        raise InvalidArgument("run_launched() needs RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT in the environment")
    rank, env_world = launched
    if world_size != env_world:
        raise InvalidArgument(
            f"world_size={world_size} does not match the launched world: this process was started "
            f"(by torchrun) with WORLD_SIZE={env_world}. Under torchrun tpsim uses that world instead "
            f"of spawning one, so pass world_size={env_world}, or launch {world_size} ranks."
        )
    if backend == "nccl":
        local = int(_launcher("LOCAL_RANK") or "0")
        reason = nccl_unavailable_reason(local + 1)
        if reason is not None:
            raise BackendUnavailable("nccl", reason)
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        register_backends(loopback=False)
        with _launcher_environment():
            dist.init_process_group(
                BACKEND_NAMES[backend],
                init_method="env://",
                rank=rank,
                world_size=env_world,
                timeout=datetime.timedelta(seconds=max(timeout, 60.0)),
            )
    elif dist.get_world_size() != world_size:
        raise InvalidArgument(
            f"world_size={world_size} does not match the initialised default group "
            f"(dist.get_world_size()={dist.get_world_size()})"
        )
    rank = dist.get_rank()
    store = dist.distributed_c10d._get_default_store()
    _RUNS[0] += 1
    run = _RUNS[0]
    if run > 2:
        # Every rank has read run-2's outcomes: it finished run-1, which needed all of them.
        with contextlib.suppress(Exception):
            store.delete_key(_key(run - 2, rank))

    start = time.monotonic()
    limit = timeout + margin(timeout)
    outcome = execute(rank, fn, args, kwargs, timeout=timeout, faults=faults, checksum=checksum)
    try:
        blob = dumps(outcome)
    except Exception as exc:  # e.g. an exception object that pickles but is huge or odd
        blob = dumps(failure_outcome(rank, exc, None, prefix="could not send this rank's outcome: "))
    store.set(_key(run, rank), blob)

    keys = [_key(run, r) for r in range(world_size)]
    left = max(1.0, limit - (time.monotonic() - start))
    timed_out = False
    try:
        store.wait(keys, datetime.timedelta(seconds=left))
    except Exception:  # the store's timeout error; find out below who is missing
        timed_out = True
    outcomes: dict[int, Outcome] = {}
    unfinished: dict[int, Unfinished] = {}
    for r, key in enumerate(keys):
        if store.check([key]):
            outcomes[r] = pickle.loads(store.get(key))
        else:
            unfinished[r] = Unfinished(state="unknown")
    fired = sorted((item for o in outcomes.values() for item in o.fired), key=lambda item: item[1].rank)
    values, trace = values_or_raise(
        world_size=world_size,
        backend=backend,
        outcomes=outcomes,
        exits={},
        unfinished=unfinished,
        limit=limit,
        timed_out=timed_out,
        fired=fired,
        timeout=timeout,
    )
    return WorldResult(values=values, trace=trace, backend=backend, faults_fired=fired)
