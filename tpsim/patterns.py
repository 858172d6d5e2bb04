"""Numeric patterns the diagnosis recognisers look for: pure functions of float64 tensors.

Each answers one question about an actual result next to the dense reference (is it a multiple of
the bias, a constant times the reference, the reference's blocks permuted, the ranks' summands?),
with a per-element tolerance from :mod:`tpsim.props.tolerance`. They name nothing themselves: the
recognisers in :mod:`tpsim.props.linear.checks` (and the module checks) turn a pattern into a diagnosis of
:mod:`tpsim.diagnosis`. Tested on synthetic tensors without running any world
(tests/test_properties_diagnosis.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = [
    "EXPLAINS_FAR_BETTER",
    "bias_multiple",
    "block_mapping",
    "close",
    "is_bias_multiple",
    "multiple_of",
    "rank_summands",
    "regathered_dim",
    "scale_factor",
    "worst_violation",
]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    """Same shape and ``|actual - expected| <= tol`` everywhere; a NaN matches only where the dense
    result is NaN too (``F.cross_entropy``'s mean over no target is NaN on every rank), or where the
    bound is infinite: nothing about that element can be judged in the case's dtype (a correct run
    of the same operations in that dtype overflows there too, see :mod:`tpsim.props.module.twin`)."""
    if actual.shape != expected.shape:
        return False
    if actual.dim() == 0 or actual.numel() <= _CHUNK:
        return _close(actual, expected, tol)
    # In row blocks: each block's float64 copies and differences are temporaries of its size, not of the
    # whole tensor's (at the lab note's size a weight grad's were 2 GB beside everything the check keeps).
    tol = torch.broadcast_to(tol, actual.shape)
    rows = max(1, _CHUNK // max(1, actual[0].numel()))
    return all(_close(a, e, t) for a, e, t in zip(actual.split(rows), expected.split(rows), tol.split(rows),
                                                   strict=True))


#: Elements :func:`close` compares at a time.
_CHUNK = 1 << 22


def _close(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    ok = (a - e).abs() <= tol
    if bool(ok.all()):
        return True
    return bool((ok | (a.isnan() & e.isnan()) | tol.isposinf()).all())


def scale_factor(
    actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, *, known: Sequence[float] = ()
) -> float | None:
    """``c`` (not ~1) such that *every element* of ``actual`` is ``c`` times its element of ``expected``,
    else None. Evidence of one multiple, all three of:

    - every element within ``tol * max(1, |c|)`` of ``c * expected``;
    - the same exact zeros: an element exactly 0 in one and not in the other is no multiple of it;
    - the multiple explains the difference far better than no multiple at all: the RMS of
      ``actual - c * expected`` is at most a quarter of that of ``actual - expected`` (a rounding
      that is not uniform, a narrower dtype's cast, fits a factor near 1 within a loose bound but
      leaves most of the difference unexplained).

    A single element is a multiple of any other, so for one-element tensors only a factor in
    ``known`` (e.g. ``world_size`` or ``1/world_size``) counts as evidence.
    """
    if actual.shape != expected.shape or actual.numel() == 0:
        return None
    a = actual.to(torch.float64).reshape(-1)
    e = expected.to(torch.float64).reshape(-1)
    if not bool(torch.isfinite(a).all()) or not bool(torch.isfinite(e).all()):
        return None
    denom = float(e @ e)
    if denom == 0.0:
        return None
    c = float(a @ e) / denom
    # ~1 is no scale bug; ~0 is a result that is (nearly) all zeros, not a scaled one.
    if abs(c - 1.0) < 1e-3 or abs(c) < 1e-3 or c != c:
        return None
    if a.numel() == 1 and not any(abs(c - k) <= 1e-3 * max(1.0, abs(k)) for k in known):
        return None
    return c if multiple_of(actual, expected, c, tol) else None


def multiple_of(actual: torch.Tensor, expected: torch.Tensor, c: float, tol: torch.Tensor) -> bool:
    """Whether ``actual`` is ``c`` times ``expected`` in every element (see :func:`scale_factor`: within
    ``tol * max(1, |c|)``, the same exact zeros, and explaining the difference far better than ``c = 1``);
    an ``actual`` that is zero within its bound shows no multiple."""
    if actual.shape != expected.shape or actual.numel() == 0:
        return False
    a = actual.to(torch.float64).reshape(-1)
    e = expected.to(torch.float64).reshape(-1)
    t = tol.to(torch.float64).expand(actual.shape).reshape(-1)
    if not bool(((a - c * e).abs() <= t * max(1.0, abs(c))).all()):
        return False
    if bool((a.abs() <= t).all()):
        return False  # zero within its bound: any small multiple fits it, none is read from it
    if c != 0.0 and not torch.equal(a == 0, e == 0):
        return False
    return _rms(a - c * e) <= EXPLAINS_FAR_BETTER * _rms(a - e)


#: How much better a pattern must explain a result than the dense reference does (ratio of the RMS
#: residuals) to count as its evidence: a structural error is as far from a rounding of the dense
#: result as from the dense result, a pattern that only fits within a loose bound is not.
EXPLAINS_FAR_BETTER = 0.25


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


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


def is_bias_multiple(diff: torch.Tensor, bias: torch.Tensor, c: float, tol: torch.Tensor) -> bool:
    """Whether ``diff`` is exactly ``c`` times ``bias`` (broadcast over the leading dims) in every
    element, for the known multiple ``c`` (non-zero): within ``tol * max(1, |c|)`` and explaining ``diff``
    far better than no bias at all (the RMS left is at most a quarter of ``diff``'s). ``c`` is given, not
    fitted: a fitted multiple of a single number is any number."""
    if c == 0.0 or diff.numel() == 0 or bias.numel() == 0 or diff.shape[-1:] != bias.shape:
        return False
    b = bias.to(torch.float64).expand_as(diff)
    d = diff.to(torch.float64)
    if not bool(b.ne(0).any()):
        return False
    t = tol.to(torch.float64).expand_as(d)
    if not bool(((d - c * b).abs() <= t * max(1.0, abs(c))).all()) or bool((d.abs() <= t).all()):
        return False  # not that multiple, or a difference within its bound of zero: no multiple is read from it
    return _rms(d - c * b) <= EXPLAINS_FAR_BETTER * _rms(d)


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
    """True when each rank holds only its own summand: the ranks' tensors sum to ``expected``, and
    they are summands, not something else that adds up:

    - identical tensors that sum to ``expected`` (every rank holds ``expected / ws``, or the same
      garbage) are a scaled result (``grad-scaled``), not summands: some pair of ranks must differ;
    - a rank holding ``expected`` whole beside ranks holding exact zeros (only one rank computed it)
      is no summand either.
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
    nonzero = [t for t in per_rank if bool(t.ne(0).any())]
    if len(nonzero) == 1 and close(nonzero[0], expected, tol):
        return False
    first = per_rank[0].to(torch.float64)
    return any(not close(t, first, tol) for t in per_rank[1:])


def worst_violation(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> tuple[int, ...] | None:
    """The index of the element that violates ``|actual - expected| <= tol`` by the largest factor
    (``|actual - expected| / tol``; NaN counts as infinitely far), or None when none violates it.

    A failure message quotes this element: the largest *absolute* error may sit on a large element
    well inside its own bound while the violating one is tiny (a subnormal, a near-cancellation).
    """
    if actual.shape != expected.shape or actual.numel() == 0:
        return None
    diff = (actual.to(torch.float64) - expected.to(torch.float64)).abs()
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    t = tol.to(torch.float64).expand_as(diff)
    over = diff > t
    if not bool(over.any()):
        return None
    ratio = torch.where(over, diff / t.clamp_min(torch.finfo(torch.float64).tiny), torch.zeros_like(diff))
    flat = int(torch.argmax(ratio))
    return tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)) if diff.dim() else ()
