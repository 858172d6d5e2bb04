"""Correct tensor-parallel layers whose constructor has no ``bias`` flag: they always have a bias.

The tp-rank convention (``(in_features, out_features, tp_size, tp_rank[, tp_group])``), weights
stored transposed for ``x @ weight``, and a bias initialised like ``nn.Linear``'s (random,
seeded alike on every rank). Nothing in the signature says "bias": only the built module does.
Written for tpsim's false-alarm regression suite.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn


def _check(name: str, size: int, tp_size: int) -> int:
    if size % tp_size:
        raise ValueError(f"{name}={size} is not divisible by tp_size={tp_size}")
    return size // tp_size


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _CopyIn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _uniform(shape: tuple[int, ...], fan_in: int) -> torch.Tensor:
    bound = 1 / math.sqrt(fan_in) if fan_in else 0.0
    return torch.empty(shape).uniform_(-bound, bound)


class ColumnParallelLinear(nn.Module):
    """``x @ weight + bias``: weight ``[in, out/tp]``, bias ``[out/tp]``."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group=None):
        super().__init__()
        per_rank = _check("out_features", out_features, tp_size)
        self.tp_group = tp_group
        self.weight = nn.Parameter(_uniform((in_features, per_rank), in_features))
        self.bias = nn.Parameter(_uniform((per_rank,), in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _CopyIn.apply(x, self.tp_group) @ self.weight + self.bias


class RowParallelLinear(nn.Module):
    """``all_reduce(x_local @ weight) + bias``: weight ``[in/tp, out]``, bias ``[out]`` on every rank."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group=None):
        super().__init__()
        per_rank = _check("in_features", in_features, tp_size)
        self.tp_group = tp_group
        self.weight = nn.Parameter(_uniform((per_rank, out_features), in_features))
        self.bias = nn.Parameter(_uniform((out_features,), in_features))

    def forward(self, x_local: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(x_local @ self.weight, self.tp_group) + self.bias
