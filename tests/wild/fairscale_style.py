"""Correct tensor-parallel layers in the fairscale style: the tp group lives in a module global.

An init function (``initialize_model_parallel``) synchronises the ranks and records the tp group
in ``_MODEL_PARALLEL_GROUP``; the layers and their autograd collectives read it at call time. In a
real job every process has its own copy of this module, so the layers are correct. On tpsim's
in-process backend the ranks are threads of one process: unless the module is rank-local, the
ranks rebind each other's group. Written for tpsim's false-alarm regression suite; not a copy of
fairscale's code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec, Variant

_MODEL_PARALLEL_GROUP = None


def initialize_model_parallel(group=None) -> None:
    """Every rank of ``group`` (default: the world) calls this before building a layer."""
    global _MODEL_PARALLEL_GROUP
    group = dist.group.WORLD if group is None else group
    dist.barrier(group=group)  # as real init functions do: every rank arrives before any goes on
    _MODEL_PARALLEL_GROUP = group


def get_model_parallel_group():
    if _MODEL_PARALLEL_GROUP is None:
        raise RuntimeError("model parallel is not initialised: call initialize_model_parallel() first")
    return _MODEL_PARALLEL_GROUP


def get_model_parallel_world_size() -> int:
    return dist.get_world_size(group=get_model_parallel_group())


def get_model_parallel_rank() -> int:
    return dist.get_rank(group=get_model_parallel_group())


def _divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by the model parallel size {denominator}")
    return numerator // denominator


def _all_gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = get_model_parallel_world_size()
    if world == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x.contiguous(), group=get_model_parallel_group())
    return torch.cat(parts, dim=-1)


def _split_last_dim(x: torch.Tensor) -> torch.Tensor:
    world = get_model_parallel_world_size()
    if world == 1:
        return x
    size = _divide(x.shape[-1], world, "the last dim")
    rank = get_model_parallel_rank()
    return x[..., rank * size : (rank + 1) * size].contiguous()


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    if get_model_parallel_world_size() == 1:
        return x
    x = x.contiguous().clone()
    dist.all_reduce(x, group=get_model_parallel_group())
    return x


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad)


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_reduce(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _all_gather_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _split_last_dim(grad)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return _split_last_dim(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather_last_dim(grad)


class ColumnParallelLinear(nn.Module):
    """Weight ``[out/tp, in]``, bias ``[out/tp]``; gathers its output by default."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, gather_output: bool = True):
        super().__init__()
        per_rank = _divide(out_features, get_model_parallel_world_size(), "out_features")
        self.gather_output = gather_output
        self.weight = nn.Parameter(torch.empty(per_rank, in_features))
        nn.init.xavier_normal_(self.weight)
        self.bias = nn.Parameter(torch.zeros(per_rank)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(_Copy.apply(x), self.weight, self.bias)
        return _Gather.apply(y) if self.gather_output else y


class RowParallelLinear(nn.Module):
    """Weight ``[out, in/tp]``, bias ``[out]`` added once after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, input_is_parallel: bool = False):
        super().__init__()
        per_rank = _divide(in_features, get_model_parallel_world_size(), "in_features")
        self.input_is_parallel = input_is_parallel
        self.weight = nn.Parameter(torch.empty(out_features, per_rank))
        nn.init.xavier_normal_(self.weight)
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = _Scatter.apply(x)
        y = _Reduce.apply(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


def _column(in_features, out_features, bias, *, group, dtype, **_):
    initialize_model_parallel(group)
    return ColumnParallelLinear(in_features, out_features, bias=bias).to(dtype)


def _row(in_features, out_features, bias, *, group, dtype, **_):
    initialize_model_parallel(group)
    return RowParallelLinear(in_features, out_features, bias=bias).to(dtype)


column = Variant(name="fairscale_style.column", kind="column", build=_column, output="gathered",
                 params=(ParamSpec("weight", "weight", Shard(0)), ParamSpec("bias", "bias", Shard(0))))
row = Variant(name="fairscale_style.row", kind="row", build=_row, input="replicated", output="reduced",
              params=(ParamSpec("weight", "weight", Shard(1)), ParamSpec("bias", "bias", Replicate())))
