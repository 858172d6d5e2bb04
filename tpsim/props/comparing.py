"""Comparing each rank's tensors with the float64 reference, shared by the vocab and attention families.

A family with its own reference (rather than the linear or module machinery) compares every rank's
output and grads with the expected piece of the dense result: :func:`compare` returns None when it
is within the tolerance, else a :class:`~tpsim.diagnosis.Failure` — the first family recogniser
that sees its evidence, or the generic diagnoses in this order: ``grad-missing`` (no grad),
``wrong-dtype``, ``shape-error``, ``grad-scaled`` (a grad that is a constant times the dense one),
``mismatch``. (A run in which a rank failed is named by :func:`tpsim.props.blame.run_failure`, as in every family;
replicas by the engine's :func:`tpsim.props.judging.replica_consistency`.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpsim.diagnosis import (
    GRAD_MISSING,
    GRAD_SCALED,
    SHAPE_ERROR,
    WRONG_DTYPE,
    Failure,
    close,
    mismatch,
    scale_factor,
)
from tpsim.props.property_names import FORWARD

__all__ = ["close_or_nan", "compare", "failure"]

#: What :func:`replica` compares: a description, and how to read the tensor from a rank's result.
Replicated = tuple[str, Callable[[Any], "torch.Tensor | None"]]

_F64 = torch.float64


def failure(variant: Any, case: Any, prop: str, diagnosis: str, message: str, *, rank: int | None = None,
            details: dict[str, Any] | None = None) -> Failure:
    """A :class:`~tpsim.diagnosis.Failure` of ``variant`` on ``case``."""
    return Failure(prop, diagnosis, message, case=case, rank=rank, details=details or {}, variant=variant.name)


def compare(variant: Any, case: Any, prop: str, what: str, rank: int, got: torch.Tensor | None,
             expected: torch.Tensor, tol: torch.Tensor,
             recognisers: Sequence[Callable[[], Failure | None]] = ()) -> Failure | None:
    """None when ``got`` matches; else the first recogniser's failure, or shape/dtype/scale/mismatch."""
    if got is None:
        return failure(variant, case, prop, GRAD_MISSING, f"{what} on rank {rank} is None after backward: the "
                        "tensor took part in the forward but received no gradient", rank=rank)
    if got.dtype != case.torch_dtype:
        return failure(variant, case, prop, WRONG_DTYPE, f"{what} on rank {rank} has dtype {got.dtype}, not the "
                        f"case's {case.torch_dtype}", rank=rank)
    if tuple(got.shape) != tuple(expected.shape):
        return failure(variant, case, prop, SHAPE_ERROR, f"{what} on rank {rank} has shape {list(got.shape)}; "
                        f"expected {list(expected.shape)}", rank=rank,
                        details={"shape": list(got.shape), "expected_shape": list(expected.shape)})
    if close_or_nan(got, expected, tol):
        return None
    for recognise in recognisers:
        found = recognise()
        if found is not None:
            return found
    c = scale_factor(got, expected, tol)
    if c is not None and prop != FORWARD:
        return failure(variant, case, prop, GRAD_SCALED, f"{what} on rank {rank} is {c:.6g} times the dense one",
                        rank=rank, details={"factor": c})
    diag = mismatch(got, expected, what=f"{what} on rank {rank}", tol=tol)
    return failure(variant, case, prop, diag.name, diag.message, rank=rank, details=diag.details)


def close_or_nan(got: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor) -> bool:
    """``close``, where the reference is NaN (F.cross_entropy's mean over no target) NaN is expected."""
    nan = expected.isnan()
    if not bool(nan.any()):
        return close(got, expected, tol)
    same = bool((got.isnan() == nan).all())
    return same and close(got[~nan], expected[~nan], tol.expand_as(expected)[~nan])
