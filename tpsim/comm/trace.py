"""The per-rank record of collective calls, shared by every backend.

Each rank appends one :class:`CollectiveCall` per collective it issues; the runner hands
the records back (``WorldResult.trace``) so tests and reports can count collectives,
see their order and tell what a rank was doing when a world failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CollectiveCall", "Trace", "call_name"]


def call_name(op: str, index: int | None, group: str | None) -> str:
    """``all_reduce #3 on group world``; never ``#None`` (an unknown index says so)."""
    if index is None or index < 1:
        return f"{op} (call index unknown) on group {group or '?'}"
    return f"{op} #{index} on group {group}"


@dataclass(eq=True, slots=True)
class CollectiveCall:
    """One collective as issued by one rank.

    ``call_index`` is 1-based and counts this rank's calls on ``group``, point-to-point
    ``send``/``recv`` included (``all_reduce #3 on group tp`` is the third call this rank issued
    on that group; the rule of :mod:`tpsim.comm.ops`, the same on every backend). ``shapes`` and
    ``dtypes`` describe the tensors the rank contributed (inputs), in call order.
    (Not frozen: a frozen dataclass's ``__init__`` costs several microseconds, and one is
    made per collective on the in-process hot path. Treat it as read-only. Slotted: smaller
    and quicker to make; world size 256 records hundreds of thousands of them.)
    """

    rank: int
    op: str
    group: str
    group_ranks: tuple[int, ...]
    call_index: int
    shapes: tuple[tuple[int, ...], ...] = ()
    dtypes: tuple[str, ...] = ()
    reduce_op: str | None = None
    peer: int | None = None  # src/dst for broadcast, scatter, gather, send, recv

    def describe(self) -> str:
        """Short human form, e.g. ``all_reduce #3 on group world``."""
        return call_name(self.op, self.call_index, self.group)


@dataclass
class Trace:
    """Collective calls of every rank of one run, indexed by rank."""

    calls: dict[int, list[CollectiveCall]] = field(default_factory=dict)

    def of(self, rank: int) -> list[CollectiveCall]:
        """Calls issued by ``rank``, in order."""
        return list(self.calls.get(rank, ()))

    def count(self, op: str, rank: int | None = None) -> int:
        """How many ``op`` calls were issued (by ``rank``, or by rank 0 when None)."""
        ranks = [0 if rank is None else rank]
        return sum(1 for r in ranks for c in self.calls.get(r, ()) if c.op == op)

    def ops(self, rank: int = 0) -> list[str]:
        """Op names issued by ``rank`` in order (handy in assertions)."""
        return [c.op for c in self.calls.get(rank, ())]
