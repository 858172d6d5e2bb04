"""Row-parallel mutants: a correct master-weight row layer and one bug per subclass.

Each class docstring says the mechanism and the diagnosis tpsim is expected to give.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.mutants._ops import reduce_from_region

__all__ = [
    "CorrectRow",
    "RowBiasBeforeReduce",
    "RowBiasDivided",
    "RowBiasRank0Only",
    "RowFlattenNoRestore",
    "RowHalfPrecisionReduce",
    "RowNoReduceWithoutBias",
    "RowReduceFloat32",
    "RowReduceStridedView",
    "RowReduceTwice",
    "RowWeightData",
]


class CorrectRow(nn.Module):
    """The correct base: ``(in_features, out_features, bias, master_weight, *, group)``; weight
    ``[out, in/ws]`` sliced from the master, zero bias ``[out]`` (full on every rank), sharded input,
    summands all-reduced, bias added once after the reduction; output reduced (replicated)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *, group: Any = None):
        super().__init__()
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world_size, self.rank = ws, rank
        if in_features % ws:
            raise ValueError(f"in_features={in_features} is not divisible by world_size={ws}")
        self.weight = nn.Parameter(master_weight.chunk(ws, dim=1)[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=master_weight.dtype)) if bias else None

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(y, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x, self.weight))
        return y + self.bias if self.bias is not None else y


class RowBiasBeforeReduce(CorrectRow):
    """The skill's row layer: adds the full bias to its summand and returns it for the caller's
    all-reduce (output ``partial``), so the reduced output holds ``ws * bias`` (also seen in
    Wenyueh/MinivLLM #80 and gpt-neox #962: a row bias added on every rank).
    Diagnosis: ``bias-duplication``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowBiasRank0Only(CorrectRow):
    """Adds the bias before the reduction on rank 0 only (the skill's first "solution"): the output
    is right, but only rank 0's bias gets a gradient, so the replicas drift apart in training.
    Diagnosis: ``bias-grad-rank0-only``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.bias is not None and self.rank == 0:
            y = y + self.bias
        return self.reduce(y)


class RowBiasDivided(CorrectRow):
    """Adds ``bias / ws`` on every rank before the reduction (the skill's second "solution"): the
    output is right, but every rank's bias grad is ``1/ws`` of the dense one.
    Diagnosis: ``grad-scaled``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.bias is not None:
            y = y + self.bias / self.world_size
        return self.reduce(y)


class RowNoReduceWithoutBias(CorrectRow):
    """The all-reduce sits inside the ``if self.bias is not None`` branch, so a bias-free layer
    returns each rank's summand. Visible only with ``bias=False``. Diagnosis: ``missing-reduction``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.bias is not None:
            y = self.reduce(y) + self.bias
        return y


class RowHalfPrecisionReduce(CorrectRow):
    """"Compresses" the all-reduce by sending the summands in float16 and casting back: a float32 or
    float64 layer silently computes its output to half precision. Diagnosis: ``precision-loss``."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return y  # nothing to communicate
        return reduce_from_region(y.to(torch.float16), self.group).to(y.dtype)


class RowFlattenNoRestore(CorrectRow):
    """Flattens the leading dims for one 2-D GEMM and forgets to restore them: a ``[b, s, in/ws]``
    input gives ``[b*s, out]``, a vector gives ``[1, out]``. Diagnosis: ``shape-error``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x.reshape(-1, x.shape[-1]), self.weight))
        return y + self.bias if self.bias is not None else y


class RowReduceTwice(CorrectRow):
    """All-reduces its summands, and a wrapper written for a layer that returns partial sums reduces
    them again (Megatron's ``reduce_from_tensor_model_parallel_region`` inside the layer plus the
    caller's ``all_reduce``): the output is ``ws * x W^T + bias``. Diagnosis: ``double-reduction``."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(reduce_from_region(y, self.group), self.group)


class RowWeightData(CorrectRow):
    """Multiplies by ``self.weight.data`` (a habit from code that casts or views the weight "without
    autograd overhead"): the output and the input grad are right, but the weight never receives a
    gradient, so it never trains. Diagnosis: ``grad-missing``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x, self.weight.data))
        return y + self.bias if self.bias is not None else y


class RowReduceFloat32(CorrectRow):
    """Upcasts its summands (and the bias) to float32 "for an accurate all-reduce" and forgets to cast
    the result back: right for float32 layers, but a float16, bfloat16 or float64 layer returns
    float32. Diagnosis: ``wrong-dtype``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x, self.weight).float())
        return y + self.bias.float() if self.bias is not None else y



class _ReduceInPadded(torch.autograd.Function):
    """All-reduce forward into the first ``out`` columns of a padded buffer; identity backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, group: Any) -> torch.Tensor:
        out = y.shape[-1]
        big = y.new_zeros(*y.shape[:-1], out + 1)  # one spare column (a fused bias slot, an alignment pad)
        big[..., :out] = y
        dist.all_reduce(big[..., :out], group=group)  # a view that is not dense
        return big[..., :out].clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class RowReduceStridedView(CorrectRow):
    """Reduces its summands in place in a view of a padded buffer (``all_reduce(big[..., :out])``, a
    buffer with a spare column for a fused bias or alignment). The view is not dense: plain gloo
    reduces the first ``numel`` elements of the storage instead of the view's (wrong numbers past the
    first row), NCCL refuses it, and only a backend that reads the view element by element gets it
    right. Diagnosis: ``collective-on-strided-view``."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return _ReduceInPadded.apply(y, self.group)
