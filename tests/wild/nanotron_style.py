"""Fresh layers in nanotron's style, checked with no adapter code.

nanotron passes the tp group as ``pg`` and keeps a row layer's bias on tp rank 0 only: rank 0 adds
it before the all-reduce, so the sum holds it once; the other ranks build ``nn.Linear`` with
``bias=False`` (their ``bias`` is None).

- ``Rank0BiasRowLinear``: that row layer (correct);
- ``EveryRankBiasRowLinear``: every rank keeps the bias and adds it before the all-reduce (the sum
  holds it tp-size times: ``bias-duplication``);
- ``Rank0BiasBadGradRowLinear``: rank 0's bias is added in a way whose backward scales its grad by
  the tp size (the forward is right, the bias grad is not);
- ``Rank0BiasAfterReduceRowLinear``: rank 0 adds its bias *after* the all-reduce (only rank 0's
  output has it);
- ``MixedBiasRowLinear``: rank 0 adds its bias before the all-reduce, and the last rank builds an
  unused one too (the ranks disagree on who holds it);
- ``TensorParallelColumnLinear``, ``TensorParallelRowLinear``: nanotron's constructors with the
  required ``mode`` (``TensorParallelLinearMode.ALL_REDUCE`` or ``REDUCE_SCATTER``: sequence
  parallel, tensors ``[seq, batch, hidden]``, the sequence dim 0);
- ``SplitBackwardColumnLinear``: under REDUCE_SCATTER, its all-gather's backward keeps this rank's
  chunk of the grad instead of reduce-scattering it.
"""

from __future__ import annotations

from enum import Enum, auto

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _AllReduceSum(torch.autograd.Function):
    """Forward: all-reduce (sum) over ``pg``. Backward: identity (nanotron's differentiable_all_reduce_sum)."""

    @staticmethod
    def forward(ctx, x, pg):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=pg)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScaledGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the grad by ``factor`` (a wrong backward)."""

    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None


class Rank0BiasRowLinear(nn.Linear):
    """nanotron's row layer: weight ``[out, in/ws]``; the bias lives on tp rank 0 only."""

    def __init__(self, in_features: int, out_features: int, pg, bias: bool = True):
        ws = pg.size()
        if in_features % ws:
            raise ValueError(f"in_features={in_features} is not divisible by the tp size {ws}")
        self.pg = pg
        # No need to shard the bias: only rank 0 has it, and the all-reduce adds it once.
        super().__init__(in_features // ws, out_features, bias=bias and dist.get_rank(pg) == 0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(F.linear(x, self.weight, self.bias), self.pg)


class EveryRankBiasRowLinear(nn.Linear):
    """Bug: every rank keeps the bias and adds it before the all-reduce."""

    def __init__(self, in_features: int, out_features: int, pg, bias: bool = True):
        ws = pg.size()
        if in_features % ws:
            raise ValueError(f"in_features={in_features} is not divisible by the tp size {ws}")
        self.pg = pg
        super().__init__(in_features // ws, out_features, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _AllReduceSum.apply(F.linear(x, self.weight, self.bias), self.pg)


class Rank0BiasBadGradRowLinear(Rank0BiasRowLinear):
    """Bug: rank 0's bias grad comes back multiplied by the tp size (the forward is right)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else _ScaledGrad.apply(self.bias, self.pg.size())
        return _AllReduceSum.apply(F.linear(x, self.weight, bias), self.pg)


class Rank0BiasAfterReduceRowLinear(Rank0BiasRowLinear):
    """Bug: rank 0 adds its bias after the all-reduce: the other ranks' outputs lack it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _AllReduceSum.apply(F.linear(x, self.weight), self.pg)
        return out if self.bias is None else out + self.bias



class MixedBiasRowLinear(Rank0BiasRowLinear):
    """Bug: the last rank builds a bias it never uses (held by ranks 0 and ws-1, not by the others)."""

    def __init__(self, in_features: int, out_features: int, pg, bias: bool = True):
        super().__init__(in_features, out_features, pg, bias=bias)
        if bias and pg.size() > 2 and dist.get_rank(pg) == pg.size() - 1:
            self.bias = nn.Parameter(torch.zeros(out_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = self.bias if dist.get_rank(self.pg) == 0 else None
        return _AllReduceSum.apply(F.linear(x, self.weight, bias), self.pg)



# --- nanotron's mode: ALL_REDUCE, or REDUCE_SCATTER (sequence parallel, [seq, batch, hidden]) ------


class TensorParallelLinearMode(Enum):
    ALL_REDUCE = auto()
    REDUCE_SCATTER = auto()


class _Identity(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (nanotron's differentiable_identity)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


def _gather0(x: torch.Tensor, pg) -> torch.Tensor:
    pieces = [torch.empty_like(x) for _ in range(pg.size())]
    dist.all_gather(pieces, x.contiguous(), group=pg)
    return torch.cat(pieces, dim=0)


def _reduce_scatter0(x: torch.Tensor, pg) -> torch.Tensor:
    if x.shape[0] % pg.size():
        raise ValueError(f"the sequence dim {x.shape[0]} is not divisible by the tp size {pg.size()}")
    x = x.contiguous().clone()
    dist.all_reduce(x, group=pg)  # gloo has no reduce-scatter: reduce, then keep this rank's chunk
    return x.chunk(pg.size(), dim=0)[dist.get_rank(pg)].contiguous()


class _AllGather(torch.autograd.Function):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0 (differentiable_all_gather)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _gather0(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter0(grad, ctx.pg), None


class _ReduceScatter(torch.autograd.Function):
    """Forward: reduce-scatter along dim 0. Backward: all-gather along dim 0 (differentiable_reduce_scatter_sum)."""

    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return _reduce_scatter0(x, pg)

    @staticmethod
    def backward(ctx, grad):
        return _gather0(grad, ctx.pg), None


class _AllGatherSplitBackward(_AllGather):
    """Bug: the backward keeps this rank's chunk of the grad instead of reduce-scattering it."""

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.pg.size(), dim=0)[dist.get_rank(ctx.pg)].contiguous(), None


class TensorParallelColumnLinear(nn.Linear):
    """nanotron's column layer: weight ``[out/ws, in]``; ALL_REDUCE: replicated input, REDUCE_SCATTER:
    a sequence-sharded input (dim 0) gathered before the matmul."""

    _gather = _AllGather

    def __init__(self, in_features: int, out_features: int, pg, mode: TensorParallelLinearMode, bias: bool = True,
                 device=None, dtype=None, async_communication: bool = False, contiguous_chunks=None):
        if out_features % pg.size():
            raise ValueError(f"out_features={out_features} is not divisible by the tp size {pg.size()}")
        self.pg, self.mode = pg, mode
        super().__init__(in_features, out_features // pg.size(), bias=bias, device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.mode is TensorParallelLinearMode.ALL_REDUCE:
            x = _Identity.apply(x, self.pg)
        else:
            x = self._gather.apply(x, self.pg)
        return F.linear(x, self.weight, self.bias)


class TensorParallelRowLinear(nn.Linear):
    """nanotron's row layer: weight ``[out, in/ws]``, the bias on tp rank 0 only; ALL_REDUCE: all-reduced
    output, REDUCE_SCATTER: reduce-scattered along the sequence (dim 0)."""

    def __init__(self, in_features: int, out_features: int, pg, mode: TensorParallelLinearMode, bias: bool = True,
                 device=None, dtype=None, async_communication: bool = False, contiguous_chunks=None):
        if in_features % pg.size():
            raise ValueError(f"in_features={in_features} is not divisible by the tp size {pg.size()}")
        self.pg, self.mode = pg, mode
        super().__init__(in_features // pg.size(), out_features, bias=bias and dist.get_rank(pg) == 0,
                         device=device, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.mode is TensorParallelLinearMode.ALL_REDUCE:
            return _AllReduceSum.apply(out, self.pg)
        return _ReduceScatter.apply(out, self.pg)


class SplitBackwardColumnLinear(TensorParallelColumnLinear):
    """Bug (REDUCE_SCATTER only): the all-gather's backward keeps this rank's chunk, so the input grad
    misses the other ranks' contributions."""

    _gather = _AllGatherSplitBackward

# --- the same layers declared as variants (a Variant names where each parameter lives) ----------

from tpsim.placement import Replicate, Shard  # noqa: E402 - the declarations below only
from tpsim.variant import ParamSpec, Variant  # noqa: E402


def _builder(cls):
    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        return cls(in_features, out_features, group, bias=bias).to(dtype)  # its own init is overwritten

    return build


def _declared(name, cls, held_by):
    return Variant(name=name, kind="row", build=_builder(cls), output="reduced",
                   params=(ParamSpec("weight", "weight", Shard(1)),
                           ParamSpec("bias", "bias", Replicate(), held_by=held_by)))


#: The bias declared on tp rank 0 only.
rank0_row = _declared("rank0_row", Rank0BiasRowLinear, "rank0")
rank0_bad_grad_row = _declared("rank0_bad_grad_row", Rank0BiasBadGradRowLinear, "rank0")
#: Declared on rank 0 only, but every rank holds one: the declaration does not fit the layer.
every_rank_declared_rank0 = _declared("every_rank_declared_rank0", EveryRankBiasRowLinear, "rank0")
#: The bias declared on every rank (the default), but only rank 0 holds one.
rank0_declared_all = _declared("rank0_declared_all", Rank0BiasRowLinear, "all")
