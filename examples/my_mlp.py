"""A tensor-parallel MLP written the usual way (Megatron's pattern, plain torch.distributed), checked
as a whole module — no description of how it is sharded, no dense twin to write::

    tpsim check examples/my_mlp.py:TensorParallelMLP --kind module
    tpsim check examples/my_mlp.py:BuggyMLP --kind module    # exit 1: fc2: bias-duplication

tpsim builds the module on a tp group of one rank in float64 as the dense reference, reads how each
parameter is sharded from its shapes there and on the real tp group, loads every rank's piece of the
same master values, and compares outputs and every gradient. ``BuggyMLP``'s row layer adds its full
bias before the all-reduce, so the output holds it ``tp`` times: the failure names ``fc2``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _CopyToTP(torch.autograd.Function):
    """Identity forward; all-reduce of the grad backward (the replicated input's grad is complete)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class ColumnParallelLinear(nn.Module):
    """Output features sharded: weight ``[out/tp, in]``, bias ``[out/tp]``."""

    def __init__(self, in_features: int, out_features: int, *, process_group: Any = None) -> None:
        super().__init__()
        tp = dist.get_world_size(process_group)
        if out_features % tp:
            raise ValueError(f"out_features={out_features} is not divisible by the tp size {tp}")
        self.group = process_group
        self.weight = nn.Parameter(torch.randn(out_features // tp, in_features) * in_features**-0.5)
        self.bias = nn.Parameter(torch.zeros(out_features // tp))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToTP.apply(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features sharded: weight ``[out, in/tp]``, bias ``[out]`` added once, after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, *, process_group: Any = None) -> None:
        super().__init__()
        tp = dist.get_world_size(process_group)
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by the tp size {tp}")
        self.group = process_group
        self.weight = nn.Parameter(torch.randn(out_features, in_features // tp) * in_features**-0.5)
        self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight), self.group) + self.bias


class TensorParallelMLP(nn.Module):
    """``fc2(gelu(fc1(x)))`` with fc1 column- and fc2 row-parallel: replicated input and output."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.fc1 = ColumnParallelLinear(hidden, ffn, process_group=process_group)
        self.fc2 = RowParallelLinear(ffn, hidden, process_group=process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class _RowBiasBeforeReduce(RowParallelLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _ReduceFromTP.apply(F.linear(x, self.weight, self.bias), self.group)


class BuggyMLP(TensorParallelMLP):
    """The same MLP with a row layer that adds its full bias on every rank before the all-reduce."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__(hidden, ffn, process_group=process_group)
        self.fc2 = _RowBiasBeforeReduce(ffn, hidden, process_group=process_group)
