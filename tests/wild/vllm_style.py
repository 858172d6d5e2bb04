"""Fresh layers in vLLM's style, checked with no adapter code (``tpsim check --forward-only``).

vLLM's linear layers take no group: they read the tp group from the parallel state through
``get_tp_group()`` (here a module global that defaults to the whole world, as a one-model
inference server sets it up). Their constructors are ``(input_size, output_size, bias=True,
..., skip_bias_add=False, params_dtype=None, ...)``; weights have no grads; ``forward`` returns
``(output, output_bias)``: ``output_bias`` is None, or the bias the caller adds under
``skip_bias_add``. The row layer lets rank 0 alone add the bias before the all-reduce, so the sum
holds it once; every rank keeps the full bias.

- ``ColumnParallelLinear``, ``RowParallelLinear``: correct;
- ``BiasOnEveryRankRowLinear``: every rank adds the bias before the all-reduce (``bias-duplication``);
- ``ReturnsBiasAndAddsItRowLinear``: under ``skip_bias_add`` it returns the bias *and* adds it (the
  caller adds it a second time);
- ``TrainableRowLinear``: the row layer with grads, for ``reduce_results=False`` (a partial output)
  under ``skip_bias_add``: the caller adds the returned bias once, after its all-reduce.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

#: The tp group of this process (vLLM's ``_TP``), set by ``init_tp_group``; the world when unset.
_TP_GROUP = None


def init_tp_group(group) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group():
    return dist.group.WORLD if _TP_GROUP is None else _TP_GROUP


def _divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


def _all_reduce(x: torch.Tensor) -> torch.Tensor:
    dist.all_reduce(x, group=get_tp_group())  # in place, outside autograd: inference only
    return x


def _all_gather(x: torch.Tensor) -> torch.Tensor:
    group = get_tp_group()
    pieces = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(pieces, x.contiguous(), group=group)
    return torch.cat(pieces, dim=-1)


class _LinearBase(nn.Module):
    def __init__(self, input_size: int, output_size: int, skip_bias_add: bool, params_dtype):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.skip_bias_add = skip_bias_add
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.tp_rank = dist.get_rank(get_tp_group())
        self.tp_size = dist.get_world_size(get_tp_group())

    def _param(self, *shape: int) -> nn.Parameter:
        param = nn.Parameter(torch.empty(*shape, dtype=self.params_dtype), requires_grad=False)
        nn.init.normal_(param)
        return param


class ColumnParallelLinear(_LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, params_dtype=None, prefix: str = ""):
        super().__init__(input_size, output_size, skip_bias_add, params_dtype)
        self.gather_output = gather_output
        self.output_size_per_partition = _divide(output_size, self.tp_size)
        self.weight = self._param(self.output_size_per_partition, input_size)
        self.bias = self._param(self.output_size_per_partition) if bias else None

    def forward(self, input_):
        bias = None if self.skip_bias_add else self.bias
        output_parallel = F.linear(input_, self.weight, bias)
        output = _all_gather(output_parallel) if self.gather_output else output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class RowParallelLinear(_LinearBase):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, params_dtype=None, reduce_results: bool = True, prefix: str = ""):
        super().__init__(input_size, output_size, skip_bias_add, params_dtype)
        if not reduce_results and bias and not skip_bias_add:
            raise ValueError("When not reducing the results, adding bias to the results can lead to incorrect results")
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.input_size_per_partition = _divide(input_size, self.tp_size)
        self.weight = self._param(output_size, self.input_size_per_partition)
        self.bias = self._param(output_size) if bias else None

    def _rank_bias(self):
        # Only rank 0 adds the bias, so the all-reduce adds it once.
        return None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias

    def forward(self, input_):
        if self.input_is_parallel:
            input_parallel = input_
        else:
            input_parallel = torch.tensor_split(input_, self.tp_size, dim=-1)[self.tp_rank].contiguous()
        output_parallel = F.linear(input_parallel, self.weight, self._rank_bias())
        output = _all_reduce(output_parallel) if self.reduce_results and self.tp_size > 1 else output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class BiasOnEveryRankRowLinear(RowParallelLinear):
    """Bug: every rank adds the bias before the all-reduce."""

    def _rank_bias(self):
        return None if self.skip_bias_add else self.bias


class ReturnsBiasAndAddsItRowLinear(RowParallelLinear):
    """Bug: under skip_bias_add it adds the bias (rank 0) and returns it for the caller as well."""

    def _rank_bias(self):
        return None if self.tp_rank > 0 else self.bias


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=get_tp_group())
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class TrainableRowLinear(nn.Module):
    """The row layer with grads (a training fork): ``reduce_results=False`` leaves the all-reduce, and
    under ``skip_bias_add`` the bias, to the caller."""

    def __init__(self, input_size: int, output_size: int, bias: bool = True, skip_bias_add: bool = False,
                 reduce_results: bool = True):
        super().__init__()
        group = get_tp_group()
        self.tp_rank, self.tp_size = dist.get_rank(group), dist.get_world_size(group)
        self.skip_bias_add, self.reduce_results = skip_bias_add, reduce_results
        self.weight = nn.Parameter(torch.randn(output_size, _divide(input_size, self.tp_size)))
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, input_):
        bias = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output = F.linear(input_, self.weight, bias)
        if self.reduce_results:
            output = _AllReduceSum.apply(output)
        return output, (self.bias if self.skip_bias_add else None)
