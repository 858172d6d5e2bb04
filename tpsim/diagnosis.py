"""Diagnoses: stable names for the ways a sharded layer goes wrong, recognised from the numbers.

A property that fails compares per-rank tensors with the float64 dense reference; the recognisers
here look for the signature of a known mechanism and name it. When nothing matches, the diagnosis
is ``mismatch`` with the maximum absolute and relative error and where. Names are stable: scripts
match on them (``tpsim check --report json``), so a name is never reused for something else.

=========================  ===================================================================
diagnosis                  what the harness saw (and the usual cause)
=========================  ===================================================================
``bias-duplication``       the output is off by exactly ``(world_size-1) * bias``: every rank
                           added the full bias to its summand before the reduction (add it once,
                           after the reduction)
``bias-missing``           the output is off by exactly ``-bias``: the bias is never added
``wrong-shard-dim``        a tensor was split or gathered along the wrong dim: a parameter has
                           the shape of the master cut along its other dim, or the output holds
                           the right values concatenated along a batch dim, or a sequence-sharded
                           output/grad is sliced along the batch dim instead of the sequence dim
                           (a reduce-scatter on the wrong dim: vllm #30610, ROCm/aiter #3395)
``wrong-shard-order``      a rank holds another rank's shard: the output's feature blocks are
                           permuted or repeated (a reversed or node-local rank order)
``packed-shard-layout``    a packed column weight (gate/up, Q/K/V) was split contiguously: a
                           rank's output (or weight grad) is its contiguous ``1/ws`` slice of
                           the packed dim instead of its shard of every part (vllm #3775)
``missing-reduction``      a rank returned only its own summand ``x_r W_rᵀ``: the all-reduce
                           over the tp group is missing
``double-reduction``       the output is exactly ``world_size`` times the dense one: it was
                           reduced twice (e.g. a layer that reduces, declared ``partial``)
``grad-not-reduced``       each rank's gradient (of a replicated input or parameter) is only its
                           summand: the ranks' grads differ and add up to the dense grad; the
                           backward all-reduce is missing; for a replicated parameter the
                           report names it (under sequence parallelism: a norm weight or a row
                           bias used on one slice of the sequence per rank; NeMo #7184)
``grad-scaled``            a gradient is the dense one times a constant (``1/world_size``:
                           averaged instead of summed, or a value divided by the world size in
                           forward; ``world_size``: reduced twice)
``grad-missing``           a tensor that takes part in the forward has no gradient on some rank
``bias-grad-rank0-only``   only rank 0's bias received its gradient, the others got none or
                           zeros: the bias is added on rank 0 only, so the replicas drift apart
``replica-divergence``     a tensor that must be identical on every rank (a reduced output, a
                           complete input grad, a replicated parameter or its grad) differs,
                           or a replicated parameter differs right after construction (every
                           rank seeded alike: its init is not synchronised; NeMo Automodel #1291)
``divisibility-unchecked`` a size that does not divide by the tp size was accepted (silently
                           truncated or padded), refused on some ranks only (the others failed
                           in a collective), or refused with an error naming neither the sizes
                           nor divisibility
``precision-loss``         the error is too large for the case's dtype but within the rounding
                           of a narrower one: part of the computation or communication runs in
                           lower precision (e.g. a float16 all-reduce)
``shape-error``            a rank's tensor (output, grad, parameter) has the wrong shape, in no
                           recognised pattern
``wrong-group``            with tp groups smaller than the world: a result is the sum (or the
                           concatenation) over another set of ranks than the rank's tp group —
                           the whole world, its data-parallel group, or its group in the other
                           mesh layout, which the report names (Megatron-LM #7452)
``exception``              the variant raised on some rank: the report names the first rank
                           that raised (``Failure.rank``), the phase (build, forward, backward,
                           SGD step) and carries its traceback (``Failure.traceback``)
``mismatch``               the values differ in no recognised pattern: the message gives the max
                           absolute error, the index where it occurs (got vs expected) and the
                           max relative error
=========================  ===================================================================

Each recogniser is a pure function of float64 tensors and a per-element tolerance (see
:mod:`tpsim.props.tolerance`), tested on synthetic tensors without running any world
(tests/test_properties_diagnosis.py). :class:`Failure` is what reports list and case files record.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "DIAGNOSES",
    "Diagnosis",
    "Failure",
    "block_mapping",
    "bias_multiple",
    "close",
    "mismatch",
    "regathered_dim",
    "scale_factor",
]

#: Every diagnosis name tpsim reports, with what it means. Names are stable (scripts match them).
DIAGNOSES: dict[str, str] = {
    "bias-duplication": "the output is off by exactly (world_size-1)*bias: every rank added the full bias "
    "to its summand before the reduction",
    "bias-missing": "the output is off by exactly -bias: the bias was never added",
    "wrong-shard-dim": "a tensor was split or gathered along the wrong dim (its values are the expected "
    "ones, re-cut along another dim)",
    "wrong-shard-order": "a rank holds another rank's shard (blocks of the result are permuted or repeated)",
    "packed-shard-layout": "a packed weight (gate/up, Q/K/V) was split as one contiguous block: a rank holds a "
    "contiguous slice of the packed dim instead of its shard of every packed part",
    "missing-reduction": "each rank returned only its own summand: the reduction over the tp group is missing",
    "double-reduction": "the result is world_size times the expected one: it was reduced twice",
    "grad-not-reduced": "each rank's gradient is only its summand: the backward all-reduce is missing",
    "grad-scaled": "a gradient is off by a constant factor (e.g. 1/world_size: averaged instead of summed, "
    "or world_size: reduced twice)",
    "grad-missing": "a tensor that takes part in the forward received no gradient on some rank",
    "bias-grad-rank0-only": "only rank 0's bias received its gradient (the bias was added on rank 0 only)",
    "replica-divergence": "a tensor that must be identical on every rank of the tp group differs across ranks",
    "wrong-group": "a result is a reduction (or gather) over another set of ranks than the layer's tp group "
    "(e.g. the whole world): a collective runs on the wrong process group",
    "divisibility-unchecked": "a size that does not divide by the tp size was accepted (silently truncated or "
    "padded, or failing in a collective) instead of raising a clear error on every rank",
    "precision-loss": "the error is too large for the case's dtype but within rounding of a lower precision: "
    "something was computed or communicated in a narrower dtype",
    "shape-error": "a rank's tensor has the wrong shape",
    "exception": "the variant raised an exception on some rank (the rank and its traceback are reported)",
    "mismatch": "the values differ from the dense reference in no recognised pattern (max abs/rel error and "
    "where are reported)",
}


@dataclass(frozen=True)
class Diagnosis:
    """A named explanation: ``name`` (a key of :data:`DIAGNOSES`), a one-paragraph ``message``,
    and ``details`` (numbers such as ``max_abs``, ``max_rel``, ``where``, ``factor``)."""

    name: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in DIAGNOSES:
            raise ValueError(f"Diagnosis(name={self.name!r}) is not one of {sorted(DIAGNOSES)}")


@dataclass
class Failure:
    """One failed property on one case: what a report lists and a case file records.

    - ``property``: the property's name (``forward-equivalence``, ...);
    - ``diagnosis``: a key of :data:`DIAGNOSES` (stable: scripts match on it);
    - ``message``: one paragraph saying what was wrong, with the numbers (no traceback);
    - ``case``: the (minimal, when it comes from a search) :class:`tpsim.props.case.Case`;
    - ``case_file``: the path the case was saved to (None until saved);
    - ``rank``: the rank the evidence comes from, when one rank stands out (always set for
      ``exception``: the first rank that raised);
    - ``traceback``: that rank's traceback text, for ``exception`` (else None);
    - ``details``: numbers behind the message (``max_abs``, ``max_rel``, ``where``, ``factor``...);
    - ``variant``: the variant's name;
    - ``found_after``: how many examples a search had run when this property first failed with
      this diagnosis (None outside a search).
    """

    property: str
    diagnosis: str
    message: str
    case: Any = None
    case_file: str | None = None
    rank: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None
    traceback: str | None = None
    found_after: int | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: every field above, the case as its dict (:meth:`Case.to_dict`)."""
        case = self.case.to_dict() if hasattr(self.case, "to_dict") else self.case
        return {
            "variant": self.variant,
            "property": self.property,
            "diagnosis": self.diagnosis,
            "message": self.message,
            "rank": self.rank,
            "traceback": self.traceback,
            "case": case,
            "case_file": self.case_file,
            "found_after": self.found_after,
            "details": _jsonable(self.details),
        }

    #: Older name of :meth:`to_json`.
    to_dict = to_json

    def describe(self) -> str:
        """Human-readable block: ``property: diagnosis``, the message, the case, the traceback."""
        lines = [f"{self.property}: {self.diagnosis}", f"  {self.message}"]
        if self.case is not None:
            lines.append(f"  case: {self.case.describe() if hasattr(self.case, 'describe') else self.case}")
        if self.case_file:
            lines.append(f"  case file: {self.case_file}")
        if self.traceback:
            lines.append(f"  traceback on rank {self.rank}:")
            lines.extend("    " + line for line in self.traceback.rstrip().splitlines())
        return "\n".join(lines)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


# --- recognisers ---------------------------------------------------------------------------------


def close(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    """Same shape and ``|actual - expected| <= tol`` everywhere (NaN never matches)."""
    if actual.shape != expected.shape:
        return False
    diff = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
    return bool((diff <= tol).all())


def mismatch(actual: torch.Tensor, expected: torch.Tensor, *, what: str) -> Diagnosis:
    """The fallback: max absolute and relative error and the index where the absolute one peaks."""
    a = actual.to(torch.float64)
    e = expected.to(torch.float64)
    diff = (a - e).abs()
    if diff.numel() == 0:
        return Diagnosis("mismatch", f"{what} differs from the dense reference", {})
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    flat = int(torch.argmax(diff))
    where = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
    max_abs = float(diff.reshape(-1)[flat])
    rel = diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)
    max_rel = float(rel.max())
    got = float(a.reshape(-1)[flat]) if a.numel() else float("nan")
    want = float(e.reshape(-1)[flat]) if e.numel() else float("nan")
    return Diagnosis(
        "mismatch",
        f"{what} differs from the dense reference: max abs error {max_abs:.3g} at index {list(where)} "
        f"(got {got:.6g}, expected {want:.6g}); max rel error {max_rel:.3g}",
        {"max_abs": max_abs, "max_rel": max_rel, "where": list(where)},
    )


def scale_factor(
    actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, *, known: Sequence[float] = ()
) -> float | None:
    """``c`` (not ~1) such that ``actual ~= c * expected`` within ``tol * max(1, |c|)``, else None.

    A single element is a multiple of any other, so for one-element tensors only a factor in
    ``known`` (e.g. ``world_size`` or ``1/world_size``) counts as evidence.
    """
    if actual.shape != expected.shape or actual.numel() == 0:
        return None
    a = actual.to(torch.float64).reshape(-1)
    e = expected.to(torch.float64).reshape(-1)
    denom = float(e @ e)
    if denom == 0.0:
        return None
    c = float(a @ e) / denom
    if abs(c - 1.0) < 1e-3 or c != c:
        return None
    if a.numel() == 1 and not any(abs(c - k) <= 1e-3 * max(1.0, abs(k)) for k in known):
        return None
    if bool(((a - c * e).abs() <= tol.reshape(-1) * max(1.0, abs(c))).all()):
        return c
    return None


def bias_multiple(diff: torch.Tensor, bias: torch.Tensor, tol: torch.Tensor) -> float | None:
    """``c`` such that ``diff ~= c * bias`` broadcast over the leading dims, else None (c == 0 too)."""
    if diff.numel() == 0 or bias.numel() == 0 or diff.shape[-1:] != bias.shape:
        return None
    b = bias.to(torch.float64).expand_as(diff).reshape(-1)
    d = diff.to(torch.float64).reshape(-1)
    denom = float(b @ b)
    if denom == 0.0:
        return None
    c = float(d @ b) / denom
    if abs(c) < 1e-3 or c != c:
        return None
    if bool(((d - c * b).abs() <= tol.reshape(-1) * max(1.0, abs(c))).all()):
        return c
    return None


def block_mapping(
    actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, *, dim: int, parts: int
) -> list[int] | None:
    """For ``parts`` equal blocks along ``dim``: which expected block each actual block equals.

    Returns the list (``mapping[i] = j``: block i holds expected block j), or None when shapes
    differ, the size does not divide, or some block matches no expected block.
    """
    if actual.shape != expected.shape or parts < 2 or actual.dim() == 0:
        return None
    size = actual.shape[dim]
    if size % parts or size == 0:
        return None
    a_blocks = actual.chunk(parts, dim=dim)
    e_blocks = expected.chunk(parts, dim=dim)
    t_blocks = tol.chunk(parts, dim=dim)
    mapping = []
    for i, blk in enumerate(a_blocks):
        found = None
        # Prefer the identity so a correct block is never reported as another one.
        for j in [i] + [k for k in range(parts) if k != i]:
            if close(blk, e_blocks[j], torch.maximum(t_blocks[i], t_blocks[j])):
                found = j
                break
        if found is None:
            return None
        mapping.append(found)
    return mapping


def regathered_dim(
    actual: torch.Tensor, expected: torch.Tensor, *, dim: int, parts: int, tol_scalar: float
) -> int | None:
    """The dim ``d`` (≠ ``dim``) such that ``actual`` equals ``expected``'s ``parts`` blocks along
    ``dim`` concatenated along ``d`` instead (a gather or split along the wrong dim), else None."""
    if parts < 2 or expected.dim() == 0 or expected.shape[dim] % parts:
        return None
    blocks = expected.chunk(parts, dim=dim)
    nd = expected.dim()
    for d in range(-nd, nd):
        if d % nd == dim % nd:
            continue
        candidate = torch.cat(blocks, dim=d)
        if candidate.shape == actual.shape and bool(
            ((actual.to(torch.float64) - candidate).abs() <= tol_scalar).all()
        ):
            return d % nd
    # Also the one-extra-dim form: blocks stacked along a new leading dim and flattened into dim 0.
    return None


def rank_summands(per_rank: Sequence[torch.Tensor], expected: torch.Tensor, tol: torch.Tensor) -> bool:
    """True when the ranks' tensors differ yet sum to ``expected``: each holds only its summand.

    Identical tensors that sum to ``expected`` (every rank holds ``expected / ws``) are not
    summands but a scaled result (``grad-scaled``), so some pair of ranks must differ.
    """
    if len(per_rank) < 2 or any(t.shape != expected.shape for t in per_rank):
        return False
    total = torch.zeros_like(expected, dtype=torch.float64)
    for t in per_rank:
        total = total + t.to(torch.float64)
    if not close(total, expected, tol * len(per_rank)):
        return False
    if all(close(t, expected, tol) for t in per_rank):
        return False
    first = per_rank[0].to(torch.float64)
    return any(not close(t, first, tol) for t in per_rank[1:])


def lower_precision(
    actual: torch.Tensor,
    expected: torch.Tensor,
    dtype: torch.dtype,
    tol_for: Callable[[torch.dtype], torch.Tensor],
) -> torch.dtype | None:
    """The widest dtype narrower than ``dtype`` whose tolerance accepts ``actual``, else None."""
    order = [torch.float64, torch.float32, torch.float16, torch.bfloat16]
    if dtype not in order:
        return None
    for candidate in order[order.index(dtype) + 1 :]:
        if close(actual, expected, tol_for(candidate)):
            return candidate
    return None
