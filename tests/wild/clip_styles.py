"""Gradient clipping by global norm in the early Megatron / fairscale style, on a pre-norm MLP block.

The block: a LayerNorm (replicated weight and bias, its input whole on every rank), a column-parallel
``fc1`` (weight and bias ``[ffn/tp, ...]``), GELU, a row-parallel ``fc2`` (weight ``[hidden, ffn/tp]``)
whose replicated bias is added after the all-reduce. As those libraries do, the sharded parameters
carry ``param.model_parallel = True``.

The clip (``clip_grad_norm(parameters, max_norm, *, group)``) sums every counted grad's squared norm
on the rank, all-reduces that sum over the tp group, and scales every grad by
``max_norm / (total + 1e-6)`` when that is below one; it returns the total norm. A replicated
parameter is the same on every rank, so it must be counted on one rank only:

- :func:`clip_grad_norm` counts a parameter when it is ``model_parallel`` or this is tp rank 0:
  correct;
- :func:`clip_grad_norm_every_rank` counts every parameter on every rank, so the LayerNorm's weight
  and bias and ``fc2``'s bias are counted tp times: the norm is
  ``sqrt(dense^2 + (tp-1) * replicated^2)`` and the grads are clipped too hard
  (``training-equivalence: norm-counts-replicas``).

Written fresh for tpsim's wild tests; not a copy of any library's code.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import ModuleVariant


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class PreNormMLP(nn.Module):
    """``fc2(gelu(fc1(norm(x))))`` with ``fc1`` column- and ``fc2`` row-parallel over ``group``."""

    def __init__(self, hidden: int, ffn: int, *, group: Any, dtype: Any) -> None:
        super().__init__()
        tp = dist.get_world_size(group)
        if ffn % tp:
            raise ValueError(f"ffn={ffn} is not divisible by the model parallel size {tp}")
        self.group = group
        self.norm = nn.LayerNorm(hidden, dtype=dtype)
        self.fc1 = nn.Linear(hidden, ffn // tp, dtype=dtype)
        self.fc2 = nn.Linear(ffn // tp, hidden, dtype=dtype)
        for p in (self.fc1.weight, self.fc1.bias, self.fc2.weight):
            p.model_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Copy.apply(self.norm(x), self.group)
        h = F.gelu(self.fc1(h))
        return _Reduce.apply(F.linear(h, self.fc2.weight), self.group) + self.fc2.bias


def _clip(parameters: Any, max_norm: float, group: Any, counted: Any) -> float:
    params = [p for p in parameters if p.grad is not None]
    total = 0.0
    for p in params:
        if counted(p):
            total += float(p.grad.detach().norm(2)) ** 2
    summed = torch.tensor([total], dtype=torch.float64)
    dist.all_reduce(summed, group=group)
    total_norm = math.sqrt(float(summed[0]))
    coef = max_norm / (total_norm + 1e-6)
    if coef < 1:
        for p in params:
            p.grad.detach().mul_(coef)
    return total_norm


def clip_grad_norm(parameters: Any, max_norm: float, *, group: Any) -> float:
    """Clip to a total norm of ``max_norm``, counting a replicated parameter on tp rank 0 only."""
    rank = dist.get_rank(group)
    return _clip(parameters, max_norm, group, lambda p: getattr(p, "model_parallel", False) or rank == 0)


def clip_grad_norm_every_rank(parameters: Any, max_norm: float, *, group: Any) -> float:
    """The same clip without the duplicate filter: every parameter counted on every rank."""
    return _clip(parameters, max_norm, group, lambda p: True)


def _build(hidden: int, ffn: int, *, group: Any, dtype: Any) -> nn.Module:
    return PreNormMLP(hidden, ffn, group=group, dtype=dtype)


#: Trained with the correct clip: passes.
pre_norm_mlp_clipped = ModuleVariant(name="pre_norm_mlp_clipped", build=_build, sizes=("hidden", "ffn"),
                                     clip=clip_grad_norm)
#: Trained with the clip that counts replicated parameters once per rank: norm-counts-replicas.
pre_norm_mlp_clip_counts_replicas = ModuleVariant(name="pre_norm_mlp_clip_counts_replicas", build=_build,
                                                  sizes=("hidden", "ffn"), clip=clip_grad_norm_every_rank)
