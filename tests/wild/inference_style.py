"""Fresh layers in two libraries' styles, checked with no adapter code.

- ``InferenceRowLinear``: vLLM's inference style: weights without grads, the all-reduce outside
  autograd, a divisibility check by bare ``assert`` (``tpsim check --forward-only``);
- ``PgColumnLinear``: nanotron's style: the tp group passed as ``pg``, a column layer whose
  copy-to-region all-reduces the input grad over ``pg``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class InferenceRowLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, process_group=None):
        super().__init__()
        self.group = process_group
        ws = dist.get_world_size(process_group)
        assert input_size % ws == 0  # vLLM's divide(): stripped by python -O
        self.weight = nn.Parameter(torch.empty(output_size, input_size // ws), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None
        nn.init.normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)  # no autograd: inference only
        return out if self.bias is None else out + self.bias


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, pg):
        ctx.pg = pg
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.pg)
        return grad, None


class PgColumnLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, pg, bias: bool = True):
        super().__init__()
        ws = pg.size()
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by the tp size {ws}")
        self.pg = pg
        self.weight = nn.Parameter(torch.empty(out_features // ws, in_features))
        self.bias = nn.Parameter(torch.zeros(out_features // ws)) if bias else None
        nn.init.normal_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyToRegion.apply(x, self.pg), self.weight, self.bias)
