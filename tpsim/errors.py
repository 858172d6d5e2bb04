"""The exceptions tpsim raises.

One root (:class:`TpsimError`); each concrete error also subclasses the builtin it
refines, so ``except RuntimeError`` / ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailable",
    "CollectiveError",
    "InvalidArgument",
    "RankError",
    "TpsimError",
]


class TpsimError(Exception):
    """Root of every exception tpsim raises on purpose."""


class InvalidArgument(TpsimError, ValueError):
    """A tpsim API was called with an argument it cannot use (the message names it)."""


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

    ``rank`` is the failing rank (global rank in the world); ``remote_traceback`` is the
    traceback text captured on that rank (also part of the message); ``errors`` maps every
    failed rank to its own error when the runner collected more than one.
    """

    def __init__(
        self,
        message: str,
        *,
        rank: int,
        remote_traceback: str = "",
        errors: dict[int, BaseException] | None = None,
    ) -> None:
        text = message
        if remote_traceback:
            text = f"{message}\n\n--- traceback on rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)
        self.rank = rank
        self.summary = message
        self.remote_traceback = remote_traceback
        self.errors: dict[int, BaseException] = dict(errors or {})

    def __reduce__(self):  # keep the attributes across pickling (gloo workers send these)
        return (_rebuild, (type(self), self.__dict__.copy(), self.args))


class CollectiveError(RankError):
    """A collective could not complete on ``rank``.

    Raised on a rank that waits in a collective which can never finish (a peer exited,
    raised, called a different collective, or passed a mismatched shape/dtype/op), or
    whose bounded wait timed out. ``collective`` is the op name (e.g. ``all_reduce``),
    ``call_index`` its 1-based position among this rank's calls on ``group``.
    """

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
    ) -> None:
        super().__init__(message, rank=rank, remote_traceback=remote_traceback, errors=errors)
        self.collective = collective
        self.call_index = call_index
        self.group = group
        self.faulty_ranks = tuple(faulty_ranks)


def _rebuild(cls, state, args):
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err
