"""What every family's rank returns in common: the typed head of its per-rank result.

Each family's rank function returns a dataclass of its own (:class:`tpsim.props.world.RankResult`
for linear layers, :class:`~tpsim.props.module.world.ModuleRankResult`, the vocab and attention
results), plain data that travels back from gloo workers and from the isolated worker. They all
start with :class:`RankOutput`: the status of the run, the rank's tp group and tp rank, and what its
forward returned. :meth:`RankOutput.unusable` is the one rule for a forward whose result cannot be
back-propagated. :class:`Observation` holds one run of a family whose data the parent draws.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tpsim.errors import RankError

__all__ = ["DETACHED", "OK", "OUTPUT_SHAPE", "Observation", "RankOutput"]

#: :attr:`RankOutput.status` values every family uses (a family may add its own).
OK = "ok"  # built, ran every step
OUTPUT_SHAPE = "output-shape"  # the forward returned no tensor, or one of another shape than the upstream grad
DETACHED = "detached"  # the output has no autograd graph although the input requires grad


@dataclass
class RankOutput:
    """The fields every family's per-rank result has.

    - ``status``: :data:`OK`, :data:`OUTPUT_SHAPE`, :data:`DETACHED` or a family's own;
    - ``group``/``tp_rank``: this rank's tp group index and rank within it;
    - ``output``: the step-0 output (detached), None when the forward returned no tensor;
    - ``output_type``: the type name of what the forward returned.
    """

    status: str = OK
    group: int = 0
    tp_rank: int = 0
    output: torch.Tensor | None = None
    output_type: str | None = None

    def unusable(self, out: Any, shape: torch.Size, *, graph: torch.Tensor | None = None) -> bool:
        """Whether ``out`` (what the forward returned) cannot be back-propagated with an upstream grad
        of ``shape``; if so, record it (status, output, type) for the parent to report. With ``graph``
        (an input that requires grad) an output cut off from autograd counts too: backward would only
        raise "does not require grad", where the parent can name the cause."""
        tensor = isinstance(out, torch.Tensor)
        if tensor and out.shape == shape and not (
            graph is not None and graph.requires_grad and out.grad_fn is None and not out.requires_grad
        ):
            return False
        self.status = DETACHED if tensor and out.shape == shape else OUTPUT_SHAPE
        self.output = out.detach().clone() if tensor else None
        self.output_type = type(out).__name__
        return True


@dataclass
class Observation:
    """One world run of a case whose data the parent draws (the vocab and attention families): the
    case, its data, and every rank's result (global rank order) or the run's error."""

    case: Any
    data: Any
    values: list[Any] | None = None
    error: RankError | None = None
