"""Layers and modules in the style of the defects whose mechanism names were not true, and the true
mechanisms beside them (``tests/test_claims.py``).

Each docstring says what the code does wrong, the name tpsim once gave it that was not true, and the
name (or ``mismatch``) it must give now. A file target: gloo workers import it by path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import ModuleVariant
from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec, Variant


def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Sum over ``group`` in forward, identity in backward (Megatron's reduce_from_tensor_parallel_region)."""
    return _AllReduce.apply(x, group)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Broadcast(torch.autograd.Function):
    """Rank 0's tensor on every rank in forward (a broadcast where an all-reduce belongs); the grad as is."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.broadcast(out, src=dist.get_global_rank(group, 0) if group is not None else 0, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyToRegion(torch.autograd.Function):
    """Identity forward; all-reduce of the grad in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _GatherFeatures(torch.autograd.Function):
    """All-gather along the last dim forward; this rank's slice of the grad backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ws = dist.get_world_size(group)
        ctx.rank, ctx.ws = dist.get_rank(group), ws
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad.chunk(ctx.ws, dim=-1)[ctx.rank].contiguous(), None


# --- single layers (the linear family) ------------------------------------------------------------


class _Row(nn.Module):
    """A row-parallel linear layer in the master-weight convention: ``weight [out, in/tp]``, a full bias."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *,
                 group: Any = None) -> None:
        super().__init__()
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        if in_features % ws:
            raise ValueError(f"in_features={in_features} is not divisible by world_size={ws}")
        self.weight = nn.Parameter(master_weight.chunk(ws, dim=1)[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=master_weight.dtype)) if bias else None

    def summand(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _all_reduce(self.summand(x), self.group)
        return y + self.bias if self.bias is not None else y


class BroadcastInsteadOfReduceRow(_Row):
    """Broadcasts rank 0's summand where the all-reduce belongs: every rank holds the same values,
    ``x_0 W_0ᵀ`` — rank 0's own summand, the others' not. Once named ``missing-reduction`` (rank 0 alone
    holds its summand); now ``mismatch``: no rank but rank 0 holds its own summand."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Broadcast.apply(self.summand(x), self.group)
        return y + self.bias if self.bias is not None else y


class NoReduceRow(_Row):
    """The true missing reduction: every rank returns its own summand (no all-reduce): ``missing-reduction``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.summand(x)
        return y + self.bias if self.bias is not None else y


class BiasTwiceRow(_Row):
    """Reduces right, then adds its bias twice (the layer adds it, and so does the code it was copied
    from, which expected a bias-free layer): off by one bias on any number of ranks. At tp 2 that is
    ``(tp-1) x bias``: once named ``bias-duplication``; the same case on one rank fails too, so now
    ``mismatch``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _all_reduce(self.summand(x), self.group)
        return y + self.bias + self.bias if self.bias is not None else y


class BiasBeforeReduceRow(_Row):
    """The true bias duplication: every rank adds the full bias to its summand, then all-reduces:
    ``bias-duplication``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.summand(x)
        return _all_reduce(y + self.bias if self.bias is not None else y, self.group)


class _Column(nn.Module):
    """A column-parallel linear layer in the master-weight convention: ``weight [out/tp, in]``, its bias shard."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *,
                 group: Any = None) -> None:
        super().__init__()
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={ws}")
        self.weight = nn.Parameter(master_weight.chunk(ws, dim=0)[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features // ws, dtype=master_weight.dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias)


class EarlyBfloat16Column(_Column):
    """Casts its input and weight to bfloat16 before the product (a kernel written for bfloat16, used in
    every dtype) and the result back: every grad is the dense one rounded through bfloat16, element by
    element differently — 1.005 x the dense grad on average, no uniform factor. Once named ``grad-scaled``
    (a factor fitted within a float16 bound); now never a factor."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToRegion.apply(x, self.group)
        y = F.linear(x.to(torch.bfloat16), self.weight.to(torch.bfloat16)).to(x.dtype)
        return y + self.bias if self.bias is not None else y


def _linear_variant(cls: type, kind: str, name: str) -> Variant:
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, master_weight: Any, **_: Any) -> nn.Module:
        return cls(in_features, out_features, bias, master_weight.clone(), group=group)

    weight = Shard(0) if kind == "column" else Shard(1)
    params = (ParamSpec("weight", "weight", weight, load=False),
              ParamSpec("bias", "bias", Shard(0) if kind == "column" else Replicate()))
    return Variant(name=name, kind=kind, build=build, params=params, description=(cls.__doc__ or "").split("\n")[0])


broadcast_row = _linear_variant(BroadcastInsteadOfReduceRow, "row", "broadcast_row")
no_reduce_row = _linear_variant(NoReduceRow, "row", "no_reduce_row")
early_bf16_column = _linear_variant(EarlyBfloat16Column, "column", "early_bf16_column")
bias_twice_row = _linear_variant(BiasTwiceRow, "row", "bias_twice_row")
bias_before_reduce_row = _linear_variant(BiasBeforeReduceRow, "row", "bias_before_reduce_row")


# --- whole modules (the module family) -------------------------------------------------------------


class DoubledColumn(nn.Module):
    """A column-parallel layer that gathers its output and returns it twice over (``y + y``, a residual
    added to itself): 2x the dense ``nn.Linear`` on any number of ranks, one rank included. At tp 2 its
    factor is the tp size: once named ``double-reduction``; a gather reduces nothing and the same case on
    one rank fails too, so now ``mismatch``."""

    def __init__(self, hidden: int, out: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        ws = dist.get_world_size(process_group)
        self.weight = nn.Parameter(torch.zeros(out // ws, hidden))
        self.bias = nn.Parameter(torch.zeros(out // ws))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _GatherFeatures.apply(F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias), self.group)
        return y + y


class ReducedTwiceRow(nn.Module):
    """The true double reduction: a row-parallel layer that all-reduces its summands, then all-reduces the
    sum again (its caller's reduction, kept after the layer learned to reduce): ``double-reduction``."""

    def __init__(self, hidden: int, out: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        ws = dist.get_world_size(process_group)
        self.weight = nn.Parameter(torch.zeros(out, hidden // ws))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToRegion.apply(x, self.group)  # every rank's grad of its slice, summed: the whole input grad
        local = x.chunk(dist.get_world_size(self.group), dim=-1)[dist.get_rank(self.group)]
        return _all_reduce(_all_reduce(F.linear(local, self.weight), self.group), self.group)


def _dense_linear(hidden: int, out: int, *, dtype: torch.dtype, bias: bool) -> nn.Module:
    return nn.Linear(hidden, out, bias=bias).to(dtype)


def _dense_with_bias(hidden: int, out: int, *, dtype: torch.dtype) -> nn.Module:
    return _dense_linear(hidden, out, dtype=dtype, bias=True)


def _dense_without_bias(hidden: int, out: int, *, dtype: torch.dtype) -> nn.Module:
    return _dense_linear(hidden, out, dtype=dtype, bias=False)


def _doubled_column(hidden: int, out: int, *, group: Any, dtype: torch.dtype) -> nn.Module:
    return DoubledColumn(hidden, out, process_group=group).to(dtype)


def _reduced_twice_row(hidden: int, out: int, *, group: Any, dtype: torch.dtype) -> nn.Module:
    return ReducedTwiceRow(hidden, out, process_group=group).to(dtype)


doubled_column = ModuleVariant(name="doubled_column", build=_doubled_column, dense=_dense_with_bias,
                               sizes=("hidden", "out"))
reduced_twice_row = ModuleVariant(name="reduced_twice_row", build=_reduced_twice_row, dense=_dense_without_bias,
                                  sizes=("hidden", "out"))


class _ColumnLinear(nn.Module):
    """Column-parallel: ``weight [ffn/tp, hidden]`` and its bias shard; the input's grad all-reduced."""

    def __init__(self, hidden: int, ffn: int, group: Any, bias: bool = True) -> None:
        super().__init__()
        self.group = group
        ws = dist.get_world_size(group)
        self.weight = nn.Parameter(torch.zeros(ffn // ws, hidden))
        self.bias = nn.Parameter(torch.zeros(ffn // ws)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias)


class _RowLinearNoReduce(nn.Module):
    """Row-parallel without its own reduction (Megatron's ``reduce_results=False``): the caller reduces.
    ``returns_bias``: it returns ``(summand, bias)`` for the caller to add (``skip_bias_add``)."""

    def __init__(self, ffn: int, hidden: int, group: Any, bias: bool, returns_bias: bool = False) -> None:
        super().__init__()
        ws = dist.get_world_size(group)
        self.weight = nn.Parameter(torch.zeros(hidden, ffn // ws))
        self.bias = nn.Parameter(torch.zeros(hidden)) if bias else None
        self.returns_bias = returns_bias

    def forward(self, x: torch.Tensor) -> Any:
        if self.returns_bias:
            return F.linear(x, self.weight), self.bias
        return F.linear(x, self.weight, self.bias)


class DeferredReduceMLP(nn.Module):
    """The down projection does not reduce (the MLP does, once, after it) but adds its bias on every
    rank: the MLP's all-reduce adds it tp times. Once ``mismatch``; now ``fc2: bias-duplication``."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        self.fc1 = _ColumnLinear(hidden, ffn, process_group)
        self.fc2 = _RowLinearNoReduce(ffn, hidden, process_group, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.fc2(F.gelu(self.fc1(x))), self.group)


class ParentBiasMLP(nn.Module):
    """The column layer adds its (sharded) bias, the row layer has none, and the MLP adds a bias of its own
    to the row layer's summand before its all-reduce: the reduction adds the MLP's bias tp times. Once
    ``mismatch`` (or ``double-reduction``); now ``bias-duplication``, named at the module that adds it
    (the MLP itself)."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        self.fc1 = _ColumnLinear(hidden, ffn, process_group)
        self.fc2 = _RowLinearNoReduce(ffn, hidden, process_group, bias=False)
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _all_reduce(self.fc2(F.gelu(self.fc1(x))) + self.bias, self.group)


class SkipBiasMLP(nn.Module):
    """The down projection returns ``(summand, bias)`` for its caller to add after the reduction
    (``skip_bias_add``); the MLP adds the bias first, then all-reduces: ``fc2: bias-duplication`` (the
    bias is fc2's), though fc2's own output is a right summand."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        self.fc1 = _ColumnLinear(hidden, ffn, process_group)
        self.fc2 = _RowLinearNoReduce(ffn, hidden, process_group, bias=True, returns_bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y, bias = self.fc2(F.gelu(self.fc1(x)))
        return _all_reduce(y + bias, self.group)


class _Norm(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class DeferredReduceBlock(nn.Module):
    """A block whose MLP is :class:`DeferredReduceMLP` (the reduction is the MLP's, the bias fc2's on every
    rank), then a residual and a norm: nothing after the reduction is a bias multiple any more, yet the
    bias was added before a parent's reduction: ``mlp.fc2: bias-duplication``."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.mlp = DeferredReduceMLP(hidden, ffn, process_group=process_group)
        self.norm = _Norm(hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.mlp(x))


class NoReduceBiasMLP(nn.Module):
    """The down projection adds its bias on every rank and nothing reduces after it: each rank holds its
    own summand plus the bias. ``fc2: missing-reduction``, not a bias duplication (no reduction adds it)."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.fc1 = _ColumnLinear(hidden, ffn, process_group)
        self.fc2 = _RowLinearNoReduce(ffn, hidden, process_group, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))



class HalfPrecisionPathRow(_Row):
    """A fast path for bfloat16 and float16 that adds the bias on every rank before the all-reduce; the
    float32/float64 path is right. In bfloat16 the output is off by (tp-1) x bias, a pattern that float64
    cannot confirm (the same case in float64 passes): reported as ``mismatch`` with the facts, not
    ``bias-duplication``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.summand(x)
        if self.bias is None:
            return _all_reduce(y, self.group)
        if y.dtype in (torch.bfloat16, torch.float16):
            return _all_reduce(y + self.bias, self.group)
        return _all_reduce(y, self.group) + self.bias


half_precision_path_row = _linear_variant(HalfPrecisionPathRow, "row", "half_precision_path_row")
