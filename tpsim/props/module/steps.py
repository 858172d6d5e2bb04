"""One tp group's training on the dense module, as the reference world and the dense twin record them.

A leaf of the module family: the reference world (:mod:`tpsim.props.module.world`) and the dense
twin (:mod:`tpsim.props.module.twin`) both build these, and neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpsim.props.rank import schedule

__all__ = ["CLIP_FRACTION", "StepTensors", "assign", "dense_step", "step_plan", "total_norm"]

#: Where a target supplies a clip function, ``max_norm`` is this fraction of the dense total grad norm of
#: the first optimizer step (per tp group): clipping really happens on that step.
CLIP_FRACTION = 0.5


@dataclass
class StepTensors:
    """One tp group's training on the dense module (or its magnitudes): the first micro-batch's output
    ``y``, input grad ``dx`` (None: the input got none) and parameter grads by dotted name, its sublayer
    boundaries (:meth:`Capture.as_payload`, None when not recorded), every parameter after the last
    optimizer step (``final``), the grads accumulated over the first optimizer step's micro-batches
    (``accumulated``), and where the target clips, the ``max_norm`` and the total grad norm of each
    optimizer step before clipping (``norms``; magnitudes: the bound of each)."""

    y: torch.Tensor
    dx: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    capture: dict[str, Any] | None = None
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    #: What the magnitude run measured (magnitudes from the derived bound only; None: the twin's).
    derived: Any = None
    accumulated: dict[str, torch.Tensor | None] = field(default_factory=dict)
    norms: list[float] = field(default_factory=list)
    max_norm: float | None = None
    #: The grads accumulated after each micro-batch of the first optimizer step between its first and its
    #: last (none for two micro-batches): with ``grads`` and ``accumulated``, each micro-batch's own grad.
    prefixes: list[dict[str, torch.Tensor | None]] = field(default_factory=list)

    def micro_grads(self, name: str) -> list[torch.Tensor | None]:
        """The grads of ``name`` of the first optimizer step's micro-batches but the last, each its own."""
        seen = [self.grads.get(name), *(p.get(name) for p in self.prefixes)]
        if any(t is None for t in seen):
            return [None] * len(seen)
        return [seen[0], *(b - a for a, b in zip(seen[:-1], seen[1:], strict=True))]  # type: ignore[operator]


def assign(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Make ``values`` the module's parameters (no copy: the tensors become their storage). A parameter
    the module keeps in a dtype of its own (a router kept in float32 in a float64 model) takes its
    value in that dtype, as a checkpoint loads it."""
    for name, p in module.named_parameters():
        value = values[name]
        p.data = value if value.dtype == p.dtype or not p.is_floating_point() else value.to(p.dtype)


def total_norm(grads: list[torch.Tensor]) -> float:
    """The 2-norm of every tensor of ``grads`` together (``torch.nn.utils.clip_grad_norm_``'s total norm)."""
    if not grads:
        return 0.0
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.detach()) for g in grads])))


def dense_step(module: nn.Module, optimizer: Any, *, set_to_none: bool, max_norm: float | None) -> float | None:
    """The dense module's optimizer step after its micro-batches: clipped by global norm with
    ``torch.nn.utils.clip_grad_norm_`` where ``max_norm`` is given (returns the total norm before
    clipping), then ``optimizer.step()`` and ``optimizer.zero_grad(set_to_none)``."""
    norm = None
    if max_norm is not None:
        params = [p for p in module.parameters() if p.grad is not None]
        norm = float(torch.nn.utils.clip_grad_norm_(params, max_norm)) if params else 0.0
    if optimizer is not None:
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
    return norm


def step_plan(variant: Any, case: Any, *, traced: bool = False) -> tuple[int, ...]:
    """Micro-batches per optimizer step of a case of ``variant``: one forward for a forward-only
    variant, else the case's :func:`~tpsim.props.rank.schedule` (the first step accumulates
    ``micro_batches`` micro-batches). ``traced``: a run that records the sublayer boundaries to explain a
    failure reads the first micro-batch only: it runs that one (the reference world still draws every
    micro-batch's numbers, :func:`tpsim.props.module.world.reference_main`)."""
    return (1,) if variant.forward_only or traced else schedule(case)
