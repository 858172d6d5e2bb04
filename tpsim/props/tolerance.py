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

Why sqrt rather than linear in K: with K up to a few dozen the two differ by a small factor, and
a linear bound in bfloat16 (u = 2**-8 per rounding, eps = 2**-7) would accept errors of the order
of the result itself — too loose to tell ``bias-missing`` from rounding.
"""

from __future__ import annotations

import math

import torch

__all__ = ["FACTOR", "eps", "tolerance"]

#: Safety factor C in ``C * eps * sqrt(K + ws) * M``.
FACTOR = 4.0

# A floor so that exactly-zero magnitudes (e.g. a zero upstream grad) still allow float64 noise.
_TINY = 1e-300


def eps(dtype: torch.dtype) -> float:
    """Machine epsilon of a floating dtype (``torch.finfo(dtype).eps``)."""
    return float(torch.finfo(dtype).eps)


def tolerance(
    dtype: torch.dtype,
    magnitude: torch.Tensor,
    *,
    reduction_length: int,
    world_size: int,
    factor: float = FACTOR,
) -> torch.Tensor:
    """Per-element absolute tolerance ``factor * eps(dtype) * sqrt(K + ws) * magnitude``.

    ``magnitude`` is float64 and has the shape of the compared tensor (see the module docstring).
    """
    scale = factor * eps(dtype) * math.sqrt(max(int(reduction_length), 1) + max(int(world_size), 1))
    return magnitude.to(torch.float64) * scale + _TINY
