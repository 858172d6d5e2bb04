"""How close a sharded result must be to the float64 dense reference.

The reference is computed in float64 from the *same* master values the ranks use (already rounded
to the case's dtype), so rounding of the inputs is not an error source: only the arithmetic the
layer does in its dtype is. For an output element ``y = sum_k a_k * b_k`` (a matmul row, a grad
entry) computed in floating point with unit roundoff ``u = eps(dtype)``, the classic bound is

    |y_hat - y| <= gamma_K * sum_k |a_k * b_k|,   gamma_K ~ K * u   (worst case)

and, for rounding errors that behave like independent random signs (the usual case in practice),
the error grows like ``sqrt(K) * u`` (Higham, *Accuracy and Stability of Numerical Algorithms*,
ch. 3). We use the probabilistic form with a safety factor, per element:

    atol(i) = C * eps(dtype) * sqrt(K + ws) * M(i)

- ``M(i)`` is the *magnitude* of element i: ``(|A| @ |B|)(i)`` (plus ``|bias|`` where a bias is
  added). It scales with the terms that are actually summed, so cancellation (a small ``y`` made
  of large terms) does not cause false failures, and a relative criterion needs no special case
  for ``y == 0``.
- ``K`` is the reduction length (``in_features`` for the forward, ``out_features`` for the input
  grad, the number of batch rows for weight/bias grads); ``+ ws`` accounts for the cross-rank
  sum, which adds up to ``ws`` more roundings of partial sums in low precision (each rank rounds
  its partial result to the dtype before the all-reduce).
- ``C = 4`` covers the rounding of the result itself (``u/2 * |y| <= u/2 * M``) and leaves room
  for the tails of the error distribution; the property suite's correct variants pass thousands
  of examples with it, while the bugs it looks for are off by O(1) * M (a whole bias, a missing
  summand), orders of magnitude above it in every dtype.

**The floor: rounding near zero.** The model above (``fl(a op b) = (a op b)(1 + d)``, ``|d| <= u``,
``u = eps/2``) holds only while results stay normal. Below the smallest normal number ``λ``
(``torch.finfo(dtype).tiny``; float16: 6.1e-5) the spacing of representable numbers stops
shrinking: it is ``eps * λ`` (float16: 2**-24 = 5.96e-8, the smallest subnormal), so rounding a
result there errs by up to ``u * λ`` however small the result is. Higham's model with gradual
underflow adds that absolute term to each rounding: ``fl(a op b) = (a op b)(1 + d) + e`` with
``|e| <= u * λ`` (Higham, §2.1; ``e = 0`` for additions, which are exact on subnormals). Summed over
the same ``K + ws`` roundings, with the same probabilistic growth and safety factor, the absolute
floor is

    floor = C * sqrt(K + ws) * eps(dtype) * λ(dtype)     (= C * sqrt(K + ws) * 2 * u * λ)

and the tolerance is ``atol(i) = C * eps * sqrt(K + ws) * M(i) + floor``. It matters only where the
magnitude ``M(i)`` is itself below about ``λ`` (a float16 product of two small draws, a tiny
gradient); there ``eps * M(i)`` alone is smaller than one subnormal step, so a correctly rounded
result would fail. For float32 and bfloat16 (``λ`` = 1.2e-38) and float64 the floor is negligible;
it also keeps exactly-zero magnitudes (a zero upstream grad) from demanding more than exactness.

Why sqrt rather than linear in K: with K up to a few dozen the two differ by a small factor, and
a linear bound in bfloat16 (u = 2**-8 per rounding, eps = 2**-7) would accept errors of the order
of the result itself — too loose to tell ``bias-missing`` from rounding.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

__all__ = ["FACTOR", "Tolerance", "eps", "floor", "subnormal_step", "tolerance"]

#: Safety factor C in ``C * eps * sqrt(K + ws) * M``.
FACTOR = 4.0


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype (``torch.finfo(dtype).eps``)."""
    return float(torch.finfo(dtype).eps)


def subnormal_step(dtype: torch.dtype) -> float:
    """The spacing of ``dtype``'s numbers below its smallest normal: ``eps * tiny`` (float16: 2**-24)."""
    info = torch.finfo(dtype)
    return float(info.eps) * float(info.tiny)


def floor(dtype: torch.dtype, *, reduction_length: int, world_size: int, factor: float = FACTOR) -> float:
    """The absolute floor ``factor * sqrt(K + ws) * subnormal_step(dtype)`` (see the module docstring)."""
    return factor * math.sqrt(max(int(reduction_length), 1) + max(int(world_size), 1)) * subnormal_step(dtype)


def tolerance(
    dtype: torch.dtype,
    magnitude: torch.Tensor,
    *,
    reduction_length: int,
    world_size: int,
    factor: float = FACTOR,
    in_place: bool = False,
) -> torch.Tensor:
    """Per-element absolute tolerance ``factor * eps(dtype) * sqrt(K + ws) * magnitude + floor``.

    ``magnitude`` is float64 and has the shape of the compared tensor; the floor is
    :func:`floor` (see the module docstring for both). ``in_place``: a float64 ``magnitude`` that the
    caller no longer needs becomes the tolerance (the same operations, so the same values, without two
    temporaries as large as it: at a realistic vocabulary each is a [tokens, V] float64 tensor).
    """
    scale = factor * eps(dtype) * math.sqrt(max(int(reduction_length), 1) + max(int(world_size), 1))
    atol = floor(dtype, reduction_length=reduction_length, world_size=world_size, factor=factor)
    if in_place and magnitude.dtype == torch.float64:
        return magnitude.mul_(scale).add_(atol)
    return magnitude.to(torch.float64) * scale + atol


@dataclass(frozen=True)
class Tolerance:
    """The one tolerance model every family's checks use: the bound of each element of a result of a
    given magnitude, computed in ``dtype`` by a tp group of ``world_size`` ranks with reductions of a
    given length (:func:`tolerance`). Where the magnitudes come from is the family's: the product of
    absolute values (linear layers), the magnitude run (a module), the dense twin's equivalent
    magnitude (:mod:`tpsim.props.module.twin`)."""

    dtype: torch.dtype
    world_size: int

    def bound(self, magnitude: torch.Tensor, reduction_length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``tolerance(dtype, magnitude, reduction_length=..., world_size=...)`` (``dtype``: another
        dtype than the case's, e.g. a narrower one a recogniser tries)."""
        return tolerance(dtype or self.dtype, magnitude, reduction_length=reduction_length,
                         world_size=self.world_size)
