"""Fault plans: which rank misbehaves, at which collective call, and how.

A fault plan is a sequence of faults, each a frozen dataclass that serialises to a small JSON
dict (so it travels in a case file and replays exactly)::

    from tpsim.faults import Drop, Delay
    tpsim.run(fn, 4, backend="gloo", faults=[Drop(rank=1, at_call=3)], timeout=5)

Faults are injected *below* the code under test, in the process group, so the layer calls
``dist.*`` unchanged:

============  ==============================================================================
``Drop``      the rank stops participating from that call on, as a dead process would: on
              ``inproc`` its thread ends there; on ``gloo``/``nccl`` its process exits
              (``os._exit``), so its peers see a real dead peer.
``Crash``     the rank raises :class:`InjectedCrash` (a RuntimeError) from that call.
``Delay``     the rank stalls ``seconds`` (a real sleep) before issuing the call: a straggler.
``Corrupt``   the rank's contribution (the tensors it hands to the collective) is perturbed in
              place before it is sent — as a memory fault in its send buffer would: ``how="nan"``
              puts a NaN at flat element ``index``; ``"bitflip"`` flips bit ``bit`` of element
              ``index``; ``"scale"`` multiplies every element by ``factor``. Modified through
              ``.data``, so autograd does not notice (it would not notice a bit flip either).
``Mismatch``  the rank issues a different collective (``what="op"``: a barrier, or an
              all_reduce in place of a barrier), a contribution of another shape
              (``"shape"``: first dim + 1) or dtype (``"dtype"``: float32 <-> float64).
============  ==============================================================================

**Which call** — ``at_call`` is **1-based**, like the call indices in traces and error messages
(``all_reduce #3 on group world`` is a rank's 3rd call on that group). With ``group=None`` (the
default) it counts *all* of that rank's collective calls in the run, on every group, point to
point ``send``/``recv`` included, in the order the rank issues them (for a program that uses one
group this is exactly that group's call index). With ``group="tp"`` (a group's name as traces
show it: ``world``, the ``group_desc`` given to ``dist.new_group``, or ``[0,1]``), it counts only
that rank's calls on that group. A fault whose call never comes does nothing (the run says which
faults fired in ``WorldResult.faults_fired``).

Notes: a corrupted contribution that the collective ignores (a non-root rank of ``broadcast`` or
``scatter``, a ``recv`` buffer, a ``barrier``) changes nothing. ``"nan"`` on an integer or bool
tensor flips the element's top bit instead (they have no NaN).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, ClassVar

from tpsim.errors import InvalidArgument, TpsimError

__all__ = [
    "FAULT_KINDS",
    "Corrupt",
    "Crash",
    "Delay",
    "Drop",
    "Fault",
    "InjectedCrash",
    "Mismatch",
    "check_plan",
    "parse_plan",
    "plan_from_json",
    "plan_to_json",
]

CORRUPT_HOWS = ("nan", "bitflip", "scale")
MISMATCH_WHATS = ("op", "shape", "dtype")


class InjectedCrash(TpsimError, RuntimeError):
    """Raised on a rank by a :class:`Crash` fault (the message names the fault and the call)."""


def _int(name: str, value: Any, minimum: int, kind: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidArgument(f"{kind}: {name}={value!r} must be an int >= {minimum} (got {type(value).__name__})")
    if value < minimum:
        raise InvalidArgument(f"{kind}: {name}={value} must be >= {minimum}"
                              + (" (at_call is 1-based: the first call is 1)" if name == "at_call" else ""))
    return value


@dataclass(frozen=True)
class Fault:
    """Base of every fault: ``rank`` misbehaves at its ``at_call``-th collective call (1-based).

    ``group`` (optional) restricts the count to that rank's calls on one group (see the module doc).
    """

    kind: ClassVar[str] = ""

    rank: int
    at_call: int
    group: str | None = field(default=None, kw_only=True)

    def __post_init__(self) -> None:
        name = type(self).__name__
        _int("rank", self.rank, 0, name)
        _int("at_call", self.at_call, 1, name)
        if self.group is not None and (not isinstance(self.group, str) or not self.group):
            raise InvalidArgument(f"{name}: group={self.group!r} must be None or a non-empty group name (e.g. 'world')")

    def matches(self, rank: int, nth_call: int, group: str, group_index: int) -> bool:
        """Whether this fault acts on ``rank``'s call that is its ``nth_call`` overall and ``group_index``-th on ``group``."""
        if rank != self.rank:
            return False
        if self.group is None:
            return nth_call == self.at_call
        return group == self.group and group_index == self.at_call

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict: ``{"kind": "drop", "rank": 1, "at_call": 3, ...}`` (``group`` only when set)."""
        data = {"kind": self.kind, **asdict(self)}
        if data.get("group") is None:
            data.pop("group", None)
        return data

    @staticmethod
    def from_json(data: Mapping[str, Any]) -> Fault:
        """Inverse of :meth:`to_json`; raises :class:`tpsim.InvalidArgument` naming a bad field."""
        if isinstance(data, Fault):
            return data
        if not isinstance(data, Mapping):
            raise InvalidArgument(f"a fault must be a JSON object like {{\"kind\": \"drop\", \"rank\": 1, "
                                  f"\"at_call\": 2}}, got {type(data).__name__}: {data!r}")
        kind = data.get("kind")
        cls = _BY_KIND.get(kind)  # type: ignore[arg-type]
        if cls is None:
            raise InvalidArgument(f"fault kind={kind!r} is not one of {', '.join(FAULT_KINDS)}")
        allowed = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - allowed - {"kind"})
        if unknown:
            raise InvalidArgument(f"fault {data!r}: unknown field(s) {unknown}; a {kind} fault has {sorted(allowed)}")
        missing = [n for n in ("rank", "at_call") if n not in data]
        if missing:
            raise InvalidArgument(f"fault {data!r}: missing field(s) {missing}")
        return cls(**{k: v for k, v in data.items() if k != "kind"})

    def __str__(self) -> str:
        parts = [f"{f.name}={getattr(self, f.name)!r}" for f in fields(self)
                 if not (f.name == "group" and self.group is None)]
        return f"{type(self).__name__}({', '.join(parts)})"


@dataclass(frozen=True)
class Drop(Fault):
    """The rank stops participating from its ``at_call``-th call on, as a dead process would."""

    kind: ClassVar[str] = "drop"


@dataclass(frozen=True)
class Crash(Fault):
    """The rank raises :class:`InjectedCrash` at its ``at_call``-th call."""

    kind: ClassVar[str] = "crash"


@dataclass(frozen=True)
class Delay(Fault):
    """The rank sleeps ``seconds`` before issuing its ``at_call``-th call (a straggler)."""

    kind: ClassVar[str] = "delay"
    seconds: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        s = self.seconds
        if isinstance(s, bool) or not isinstance(s, (int, float)) or not (s >= 0 and math.isfinite(s)):
            raise InvalidArgument(f"Delay: seconds={s!r} must be a finite number >= 0")


@dataclass(frozen=True)
class Corrupt(Fault):
    """The rank's contribution to its ``at_call``-th call is perturbed (see the module doc)."""

    kind: ClassVar[str] = "corrupt"
    how: str = "nan"
    index: int = 0
    bit: int | None = None
    factor: float = 2.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.how not in CORRUPT_HOWS:
            raise InvalidArgument(f"Corrupt: how={self.how!r} must be one of {', '.join(CORRUPT_HOWS)}")
        _int("index", self.index, 0, "Corrupt")
        if self.bit is not None:
            _int("bit", self.bit, 0, "Corrupt")
            if self.bit > 63:
                raise InvalidArgument(f"Corrupt: bit={self.bit} must be < 64 (a bit of one element)")
        f = self.factor
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f == 1:
            raise InvalidArgument(f"Corrupt: factor={f!r} must be a finite number other than 1")

    def __str__(self) -> str:
        extra = {"nan": f"index={self.index}", "scale": f"factor={self.factor!r}",
                 "bitflip": f"index={self.index}, bit={self.bit!r}"}[self.how]
        group = f", group={self.group!r}" if self.group is not None else ""
        return f"Corrupt(rank={self.rank}, at_call={self.at_call}, how={self.how!r}, {extra}{group})"


@dataclass(frozen=True)
class Mismatch(Fault):
    """The rank issues a different collective op, shape or dtype at its ``at_call``-th call."""

    kind: ClassVar[str] = "mismatch"
    what: str = "op"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.what not in MISMATCH_WHATS:
            raise InvalidArgument(f"Mismatch: what={self.what!r} must be one of {', '.join(MISMATCH_WHATS)}")


_BY_KIND: dict[str, type[Fault]] = {c.kind: c for c in (Drop, Crash, Delay, Corrupt, Mismatch)}

#: Fault kind names, as used in JSON and on the command line (``--faults drop,crash``).
FAULT_KINDS: tuple[str, ...] = tuple(_BY_KIND)


def parse_plan(items: Iterable[Any] | None) -> tuple[Fault, ...]:
    """A fault plan from faults and/or their JSON dicts (what ``tpsim.run(faults=...)`` accepts).

    Refuses two faults on the same rank and call (which one would act is ambiguous).
    """
    if items is None:
        return ()
    if isinstance(items, (Fault, Mapping, str, bytes)):
        raise InvalidArgument(f"faults={items!r} must be a list of faults, e.g. [Drop(rank=1, at_call=2)]")
    try:
        plan = tuple(Fault.from_json(item) for item in items)
    except TypeError as err:
        raise InvalidArgument(f"faults={items!r} must be a list of faults ({err})") from None
    seen: dict[tuple[int, int, str | None], Fault] = {}
    for fault in plan:
        key = (fault.rank, fault.at_call, fault.group)
        if key in seen:
            raise InvalidArgument(f"faults: {seen[key]} and {fault} act on the same call of rank {fault.rank}; "
                                  "give each (rank, at_call) at most one fault")
        seen[key] = fault
    return plan


def check_plan(plan: Iterable[Fault], world_size: int) -> None:
    """Refuse faults on ranks the world does not have."""
    for fault in plan:
        if fault.rank >= world_size:
            raise InvalidArgument(f"{fault}: rank={fault.rank} is not a rank of a world of "
                                  f"world_size={world_size} (ranks 0..{world_size - 1})")


def plan_to_json(plan: Iterable[Any]) -> list[dict[str, Any]]:
    """JSON-ready list for a case file."""
    return [f.to_json() for f in parse_plan(plan)]


def plan_from_json(data: Any) -> tuple[Fault, ...]:
    """Inverse of :func:`plan_to_json`."""
    if data is None:
        return ()
    if not isinstance(data, list):
        raise InvalidArgument(f"a fault plan must be a JSON list of fault objects, got {type(data).__name__}")
    return parse_plan(data)
