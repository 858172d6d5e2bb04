"""A row-parallel layer in picotron's style: its tp group and rank come from the module-global
manager of ``picotron_state`` (declared as a variant whose builder sets that state, as a training
script's set-up does once per process)."""

from __future__ import annotations

import picotron_state as pgm  # noqa: E402 - beside this file
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec, Variant


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        x = x.contiguous()
        dist.all_reduce(x, group=pgm.process_group_manager.tp_group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = True):
        super().__init__()
        tp = pgm.process_group_manager.tp_world_size
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by tp={tp}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _Reduce.apply(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias


def _build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
    pgm.setup(group)  # the training script's set-up, once per process
    return RowParallelLinear(in_features, out_features, bias).to(dtype)


row = Variant(name="picotron_row", kind="row", build=_build,
              params=(ParamSpec("weight", "weight", Shard(1)), ParamSpec("bias", "bias", Replicate())))
