"""Correct layers in the tp-rank convention (transposed weights, own random init).

Constructor ``(in_features, out_features, tp_size, tp_rank, tp_group=None, bias=False)``: each
layer draws its own weight (the harness overwrites it with the master shard) and stores it
transposed for ``x @ weight`` — column ``[in, out/tp_size]``, row ``[in/tp_size, out]``. Unlike the
tutorial these re-creations take an optional bias, so the transposed layout is checked with and
without one. They are the correct forms the mutant tests require to pass (tpsim/mutants/__init__.py
declares their variants); the CLI's own adapters for the convention live in ``examples/``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpsim.mutants._ops import copy_to_region

__all__ = ["CorrectTpRankColumn", "CorrectTpRankRow"]


class CorrectTpRankColumn(nn.Module):
    """``y_local = copy(x) @ weight + bias`` with weight ``[in, out/tp]`` and bias ``[out/tp]``;
    the replicated input's grad is all-reduced in backward (complete on every rank)."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group: Any = None,
                 bias: bool = False):
        super().__init__()
        if out_features % tp_size:
            raise ValueError(f"out_features={out_features} is not divisible by tp_size={tp_size}")
        self.group = tp_group
        self.weight = nn.Parameter(torch.empty(in_features, out_features // tp_size))
        nn.init.xavier_uniform_(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features // tp_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = copy_to_region(x, self.group) @ self.weight
        return y + self.bias if self.bias is not None else y


class CorrectTpRankRow(nn.Module):
    """``y = all_reduce(x_local @ weight) + bias`` with weight ``[in/tp, out]`` and the full bias;
    ``dist.all_reduce`` is called directly (outside autograd: the backward of a sum over ranks is
    the identity for a replicated upstream grad, so autograd's view is still right)."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group: Any = None,
                 bias: bool = False):
        super().__init__()
        if in_features % tp_size:
            raise ValueError(f"in_features={in_features} is not divisible by tp_size={tp_size}")
        self.group = tp_group
        self.weight = nn.Parameter(torch.empty(in_features // tp_size, out_features))
        nn.init.xavier_uniform_(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight
        if dist.get_world_size(self.group) > 1:
            dist.all_reduce(y, group=self.group)
        return y + self.bias if self.bias is not None else y
