"""The world runner: run one SPMD function on every rank of a world and collect results.

``run(fn, world_size)`` is the whole API most callers need; ``run_world`` returns the
per-rank values together with the collective trace. The backend decides how ranks are
made: threads in this process (``inproc``), or one process per rank (``gloo``, ``nccl``);
under ``torchrun`` the existing world is used instead of spawning one.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tpsim.comm.trace import Trace
from tpsim.errors import InvalidArgument

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT", "WorldResult", "run", "run_world"]

#: Backends a world can run on.
BACKENDS = ("inproc", "gloo", "nccl")

#: Seconds any single collective wait may block before the world is declared stuck.
DEFAULT_TIMEOUT = 30.0


@dataclass
class WorldResult:
    """What a finished world returns: ``values[r]`` is rank r's return value."""

    values: list[Any]
    trace: Trace = field(default_factory=Trace)
    backend: str = "inproc"
    #: ``(fault, call)`` for every fault of the plan that acted, and the call it acted on.
    faults_fired: list[tuple[Any, Any]] = field(default_factory=list)


def _check_args(world_size: Any, backend: Any, timeout: Any) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int):
        raise InvalidArgument(
            f"world_size={world_size!r} must be an int >= 1 (got {type(world_size).__name__})"
        )
    if world_size < 1:
        raise InvalidArgument(f"world_size={world_size} must be >= 1")
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend={backend!r} is not one of {', '.join(BACKENDS)}")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or not (
        timeout > 0 and math.isfinite(timeout)
    ):
        raise InvalidArgument(f"timeout={timeout!r} must be a positive number of seconds")


def run_world(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "inproc",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    faults: Sequence[Any] = (),
    checksum: bool | None = None,
) -> WorldResult:
    """Run ``fn(*args, **kwargs)`` on every rank; return values and the collective trace.

    Inside ``fn`` the default process group is initialised, so ``dist.get_rank()``,
    ``dist.all_reduce(t)`` and ``dist.new_group(...)`` work unmodified.

    ``faults`` is a fault plan: :mod:`tpsim.faults` objects (``Drop``, ``Crash``, ``Delay``,
    ``Corrupt``, ``Mismatch``) or their JSON dicts, injected beneath the process group;
    ``WorldResult.faults_fired`` (or ``err.faults_fired`` on failure) says which acted where.
    ``checksum=True`` (default: the environment variable ``TPSIM_CHECKSUM=1``) checksums every
    contribution where the rank hands it to ``torch.distributed`` and again where the collective
    consumes it; a difference (e.g. a ``Corrupt`` fault) fails that collective on every member
    with a :class:`tpsim.CollectiveError` naming the rank whose contribution changed.

    Raises :class:`tpsim.RankError` (a RuntimeError) when a rank raised or died, with the
    failing rank's traceback in the message, or :class:`tpsim.CollectiveError` when a
    collective could not complete (never a hang: every wait is bounded by ``timeout``).
    A rank dropped by the fault plan never yields a value: the run raises even if every other
    rank finished.
    """
    if not callable(fn):
        raise InvalidArgument(f"fn={fn!r} must be callable")
    _check_args(world_size, backend, timeout)
    from tpsim.faults import check_plan, parse_plan

    plan = parse_plan(faults)
    check_plan(plan, world_size)
    if checksum is None:
        checksum = os.environ.get("TPSIM_CHECKSUM", "0") not in ("", "0")
    elif not isinstance(checksum, bool):
        raise InvalidArgument(f"checksum={checksum!r} must be True, False or None (None: TPSIM_CHECKSUM decides)")
    kwargs = dict(kwargs or {})
    if backend == "inproc":
        from tpsim.comm.inproc import run_inproc

        return run_inproc(fn, world_size, args=tuple(args), kwargs=kwargs, timeout=float(timeout), faults=plan,
                          checksum=checksum)
    from tpsim.comm.procs import run_processes

    return run_processes(
        fn, world_size, backend=backend, args=tuple(args), kwargs=kwargs, timeout=float(timeout), faults=plan,
        checksum=checksum,
    )


def run(
    fn: Callable[..., Any],
    world_size: int,
    *,
    backend: str = "inproc",
    args: Sequence[Any] = (),
    kwargs: dict[str, Any] | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    faults: Sequence[Any] = (),
    checksum: bool | None = None,
) -> list[Any]:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return the per-rank values.

    >>> import torch, torch.distributed as dist, tpsim
    >>> def total():
    ...     t = torch.tensor([float(dist.get_rank())])
    ...     dist.all_reduce(t)
    ...     return t.item()
    >>> tpsim.run(total, 4)
    [6.0, 6.0, 6.0, 6.0]
    """
    return run_world(
        fn, world_size, backend=backend, args=args, kwargs=kwargs, timeout=timeout, faults=faults,
        checksum=checksum,
    ).values
