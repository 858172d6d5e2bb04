"""Layers in the "master-weight" convention, re-created for tpsim to check.

The convention (as an agent skill teaches it): the constructor is
``(in_features, out_features, bias, master_weight)``; each layer reads its rank and the world size
from the default process group and keeps its slice of the full ``[out, in]`` master weight
(column: rows ``[out/ws, in]``, row: columns ``[out, in/ws]``); the bias starts at zero
(column: ``[out/ws]``, row: the full ``[out]`` on every rank). The layers do not reduce the
gradient of a replicated input: the caller does, so the column adapter declares
``input_grad="partial"``.

Three classes:

- ``ColumnParallelLinear`` — correct;
- ``RowParallelLinear`` — correct: all-reduces the summands itself and adds the bias once,
  after the reduction (output ``reduced``);
- ``BuggyRowParallelLinear`` — the convention's pitfall: adds the full bias to its summand and
  leaves the reduction to the caller, so the reduced output holds ``world_size * bias``.
  tpsim names it ``bias-duplication``.

Check the correct pair (the variants below) and the buggy class (a plain class: the CLI detects
the convention from the constructor and the kind from the name)::

    tpsim check examples/skill_convention.py
    tpsim check examples/skill_convention.py:BuggyRowParallelLinear     # exit 1, bias-duplication

The plain classes can be checked with options instead of the declared variants::

    tpsim check examples/skill_convention.py:ColumnParallelLinear --input-grad partial
    tpsim check examples/skill_convention.py:RowParallelLinear --output reduced
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.conventions import variant_from_class


def _check_divides(name: str, size: int, world_size: int) -> None:
    # A ValueError on every rank, before any collective: tpsim's divisibility property wants this.
    if size % world_size:
        raise ValueError(f"{name}={size} is not divisible by world_size={world_size}")


class _SumOverRanks(torch.autograd.Function):
    """Forward: all-reduce (sum) over the default group. Backward: identity — every rank already
    holds the full upstream gradient of the replicated output."""

    @staticmethod
    def forward(ctx, partial: torch.Tensor) -> torch.Tensor:
        total = partial.clone()
        dist.all_reduce(total)
        return total

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class ColumnParallelLinear(nn.Module):
    """Output features sharded: weight ``[out/ws, in]``, bias ``[out/ws]``, output ``[..., out/ws]``."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor):
        super().__init__()
        rank, ws = dist.get_rank(), dist.get_world_size()
        _check_divides("out_features", out_features, ws)
        rows = out_features // ws
        self.weight = nn.Parameter(master_weight[rank * rows : (rank + 1) * rows].clone())
        self.bias = nn.Parameter(torch.zeros(rows, dtype=master_weight.dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """Input features sharded: weight ``[out, in/ws]``, bias ``[out]`` on every rank; takes this
    rank's slice of the input, returns the full (reduced) output with the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor):
        super().__init__()
        rank, ws = dist.get_rank(), dist.get_world_size()
        _check_divides("in_features", in_features, ws)
        cols = in_features // ws
        self.weight = nn.Parameter(master_weight[:, rank * cols : (rank + 1) * cols].clone())
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=master_weight.dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _SumOverRanks.apply(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class BuggyRowParallelLinear(RowParallelLinear):
    """The pitfall: the full bias joins every rank's summand, then the caller all-reduces."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


#: What ``tpsim check examples/skill_convention.py`` checks (the correct pair).
TPSIM_VARIANTS = [
    variant_from_class(ColumnParallelLinear, input_grad="partial", name="skill.ColumnParallelLinear"),
    variant_from_class(RowParallelLinear, output="reduced", name="skill.RowParallelLinear"),
]
