"""Placed comparisons: every rank's piece of a tensor against the float64 dense one, and what a difference is.

Every family's checks say what they compare as a :class:`Placed` tensor — what it is, each rank's
piece, the float64 reference, the bound of each element, how the pieces make the whole (a
placement, or a sum) — and :func:`verdict` decides, the same way for every family:

1. a missing piece: ``grad-missing`` (a grad) or ``shape-error``;
2. a floating piece of another dtype than the case's: ``wrong-dtype``;
3. a piece of another shape than its placement gives: ``wrong-shard-dim`` when it is the dense
   tensor cut along another dim, else ``shape-error``;
4. the pieces against the reference, within the bound: assembled (a shard), summed (a summand, as
   the caller's or the trainer's reduction adds them) or each (a replica). Equal: no failure.

A difference is then named by the first recogniser whose evidence is there — the family's own first
(``recognisers``), then the shared ones, each on the evidence its registry entry states
(:mod:`tpsim.diagnosis`): each rank holding only its own summand (``missing-reduction``, or
``grad-not-reduced`` for a grad; never the same values on every rank, nor the whole beside zeros); the
result off by ``(tp-1)`` times one of the biases that may have been added, or minus it
(``bias-duplication``, ``bias-missing``); a packed piece that is a contiguous slice of the packed dim
(``packed-shard-layout``); pieces cut along another dim than the sequence dim (``wrong-shard-dim``);
the result ``tp`` times the dense one where a reduction was made (``double-reduction``), or a grad that
is one constant times the dense one in every element (``grad-scaled``); shards out of order
(``wrong-shard-order``); a narrower dtype's rounding that explains it (``precision-loss``). A pattern
holds in every element: within the bound, with the same exact zeros, explaining the difference far
better than no pattern (:mod:`tpsim.patterns`). Otherwise ``mismatch``, quoting the element that
violates its bound most, with hints (never names) for what it resembles. A name read from numbers is
a claim: every family confirms it on the float64 re-run of a narrower case, and a factor of the tp
size on one rank (:meth:`tpsim.props.family.Family.confirm_claims`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpsim.diagnosis import (
    BIAS_DUPLICATION,
    BIAS_GRAD_RANK0_ONLY,
    BIAS_MISSING,
    DOUBLE_REDUCTION,
    GRAD_MISSING,
    GRAD_NOT_REDUCED,
    GRAD_SCALED,
    MISSING_REDUCTION,
    PACKED_SHARD_LAYOUT,
    PRECISION_LOSS,
    SHAPE_ERROR,
    WRONG_DTYPE,
    WRONG_SHARD_DIM,
    WRONG_SHARD_ORDER,
    Diagnosis,
    mismatch,
    recogniser,
)
from tpsim.errors import InvalidArgument
from tpsim.patterns import (
    EXPLAINS_FAR_BETTER,
    bias_multiple,
    block_mapping,
    close,
    is_bias_multiple,
    multiple_of,
    rank_summands,
    regathered_dim,
    scale_factor,
)
from tpsim.placement import Placement, Replicate, Shard, assemble_pieces, part_sizes, piece, shard_tensor

__all__ = ["NARROWER", "Placed", "Recogniser", "expected_pieces", "holds", "holds_fast", "verdict"]

_F64 = torch.float64

#: Dtypes with fewer mantissa bits than each case dtype, widest first: what a narrower computation
#: can have used (bfloat16 keeps float32's range, so it also counts below float16).
NARROWER = {
    torch.float64: (torch.float32, torch.float16, torch.bfloat16),
    torch.float32: (torch.float16, torch.bfloat16),
    torch.float16: (torch.bfloat16,),
    torch.bfloat16: (),
}
#: How much better a narrower recomputation must explain a result than the dense reference does (ratio of
#: the RMS residuals): the same rule as every numeric pattern's (:data:`tpsim.patterns.EXPLAINS_FAR_BETTER`).
_EXPLAINS_FAR_BETTER = EXPLAINS_FAR_BETTER


@dataclass
class Placed:
    """One tensor a property compares (see the module docstring).

    - ``what``: how messages name it (``"the output"``, ``"the fc1.weight grad"``);
    - ``pieces``: each rank's (tp rank order; None: it has none), in the case's dtype;
    - ``full``: the float64 reference; ``tol``: the bound of each of its elements;
    - ``placement``: how the pieces make ``full`` (a ``Shard``, packed parts included, or
      ``Replicate``: each piece is it); ``summed``: each piece is a summand; ``uneven``: a shard of a
      size that does not divide, in ``torch.tensor_split``'s pieces;
    - ``grad``: it is a gradient (missing: ``grad-missing``; a constant factor: ``grad-scaled``);
    - ``param``: the parameter it belongs to; ``sublayer``: the sublayer a failure is named with;
    - ``biases``: ``(name, dense value)`` of the biases that may have been added tp times or never;
    - ``reduced``: the computation reduces over the ranks (``double-reduction`` can be its name);
    - ``sequence_dim``: the sequence dim of a sequence-sharded tensor; ``sequence_parallel``: it belongs
      to a layer run on sequence-sharded activations (a replicated parameter's grad is then each rank's
      summand until it is reduced);
    - ``mag``/``k``/``summands``/``offset``: what ``precision-loss`` recomputes in a narrower dtype
      (the magnitudes, the reduction length, each rank's expected summand and what is added after);
    - ``ranks``: the tp rank of each piece, where they are not ``0, 1, ...`` (one rank's piece alone).
    """

    what: str
    pieces: list[Any]
    full: torch.Tensor
    tol: torch.Tensor
    placement: Placement = Replicate()
    summed: bool = False
    uneven: bool = False
    grad: bool = False
    param: str | None = None
    sublayer: str | None = None
    biases: Sequence[tuple[str, torch.Tensor]] = ()
    reduced: bool = False
    sequence_dim: int | None = None
    sequence_parallel: bool = False
    mag: torch.Tensor | None = None
    k: int = 1
    summands: list[torch.Tensor] | None = None
    offset: torch.Tensor | None = None
    ranks: Sequence[int] | None = None

    @property
    def tp(self) -> int:
        return len(self.pieces)

    def rank_of(self, i: int) -> int:
        """The tp rank piece ``i`` is (``ranks``: a family that compares one rank's piece at a time)."""
        return self.ranks[i] if self.ranks is not None else i

    @property
    def sharded(self) -> bool:
        return isinstance(self.placement, Shard) and not self.summed


#: A family's recogniser: ``recognise(placed, actual, pieces) -> Diagnosis | None`` (``actual``: the
#: assembled, summed or first differing piece compared with ``placed.full``; ``pieces``: float64).
Recogniser = Callable[[Placed, torch.Tensor, list[torch.Tensor]], "Diagnosis | None"]


def expected_pieces(full: torch.Tensor, placement: Placement, tp: int, uneven: bool | None = None) -> list[torch.Tensor]:
    """Each rank's piece of ``full`` laid out by ``placement`` (``uneven``: None, read from the size)."""
    if isinstance(placement, Shard):
        if uneven is None:
            uneven = full.shape[placement.dim] % tp != 0
        return [piece(full, placement, r, tp, uneven) for r in range(tp)]
    return [full] * tp


#: Elements compared at a time by :func:`_close_in_chunks` (a few MB: the chain of elementwise
#: passes stays in cache instead of streaming a lab-scale grad through memory once per pass).
_CHUNK = 1 << 19


def _close_in_chunks(actual: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor,
                     tol_of: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """``close(actual, expected, tol_of(mag))`` for large tensors, slice by slice along the first
    dim and in as few passes as possible: the tolerance is linear in the magnitude (see
    :mod:`tpsim.props.tolerance`), so it is ``mag`` times the tolerance of a unit magnitude; the
    floor for a zero magnitude is dropped, which only makes the comparison stricter there."""
    if actual.shape != expected.shape or mag.shape != expected.shape:
        return False
    if expected.dim() == 0 or expected.numel() <= _CHUNK:
        return close(actual, expected, tol_of(mag))
    unit = float(tol_of(torch.ones((), dtype=_F64)))
    step = max(1, _CHUNK // max(1, expected[0].numel()))
    # One thread: the chunks are cache-sized and memory-bound, where a parallel region per op
    # costs more than it gains (several times more on a loaded machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(0, expected.shape[0], step):
            diff = torch.sub(actual[i:i + step], expected[i:i + step]).abs_()  # float64: expected is
            if not bool((diff <= mag[i:i + step] * unit).all()):  # NaN never passes
                return False
        return True
    finally:
        torch.set_num_threads(threads)


def holds_fast(pieces: list[Any], full: torch.Tensor, mag: torch.Tensor, tol_of: Callable[[torch.Tensor], torch.Tensor],
           placement: Placement, summed: bool, uneven: bool) -> bool:
    """The fast path of :func:`_compare` for large tensors (a lab-scale weight grad): every rank's
    piece against its view of the reference and of the magnitude, in chunks; nothing is assembled
    and nothing converted before it is compared."""
    if any(p is None for p in pieces):
        return False
    if summed or not isinstance(placement, Shard):
        if any(p.shape != full.shape for p in pieces):
            return False
        if summed:
            return close(torch.stack([p.to(_F64) for p in pieces]).sum(0), full, tol_of(mag))
        return all(_close_in_chunks(p, full, mag, tol_of) for p in pieces)
    tp = len(pieces)
    if uneven or not placement.parts:
        expected = expected_pieces(full, placement, tp, uneven)
        mags = expected_pieces(mag, placement, tp, uneven)
        return all(p.shape == e.shape and _close_in_chunks(p, e, m, tol_of)
                   for p, e, m in zip(pieces, expected, mags, strict=True))
    # Packed parts: each part of a rank's piece against its view of the reference (no copies).
    dim = placement.dim % full.dim()
    sizes = part_sizes(full.shape[dim], placement)
    local = [size // tp for size in sizes]
    for r, p in enumerate(pieces):
        if p.dim() != full.dim() or p.shape[dim] != sum(local):
            return False
        for k in range(len(sizes)):
            start = sum(sizes[:k]) + r * local[k]
            mine = p.narrow(dim, sum(local[:k]), local[k])
            if mine.shape != full.narrow(dim, start, local[k]).shape or not _close_in_chunks(
                mine, full.narrow(dim, start, local[k]), mag.narrow(dim, start, local[k]), tol_of
            ):
                return False
    return True



def _pieces_f64(placed: Placed) -> list[torch.Tensor]:
    return [p.to(_F64) for p in placed.pieces]


def holds(placed: Placed) -> bool:
    """Whether every piece is there, of its shape, and together the pieces make ``full`` within
    ``tol`` (the comparison only: :func:`verdict` says what is wrong otherwise)."""
    if any(p is None for p in placed.pieces):
        return False
    return _compared(placed, _pieces_f64(placed))[0]


def _compared(placed: Placed, pieces: list[torch.Tensor]) -> tuple[bool, torch.Tensor | None, int]:
    """``(equal, what was compared with full, the first rank that differs)``."""
    full, tol = placed.full, placed.tol
    if placed.summed:
        if any(p.shape != full.shape for p in pieces):
            return False, None, 0
        total = pieces[0]
        for p in pieces[1:]:
            total = total + p  # rank order, as the reduction adds them
        return close(total, full, tol), total, 0
    expected = expected_pieces(full, placed.placement, placed.tp, placed.uneven if placed.sharded else None)
    if any(p.shape != e.shape for p, e in zip(pieces, expected, strict=True)):
        return False, None, 0
    if placed.sharded:
        assembled = assemble_pieces(pieces, placed.placement, placed.uneven)
        return close(assembled, full, tol), assembled, 0
    for r, p in enumerate(pieces):
        if not close(p, full, tol):
            return False, p, r
    return True, None, 0


@recogniser(GRAD_MISSING, WRONG_DTYPE, SHAPE_ERROR, WRONG_SHARD_DIM)
def verdict(placed: Placed, dtype: torch.dtype, recognisers: Sequence[Recogniser] = ()) -> tuple[Diagnosis, int | None] | None:
    """None when ``placed`` holds; else what is wrong and the tp rank it shows on (None: the whole)."""
    what, tp = placed.what, placed.tp
    rank0 = _rank0_only(placed, dtype)
    if rank0 is not None:
        return rank0, placed.rank_of(1)
    for i, p in enumerate(placed.pieces):
        r = placed.rank_of(i)
        if p is None:
            return (Diagnosis(GRAD_MISSING, f"{what} received no gradient on rank {r} (.grad is None)")
                    if placed.grad else Diagnosis(SHAPE_ERROR, f"{what} is missing on rank {r}")), r
        if p.is_floating_point() and p.dtype != dtype:
            got = str(p.dtype).replace("torch.", "")
            want = str(dtype).replace("torch.", "")
            return Diagnosis(WRONG_DTYPE, f"{what} on rank {r} is {got}, but the case is {want}: part of the "
                             f"computation or communication runs in {got} and never casts back",
                             {"dtype": got, "expected_dtype": want}), r
    pieces = _pieces_f64(placed)
    shape = _shape_verdict(placed, pieces)
    if shape is not None:
        return shape
    equal, actual, rank = _compared(placed, pieces)
    if equal:
        return None
    if actual is None:  # not reached (the shapes matched); never a pass
        return fail_shape(what, placed), None
    one = tp == 1 and placed.ranks is None
    label = what if placed.sharded or placed.summed or one else f"{what} on rank {placed.rank_of(rank)}"
    at = None if placed.sharded or placed.summed else placed.rank_of(rank)
    for recognise in recognisers:
        found = recognise(placed, actual, pieces)
        if found is not None:
            return found, at
    return _diagnose(placed, dtype, actual, pieces, label), at


def _shape_verdict(placed: Placed, pieces: list[torch.Tensor]) -> tuple[Diagnosis, int] | None:
    full, tp = placed.full, placed.tp
    if placed.summed:
        expected = [full] * tp
    else:
        expected = expected_pieces(full, placed.placement, tp, placed.uneven if placed.sharded else None)
    for i, (p, e) in enumerate(zip(pieces, expected, strict=True)):
        if p.shape == e.shape:
            continue
        r = placed.rank_of(i)
        bound = float(placed.tol.max()) if placed.tol.numel() else 0.0
        if tp > 1 and full.dim() > 0:
            dim = _other_dim(placed, p, full, i, bound)
            if dim is not None:
                instead = (f"sharded along dim {dim} instead of dim {placed.placement.dim % full.dim()}"  # type: ignore[union-attr]
                           if placed.sharded else f"its shards concatenated along dim {dim} instead of the last "
                           "(feature) dim")
                return Diagnosis(WRONG_SHARD_DIM, f"{placed.what} on rank {r} has shape {list(p.shape)} (expected "
                                 f"{list(e.shape)}): it is the dense result {instead}",
                                 {"shape": list(p.shape), "expected_shape": list(e.shape), "dim": dim}), r
        return Diagnosis(SHAPE_ERROR, f"{placed.what} on rank {r} has shape {list(p.shape)}, expected {list(e.shape)}",
                         {"shape": list(p.shape), "expected_shape": list(e.shape)}), r
    return None


def _other_dim(placed: Placed, p: torch.Tensor, full: torch.Tensor, rank: int, bound: float) -> int | None:
    """The dim ``d`` along which rank ``rank``'s shard ``p`` is its slice of ``full`` (a split along the
    wrong dim), or the dim a replicated tensor's shards were concatenated along instead of the
    feature dim (a gather along the wrong dim)."""
    tp = placed.tp
    if not placed.sharded:
        return regathered_dim(p, full, dim=-1, parts=tp, tol_scalar=bound)
    skip = placed.placement.dim % full.dim()  # type: ignore[union-attr]
    for d in range(full.dim()):
        if d == skip:
            continue
        cand = (shard_tensor(full, Shard(d), rank, tp) if full.shape[d] % tp == 0
                else torch.tensor_split(full, tp, dim=d)[rank])
        if cand.shape == p.shape and bool(((p - cand).abs() <= bound).all()):
            return d
    return None


# --- the shared recognisers, in order -------------------------------------------------------------


@recogniser(BIAS_GRAD_RANK0_ONLY)
def _rank0_only(placed: Placed, dtype: torch.dtype) -> Diagnosis | None:
    """Only tp rank 0's grad of a replicated parameter is right, every other rank has none or zeros:
    it is added on rank 0 only, so the other replicas never learn."""
    pieces, tp = placed.pieces, placed.tp
    if not placed.grad or placed.param is None or placed.sharded or placed.summed or tp < 2 or pieces[0] is None:
        return None
    first = pieces[0]
    if first.shape != placed.full.shape or not close(first, placed.full, placed.tol):
        return None
    if not all(g is None or (g.shape == placed.full.shape and not bool(g.abs().gt(0).any())) for g in pieces[1:]):
        return None
    return Diagnosis(BIAS_GRAD_RANK0_ONLY,
                     f"only rank 0's {placed.param} received its gradient (rank{'s 1..' if tp > 2 else ' '}{tp - 1} "
                     f"{'have' if tp > 2 else 'has'} {'None' if pieces[1] is None else 'zeros'}): it is added on rank 0 "
                     "only, so the other replicas never learn; add it on every rank after the reduction",
                     {"param": placed.param})


@recogniser(GRAD_SCALED)
def _complete_summed(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """Summands that are each the whole tensor: every rank holds it complete already, so the sum counts
    it ``tp`` times (a grad declared partial, or an input grad the caller would reduce again)."""
    tp = placed.tp
    if not placed.summed or tp < 2 or not all(close(p, placed.full, placed.tol) for p in pieces):
        return None
    if placed.grad:
        return Diagnosis(GRAD_SCALED, f"{label} is {tp} x the dense grad: every rank already holds the complete "
                         f"gradient, so the sum counts it {tp} times; it is reduced already: declare it complete "
                         "(grad='complete', or input_grad='complete'; and drop a sequence_parallel marker)",
                         {"factor": float(tp), **({"param": placed.param} if placed.param else {})})
    return Diagnosis(DOUBLE_REDUCTION, f"{label} is {tp} x the dense output: every rank already holds it reduced, so "
                     f"the sum counts it {tp} times: declare output='replicated' (or 'reduced')", {"factor": float(tp)})


def _diagnose(placed: Placed, dtype: torch.dtype, actual: torch.Tensor, pieces: list[torch.Tensor],
              label: str) -> Diagnosis:
    for recognise in (_complete_summed, _summands, _bias_multiple, _packed_contiguous, _sequence_dim, _scaled,
                      _blocks):
        found = recognise(placed, actual, pieces, label)
        if found is not None:
            return found
    return _unexplained(placed, dtype, actual, label)


@recogniser(MISSING_REDUCTION, GRAD_NOT_REDUCED)
def _summands(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """Every rank holds only its own summand: the ranks' pieces of a replicated tensor differ, and
    their sum is the dense one (:func:`tpsim.patterns.rank_summands`: never where every rank holds the
    same values, nor where one rank holds the whole beside zeros); for an output, each summand may carry
    a whole bias (their sum is then the dense one plus ``(tp-1)`` times it)."""
    if placed.sharded or placed.summed or placed.tp < 2:
        return None
    with_bias = None
    if not rank_summands(pieces, placed.full, placed.tol):
        if placed.grad:
            return None
        with_bias = next((name for name, b in placed.biases if actual.shape[-1:] == b.shape and bool(b.ne(0).any())
                          and rank_summands([p - b for p in pieces], placed.full - b, placed.tol)), None)
        if with_bias is None:
            return None
    if placed.grad:
        param = f" of the replicated parameter {placed.param!r}" if placed.param else ""
        why = (" (under sequence parallelism each rank uses it on its own slice of the sequence only; NeMo #7184, "
               "gpt-neox #1257)" if placed.param and placed.sequence_parallel else "")
        return Diagnosis(GRAD_NOT_REDUCED, f"{placed.what} on every rank is only its own summand (the ranks' grads "
                         f"differ and add up to the dense grad): the backward all-reduce{param} over the tp group is "
                         f"missing{why}", {"param": placed.param} if placed.param else {})
    if with_bias is not None:
        return Diagnosis(MISSING_REDUCTION, f"{placed.what}: each rank holds only its own summand plus the whole "
                         f"{with_bias} (the ranks' values differ and add up to the dense one plus "
                         f"{placed.tp - 1}*{with_bias}): the all-reduce over the tp group is missing (and the bias "
                         "must be added once, after it)", {"bias": with_bias})
    return Diagnosis(MISSING_REDUCTION, f"{placed.what}: each rank holds only its own summand (the ranks' values "
                     "differ and add up to the dense one): the all-reduce over the tp group is missing", {})


@recogniser(BIAS_DUPLICATION, BIAS_MISSING)
def _bias_multiple(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """Off by exactly ``(tp-1)`` times a non-zero bias (every rank added it before the reduction), or by
    minus it (never added): the known multiple, in every element (:func:`tpsim.patterns.is_bias_multiple`)."""
    tp = placed.tp
    for name, bias in placed.biases:
        if not bool(bias.ne(0).any()) or actual.shape[-1:] != bias.shape:
            continue
        diff = actual - placed.full
        if tp > 1 and is_bias_multiple(diff, bias, tp - 1, placed.tol):
            return Diagnosis(BIAS_DUPLICATION, f"{label} is off by exactly (world_size-1)*{name} = {tp - 1}*{name} "
                             f"(tp size {tp}): every rank adds the full bias to its summand before the reduction; "
                             "add it once, after the reduction", {"factor": float(tp - 1), "bias": name})
        if is_bias_multiple(diff, bias, -1.0, placed.tol):
            return Diagnosis(BIAS_MISSING, f"{label} is off by exactly -{name}: the bias is never added",
                             {"factor": -1.0, "bias": name})
    return None


@recogniser(PACKED_SHARD_LAYOUT)
def _packed_contiguous(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """Each rank's piece of a packed tensor is the rank-th contiguous slice of the packed dim instead of
    its shard of every packed part."""
    placement, full, tp = placed.placement, placed.full, placed.tp
    if not placed.sharded or not getattr(placement, "parts", None) or tp < 2 or full.dim() == 0:
        return None
    dim = placement.dim % full.dim()  # type: ignore[union-attr]
    if full.shape[dim] % tp:
        return None
    if not all(p.shape == shard_tensor(full, Shard(dim), r, tp).shape
               and close(p, shard_tensor(full, Shard(dim), r, tp), shard_tensor(placed.tol, Shard(dim), r, tp))
               for r, p in enumerate(pieces)):
        return None
    parts = list(placement.parts)  # type: ignore[union-attr]
    return Diagnosis(PACKED_SHARD_LAYOUT,
                     f"{label}: every rank holds a contiguous 1/{tp} slice of the packed dim instead of its shard of "
                     f"each of the {len(parts)} packed parts (proportions {parts}): the packed weight was split as one "
                     "block, so a rank's 'gate' and 'up' (or Q, K, V) come from the wrong parts; shard each part on "
                     "its own (Megatron's partition stride; vllm #3775)", {"parts": parts})


@recogniser(WRONG_SHARD_DIM)
def _sequence_dim(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """Pieces of a sequence-sharded tensor that are the dense one's slices along another dim."""
    full, tp, seq = placed.full, placed.tp, placed.sequence_dim
    if seq is None or not placed.sharded or tp < 2 or full.dim() < 2:
        return None
    for d in range(full.dim() - 1):
        if d == seq or full.shape[d] % tp:
            continue
        if all(p.shape == shard_tensor(full, Shard(d), r, tp).shape
               and close(p, shard_tensor(full, Shard(d), r, tp), shard_tensor(placed.tol, Shard(d), r, tp))
               for r, p in enumerate(pieces)):
            return Diagnosis(WRONG_SHARD_DIM, f"{label}: every rank holds its 1/{tp} slice of dim {d} of the dense "
                             f"tensor instead of dim {seq} (the sequence dim): the reduce-scatter or gather runs along "
                             "the wrong dim (e.g. the batch dim; vllm #30610, ROCm/aiter #3395)",
                             {"dim": d, "expected_dim": seq})
    return None


@recogniser(DOUBLE_REDUCTION, GRAD_SCALED)
def _scaled(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """A result that is one constant times the dense one in every element (zeros included:
    :func:`tpsim.patterns.multiple_of`): a forward reduced twice (``tp`` times the dense one, where it
    reduces), or a scaled grad."""
    tp = placed.tp
    if not placed.grad:
        if not placed.reduced or tp < 2:
            return None  # a forward that is a multiple of the dense one, with no reduction to blame: the facts only
        # The bias added once, or tp times with the rest: the product without it is tp times the dense one.
        for offset in (None, *(b for _, b in placed.biases if actual.shape[-1:] == b.shape)):
            a, e = (actual, placed.full) if offset is None else (actual - offset, placed.full - offset)
            if multiple_of(a, e, float(tp), placed.tol):
                return Diagnosis(DOUBLE_REDUCTION, f"{label} is {tp} x the dense output: it was reduced twice",
                                 {"factor": float(tp)})
        return None
    c = scale_factor(actual, placed.full, placed.tol, known=(tp, 1 / tp))
    if c is None:
        return None
    hint = (" (averaged instead of summed?)" if abs(c * tp - 1) < 1e-2 else
            " (reduced twice?)" if abs(c - tp) < 1e-2 and tp > 1 else "")
    return Diagnosis(GRAD_SCALED, f"{label} is {c:.4g} x the dense grad in every element{hint}", {"factor": c})


@recogniser(WRONG_SHARD_ORDER)
def _blocks(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor], label: str) -> Diagnosis | None:
    """The shards of a sharded tensor, assembled, are the dense one's blocks out of place."""
    if not placed.sharded or placed.tp < 2 or actual.dim() == 0:
        return None
    dim = placed.placement.dim % actual.dim()  # type: ignore[union-attr]
    mapping = block_mapping(actual, placed.full, placed.tol, dim=dim, parts=placed.tp)
    for _, bias in placed.biases if mapping is None else ():
        if actual.shape[-1:] == bias.shape:  # the bias shards loaded in place: compare without them
            mapping = block_mapping(actual - bias, placed.full - bias, placed.tol, dim=dim, parts=placed.tp)
            break
    if mapping is None or mapping == list(range(placed.tp)):
        return None
    wrong = [f"block {i} holds shard {j}" for i, j in enumerate(mapping) if i != j]
    return Diagnosis(WRONG_SHARD_ORDER, f"{label} has its {placed.tp} blocks out of place ("
                     f"{', '.join(wrong[:6])}{' ...' if len(wrong) > 6 else ''}): a rank holds another rank's shard",
                     {"mapping": mapping})


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(_F64)


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


@recogniser(PRECISION_LOSS)
def _precision_loss(placed: Placed, dtype: torch.dtype, actual: torch.Tensor, label: str) -> Diagnosis | None:
    """A recomputation in a narrower dtype — the result rounded to it, or the ranks' summands reduced
    in it — is within that dtype's bound and leaves at most a quarter of the dense reference's residual."""
    from tpsim.props.tolerance import tolerance

    if placed.mag is None:
        return None
    residual = _rms(actual - placed.full)
    if residual == 0.0 or not bool(torch.isfinite(actual).all()):
        return None
    best: tuple[float, str, torch.dtype] | None = None
    for narrow in NARROWER.get(dtype, ()):
        emulations = [("the result rounded to {}", _rounded(placed.full, narrow))]
        if placed.summands is not None and len(placed.summands) > 1:
            total = _rounded(placed.summands[0], narrow)
            for s in placed.summands[1:]:
                total = _rounded(total + _rounded(s, narrow), narrow)
            emulations.append(("the ranks' summands reduced in {}", total + (0.0 if placed.offset is None
                                                                              else placed.offset)))
        tol = tolerance(narrow, placed.mag, reduction_length=placed.k, world_size=placed.tp)
        for how, emulated in emulations:
            left = _rms(actual - emulated)
            if left <= _EXPLAINS_FAR_BETTER * residual and close(actual, emulated, tol) and (
                    best is None or left < best[0]):
                best = (left, how, narrow)
    if best is None:
        return None
    left, how, narrow = best
    name = str(narrow).replace("torch.", "")
    base = mismatch(actual, placed.full, what=label, tol=placed.tol)
    return Diagnosis(
        PRECISION_LOSS,
        f"{label} is not within {str(dtype).replace('torch.', '')} rounding of the dense reference, but recomputing "
        f"it in {name} ({how.format(name)}) explains it: RMS residual {left:.3g} against {residual:.3g} for the dense "
        f"reference; part of the computation or communication runs in {name} ({base.message.split(': ', 1)[1]})",
        dict(base.details, narrower=name, emulation=how.format(name), residual=residual, emulated_residual=left),
    )


def _unexplained(placed: Placed, dtype: torch.dtype, actual: torch.Tensor, label: str) -> Diagnosis:
    """``precision-loss`` when its evidence is there, else ``mismatch`` with what it resembles as hints:
    another multiple of a bias, a constant factor with no reduction to blame, a narrower dtype's rounding
    that recomputing in it does not explain."""
    from tpsim.props.tolerance import tolerance

    found = _precision_loss(placed, dtype, actual, label)
    if found is not None:
        return found
    hints = []
    for name, bias in placed.biases:
        if bias.numel() > 1 and actual.shape[-1:] == bias.shape:
            m = bias_multiple(actual - placed.full, bias, placed.tol)
            if m is not None:
                hints.append(f"the error is {m:.4g}*{name} (world_size={placed.tp})")
                break
    c = scale_factor(actual, placed.full, placed.tol)
    if c is not None and not placed.grad:
        hints.append(f"it is {c:.4g} x the dense result")
    if placed.mag is not None:
        for narrow in NARROWER.get(dtype, ()):
            if close(actual, placed.full, tolerance(narrow, placed.mag, reduction_length=placed.k,
                                                    world_size=placed.tp)):
                name = str(narrow).replace("torch.", "")
                hints.append(f"the error is within {name} rounding, but recomputing in {name} does not explain it: "
                             "not a precision loss")
                break
    return mismatch(actual, placed.full, what=label, tol=placed.tol, hint="; ".join(hints))


def fail_shape(what: str, placed: Placed) -> Diagnosis:
    """``shape-error``: the pieces of ``placed`` do not assemble (used where a caller assembles them)."""
    try:
        expected_pieces(placed.full, placed.placement, placed.tp, placed.uneven)
    except (RuntimeError, InvalidArgument) as err:
        return Diagnosis(SHAPE_ERROR, f"{what}: cannot re-assemble the pieces: {err}")
    return Diagnosis(SHAPE_ERROR, f"{what}: the pieces do not re-assemble to {list(placed.full.shape)}")
