"""What training equivalence recognises beyond a single step: a grad reduced again after accumulation,
and a clip whose total norm counts replicated parameters once per rank.

Training equivalence trains as people train (:func:`tpsim.props.rank.schedule`): the first optimizer
step accumulates several micro-batches with a plain ``backward()`` each, so every grad hook fires as
in training; the grads accumulated over those micro-batches are compared with the dense ones before
the step, and where the target supplies a clip function its total norm is compared with the dense
total norm. The recognisers here read the two mechanisms that only training shows:

- :func:`reduced_after_accumulation` (``grad-reduced-after-accumulation``): a grad reduced over the tp
  group after every backward — a ``register_post_accumulate_grad_hook`` that all-reduces
  ``param.grad`` — reduces what the earlier micro-batches accumulated again. After two micro-batches
  rank ``r`` holds ``all_reduce(S1 + g2_r) = tp * S1 + S2`` (``S``: a micro-batch's reduced grad): the
  correct accumulated grad plus ``(tp - 1)`` times the first micro-batch's. The recogniser fits ``c``
  in ``actual = dense accumulated + c * dense first micro-batch`` by least squares and names it only
  when that holds within the bounds of both (on every rank's piece of a replicated grad: the
  reduction leaves them alike, where ranks holding their own summands differ), in a tensor of at
  least two elements whose first
  micro-batch's grad is not proportional to the later micro-batches' (a constant scaling of every
  micro-batch, ``grad-scaled``, would fit too otherwise).
- :func:`norm_counts_replicas` (``norm-counts-replicas``): a distributed clip that all-reduces every
  rank's sum of squares, replicated parameters included, counts those ``tp`` times:
  ``norm^2 = dense norm^2 + (tp - 1) * sum of the replicated grads' squares``.

Each is a claim from float64 numbers on the float64 dense reference: a family whose cases come in
narrower dtypes confirms it on the float64 re-run of the case (the module family's
``confirmed_in_float64``).
"""

from __future__ import annotations

import math

import torch

from tpsim.diagnosis import (
    GRAD_REDUCED_AFTER_ACCUMULATION,
    NORM_COUNTS_REPLICAS,
    NORM_NOT_REDUCED,
    Diagnosis,
    recogniser,
)
from tpsim.patterns import close
from tpsim.props.placed import Placed, Recogniser

__all__ = ["accumulated_what", "norm_counts_replicas", "norm_not_reduced", "reduced_after_accumulation"]

_F64 = torch.float64
#: Above this ``|cos|`` between the first micro-batch's grad and the later ones', an earlier micro-batch
#: counted again cannot be told from every micro-batch scaled alike: no name is given.
_PROPORTIONAL = 0.999


def accumulated_what(name: str, micro_batches: int) -> str:
    """How messages name a parameter's grad accumulated over the first optimizer step."""
    return f"the {name} grad accumulated over {micro_batches} micro-batches (before the optimizer step)"


def _counted_factor(c: float, tp: int) -> str:
    if tp > 1 and abs(c - (tp - 1)) <= 1e-2 * max(1.0, tp - 1):
        return f"(tp-1) = {tp - 1}"
    return f"{c:.4g}"


def reduced_after_accumulation(first: torch.Tensor | None, first_tol: torch.Tensor | None, tp: int,
                               micro_batches: int) -> Recogniser:
    """The recogniser of ``grad-reduced-after-accumulation`` for one parameter's accumulated grad (see the
    module docstring): ``first`` is the dense grad of the first micro-batch (float64, the accumulated
    grad's shape), ``first_tol`` its bound, ``tp`` the tp size, ``micro_batches`` how many were
    accumulated."""

    @recogniser(GRAD_REDUCED_AFTER_ACCUMULATION)
    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
        full = placed.full
        if first is None or first_tol is None or micro_batches < 2 or first.shape != full.shape \
                or actual.shape != full.shape or full.numel() < 2:
            return None
        f = first.to(_F64).reshape(-1)
        later = full.to(_F64).reshape(-1) - f
        ff, ll = float(f @ f), float(later @ later)
        if ff == 0.0 or ll == 0.0 or abs(float(f @ later)) > _PROPORTIONAL * math.sqrt(ff * ll):
            return None
        c = float((actual.to(_F64).reshape(-1) - full.to(_F64).reshape(-1)) @ f) / ff
        if not math.isfinite(c) or abs(c) < 1e-3:
            return None
        expected, tol = full + c * first.to(_F64), placed.tol + abs(c) * first_tol
        # Replicas: every rank's piece (the reduction leaves them all alike), not only the first that differs.
        compared = pieces if not placed.sharded and not placed.summed and pieces else [actual]
        if not all(close(p, expected, tol) for p in compared):
            return None
        factor = _counted_factor(c, tp)
        return Diagnosis(
            GRAD_REDUCED_AFTER_ACCUMULATION,
            f"{placed.what} equals the dense accumulated grad plus {factor} times the first micro-batch's grad: what "
            f"the earlier micro-batches accumulated is reduced again over the {tp} ranks (the grad is all-reduced "
            "after every backward, e.g. by a register_post_accumulate_grad_hook on the parameter, while each "
            "micro-batch adds to it); reduce it once per optimizer step after the accumulation, or reduce only the "
            "fresh micro-batch's grad (Tensor.register_hook)",
            {"factor": c, "tp": tp, "micro_batches": micro_batches,
             **({"param": placed.param} if placed.param else {})})

    return recognise


@recogniser(NORM_COUNTS_REPLICAS)
def norm_counts_replicas(got: float, dense: float, replicated_sq: float, tp: int, bound: float,
                         replicated: list[str]) -> Diagnosis | None:
    """``norm-counts-replicas`` when the total norm ``got`` a rank's clip returned is
    ``sqrt(dense^2 + (tp-1) * replicated_sq)`` within its bound (``bound``: that of the dense norm,
    scaled with the norm) and not within ``bound`` of ``dense`` (``replicated_sq``: the sum of the
    squared dense grads of the ``replicated`` parameters)."""
    if tp < 2 or replicated_sq <= 0.0 or dense <= 0.0 or not math.isfinite(got):
        return None
    counted = math.sqrt(dense * dense + (tp - 1) * replicated_sq)
    if abs(got - dense) <= bound or abs(got - counted) > bound * counted / dense:
        return None
    shown = ", ".join(replicated[:4]) + (f" and {len(replicated) - 4} more" if len(replicated) > 4 else "")
    return Diagnosis(
        NORM_COUNTS_REPLICAS,
        f"the clip's total grad norm is {got:.6g}, the dense one {dense:.6g}: it is sqrt(dense^2 + (tp-1) * "
        f"sum of the replicated grads^2) = {counted:.6g} with tp = {tp}, so every replicated parameter ({shown}) is "
        "counted once per rank and the grads are clipped too hard; count a replicated parameter on one rank only "
        "(Megatron's param_is_not_tensor_parallel_duplicate), or sum only sharded parameters' squares across ranks",
        {"norm": got, "dense_norm": dense, "counted_norm": counted, "tp": tp, "replicated": replicated})


@recogniser(NORM_NOT_REDUCED)
def norm_not_reduced(got: float, dense: float, local: float, tp: int, bound: float, rank: int) -> Diagnosis | None:
    """``norm-not-reduced`` when the total norm ``got`` rank ``rank``'s clip returned is ``local``, the
    2-norm of that rank's own accumulated grads, within ``bound`` (that of the dense norm), and not
    within ``bound`` of ``dense``."""
    if tp < 2 or not math.isfinite(got) or abs(got - dense) <= bound or abs(got - local) > bound:
        return None
    return Diagnosis(
        NORM_NOT_REDUCED,
        f"the clip's total grad norm on rank {rank} is {got:.6g}, the dense one {dense:.6g}: it is the norm of that "
        f"rank's own grads ({local:.6g}), never summed over the tp group, so each rank clips by its own coefficient "
        "(the sharded parameters' squares must be all-reduced before the square root; torch.nn.utils.clip_grad_norm_ "
        "does so only for DTensor grads)",
        {"norm": got, "dense_norm": dense, "local_norm": local, "tp": tp})
