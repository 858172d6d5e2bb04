"""The exceptions tpsim raises.

One root (:class:`TpsimError`); each concrete error also subclasses the builtin it
refines, so ``except RuntimeError`` / ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "BackendUnavailable",
    "CollectiveError",
    "CollectiveOnStridedView",
    "InvalidArgument",
    "RankCrashed",
    "RankDied",
    "RankError",
    "RankExited",
    "SharedModuleState",
    "TpsimError",
]


class TpsimError(Exception):
    """Root of every exception tpsim raises on purpose."""


class InvalidArgument(TpsimError, ValueError):
    """A tpsim API was called with an argument it cannot use (the message names it)."""


class CollectiveOnStridedView(InvalidArgument):
    """A rank passed a collective a tensor that a real backend computes wrongly or refuses.

    Raised on that rank at the call, before anything is exchanged, on every backend: a view that
    is not dense (``big[..., :n]``, ``x[..., ::2]``), overlaps itself (an ``expand``), or is dense
    but not contiguous where a backend reads it in storage order (gloo computes on the first
    ``numel`` elements of the storage; NCCL refuses it). Diagnosis ``collective-on-strided-view``.
    Declared fields (they survive pickling): ``rank``, ``collective``, ``call_index``, ``group``,
    ``tensor`` (which of the call's tensors: ``the tensor``, ``the output list's tensor 1``...),
    ``shape``, ``strides`` and ``storage_offset``.
    """

    #: The diagnosis that names this error in reports (``tpsim.diagnosis``).
    diagnosis = "collective-on-strided-view"

    rank: int
    collective: str
    call_index: int | None
    group: str
    tensor: str
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    storage_offset: int

    def __init__(self, message: str, *, rank: int, collective: str, call_index: int | None, group: str,
                 tensor: str, shape: tuple[int, ...], strides: tuple[int, ...], storage_offset: int) -> None:
        super().__init__(message)
        self.rank = rank
        self.collective = collective
        self.call_index = call_index
        self.group = group
        self.tensor = tensor
        self.shape = tuple(shape)
        self.strides = tuple(strides)
        self.storage_offset = storage_offset

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


class BackendUnavailable(TpsimError, RuntimeError):
    """The requested backend cannot run here (e.g. NCCL without enough GPUs).

    ``reason`` is a one-line explanation suitable for a pytest skip or a CLI message.
    """

    def __init__(self, backend: str, reason: str) -> None:
        super().__init__(f"backend {backend!r} is not available here: {reason}")
        self.backend = backend
        self.reason = reason


class RankError(TpsimError, RuntimeError):
    """A rank of a world failed: it raised, crashed or exited abnormally.

    Declared fields (all survive pickling, so gloo workers can send these back):

    - ``rank``: the failing rank (global rank in the world);
    - ``summary``: the message without the rank's traceback;
    - ``remote_traceback``: the traceback text captured on that rank (also part of the message);
    - ``errors``: every failed rank's own error, when the runner collected more than one;
    - ``trace``: the collective calls every rank issued before the world failed (a
      :class:`tpsim.Trace`; ranks whose process died before reporting are missing from it);
    - ``faults_fired``: ``(fault, call)`` for every fault of the run's plan that acted.
    """

    rank: int
    summary: str
    remote_traceback: str
    errors: dict[int, BaseException]
    trace: Any
    faults_fired: list[tuple[Any, Any]]

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        remote_traceback: str = "",
        errors: dict[int, BaseException] | None = None,
        trace: Any = None,
        faults_fired: list[tuple[Any, Any]] | None = None,
    ) -> None:
        text = message
        if remote_traceback:
            text = f"{message}\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.summary = message
        self.remote_traceback = remote_traceback
        self.errors = dict(errors or {})
        self.trace = trace
        self.faults_fired = list(faults_fired or [])

    def __reduce__(self) -> tuple[Any, ...]:  # keep the fields across pickling (gloo workers send these)
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


class CollectiveError(RankError):
    """A collective could not complete on ``rank``.

    Raised on a rank that waits in a collective which can never finish (a peer exited,
    raised, called a different collective, or passed a mismatched shape/dtype/op), or
    whose bounded wait timed out. Declared fields besides :class:`RankError`'s:

    - ``collective``: the op name (e.g. ``all_reduce``), None when no collective is known;
    - ``call_index``: its 1-based position among this rank's calls on ``group`` (the rule of
      :mod:`tpsim.comm.ops`), None when no collective is known;
    - ``group``: the group's name as traces show it (``world``, a ``group_desc``, ``[0,1]``);
    - ``faulty_ranks``: the ranks to blame (deviating or missing members);
    - ``world_intact``: every member refused the same collective at the same point after a
      completed fingerprint exchange, so the world (a gloo pool) is still usable.
    """

    collective: str | None
    call_index: int | None
    group: str | None
    faulty_ranks: tuple[int, ...]
    world_intact: bool

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        collective: str | None = None,
        call_index: int | None = None,
        group: str | None = None,
        faulty_ranks: tuple[int, ...] = (),
        remote_traceback: str = "",
        errors: dict[int, BaseException] | None = None,
        trace: Any = None,
        faults_fired: list[tuple[Any, Any]] | None = None,
        world_intact: bool = False,
    ) -> None:
        super().__init__(message, rank=rank, remote_traceback=remote_traceback, errors=errors, trace=trace,
                         faults_fired=faults_fired)
        self.collective = collective
        self.call_index = call_index
        self.group = group
        self.faulty_ranks = tuple(faulty_ranks)
        self.world_intact = world_intact


class RankDied(RankError):
    """A rank ended abnormally instead of returning or raising: it exited, crashed or ran out of memory.

    On ``inproc`` this needs an isolated world (``isolate=True``): there the ranks run in a worker
    process that dies instead of the caller. Declared fields besides :class:`RankError`'s:

    - ``phase``: the phase the rank had marked last (``build``, ``forward``, ``backward``, ``step``;
      see :func:`tpsim.mark_phase`), None when it marked none or it is unknown;
    - ``step``: the 0-based SGD step of that phase, None when not given;
    - ``cause``: one line saying what ended it (``os._exit(0) or exit(0) from native code``,
      ``sys.exit(3)``, ``signal SIGSEGV (segmentation fault)``, ``out of memory: ...``);
    - ``exitcode``: the exit status the rank gave (``os._exit``/``sys.exit``), None for a signal;
    - ``signal``: the number of the signal that ended the process, None when it exited.
    """

    phase: str | None
    step: int | None
    cause: str
    exitcode: int | None
    signal: int | None

    def __init__(self, message: str, *, rank: int, phase: str | None = None, step: int | None = None,
                 cause: str = "", exitcode: int | None = None, signal: int | None = None,
                 remote_traceback: str = "", errors: dict[int, BaseException] | None = None,
                 trace: Any = None, faults_fired: list[tuple[Any, Any]] | None = None) -> None:
        super().__init__(message, rank=rank, remote_traceback=remote_traceback, errors=errors, trace=trace,
                         faults_fired=faults_fired)
        self.phase = phase
        self.step = step
        self.cause = cause
        self.exitcode = exitcode
        self.signal = signal


class RankExited(RankDied):
    """A rank ended its process on purpose: ``os._exit(n)``, ``sys.exit(n)``, ``exit()`` from native code."""


class RankCrashed(RankDied):
    """A rank's process was killed by a signal (a segfault, ``abort()``, the out-of-memory killer) or the
    rank ran out of memory."""


class SharedModuleState(TpsimError, RuntimeError):
    """Ranks of an ``inproc`` world shared a module global that each would own in its own process.

    On ``inproc`` the ranks are threads of one process, so a module global that a library keeps
    per process (its tensor-parallel group, a buffer) is one object for every rank. tpsim raises
    this when one rank rebinds such a global and another rank then depends on it. Declared fields:
    ``module`` (its name), ``attribute`` (the global's name), ``ranks`` (the ranks involved, the
    one that rebound it first) and ``cause`` (the failure it led to, when there was one). The fix
    is in the message: declare the module rank-local (``rank_local=(module,)`` /
    ``--rank-local MODULE``), or run on a backend with one process per rank (``gloo``).
    """

    module: str
    attribute: str
    ranks: tuple[int, ...]
    cause: BaseException | None

    def __init__(self, message: str, *, module: str, attribute: str, ranks: tuple[int, ...],
                 cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.module = module
        self.attribute = attribute
        self.ranks = tuple(ranks)
        self.cause = cause

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


def _rebuild(cls: type[BaseException], state: dict[str, Any], args: tuple[Any, ...]) -> BaseException:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err
