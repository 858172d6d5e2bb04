"""A tensor-parallel layer written the way fairscale and Megatron keep their parallel state.

Written fresh for tpsim's tests (no library code): the tensor-parallel group lives in a module
global, set once per process by an init function that synchronises the ranks (a barrier inside
it), refused a second time ("already initialized"), and read by the layer at forward time. In a
real job every rank is a process with its own copy of these globals; on tpsim's in-process
backend they are shared unless the module is declared rank-local.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

_TENSOR_PARALLEL_GROUP: dist.ProcessGroup | None = None
_TENSOR_PARALLEL_RANKS: list[int] | None = None


def initialize_tensor_parallel(tp_size: int) -> None:
    """Split the world into consecutive groups of ``tp_size`` ranks; remember this rank's group."""
    global _TENSOR_PARALLEL_GROUP, _TENSOR_PARALLEL_RANKS
    if _TENSOR_PARALLEL_GROUP is not None:
        raise RuntimeError("tensor parallel group is already initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    for start in range(0, world, tp_size):
        ranks = list(range(start, start + tp_size))
        group = dist.new_group(ranks)  # every rank creates every group, as torch requires
        if rank in ranks:
            _TENSOR_PARALLEL_GROUP = group
            _TENSOR_PARALLEL_RANKS = ranks
    dist.barrier()


def initialize_tensor_parallel_unguarded(tp_size: int) -> None:
    """The same without the "already initialized" check (some codebases re-initialise freely)."""
    global _TENSOR_PARALLEL_GROUP, _TENSOR_PARALLEL_RANKS
    world, rank = dist.get_world_size(), dist.get_rank()
    for start in range(0, world, tp_size):
        ranks = list(range(start, start + tp_size))
        group = dist.new_group(ranks)
        if rank in ranks:
            _TENSOR_PARALLEL_GROUP = group
            _TENSOR_PARALLEL_RANKS = ranks
    dist.barrier()


def destroy_tensor_parallel() -> None:
    """Forget the group (what a training script does at exit; worker processes are reused)."""
    global _TENSOR_PARALLEL_GROUP, _TENSOR_PARALLEL_RANKS
    _TENSOR_PARALLEL_GROUP = None
    _TENSOR_PARALLEL_RANKS = None


def get_tensor_parallel_group() -> dist.ProcessGroup:
    if _TENSOR_PARALLEL_GROUP is None:
        raise RuntimeError("tensor parallel group is not initialized")
    return _TENSOR_PARALLEL_GROUP


class _GatherFromTensorParallel(torch.autograd.Function):
    """Forward: all-gather the last dim over the tp group; backward: keep this rank's slice."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        group = get_tensor_parallel_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        ctx.rank, ctx.width = rank, x.shape[-1]
        parts = [torch.empty_like(x) for _ in range(size)]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad[..., ctx.rank * ctx.width:(ctx.rank + 1) * ctx.width].contiguous()


class ColumnParallelLinear(nn.Module):
    """``y = x Wᵀ + b`` with W's rows split over the tp group read from the module global."""

    def __init__(self, in_features: int, out_features: int, master_weight: torch.Tensor,
                 master_bias: torch.Tensor) -> None:
        super().__init__()
        group = get_tensor_parallel_group()
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        rows = out_features // size
        self.weight = nn.Parameter(master_weight[rank * rows:(rank + 1) * rows].clone())
        self.bias = nn.Parameter(master_bias[rank * rows:(rank + 1) * rows].clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _GatherFromTensorParallel.apply(nn.functional.linear(x, self.weight, self.bias))
