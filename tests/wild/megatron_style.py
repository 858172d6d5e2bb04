"""Correct tensor-parallel layers in the Megatron style: a group keyword, tuple outputs,
``skip_bias_add``, and sequence parallelism with trainer-reduced grads.

- Constructors ``(input_size, output_size, *, bias=..., gather_output=..., skip_bias_add=...,
  tp_group=None)`` (the row layer says ``process_group=``, the ``ProjectionRowLinear`` says
  ``group=`` with ``in_features``/``out_features``); weights ``[out/tp, in]`` / ``[out, in/tp]``
  with their own random init; ``forward`` returns ``(output, bias_or_None)``: under
  ``skip_bias_add`` the bias is returned for the caller to add.
- Sequence parallelism, sequence-first ``[s, b, h]``: the column layer all-gathers its
  sequence-sharded input (reduce-scatter in backward); the row layer reduce-scatters its output
  along the sequence and adds the full bias to its shard, so its bias grad is a per-rank summand
  which the trainer all-reduces. The layer marks that parameter ``bias.sequence_parallel = True``,
  as Megatron-core does.

Written for tpsim's false-alarm regression suite; not a copy of Megatron's code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec, Variant


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the tensor-parallel size {denominator}")
    return numerator // denominator


def _size(group) -> int:
    return dist.get_world_size(group=group)


def _rank(group) -> int:
    return dist.get_rank(group=group)


def _all_reduce(x, group):
    if _size(group) == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=group)
    return x


def _gather(x, group, dim):
    if _size(group) == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _split(x, group, dim):
    n = _size(group)
    if n == 1:
        return x
    size = _divide(x.shape[dim], n, f"dim {dim}")
    return x.narrow(dim, _rank(group) * size, size).contiguous()


def _reduce_scatter_first(x, group):
    n = _size(group)
    if n == 1:
        return x
    _divide(x.shape[0], n, "the sequence length")
    out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype)
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return _all_reduce(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.group, -1), None


class _ScatterLast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, -1), None


class _GatherSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group, 0)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_first(grad, ctx.group), None


class _ReduceScatterSequence(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_first(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group, 0), None


class ColumnParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by output features; returns ``(output, bias_or_None)``."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, sequence_parallel: bool = False, tp_group=None):
        super().__init__()
        self.group = dist.group.WORLD if tp_group is None else tp_group
        per_rank = _divide(output_size, _size(self.group), "output_size")
        self.gather_output = gather_output
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel and _size(self.group) > 1
        self.weight = nn.Parameter(torch.empty(per_rank, input_size))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.bias = nn.Parameter(torch.zeros(per_rank)) if bias else None

    def forward(self, x: torch.Tensor):
        x = _GatherSequence.apply(x, self.group) if self.sequence_parallel else _Copy.apply(x, self.group)
        y = F.linear(x, self.weight, None if self.skip_bias_add else self.bias)
        if self.gather_output:
            y = _GatherLast.apply(y, self.group)
        return y, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(nn.Module):
    """``Y = X A + b`` with ``A`` split by input features; every option is required, as in Megatron."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool, input_is_parallel: bool,
                 skip_bias_add: bool, sequence_parallel: bool = False, process_group=None):
        super().__init__()
        if sequence_parallel and not input_is_parallel:
            raise ValueError("sequence_parallel=True needs input_is_parallel=True")
        self.group = dist.group.WORLD if process_group is None else process_group
        per_rank = _divide(input_size, _size(self.group), "input_size")
        self.input_is_parallel = input_is_parallel
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel = sequence_parallel
        self.weight = nn.Parameter(torch.empty(output_size, per_rank))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        if bias:
            self.bias = nn.Parameter(torch.zeros(output_size))
            # Its grad stays a per-rank summand under sequence parallelism: the trainer sums it.
            self.bias.sequence_parallel = sequence_parallel
        else:
            self.bias = None

    def forward(self, x: torch.Tensor):
        if not self.input_is_parallel:
            x = _ScatterLast.apply(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = _ReduceScatterSequence.apply(y, self.group)
        else:
            y = _Reduce.apply(y, self.group)
        if self.skip_bias_add or self.bias is None:
            return y, self.bias
        return y + self.bias, None


class ProjectionRowLinear(nn.Module):
    """A row layer spelled differently: ``(in_features, out_features, *, bias=True, group=None)``,
    input already split, bias returned for the caller (``skip_bias_add`` on by default)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = True, skip_bias_add: bool = True,
                 group=None):
        super().__init__()
        self.group = dist.group.WORLD if group is None else group
        per_rank = _divide(in_features, _size(self.group), "in_features")
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(out_features, per_rank))
        nn.init.kaiming_uniform_(self.weight, a=5**0.5)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor):
        y = _Reduce.apply(F.linear(x, self.weight), self.group)
        if self.bias is not None and not self.skip_bias_add:
            return y + self.bias, None
        return y, self.bias


# --- declared variants of the sequence-parallel pair (sequence-first: sequence dim 0) -------------


def _unpack(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    out, bias = module(x)
    return out if bias is None else out + bias


def _sp_column(in_features, out_features, bias, *, group, dtype, **_):
    return ColumnParallelLinear(in_features, out_features, bias=bias, sequence_parallel=True,
                                tp_group=group).to(dtype)


def _sp_row(in_features, out_features, bias, *, group, dtype, **_):
    return RowParallelLinear(in_features, out_features, bias=bias, input_is_parallel=True, skip_bias_add=False,
                             sequence_parallel=True, process_group=group).to(dtype)


sp_column = Variant(name="megatron_style.sp_column", kind="column", build=_sp_column, forward=_unpack,
                    input="sequence-sharded", output="sharded", sequence_dim=0, min_batch_dims=1,
                    params=(ParamSpec("weight", "weight", Shard(0)), ParamSpec("bias", "bias", Shard(0))))
sp_row = Variant(name="megatron_style.sp_row", kind="row", build=_sp_row, forward=_unpack,
                 input="sharded", output="sequence-sharded", sequence_dim=0, min_batch_dims=1,
                 params=(ParamSpec("weight", "weight", Shard(1)), ParamSpec("bias", "bias", Replicate())))
