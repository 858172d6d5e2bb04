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
    "bias_multiple",
    "block_mapping",
    "close",
    "rank_summands",
    "regathered_dim",
    "scale_factor",
    "worst_violation",
]


def close(actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    """Same shape and ``|actual - expected| <= tol`` everywhere; a NaN matches only where the dense
    result is NaN too (``F.cross_entropy``'s mean over no target is NaN on every rank)."""
    if actual.shape != expected.shape:
        return False
    a, e = actual.to(torch.float64), expected.to(torch.float64)
    ok = (a - e).abs() <= tol
    if bool(ok.all()):
        return True
    return bool((ok | (a.isnan() & e.isnan())).all())


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
    # ~1 is no scale bug; ~0 is a result that is (nearly) all zeros, not a scaled one.
    if abs(c - 1.0) < 1e-3 or abs(c) < 1e-3 or c != c:
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
