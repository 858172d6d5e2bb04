"""Layers that shard sizes which do not divide with ``torch.chunk``'s layout, by design: pieces of
``ceil(n / tp)`` while the dim lasts, the last non-empty piece smaller and the ranks after it empty
(5 over 4 ranks: 2, 2, 1, 0), rather than ``torch.tensor_split``'s (2, 1, 1, 1). The tp group by the
``process_group`` keyword (the group convention).

- ``ChunkColumnLinear``, ``ChunkRowLinear``: correct for every size;
- ``FloorRowLinear``: cuts ``in_features // tp`` on every rank (floor division): the rest is dropped.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


def chunk_piece(size: int, tp: int, rank: int) -> tuple[int, int]:
    """``(start, length)`` of ``rank``'s piece of a dim of ``size``, as ``torch.chunk`` cuts it."""
    step = -(-size // tp)
    start = min(size, rank * step)
    return start, max(0, min(step, size - start))


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class ChunkColumnLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, process_group=None):
        super().__init__()
        self.group = process_group
        tp, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        _, rows = chunk_piece(output_size, tp, rank)
        self.weight = nn.Parameter(torch.randn(rows, input_size))
        self.bias = nn.Parameter(torch.zeros(rows)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias)


class ChunkRowLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, process_group=None):
        super().__init__()
        self.group = process_group
        tp, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        _, cols = chunk_piece(input_size, tp, rank)
        self.weight = nn.Parameter(torch.randn(output_size, cols))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _ReduceFromRegion.apply(F.linear(x, self.weight), self.group)
        return out if self.bias is None else out + self.bias


class FloorRowLinear(ChunkRowLinear):
    """Bug: ``in_features // tp`` columns on every rank: the last ``in_features % tp`` are dropped."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, process_group=None):
        nn.Module.__init__(self)
        self.group = process_group
        tp = dist.get_world_size(process_group)
        self.weight = nn.Parameter(torch.randn(output_size, input_size // tp))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
