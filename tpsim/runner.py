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
from types import ModuleType
from typing import Any

from tpsim.comm.result import WorldResult
from tpsim.errors import InvalidArgument, RankError

__all__ = ["BACKENDS", "DEFAULT_TIMEOUT", "WorldResult", "run", "run_world"]

#: Backends a world can run on.
BACKENDS = ("inproc", "gloo", "nccl")

#: Seconds any single collective wait may block before the world is declared stuck.
DEFAULT_TIMEOUT = 30.0


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
    isolate: bool = False,
    rank_local: Sequence[str | ModuleType] = (),
    watch: Sequence[str | ModuleType] = (),
    plain: bool = False,
    slot: str = "ranks",
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

    ``rank_local`` names modules whose globals each rank must own, as it would in its own
    process (a library's parallel state: ``("fairscale.nn.model_parallel.initialize",)``). On
    ``inproc`` each rank starts from the module as it was when the world started and its globals
    are swapped in at every hand-off; the module is put back afterwards. On ``gloo``/``nccl`` every
    rank is its own process already: the names are checked and nothing else happens. ``watch``
    adds modules to those whose globals inproc watches for sharing between ranks (by default the
    modules ``fn`` and its arguments come from, and their packages): a global one rank rebinds and
    another then relies on raises :class:`tpsim.SharedModuleState` naming it and the fix.

    Raises :class:`tpsim.RankError` (a RuntimeError) when a rank raised or died, with the
    failing rank's traceback in the message, or :class:`tpsim.CollectiveError` when a
    collective could not complete (never a hang: every wait is bounded by ``timeout``).
    A rank dropped by the fault plan never yields a value: the run raises even if every other
    rank finished. A rank that calls ``sys.exit`` or runs out of memory raises
    :class:`tpsim.RankExited` / :class:`tpsim.RankCrashed` (:class:`tpsim.RankError` subclasses).

    ``isolate=True`` runs an ``inproc`` world in a supervised worker process
    (:mod:`tpsim.comm.isolate`), so a rank's ``os._exit``, segfault, ``abort()`` or out-of-memory
    death raises :class:`tpsim.RankExited` / :class:`tpsim.RankCrashed` naming the rank and its
    phase instead of ending this process, and a rank stuck in native code is abandoned with the
    worker. ``fn`` must then be a top-level function and its arguments and results picklable.
    (gloo and nccl ranks are processes already: there it changes nothing.) ``slot`` picks which of
    this process's isolated workers runs it (``"ranks"``, ``"reference"``: :data:`tpsim.comm.isolate.SLOTS`).

    ``plain=True`` (worker processes only: isolated, gloo, nccl) ships every value and error back as
    plain data for a process that must never import the checked code (:mod:`tpsim.comm.plain`):
    tensors as plain ``torch.Tensor`` read without their subclass's ``__torch_function__``, and every
    object of a module other than the standard library, torch, numpy and tpsim as a
    :class:`tpsim.comm.plain.Foreign` that names it. The property engine runs its worlds so.

    World sizes above the backend's limit on this machine are refused before anything starts
    (:func:`tpsim.comm.limits.check_world_size`; override: ``TPSIM_MAX_WORLD_SIZE``).
    """
    if not callable(fn):
        raise InvalidArgument(f"fn={fn!r} must be callable")
    _check_args(world_size, backend, timeout)
    if not isinstance(isolate, bool):
        raise InvalidArgument(f"isolate={isolate!r} must be True or False")
    if not isinstance(plain, bool):
        raise InvalidArgument(f"plain={plain!r} must be True or False")
    from tpsim.comm import _torchrun, rank_death
    from tpsim.comm.limits import check_world_size

    if backend == "inproc" or _torchrun.launched_world() is None:  # a launched world exists already
        check_world_size(world_size, backend)
    from tpsim.faults import check_plan, parse_plan

    plan = parse_plan(faults)
    check_plan(plan, world_size)
    if checksum is None:
        checksum = os.environ.get("TPSIM_CHECKSUM", "0") not in ("", "0")
    elif not isinstance(checksum, bool):
        raise InvalidArgument(f"checksum={checksum!r} must be True, False or None (None: TPSIM_CHECKSUM decides)")
    kwargs = dict(kwargs or {})
    from tpsim.comm.modstate import expand_watch, resolve_modules

    if plain:
        # A judge's world: the names are the checked code's modules, which this process never imports
        # (the worker resolves them; the target's resolver checked them already).
        local_names = [m if isinstance(m, str) else m.__name__ for m in rank_local]
        watch_names = [m if isinstance(m, str) or not isinstance(m, ModuleType) else m.__name__ for m in watch]
    else:
        local = resolve_modules(rank_local, "rank_local")  # checked on every backend: a typo is an error anywhere
        watched = resolve_modules(expand_watch(watch, [m.__name__ for m in local]), "watch")
        local_names, watch_names = [m.__name__ for m in local], [m.__name__ for m in watched]
    try:
        if backend == "inproc" and isolate:
            from tpsim.comm.isolate import run_isolated

            return run_isolated(fn, world_size, args=tuple(args), kwargs=kwargs, timeout=float(timeout),
                                faults=plan, checksum=checksum, rank_local=local_names, watch=watch_names,
                                plain_data=plain, slot=slot)
        if backend == "inproc":
            from tpsim.comm.inproc import run_inproc

            if plain:
                raise InvalidArgument("plain=True ships values from worker processes: use it with isolate=True or a "
                                      "process backend")

            return run_inproc(fn, world_size, args=tuple(args), kwargs=kwargs, timeout=float(timeout), faults=plan,
                              checksum=checksum, rank_local=local, watch=watched)
        from tpsim.comm.procs import run_processes

        return run_processes(
            fn, world_size, backend=backend, args=tuple(args), kwargs=kwargs, timeout=float(timeout), faults=plan,
            checksum=checksum, plain_data=plain,
        )
    except RankError as err:
        death = rank_death.classify(err)  # a rank's sys.exit / MemoryError: a death, as on an isolated world
        if death is err:
            raise
        raise death from err


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
    isolate: bool = False,
    rank_local: Sequence[str | ModuleType] = (),
    watch: Sequence[str | ModuleType] = (),
    plain: bool = False,
    slot: str = "ranks",
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
        checksum=checksum, isolate=isolate, rank_local=rank_local, watch=watch, plain=plain, slot=slot,
    ).values
