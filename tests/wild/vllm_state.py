"""vLLM's style of parallel state: a module-global tp ``GroupCoordinator`` set once per process by
``initialize_model_parallel`` and read by every layer through ``get_tp_group()``."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP = None


class _AllReduce(torch.autograd.Function):
    # vLLM's all-reduce is an inference-only custom op; here it is differentiable, so that a layer
    # built on it can also be trained (tpsim checks its grads too).
    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class GroupCoordinator:
    def __init__(self, group) -> None:
        self.device_group = group
        self.world_size = dist.get_world_size(group)
        self.rank_in_group = dist.get_rank(group)

    def all_reduce(self, input_: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return input_
        return _AllReduce.apply(input_, self.device_group)


def initialize_model_parallel(group) -> None:
    global _TP
    _TP = GroupCoordinator(group)


def get_tp_group() -> GroupCoordinator:
    if _TP is None:
        raise RuntimeError("tensor model parallel group is not initialized")
    return _TP


def get_tensor_model_parallel_world_size() -> int:
    return get_tp_group().world_size


def get_tensor_model_parallel_rank() -> int:
    return get_tp_group().rank_in_group


def tensor_model_parallel_all_reduce(input_: torch.Tensor) -> torch.Tensor:
    return get_tp_group().all_reduce(input_)
