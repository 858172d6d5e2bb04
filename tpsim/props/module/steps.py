"""One tp group's steps on the dense module, as the reference world and the dense twin record them.

A leaf of the module family: the reference world (:mod:`tpsim.props.module.world`) and the dense
twin (:mod:`tpsim.props.module.twin`) both build these, and neither imports the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = ["StepTensors", "assign"]


@dataclass
class StepTensors:
    """One tp group's steps on the dense module (or their magnitudes): the step-0 output ``y``, input
    grad ``dx`` (None: the input got none) and parameter grads by dotted name, the sublayer
    boundaries of step 0 (:meth:`Capture.as_payload`, None when not recorded), and every parameter
    after the ``TRAIN_STEPS`` steps (``final``)."""

    y: torch.Tensor
    dx: torch.Tensor | None
    grads: dict[str, torch.Tensor | None]
    capture: dict[str, Any] | None = None
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    #: What the magnitude run measured (magnitudes from the derived bound only; None: the twin's).
    derived: Any = None


def assign(module: nn.Module, values: dict[str, torch.Tensor]) -> None:
    """Make ``values`` the module's parameters (no copy: the tensors become their storage). A parameter
    the module keeps in a dtype of its own (a router kept in float32 in a float64 model) takes its
    value in that dtype, as a checkpoint loads it."""
    for name, p in module.named_parameters():
        value = values[name]
        p.data = value if value.dtype == p.dtype or not p.is_floating_point() else value.to(p.dtype)
