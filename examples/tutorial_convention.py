"""Layers in the "tp-rank" convention, re-created for tpsim to check.

The convention (as a popular tutorial teaches it): the constructor is
``(in_features, out_features, tp_size, tp_rank[, tp_group])``; each layer initialises its own
weight randomly (tpsim overwrites it with the master shard after construction) and stores it
transposed, for ``x @ weight``: column ``[in, out/tp_size]``, row ``[in/tp_size, out]``. There is
no bias. The row layer's forward calls ``dist.all_reduce`` directly on its partial output (not
through an autograd function: the backward of a sum is the identity, so autograd still gets it
right). The column layer leaves the gradient of its replicated input to the caller, so its
adapter declares ``input_grad="partial"``.

The classes have no bias flag, so tpsim runs bias-free cases only and its report says so::

    tpsim check examples/tutorial_convention.py

or the plain classes, with the convention detected from the constructor::

    tpsim check examples/tutorial_convention.py:ColumnParallelLinear --input-grad partial
    tpsim check examples/tutorial_convention.py:RowParallelLinear
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from tpsim.conventions import variant_from_class


class ColumnParallelLinear(nn.Module):
    """``y_local = x @ weight`` with weight ``[in, out/tp_size]``: this rank's output columns."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int):
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"out_features={out_features} is not divisible by tp_size={tp_size}")
        self.tp_rank = tp_rank
        self.weight = nn.Parameter(torch.empty(in_features, out_features // tp_size))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ weight)`` with weight ``[in/tp_size, out]``."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group=None):
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tp_size={tp_size}")
        self.tp_rank = tp_rank
        self.tp_group = tp_group
        self.weight = nn.Parameter(torch.empty(in_features // tp_size, out_features))
        nn.init.xavier_uniform_(self.weight)

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        y = x_local @ self.weight
        dist.all_reduce(y, op=dist.ReduceOp.SUM, group=self.tp_group)
        return y


#: What ``tpsim check examples/tutorial_convention.py`` checks.
TPSIM_VARIANTS = [
    variant_from_class(ColumnParallelLinear, input_grad="partial", name="tutorial.ColumnParallelLinear"),
    variant_from_class(RowParallelLinear, name="tutorial.RowParallelLinear"),
]
