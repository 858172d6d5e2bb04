"""The op vocabulary every backend speaks: names, signatures, call numbering, messages and blame.

The in-process backend (:mod:`tpsim.comm.inproc`) and the tracing wrapper around real gloo/NCCL
groups (:mod:`tpsim.comm._tracing`, :mod:`tpsim.comm._verdict`) both follow the rules written
here, so a program that fails on one backend fails with the same words on the other.

**Op names** are torch.distributed's function names (``all_reduce``, ``all_gather_into_tensor``,
``send``...), whatever method of the process group the call reached.

**Call numbering** (one rule for every backend): a call's index is its 1-based position among
*all* the calls its rank issued on that group in the run — collectives and point-to-point
``send``/``recv`` alike. ``all_reduce #3 on group world`` is the third thing this rank asked of
the world group. Members of one collective usually agree on its index; they differ only where
ranks exchanged different numbers of point-to-point messages before it, and then each rank's own
record keeps its own index. (Which members form one collective instance is decided by the
backend, e.g. inproc's separate count of collectives only; never by this index.) A message that
names a collective instance uses the index of its lowest-ranked member in question.

**Signature**: what every member of a collective must agree on (:func:`signature`). Disagreement
is a *mismatched collective*, explained by :func:`mismatch_message` with a majority vote
(:func:`verdict_on_signatures`) that blames the minority.

**Buffers**: what each member's own tensors must satisfy (:func:`buffer_problem`); a member that
breaks it raises on its own rank at the call, before anything is exchanged, as a real backend's
argument check does, so the error names the rank whose buffer is wrong.

**Layouts** (:func:`strided_view`): a tensor that gloo computes on its storage (a view that is not
dense, or a dense one where gloo reads storage order) or that NCCL refuses is refused on its own rank
at the call with :class:`tpsim.CollectiveOnStridedView`, on every backend; the table says, by op and
place, what each backend does (tests/test_layouts.py checks gloo's column against plain torch gloo).

**Group names** (:func:`group_label`, :func:`group_words`): ``world`` for the default group, else the
group's description, else its ranks, the same on every backend; messages add the ranks to a
description (``all_reduce #1 on group tp [2,3]``).

**Precedence and blame** (:func:`explain`): when a world fails, one rank's failure explains the
others'. In order: a rank whose own code raised or whose process died; a crash the fault plan
injected; a rank the plan dropped; a rank the plan stalled; a verdict every member of a
collective reached (mismatch, checksum, a departed member); otherwise a timeout. A rank that tpsim
itself stopped is described, never the error's subject (``err.rank``), and never blamed for a
collective it was blocked in; one still running its own code when its peers timed out is named as
the suspect (``faulty_ranks``).
"""

from __future__ import annotations

import signal as _signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpsim.comm.trace import CollectiveCall, call_name, group_label, group_words
from tpsim.errors import CollectiveError, CollectiveOnStridedView, RankError

__all__ = [
    "COLLECTIVE",
    "COLLECTIVE_OPS",
    "CRASHED",
    "DIED",
    "DROPPED",
    "FINISHED",
    "P2P_OPS",
    "RAISED",
    "STALLED",
    "STOPPED",
    "UNKNOWN",
    "Member",
    "RankEnd",
    "altered_signature",
    "buffer_problem",
    "describe_layout",
    "strided_view",
    "strided_view_error",
    "call_name",
    "checksum_message",
    "crashed_text",
    "departure_message",
    "describe_exit",
    "describe_signature",
    "dropped_text",
    "dtype_name",
    "explain",
    "fault_note",
    "group_label",
    "group_words",
    "mismatch_message",
    "mismatched_signature",
    "plan_suffix",
    "reduce_op_name",
    "signature",
    "signature_of",
    "stall_message",
    "stalled_text",
    "verdict_on_signatures",
]

#: Collective ops, by their torch.distributed names.
COLLECTIVE_OPS = frozenset({
    "all_reduce", "reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "scatter", "gather", "all_to_all", "all_to_all_single", "barrier",
})
#: Point-to-point ops: numbered like collectives, but not joined by the whole group.
P2P_OPS = frozenset({"send", "recv"})


# -- names ------------------------------------------------------------------------------------------

_DTYPE_NAMES: dict[torch.dtype, str] = {}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (cached: called on every collective)."""
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        name = _DTYPE_NAMES[dtype] = str(dtype).removeprefix("torch.")
    return name


_REDUCE_NAMES: dict[Any, str] = {}
_SUM = torch.distributed.ReduceOp.SUM


def reduce_op_name(op: Any) -> str:
    """``ReduceOp.SUM`` (or its ``RedOpType``) -> ``"SUM"`` (cached: called on every reduction)."""
    if op == _SUM:  # the common case, without the wrapper -> enum -> dict lookup below
        return "SUM"
    key = getattr(op, "op", op)  # a ReduceOp wraps a RedOpType whose str is "RedOpType.SUM"
    name = _REDUCE_NAMES.get(key)
    if name is None:
        text = str(getattr(key, "name", None) or key)
        name = _REDUCE_NAMES[key] = text.rsplit(".", 1)[-1]
    return name


# -- signatures -----------------------------------------------------------------------------------

#: Ops whose members may legitimately pass different shapes; what they must agree on instead.
#: scatter: only the root passes the list, every other member a receive buffer. all_to_all: the
#: chunks each member sends may differ in size; their number and dtypes may not. all_to_all_single:
#: split sizes differ per member. barrier: nothing is passed.
_ROOT_ONLY = frozenset({"scatter"})
_COUNT_AND_DTYPES = frozenset({"all_to_all"})
_DTYPES_ONLY = frozenset({"all_to_all_single"})


def signature(op: str, shapes: Sequence[Sequence[int]], dtypes: Sequence[str], reduce_op: str | None,
              peer: int | None) -> tuple[Any, ...]:
    """What every member of ``op`` must agree on, as a tuple compared with ``==``.

    ``peer`` is the root (global rank) of rooted ops; ``shapes``/``dtypes`` describe the tensors
    the member contributed, as its :class:`~tpsim.comm.trace.CollectiveCall` records them.
    (Called on every collective: one dict lookup for the ops that compare everything.)
    """
    special = _SPECIAL_SIGNATURES.get(op)
    if special is None:
        return (shapes, dtypes, reduce_op, peer)
    return special(shapes, dtypes, peer)


_SPECIAL_SIGNATURES: dict[str, Any] = {
    "barrier": lambda shapes, dtypes, peer: (),
    **{op: (lambda shapes, dtypes, peer: (None, None, None, peer)) for op in _ROOT_ONLY},
    **{op: (lambda shapes, dtypes, peer: (len(shapes), tuple(dtypes), None, None)) for op in _COUNT_AND_DTYPES},
    **{op: (lambda shapes, dtypes, peer: (None, tuple(dtypes), None, None)) for op in _DTYPES_ONLY},
}


def signature_of(call: CollectiveCall) -> tuple[Any, ...]:
    """:func:`signature` of a recorded call."""
    return signature(call.op, call.shapes, call.dtypes, call.reduce_op, call.peer)


def altered_signature(sig: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    """``sig`` marked as altered by a :class:`tpsim.faults.Mismatch` of ``what`` that it does not show.

    (A scatter's signature ignores shapes; a Mismatch of its shape must still disagree, as the
    real op would have gone wrong.)
    """
    return ("altered", what, sig)


def describe_signature(op: str, sig: tuple[Any, ...]) -> str:
    """Human form of :func:`signature`: ``shapes [[2, 3]], dtypes ['float32'], op SUM``."""
    if len(sig) == 3 and sig[0] == "altered":
        return f"{describe_signature(op, sig[2])} (altered {sig[1]})"
    if not sig:
        return "no tensors"
    first, dtypes, reduce_op, peer = sig
    parts = []
    if op in _COUNT_AND_DTYPES:
        parts.append(f"{first} tensors")
    elif first is not None:
        parts.append(f"shapes {[list(s) for s in first]}")
    if dtypes is not None:
        parts.append(f"dtypes {list(dtypes)}")
    if reduce_op:
        parts.append(f"op {reduce_op}")
    if peer is not None:
        parts.append(f"root {peer}")
    return ", ".join(parts)


def mismatched_signature(before: tuple[Any, ...], after: tuple[Any, ...], what: str) -> tuple[Any, ...]:
    """The signature of a call a :class:`tpsim.faults.Mismatch` of ``what`` turned from ``before`` to ``after``."""
    return after if after != before or what == "op" else altered_signature(after, what)


# -- buffers --------------------------------------------------------------------------------------

def _same(t: torch.Tensor, shape: Any, dtype: torch.dtype) -> bool:
    return t.shape == shape and t.dtype == dtype


def _list_problem(what: str, tensors: Sequence[torch.Tensor], n: int, like: torch.Tensor, like_what: str) -> str | None:
    if len(tensors) != n:
        return f"{what} has {len(tensors)} tensors, expected {n} (one per member of the group)"
    shape, dtype = like.shape, like.dtype
    for i, t in enumerate(tensors):
        if not _same(t, shape, dtype):
            return (f"{what}[{i}] has shape {list(t.shape)} dtype {dtype_name(t.dtype)}, expected the "
                    f"{like_what}'s shape {list(shape)} dtype {dtype_name(dtype)}")
    return None


def _flat_problem(what: str, big: torch.Tensor, small: torch.Tensor, n: int, small_what: str) -> str | None:
    if big.dtype != small.dtype:
        return f"{what} has dtype {dtype_name(big.dtype)}, expected the {small_what}'s dtype {dtype_name(small.dtype)}"
    if big.numel() != n * small.numel():
        return (f"{what} has {big.numel()} elements, expected {n} x {small.numel()} = {n * small.numel()} "
                f"(group size x the {small_what}'s elements)")
    return None


def buffer_problem(op: str, group_size: int, group_rank: int, root: int | None, inputs: Any, outputs: Any,
                   splits: tuple[Sequence[int], Sequence[int]] | None = None) -> str | None:
    """What is wrong with one member's own tensors for ``op`` (None: nothing).

    ``inputs``/``outputs`` are what the member passed to the process group (tensors or lists, as
    torch hands them over: ``allgather`` gets ``[[outputs...]]`` and ``[input]``); ``root`` is the
    root's *group* rank for rooted ops; ``splits`` is ``(output_split_sizes, input_split_sizes)`` of
    ``all_to_all_single``. Only what a real backend refuses is checked, so inproc never accepts a
    call that gloo or NCCL would reject, and never refuses one they accept.
    (Called on every collective that has buffers to check: one dict lookup to find the rule.)
    """
    check = _BUFFER_RULES.get(op)
    if check is None:
        return None
    return check(group_size, group_rank, root, inputs, outputs, splits)


def _all_gather_rule(n: int, group_rank: int, root: int | None, ins: Any, out_lists: Any, splits: Any) -> str | None:
    if len(ins) != 1 or len(out_lists) != 1:
        return None  # the coalesced form: checked by torch's own wrapper
    return _list_problem("the output list", out_lists[0], n, ins[0], "input")


def _reduce_scatter_rule(n: int, group_rank: int, root: int | None, in_lists: Any, outs: Any, splits: Any) -> str | None:
    if len(outs) != 1 or len(in_lists) != 1:
        return None
    return _list_problem("the input list", in_lists[0], n, outs[0], "output")


def _scatter_rule(n: int, group_rank: int, root: int | None, in_lists: Any, outs: Any, splits: Any) -> str | None:
    if group_rank != root or not in_lists or not outs:
        return None  # only the root passes the list
    return _list_problem("the scatter list", in_lists[0], n, outs[0], "output")


def _gather_rule(n: int, group_rank: int, root: int | None, ins: Any, out_lists: Any, splits: Any) -> str | None:
    if group_rank != root or not out_lists or not ins:
        return None  # only the root passes the list
    return _list_problem("the gather list", out_lists[0], n, ins[0], "input")


def _all_to_all_rule(n: int, group_rank: int, root: int | None, ins: Any, outs: Any, splits: Any) -> str | None:
    if len(ins) != n:
        return f"the input list has {len(ins)} tensors, expected {n} (one per member of the group)"
    if len(outs) != n:
        return f"the output list has {len(outs)} tensors, expected {n} (one per member of the group)"
    for name, ts in (("output", outs), ("input", ins)):
        for i, t in enumerate(ts):
            if t.dtype != ins[0].dtype:
                return (f"the {name} list's tensor {i} has dtype {dtype_name(t.dtype)}, expected "
                        f"{dtype_name(ins[0].dtype)}")
    return None


def _all_to_all_single_rule(n: int, group_rank: int, root: int | None, inp: Any, out: Any, splits: Any) -> str | None:
    if out.dtype != inp.dtype:
        return f"the output has dtype {dtype_name(out.dtype)}, expected the input's {dtype_name(inp.dtype)}"
    out_splits, in_splits = splits or ((), ())
    for name, t, sizes in (("output", out, out_splits), ("input", inp, in_splits)):
        first = t.shape[0] if t.dim() else None
        if sizes:
            if len(sizes) != n:
                return f"{name}_split_sizes has {len(sizes)} entries, expected {n} (one per member)"
            if first is None or sum(sizes) != first:
                return (f"{name}_split_sizes {list(sizes)} sum to {sum(sizes)}, but the {name}'s first "
                        f"dimension is {first if first is not None else 'missing (a 0-d tensor)'}")
        elif first is None or first % n:
            return (f"the {name}'s first dimension {first if first is not None else '(none: 0-d)'} is not "
                    f"divisible by the group size {n} (no split sizes given)")
    return None


_BUFFER_RULES: dict[str, Any] = {
    "all_gather": _all_gather_rule,
    "all_gather_into_tensor": lambda n, group_rank, root, inp, out, splits: _flat_problem(
        "the output tensor", out, inp, n, "input"),
    "reduce_scatter": _reduce_scatter_rule,
    "reduce_scatter_tensor": lambda n, group_rank, root, inp, out, splits: _flat_problem(
        "the input tensor", inp, out, n, "output"),
    "scatter": _scatter_rule,
    "gather": _gather_rule,
    "all_to_all": _all_to_all_rule,
    "all_to_all_single": _all_to_all_single_rule,
}



# -- layouts --------------------------------------------------------------------------------------
#
# What the real backends do with a tensor that is not contiguous, by op and by the place the tensor
# has in the call (measured with plain torch gloo: tests/test_backend_rules.py::test_the_layout_table_
# is_what_plain_gloo_does; NCCL from ProcessGroupNCCL's checks). Codes: OK (computes it right),
# STORAGE (computes on its storage as if the tensor were contiguous: wrong), RAISES (refuses it).
# ``gloo`` has one code for views that are not dense (or overlap) and one for dense ones.
# ``nccl``'s RAISES is its "Tensors must be contiguous" check, which accepts a tensor contiguous in
# its suggested memory format (channels_last). A tensor is refused (CollectiveOnStridedView) unless
# both backends compute it right: inproc takes the stricter of the two.

OK, STORAGE, RAISES = "ok", "storage", "raises"


@dataclass(frozen=True)
class _Place:
    """What gloo (not dense, dense) and NCCL do with a non-contiguous tensor in one place of a call."""

    gloo_sparse: str
    gloo_dense: str
    nccl: str


_ELEMENTWISE = _Place(STORAGE, OK, RAISES)  # gloo reduces storage order: right only for a dense layout
_FLATTENED = _Place(OK, OK, RAISES)  # gloo copies it through a flat buffer; NCCL checks it
_SCRAMBLED = _Place(STORAGE, STORAGE, RAISES)
_P2P = _Place(RAISES, RAISES, STORAGE)  # NCCL only warns for point-to-point, then sends the storage

#: op -> (its inputs' place, its outputs' place); None: not checked (both backends copy it).
_LAYOUT_RULES: dict[str, tuple[_Place | None, _Place | None]] = {
    "all_reduce": (_ELEMENTWISE, None),
    "broadcast": (_ELEMENTWISE, None),
    "reduce": (_ELEMENTWISE, None),
    "all_gather": (_FLATTENED, None),
    "all_gather_into_tensor": (_FLATTENED, _FLATTENED),
    "reduce_scatter": (_Place(OK, STORAGE, OK), _SCRAMBLED),
    "reduce_scatter_tensor": (_FLATTENED, _FLATTENED),
    "scatter": (_Place(STORAGE, STORAGE, STORAGE), _SCRAMBLED),
    "gather": (_FLATTENED, _Place(OK, OK, STORAGE)),
    "all_to_all": (_Place(OK, OK, STORAGE), _Place(OK, OK, STORAGE)),
    "all_to_all_single": (_Place(RAISES, RAISES, RAISES), _SCRAMBLED),
    "send": (_P2P, None),
    "recv": (_P2P, None),
}

_CHANNELS_LAST = {4: torch.channels_last, 5: torch.channels_last_3d}


def _suggested_contiguous(t: torch.Tensor) -> bool:
    """NCCL's test: contiguous in the tensor's suggested memory format (row-major or channels_last)."""
    fmt = _CHANNELS_LAST.get(t.dim())
    return fmt is not None and t.is_contiguous(memory_format=fmt)


def _verdict(t: torch.Tensor, place: _Place) -> tuple[str, str] | None:
    """``(what gloo does, what NCCL does)`` with a non-contiguous ``t``; None when both compute it right."""
    dense = _dense(t)
    gloo = place.gloo_dense if dense else place.gloo_sparse
    nccl = place.nccl
    if nccl == RAISES and _suggested_contiguous(t):
        nccl = OK
    elif nccl == STORAGE and dense and _suggested_contiguous(t):
        nccl = OK
    if gloo == OK and nccl == OK:
        return None
    return gloo, nccl


def _first_bad(obj: Any, place: _Place) -> tuple[int, torch.Tensor, tuple[str, str]] | None:
    """The first tensor of ``obj`` (a tensor or nested lists) a backend gets wrong: (flat index, it, verdict)."""
    if isinstance(obj, torch.Tensor):
        if obj.is_contiguous():
            return None
        verdict = _verdict(obj, place)
        return None if verdict is None else (0, obj, verdict)
    index = 0
    for item in obj or ():
        if isinstance(item, torch.Tensor):
            if not item.is_contiguous():
                verdict = _verdict(item, place)
                if verdict is not None:
                    return index, item, verdict
            index += 1
        else:
            found = _first_bad(item, place)
            if found is not None:
                return index + found[0], found[1], found[2]
            index += sum(1 for _ in _iter_tensors(item))
    return None


def _iter_tensors(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        yield obj
        return
    for item in obj or ():
        yield from _iter_tensors(item)


def _which(op: str, side: str, obj: Any, index: int) -> str:
    """How a message names the tensor: ``the tensor``, ``the input``, ``the output list's tensor 1``."""
    count = sum(1 for _ in _iter_tensors(obj))
    if op in ("all_reduce", "broadcast", "reduce", "send", "recv"):
        return "the tensor" if count == 1 else f"tensor {index} of the call"
    if isinstance(obj, torch.Tensor) or (count == 1 and op not in ("all_to_all",)):
        return f"the {side}"
    return f"the {side} list's tensor {index}"


def strided_view(op: str, inputs: Any, outputs: Any = None) -> tuple[str, torch.Tensor, str] | None:
    """The first of one member's tensors that a real backend computes wrongly or refuses for ``op``.

    ``inputs``/``outputs`` as :func:`buffer_problem` takes them (tensors or lists, as torch hands them
    to the process group). Returns ``(which tensor, the tensor, why)`` with ``why`` naming what gloo
    and NCCL do with it, or None. Only non-contiguous tensors are looked at, so a call on contiguous
    tensors costs one ``is_contiguous`` per tensor. (Called on every collective.)
    """
    rules = _LAYOUT_RULES.get(op)
    if rules is None:
        return None
    for side, obj, place in (("input", inputs, rules[0]), ("output", outputs, rules[1])):
        if place is None or obj is None:
            continue
        found = _first_bad(obj, place)
        if found is not None:
            index, t, (gloo, nccl) = found
            return _which(op, side, obj, index), t, _why(t, gloo, nccl)
    return None


def _why(t: torch.Tensor, gloo: str, nccl: str) -> str:
    """What the real backends do with ``t`` (one clause per backend that gets it wrong or refuses it)."""
    parts = []
    if gloo == STORAGE:
        if _dense(t):
            parts.append("gloo reads and writes its storage as if it were contiguous, so the elements land in "
                         "another order")
        else:
            past = " (past the tensor's own memory)" if _overlaps(t) else ""
            parts.append(f"gloo computes on the {t.numel()} consecutive elements of its storage from the view's "
                         f"start instead{past}")
    elif gloo == RAISES:
        parts.append("gloo refuses it")
    if nccl == RAISES:
        parts.append("NCCL refuses it (\"Tensors must be contiguous\")")
    elif nccl == STORAGE:
        parts.append("NCCL reads and writes its storage as if it were contiguous")
    return "; ".join(parts)


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers a block of its storage exactly once, in some order (``is_non_overlapping_and_dense``)."""
    if t.numel() <= 1:
        return True
    expected = 1
    for stride, size in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n != 1):
        if stride != expected:
            return False
        expected *= size
    return True


def _overlaps(t: torch.Tensor) -> bool:
    return any(s == 0 and n > 1 for s, n in zip(t.stride(), t.shape, strict=True))


def describe_layout(t: torch.Tensor) -> str:
    """``not dense (shape [3, 4], strides (7, 1), storage offset 0)``: a non-contiguous tensor's layout."""
    if _dense(t):
        kind = "dense but not contiguous"
    else:
        kind = "overlapping" if _overlaps(t) else "not dense"
    return f"{kind} (shape {list(t.shape)}, strides {tuple(t.stride())}, storage offset {t.storage_offset()})"


def strided_view_error(call: CollectiveCall, found: tuple[str, torch.Tensor, str]) -> CollectiveOnStridedView:
    """The :class:`tpsim.CollectiveOnStridedView` a rank raises at ``call`` for :func:`strided_view`'s ``found``,
    with the same words on every backend."""
    which, t, why = found
    message = (f"{call.describe()}: on rank {call.rank}, {which} is a view that is {describe_layout(t)}: {why}. "
               "Pass a contiguous tensor (buf = t.contiguous(); the collective on buf; t.copy_(buf) where the "
               "collective writes it)")
    return CollectiveOnStridedView(message, rank=call.rank, collective=call.op, call_index=call.call_index,
                                   group=call.group, tensor=which, shape=tuple(t.shape), strides=tuple(t.stride()),
                                   storage_offset=t.storage_offset())

# -- messages ---------------------------------------------------------------------------------------

def verdict_on_signatures(signatures: Mapping[int, Any], injected: set[int]) -> tuple[tuple[int, ...], int | None]:
    """Which members deviate from the agreed signature: ``(faulty ranks, a reference rank)``.

    ``signatures`` maps rank -> a comparable description. The agreed one is the most common; a
    tie is broken against ranks a fault plan is known to have tampered with (``injected``), then
    toward the lowest rank's. Returns ``((), None)`` when everyone agrees.
    """
    groups: dict[str, list[int]] = {}
    for rank, sig in sorted(signatures.items()):
        groups.setdefault(repr(sig), []).append(rank)
    if len(groups) <= 1:
        return (), None

    def score(members: list[int]) -> tuple[int, int, int]:
        clean = sum(1 for r in members if r not in injected)
        return (len(members), clean, -min(members))

    agreed = max(groups.values(), key=score)
    faulty = tuple(sorted(r for r in signatures if r not in agreed))
    return faulty, min(agreed)


@dataclass(frozen=True)
class Member:
    """One member's side of a collective instance, as messages describe it."""

    op: str
    call_index: int
    signature: str
    note: str = ""  # the fault the plan applied to this member's call, if any


def mismatch_message(group: str, members: Mapping[int, Member], injected: set[int]) -> tuple[str, tuple[int, ...], int]:
    """Explain members that disagree: ``(message, faulty global ranks, reference rank)``.

    ``members`` maps global rank -> :class:`Member`. The message is the same on every member and
    every backend: ``all_reduce #1 on group world: mismatched collective: rank 2 called
    all_gather_into_tensor #1 while rank 0 called all_reduce #1``.
    """
    faulty, ref = verdict_on_signatures({r: (m.op, m.signature) for r, m in members.items()}, injected)
    if ref is None:  # everyone agrees: not a mismatch (callers only ask on disagreement)
        ref, faulty = min(members), ()
    mine = members[ref]
    parts = []
    for r in faulty:
        m = members[r]
        if m.op != mine.op:
            text = f"rank {r} called {m.op} #{m.call_index} while rank {ref} called {mine.op} #{mine.call_index}"
        else:
            text = f"rank {r} passed {m.signature} while rank {ref} passed {mine.signature}"
        if m.note:
            text += f" (injected by the fault plan: {m.note})"
        parts.append(text)
    head = call_name(mine.op, mine.call_index, group)
    return f"{head}: mismatched collective: " + "; ".join(parts), tuple(faulty), ref


def checksum_message(op: str, call_index: int, group: str, bad: Sequence[tuple[int, int, int, str]]) -> str:
    """A contribution changed between the call and the collective's read of it.

    ``bad`` lists ``(rank, crc at the call, crc as the collective read it, fault note)``.
    """
    parts = [f"rank {r}'s contribution changed after it called {op} (crc32 {at:#010x} at the call, "
             f"{read:#010x} as the collective read it)" + (f"; injected by the fault plan: {note}" if note else "")
             for r, at, read, note in bad]
    return (f"{call_name(op, call_index, group)}: checksum mismatch: " + "; ".join(parts)
            + ". The result would be corrupted on every member.")


def departure_message(call: str, waiting: Sequence[int], missing: Sequence[str]) -> str:
    """``all_reduce #3 on group world: ranks 0,2,3 waiting; rank 1 returned after all_gather #2``."""
    who = ",".join(str(r) for r in waiting)
    return f"{call}: ranks {who} waiting; " + ("; ".join(missing) or "no sender")


def dropped_text(call: str, fault: Any) -> str:
    """How a rank the fault plan dropped ended (after ``rank N``)."""
    return f"was dropped by the fault plan at {call} ({fault})"


def stalled_text(call: str, fault: Any) -> str:
    """What a rank the fault plan stalls is doing (after ``rank N``)."""
    return f"is stalled by the fault plan ({fault}) before {call}"


def crashed_text(call: str, fault: Any) -> str:
    """How a rank the fault plan crashed ended (after ``rank N``)."""
    return f"crashed (raised InjectedCrash, fault plan {fault}) at {call}"


def stall_message(call: str, timeout: float, rank: int, fault: Any) -> str:
    """The world's message when a straggler the plan stalled outlasted the collective timeout."""
    return f"{call}: timed out after {timeout:g} s: rank {rank} {stalled_text(call, fault)}"


def fault_note(fault: Any, call: CollectiveCall) -> str:
    """``Drop(rank=1, at_call=3) at all_reduce #3 on group world``: a fault and the call it acted on."""
    return f"{fault} at {call.describe()}"


def plan_suffix(fired: Sequence[tuple[Any, CollectiveCall]]) -> str:
    """`` [fault plan: Drop(rank=1, at_call=3) at all_reduce #3 on group world]`` (empty without faults)."""
    if not fired:
        return ""
    ordered = sorted(fired, key=lambda item: (item[1].rank, item[1].call_index))
    return " [fault plan: " + ", ".join(fault_note(f, c) for f, c in ordered) + "]"


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``signal SIGSEGV (exit code -11)`` for a process exit status."""
    if code is None:
        return "an unknown exit status"
    if code < 0:
        try:
            name = _signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"signal {name} (exit code {code})"
    return f"exit code {code}"


# -- precedence and blame ---------------------------------------------------------------------------

#: How a rank's part in a run ended (:attr:`RankEnd.kind`).
FINISHED = "finished"  # returned a value
RAISED = "raised"  # its own code raised
CRASHED = "crashed"  # a Crash fault raised InjectedCrash
DIED = "died"  # its process exited without reporting (gloo/nccl)
DROPPED = "dropped"  # a Drop fault ended it
STALLED = "stalled"  # a Delay fault still held it when the world ended
COLLECTIVE = "collective"  # a collective it issued failed (a consequence, or a verdict)
STOPPED = "stopped"  # tpsim stopped it (running its own code, or blocked) when the world ended
UNKNOWN = "unknown"  # never reported; nothing is known


@dataclass
class RankEnd:
    """What one rank's part in a failed run came to: the facts :func:`explain` works from.

    ``call`` is the call concerned (the one it failed in, was dropped, crashed or stalled at, or
    was blocked in), else its last call; ``fault`` the plan's fault that ended it; ``error`` its
    own exception when there is one; ``blocked`` for :data:`STOPPED`: it was waiting in ``call``.
    """

    rank: int
    kind: str
    call: CollectiveCall | None = None
    error: BaseException | None = None
    error_type: str = ""
    error_text: str = ""
    traceback: str = ""
    exit_code: int | None = None
    fault: Any = None
    blocked: bool = False
    #: Backend-specific words about how the rank ended (a process's exit status), shown in its line only.
    note: str = ""

    def where(self) -> str:
        return self.call.describe() if self.call is not None else "before its first collective"

    def line(self) -> str:
        """This rank's line in a world error (after ``rank N: ``)."""
        k = self.kind
        if k == FINISHED:
            return "returned" + (f" after {self.where()}" if self.call is not None else "")
        if k == RAISED:
            return f"raised {self.error_type}: {_first_line(self.error_text)}"
        if k == CRASHED:
            return crashed_text(self.where(), self.fault)
        if k == DIED:
            return f"died with {describe_exit(self.exit_code)}" + (f" after {self.where()}" if self.call else "")
        if k == DROPPED:
            return dropped_text(self.where(), self.fault) + self.note
        if k == STALLED:
            return stalled_text(self.where(), self.fault)
        if k == COLLECTIVE:
            return f"failed in {self.where()}"
        if k == STOPPED:
            if self.blocked:
                return f"was blocked in {self.where()} when tpsim stopped the world"
            last = f" (last collective: {self.where()})" if self.call is not None else " (no collective issued yet)"
            return f"was running its own code{last} when tpsim stopped the world"
        return "did not report (its state is unknown)"


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _verdict_of(end: RankEnd) -> CollectiveError | None:
    """The collective verdict a rank's error carries (a mismatch, a checksum, a departure), if any."""
    err = end.error
    if isinstance(err, CollectiveError) and err.faulty_ranks:
        return err
    return None


def explain(ends: Mapping[int, RankEnd], *, world_size: int, backend: str, fired: Sequence[tuple[Any, Any]],
            timeout: float, timed_out: bool = False) -> RankError:
    """The one error a failed world raises, built from every rank's :class:`RankEnd`.

    Precedence (see the module doc) picks the rank whose failure explains the others; the message
    is its headline, the fault plan, the backend, then one line per rank. ``errors`` holds every
    rank's own error; ``faults_fired`` the plan's faults that acted. The caller attaches the trace.
    """
    by_kind: dict[str, list[int]] = {}
    for r, end in sorted(ends.items()):
        by_kind.setdefault(end.kind, []).append(r)
    errors = {r: e.error for r, e in ends.items() if e.error is not None}
    plan = plan_suffix(fired)
    tail = f"{plan} [backend {backend}, world_size={world_size}]"
    lines = "\n".join(f"  rank {r}: {ends[r].line()}" for r in sorted(ends))
    fired_list = list(fired)

    def text(head: str) -> str:
        return f"{head}{tail}\n{lines}"

    # 1. A rank's own failure: it raised, or its process died.
    own = by_kind.get(RAISED, []) + by_kind.get(DIED, [])
    if own:
        r = min(own)
        end = ends[r]
        if end.kind == RAISED:
            head = f"rank {r} raised {end.error_type}: {end.error_text}".rstrip()
        else:
            hint = ("the process crashed or was killed before reporting a result"
                    if end.exit_code is not None and end.exit_code < 0 else
                    "the process exited without reporting a result, e.g. os._exit() or a crash in native code")
            head = f"rank {r} died with {describe_exit(end.exit_code)} ({hint})"
        _blame(ends, errors, (r,), None)
        return RankError(text(head), rank=r, remote_traceback=end.traceback, errors=errors,
                         faults_fired=fired_list)
    # 2. A crash the plan injected.
    if CRASHED in by_kind:
        r = by_kind[CRASHED][0]
        end = ends[r]
        call = end.call
        _blame(ends, errors, (r,), call)
        return CollectiveError(
            text(f"rank {r} raised InjectedCrash: {end.error_text}".rstrip()), rank=r,
            collective=call.op if call else None, call_index=call.call_index if call else None,
            group=call.group if call else None, faulty_ranks=(r,), remote_traceback=end.traceback,
            errors=errors, faults_fired=fired_list)
    # Ranks waiting in a collective: those whose collective failed, and those tpsim stopped while
    # blocked in one (a process backend may stop a blocked rank before its own error reaches it).
    survivors = sorted(by_kind.get(COLLECTIVE, []) + [r for r in by_kind.get(STOPPED, []) if ends[r].blocked])
    # The error's subject: a rank that reported its own collective failure; never one tpsim stopped
    # unless no rank reported anything.
    reported = by_kind.get(COLLECTIVE, [])
    # 3./4. A rank the plan dropped or stalled: the others waited for it.
    departed = by_kind.get(DROPPED, []) + by_kind.get(STALLED, [])
    if departed:
        r = min(departed)
        end = ends[r]
        if end.kind == DROPPED:
            # Named where the others wait for it (the dropped rank's own call when nobody does).
            anchor = ends[survivors[0]].call if survivors and ends[survivors[0]].call is not None else end.call
            where = anchor.describe() if anchor is not None else end.where()
            waiting = [s for s in survivors if _same_call(ends[s].call, anchor)]
            if waiting:
                head = departure_message(where, waiting, [f"rank {r} {dropped_text(end.where(), end.fault)}"])
            else:  # every survivor finished: the dropped rank's value is missing, never silently None
                head = (f"rank {r} was dropped by the fault plan at {end.where()} and returned no value; the "
                        "other ranks finished without waiting for it")
        else:
            # Named by the call the straggler stalls before: on inproc its peers may not have reached
            # theirs (a straggler holds the only turn), so theirs would name different calls per backend.
            anchor = end.call
            head = stall_message(end.where(), timeout, r, end.fault)
        blamed = tuple(sorted(departed))
        first = reported[0] if reported else (survivors[0] if survivors else r)
        _blame(ends, errors, blamed, anchor)
        return CollectiveError(
            text(head), rank=first, collective=anchor.op if anchor else None,
            call_index=anchor.call_index if anchor else None, group=anchor.group if anchor else None,
            faulty_ranks=blamed, errors=errors, faults_fired=fired_list)
    # 5. A verdict the members of a collective reached.
    for r in survivors:
        verdict = _verdict_of(ends[r])
        if verdict is not None:
            return CollectiveError(
                text(verdict.summary), rank=r, collective=verdict.collective, call_index=verdict.call_index,
                group=verdict.group, faulty_ranks=verdict.faulty_ranks, errors=errors, faults_fired=fired_list)
    # 6. Nothing explains it but time: name what every rank was doing.
    stopped = by_kind.get(STOPPED, []) + by_kind.get(UNKNOWN, [])
    if timed_out:
        head = (f"the world did not finish within its time bound (collective timeout {timeout:g} s plus a "
                f"margin): rank(s) {', '.join(map(str, stopped))} never reported")
    else:
        head = "no rank could complete its collectives"
    first = reported[0] if reported else (survivors[0] if survivors else (stopped[0] if stopped else 0))
    call = ends[first].call if first in ends else None
    if survivors or (call is not None and ends[first].blocked):
        return CollectiveError(
            text(head), rank=first, collective=call.op if call else None,
            call_index=call.call_index if call else None, group=call.group if call else None,
            faulty_ranks=tuple(s for s in stopped if not ends[s].blocked), errors=errors, faults_fired=fired_list)
    return RankError(text(head), rank=first, errors=errors, faults_fired=fired_list)


def _blame(ends: Mapping[int, RankEnd], errors: dict[int, BaseException], blamed: tuple[int, ...],
           call: CollectiveCall | None) -> None:
    """Every waiting rank's own error names the ranks it waited for, and ``call`` (None: its own call).

    (A process backend's survivors only know that their peer vanished; inproc's already know.)
    """
    why = "; ".join(f"rank {b} {ends[b].line()}" for b in blamed)
    for r, end in ends.items():
        waiting = end.kind == COLLECTIVE or (end.kind == STOPPED and end.blocked)
        if not waiting or r in blamed:
            continue
        err = errors.get(r)
        if isinstance(err, CollectiveError) and err.faulty_ranks:
            continue
        c = call if call is not None else end.call
        if c is None:
            continue
        summary = err.summary if isinstance(err, RankError) else f"rank {r} {end.line()}"
        errors[r] = CollectiveError(
            f"{summary} (waiting for: {why})", rank=r, collective=c.op, call_index=c.call_index, group=c.group,
            faulty_ranks=blamed, remote_traceback=err.remote_traceback if isinstance(err, RankError) else "")


def _same_call(a: CollectiveCall | None, b: CollectiveCall | None) -> bool:
    return a is not None and b is not None and a.op == b.op and a.group == b.group
