"""The per-rank record of collective calls, shared by every backend.

Each rank appends one :class:`CollectiveCall` per collective it issues; the runner hands
the records back (``WorldResult.trace``) so tests and reports can count collectives,
see their order and tell what a rank was doing when a world failed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CollectiveCall", "Trace", "call_name", "group_label", "group_words"]

#: Group descriptions torch gives groups nobody named (never shown as a group's name).
_UNNAMED = ("", "undefined", "default_pg")


def group_label(is_world: bool, desc: str | None, ranks: tuple[int, ...] | list[int]) -> str:
    """A group's name in traces, the same on every backend: ``world`` for the default group, else the
    ``group_desc`` it was given (``tp``, ``mesh_tp``), else its ranks (``[0,1]``)."""
    if is_world:
        return "world"
    if desc and str(desc) not in _UNNAMED:
        return str(desc)
    return "[" + ",".join(str(r) for r in ranks) + "]"


def group_words(group: str | None, ranks: tuple[int, ...] | list[int] = ()) -> str:
    """How messages name a group: its name, with its ranks where the name does not list them
    (``tp [0,1]``: two groups may share a description, e.g. every tp group of a device mesh)."""
    if not group:
        return "?"
    if group == "world" or group.startswith("[") or not ranks:
        return group
    return f"{group} [" + ",".join(str(r) for r in ranks) + "]"


def call_name(op: str, index: int | None, group: str | None, ranks: tuple[int, ...] | list[int] = ()) -> str:
    """``all_reduce #3 on group world`` (``on group tp [0,1]``); never ``#None`` (an unknown index says so)."""
    where = group_words(group, ranks)
    if index is None or index < 1:
        return f"{op} (call index unknown) on group {where}"
    return f"{op} #{index} on group {where}"


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
        return call_name(self.op, self.call_index, self.group, self.group_ranks)


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
