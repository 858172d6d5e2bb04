"""Layers in the "group" convention (Megatron style), re-created for tpsim to check.

The convention: the constructor is ``(input_size, output_size, *, bias=True, gather_output=False,
skip_bias_add=False, process_group=None)`` (tpsim also recognises ``group=`` / ``tp_group=`` and
``in_features``/``out_features``); the layer initialises its own weights, stored ``[out/tp, in]``
(column) / ``[out, in/tp]`` (row) as ``F.linear`` wants them, and tpsim overwrites them with the
master shards. ``forward`` returns ``(output, bias_or_None)``: under ``skip_bias_add`` the bias is
left to the caller (who fuses it with what comes next), and tpsim adds it before comparing.

Three classes, all correct:

- ``ColumnParallelLinear``: copies its replicated input into the tp region (backward: all-reduce of
  the input grad), computes this rank's output columns, gathers them with ``gather_output=True``;
- ``RowParallelLinear``: scatters its input unless ``input_is_parallel`` (the default here),
  all-reduces its partial output, then adds its full bias once, or returns it under
  ``skip_bias_add``;
- ``FusedBiasRowParallelLinear``: the row layer with ``skip_bias_add=True`` by default.

Check them (the convention is detected from the constructor, the kind from the class name)::

    tpsim check examples/group_convention.py
    tpsim check examples/group_convention.py:ColumnParallelLinear --output gathered
    tpsim check examples/group_convention.py:RowParallelLinear --input replicated

``tpsim check examples/group_convention.py`` checks the ``TPSIM_VARIANTS`` below.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.conventions import variant_from_class


def _partition(size: int, group, name: str) -> int:
    # A ValueError on every rank, before any collective: tpsim's divisibility property wants this.
    tp = dist.get_world_size(group)
    if size % tp:
        raise ValueError(f"{name}={size} is not divisible by the tensor-parallel size {tp}")
    return size // tp


class _CopyToRegion(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (every rank's input grad is a summand)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromRegion(torch.autograd.Function):
    """Forward: all-reduce of the partial outputs. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRegion(torch.autograd.Function):
    """Forward: all-gather along the last dim. Backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        size = grad.shape[-1] // dist.get_world_size(ctx.group)
        rank = dist.get_rank(ctx.group)
        return grad[..., rank * size : (rank + 1) * size].contiguous(), None


class _ScatterToRegion(torch.autograd.Function):
    """Forward: keep this rank's slice of the last dim. Backward: all-gather."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        size = _partition(x.shape[-1], group, "the input's last dim")
        rank = dist.get_rank(group)
        return x[..., rank * size : (rank + 1) * size].contiguous()

    @staticmethod
    def backward(ctx, grad):
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=-1), None


def _init(weight: torch.Tensor, fan_in: int) -> None:
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ + b`` with ``A`` split by output features: weight ``[out/tp, in]``."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, process_group=None):
        super().__init__()
        self.group = dist.group.WORLD if process_group is None else process_group
        per_rank = _partition(output_size, self.group, "output_size")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(per_rank, input_size))
        _init(self.weight, input_size)
        self.bias = nn.Parameter(torch.zeros(per_rank)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = F.linear(_CopyToRegion.apply(x, self.group), self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = _GatherFromRegion.apply(y, self.group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """``Y = X Aᵀ + b`` with ``A`` split by input features: weight ``[out, in/tp]``, bias added once."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, process_group=None):
        super().__init__()
        self.group = dist.group.WORLD if process_group is None else process_group
        per_rank = _partition(input_size, self.group, "input_size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(output_size, per_rank))
        _init(self.weight, input_size)
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if not self.input_is_parallel:
            x = _ScatterToRegion.apply(x, self.group)
        y = _ReduceFromRegion.apply(F.linear(x, self.weight), self.group)
        if self.bias is None or self.skip_bias_add:
            return y, self.bias
        return y + self.bias, None


class FusedBiasRowParallelLinear(RowParallelLinear):
    """The row layer whose caller fuses the bias: ``skip_bias_add=True`` by default."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = True, process_group=None):
        super().__init__(input_size, output_size, bias=bias, input_is_parallel=input_is_parallel,
                         skip_bias_add=skip_bias_add, process_group=process_group)


#: What ``tpsim check examples/group_convention.py`` checks.
TPSIM_VARIANTS = [
    variant_from_class(ColumnParallelLinear, name="group.ColumnParallelLinear"),
    variant_from_class(ColumnParallelLinear, output="gathered", name="group.ColumnParallelLinear(gather_output=True)"),
    variant_from_class(RowParallelLinear, name="group.RowParallelLinear"),
    variant_from_class(RowParallelLinear, input="replicated", name="group.RowParallelLinear(input_is_parallel=False)"),
    variant_from_class(FusedBiasRowParallelLinear, name="group.FusedBiasRowParallelLinear"),
]
