"""Minimal autograd-aware collectives for the mutant layers (each mutant changes one of them).

Kept separate from :mod:`tpsim.layers` on purpose: a mutant must be able to get one collective
wrong without touching the real layer core.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["copy_to_region", "gather_from_region", "reduce_from_region"]


class _Copy(torch.autograd.Function):
    """Identity forward; all-reduce of the grad in backward (``average``: divide by world size)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, average: bool) -> torch.Tensor:
        ctx.group, ctx.average = group, average
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        if ctx.average:
            grad = grad / dist.get_world_size(ctx.group)
        return grad, None, None


class _Reduce(torch.autograd.Function):
    """All-reduce (sum) forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = x.contiguous().clone()
        dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _Gather(torch.autograd.Function):
    """All-gather and concatenate along ``dim`` forward; keep this rank's chunk of the grad backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ws = dist.get_world_size(group)
        ctx.group, ctx.dim, ctx.ws, ctx.rank = group, dim, ws, dist.get_rank(group)
        parts = [torch.empty_like(x) for _ in range(ws)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return grad.chunk(ctx.ws, dim=ctx.dim)[ctx.rank].contiguous(), None, None


def copy_to_region(x: torch.Tensor, group: Any, *, average: bool = False) -> torch.Tensor:
    """Forward: identity. Backward: all-reduce the grad (the mean instead of the sum with ``average``)."""
    return _Copy.apply(x, group, average)


def reduce_from_region(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Forward: all-reduce (sum). Backward: identity."""
    return _Reduce.apply(x, group)


def gather_from_region(x: torch.Tensor, group: Any, dim: int = -1) -> torch.Tensor:
    """Forward: all-gather along ``dim``. Backward: this rank's chunk of the grad along ``dim``."""
    return _Gather.apply(x, group, dim)
