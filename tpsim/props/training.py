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
  correct accumulated grad plus ``(tp - 1)`` times the first micro-batch's; after ``k`` micro-batches
  ``sum_i tp^(k-i) S_i``, the correct grad plus ``(tp^(k-i) - 1)`` times each earlier one's. The
  recogniser tries those factors ``c_i`` in ``actual = dense accumulated + sum_(i<k) c_i * dense
  micro-batch i`` first (nothing fitted), else fits them by least squares (a hook that reduces with
  another factor), and names it only when that holds within the bounds of all of them (on every rank's
  piece of a replicated grad: the reduction leaves them alike, where ranks holding their own summands
  differ), in a tensor of more elements than coefficients whose last micro-batch's grad is not (nearly)
  a combination of the earlier ones' (a constant scaling of every micro-batch, ``grad-scaled``, would
  fit too otherwise).
- :func:`norm_counts_replicas` (``norm-counts-replicas``): a distributed clip that all-reduces every
  rank's sum of squares, replicated parameters included, counts those ``tp`` times:
  ``norm^2 = dense norm^2 + (tp - 1) * sum of the replicated grads' squares``.

Each is a claim from float64 numbers on the float64 dense reference: a family whose cases come in
narrower dtypes confirms it on the float64 re-run of the case (the module family's
``confirmed_in_float64``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

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


def _counted_factor(c: float, tp: int, power: int) -> str:
    """``c``, named ``(tp^power - 1)`` where it is that (the tp-power pattern of the module docstring)."""
    want = tp ** power - 1
    if tp > 1 and abs(c - want) <= 1e-2 * max(1.0, want):
        return f"(tp-1) = {want}" if power == 1 else f"(tp^{power}-1) = {want}"
    return f"{c:.4g}"


_ORDINALS = ("first", "second", "third", "fourth", "fifth")


def _counted(coefficients: list[float], tp: int) -> str:
    k = len(coefficients) + 1
    parts = [f"{_counted_factor(c, tp, k - 1 - i)} times the "
             + (f"{_ORDINALS[i]}" if i < len(_ORDINALS) else f"#{i + 1}") + (" micro-batch's grad" if i == 0 else "'s")
             for i, c in enumerate(coefficients)]
    return parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]


Bound = torch.Tensor | Callable[[], torch.Tensor] | None


def _parallel(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` are (nearly) proportional: ``|cos| > _PROPORTIONAL``, or either is zero."""
    na, nb = float(a.norm()), float(b.norm())
    return na == 0.0 or nb == 0.0 or abs(float(a @ b)) > _PROPORTIONAL * na * nb


@recogniser(GRAD_REDUCED_AFTER_ACCUMULATION)  # registered at import; the recogniser is made per check
def reduced_after_accumulation(earlier: torch.Tensor | Sequence[torch.Tensor | None] | None,
                               earlier_tol: Bound | Sequence[Bound], tp: int, micro_batches: int) -> Recogniser:
    """The recogniser of ``grad-reduced-after-accumulation`` for one parameter's accumulated grad (see the
    module docstring): ``earlier`` holds the dense grads of the first optimizer step's micro-batches but
    the last (the accumulated grad's shape; read in float64; one tensor: the first of two micro-batches),
    ``earlier_tol`` the bound of each (one for all), or a function that makes it (called only when a grad
    differs: at the lab note's size the bound of every weight grad was a float64 tensor as large as the
    weight, made for every passing case), ``tp`` the tp size, ``micro_batches`` how many were accumulated."""
    grads = [earlier] if isinstance(earlier, torch.Tensor) or earlier is None else list(earlier)
    bounds = list(earlier_tol) if isinstance(earlier_tol, (list, tuple)) else [earlier_tol] * len(grads)

    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
        full = placed.full
        if micro_batches < 2 or len(grads) != micro_batches - 1 or any(
                g is None or g.shape != full.shape for g in grads) or any(b is None for b in bounds) \
                or actual.shape != full.shape or full.numel() < 2:
            return None
        basis = torch.stack([g.to(_F64).reshape(-1) for g in grads], 1)  # type: ignore[union-attr]
        flat = full.to(_F64).reshape(-1)
        if any(float(basis[:, i].norm()) == 0.0 for i in range(basis.shape[1])):
            return None
        # Replicas: every rank's piece (the reduction leaves them all alike), not only the first that differs.
        compared = pieces if not placed.sharded and not placed.summed and pieces else [actual]

        def fits(c: list[float]) -> bool:
            expected, tol = full.to(_F64), placed.tol
            for x, g, b in zip(c, grads, bounds, strict=True):
                made = b() if callable(b) else b
                expected, tol = expected + x * g.to(_F64), tol + abs(x) * made  # type: ignore[union-attr,operator]
            return all(close(p, expected, tol) for p in compared)

        # The mechanism's own factors first (nothing fitted: evidence in any tensor of two elements or more),
        # where what they give is not every micro-batch scaled alike (grad-scaled would fit that too).
        c = [float(tp ** (micro_batches - 1 - i) - 1) for i in range(len(grads))]
        mechanism = flat + basis @ torch.tensor(c, dtype=_F64)
        if tp < 2 or _parallel(mechanism, flat) or not fits(c):
            # Any factors, by least squares: only in a tensor of more elements than factors, whose last
            # micro-batch's grad stands apart from the earlier ones' span (else every micro-batch scaled
            # alike fits too): its distance from that span relative to its own size.
            last = flat - basis.sum(1)
            if full.numel() <= len(grads) or float(last.norm()) == 0.0:
                return None
            fit_last = torch.linalg.lstsq(basis, last.unsqueeze(1)).solution
            apart = float((last - (basis @ fit_last).squeeze(1)).norm())
            if apart < math.sqrt(1 - _PROPORTIONAL ** 2) * float(last.norm()):
                return None
            diff = actual.to(_F64).reshape(-1) - flat
            c = [float(x) for x in torch.linalg.lstsq(basis, diff.unsqueeze(1)).solution.squeeze(1)]
            if not all(math.isfinite(x) for x in c) or max(abs(x) for x in c) < 1e-3 or not fits(c):
                return None
        return Diagnosis(
            GRAD_REDUCED_AFTER_ACCUMULATION,
            f"{placed.what} equals the dense accumulated grad plus {_counted(c, tp)}: what "
            f"the earlier micro-batches accumulated is reduced again over the {tp} ranks (the grad is all-reduced "
            "after every backward, e.g. by a register_post_accumulate_grad_hook on the parameter, while each "
            "micro-batch adds to it); reduce it once per optimizer step after the accumulation, or reduce only the "
            "fresh micro-batch's grad (Tensor.register_hook)",
            {"factor": c[0], "factors": c, "tp": tp, "micro_batches": micro_batches,
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
