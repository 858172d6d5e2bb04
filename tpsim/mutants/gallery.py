"""A gallery of published tensor-parallel bugs: one mutant per mechanism seen in public reports.

Each class re-creates, in a few lines of fresh code, the mechanism of a bug that reached users,
and its docstring cites the report. They hide where a world-size-2, contiguous-input,
tp-equals-world test never looks: in tp groups smaller than the world, in non-contiguous memory
layouts, and in the layer's own initialisation (which the harness overwrites with master values).

Two of them model a stack whose kernels keep the memory layout of their input (fused kernels that
allocate their output "like" the input, as sequence-first ``[S, B, H]`` code does): :func:`_like`
lays a result out in the dim order of a reference tensor, so a transposed input (or upstream
gradient) gives a transposed result, a strided slice a strided result, and a contiguous one a
contiguous result.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.mutants._ops import copy_to_region, reduce_from_region
from tpsim.mutants.column import CorrectColumn
from tpsim.mutants.row import CorrectRow
from tpsim.mutants.tp_rank import CorrectTpRankRow

__all__ = [
    "ColumnBackwardContiguousCopy",
    "ColumnViewFlatten",
    "RowContiguousCopyReduce",
    "RowReplicaInitDiverges",
    "RowWrongGroup",
]


def _like(t: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """``t`` laid out like ``ref``: a transposed ``ref`` gives a transposed result (the dim order of its
    strides), a strided slice a strided slice of a padded buffer, an expanded view a contiguous result."""
    if t.dim() != ref.dim() or t.dim() < 2 or 0 in ref.stride():
        return t
    if not ref.is_contiguous() and torch.empty_like(ref).is_contiguous():
        # A view with gaps (a strided slice): the result is a strided slice of a padded buffer too.
        big = t.new_zeros([2 * n for n in t.shape])
        index = tuple(slice(None, None, 2) for _ in t.shape)
        big[index] = t
        return big[index]
    strides = ref.stride()
    order = sorted(range(ref.dim()), key=lambda d: (-strides[d], d))
    if order == list(range(ref.dim())):
        return t
    inverse = [order.index(d) for d in range(ref.dim())]
    return t.permute(order).contiguous().permute(inverse)


class _ReduceContiguousCopy(torch.autograd.Function):
    """Forward: all-reduce ``x.contiguous()`` and return ``x`` — right only when ``x`` is contiguous
    (then ``.contiguous()`` is ``x`` itself); otherwise the reduced copy is dropped. Backward: identity."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        out = torch.empty_strided(x.size(), x.stride(), dtype=x.dtype).copy_(x)  # same layout as x
        dist.all_reduce(out.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class _CopyReduceContiguousCopy(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce ``grad.contiguous()`` and return ``grad`` — the same
    mistake on the gradient: a non-contiguous gradient is returned unreduced."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        out = torch.empty_strided(grad.size(), grad.stride(), dtype=grad.dtype).copy_(grad)  # same layout
        dist.all_reduce(out.contiguous(), group=ctx.group)
        return out, None


class _LinearKeepsLayout(torch.autograd.Function):
    """``y = x Wᵀ (+ b)`` whose backward returns the input gradient laid out like the upstream gradient
    (a fused kernel writing ``grad_input`` in ``grad_output``'s layout)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        x, weight = ctx.saved_tensors
        grad_input = _like(grad @ weight, grad)
        g2 = grad.reshape(-1, grad.shape[-1])
        grad_weight = g2.t() @ x.reshape(-1, x.shape[-1])
        grad_bias = g2.sum(0) if ctx.has_bias else None
        return grad_input, grad_weight, grad_bias


class RowWrongGroup(CorrectRow):
    """All-reduces its summands over the default (world) group instead of the layer's tp group —
    the Megatron-LM #7452 class of bug (a collective on the global group where the layer's own group
    was meant). Identical whenever the tp group is the whole world; with tp groups smaller than the
    world, each output sums the summands of several tp groups (other data-parallel replicas' data).
    Visible only with tp_size < world_size. Diagnosis: ``wrong-group``."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(y, None)


class RowContiguousCopyReduce(CorrectRow):
    """Its GEMM keeps the input's memory layout (see :func:`_like`), and its forward reduction
    all-reduces ``output.contiguous()`` and returns ``output`` — Megatron-LM #5337's ``_reduce``: for
    a non-contiguous output the all-reduce lands in a temporary copy, and each rank returns its own
    unreduced summand. Visible only for a transposed (sequence-first) or strided input.
    Diagnosis: ``missing-reduction`` (the report adds that only non-contiguous layouts show it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _ReduceContiguousCopy.apply(_like(F.linear(x, self.weight), x), self.group)
        return y + self.bias if self.bias is not None else y


class ColumnBackwardContiguousCopy(CorrectColumn):
    """The same mistake in backward — NovaSky-AI/SkyRL #1886: the copy-to-region's backward
    all-reduces ``grad.contiguous()`` and returns ``grad``; with a fused linear whose backward keeps
    the upstream gradient's layout, a transposed upstream gradient reaches it non-contiguous and each
    rank keeps only its own summand of the input gradient. Visible only for a transposed or strided
    upstream gradient. Diagnosis: ``grad-not-reduced``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _LinearKeepsLayout.apply(_CopyReduceContiguousCopy.apply(x, self.group), self.weight, self.bias)


class ColumnViewFlatten(CorrectColumn):
    """Flattens the leading dims with ``x.view(-1, in_features)`` for one 2-D GEMM: ``.view`` cannot
    merge the dims of a transposed, strided or expanded input, so every rank raises
    ``RuntimeError: view size is not compatible with input tensor's size and stride`` (use
    ``reshape``). Visible only for non-contiguous input. Diagnosis: ``exception``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = copy_to_region(x, self.group).view(-1, x.shape[-1])
        y = F.linear(x2, self.weight, self.bias)
        return y.view(*x.shape[:-1], y.shape[-1])


class RowReplicaInitDiverges(CorrectTpRankRow):
    """Initialises its own parameters under a rank-dependent seed (``seed + tp_rank``, as a
    model-parallel RNG tracker does for sharded weights) and draws its *replicated* bias inside the
    same fork — NeMo Automodel #1291 (replicated weights not synchronised across TP ranks: each rank
    started from different values). Every rank was seeded alike, yet the bias differs across the tp
    group right after construction. The harness loads master values afterwards, so only the
    construction check sees it. Visible with bias and tp_size >= 2. Diagnosis: ``replica-divergence``."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group: Any = None,
                 bias: bool = False):
        super().__init__(in_features, out_features, tp_size, tp_rank, tp_group=tp_group, bias=bias)
        with torch.random.fork_rng():
            torch.manual_seed(torch.initial_seed() + 2718 + tp_rank)
            with torch.no_grad():
                nn.init.xavier_uniform_(self.weight)
                if self.bias is not None:
                    self.bias.uniform_(-0.1, 0.1)
