"""Sequence-parallel mutants: row layers that return a sequence-sharded output, and a norm.

The correct row layer (master-weight convention) reduce-scatters its per-rank summands along the
sequence dim (default -2, the dim before the features; dim 0 of a 2-D input), adds its replicated
bias once to each sequence shard and all-reduces that bias's grad in backward (each rank used it on
its own tokens only). Each mutant changes one thing; its docstring cites the report and names the
diagnosis tpsim must give. Collectives are written here on purpose (not taken from
:mod:`tpsim.layers`), so a mutant can get one of them wrong.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.mutants._ops import copy_to_region
from tpsim.mutants.row import CorrectRow

__all__ = [
    "CorrectSequenceNorm",
    "CorrectSequenceRow",
    "SequenceNormNoGradReduce",
    "SequenceRowBiasGradHookReduce",
    "SequenceRowBiasGradNotReduced",
    "SequenceRowScatterBatchDim",
]


def _all_gather(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    total = x.contiguous().clone()
    dist.all_reduce(total, group=group)  # sum, then keep this rank's piece (a reduce-scatter)
    # tensor_split, like a hand-written scatter that never checks sizes: the divisibility check is
    # the caller's (the correct layer checks the dim it scatters; the mutant checks the wrong one).
    return torch.tensor_split(total, ws, dim=dim)[rank].contiguous()


class _ReduceScatter(torch.autograd.Function):
    """Reduce-scatter along ``dim`` forward; all-gather of the grad along ``dim`` backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        return _reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.group, ctx.dim), None, None


class CorrectSequenceRow(CorrectRow):
    """The correct base: ``(in_features, out_features, bias, master_weight, *, group)``; weight
    ``[out, in/ws]``, input ``[..., in/ws]``, output reduce-scattered along the sequence dim (-2),
    the bias added once per sequence shard with its grad all-reduced; the sequence length must
    divide by the world size (``ValueError`` naming it, before any collective)."""

    sequence_dim = -2

    def scatter_dim(self, x: torch.Tensor) -> int:
        return self.sequence_dim % x.dim()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2:
            raise ValueError(f"a sequence-parallel row layer needs a sequence dim; got input shape {list(x.shape)}")
        seq = self.sequence_dim % x.dim()
        if x.shape[seq] % self.world_size:
            raise ValueError(
                f"sequence length {x.shape[seq]} (dim {seq}) is not divisible by world_size={self.world_size}"
            )
        out = _ReduceScatter.apply(F.linear(x, self.weight), self.group, self.scatter_dim(x))
        return out if self.bias is None else out + self.enter_bias(self.bias)

    def enter_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return copy_to_region(bias, self.group)  # backward: all-reduce the bias grad


class SequenceRowScatterBatchDim(CorrectSequenceRow):
    """Reduce-scatters along dim 0 instead of the sequence dim (vllm #30610, ROCm/aiter #3395: a
    reduce-scatter written for ``[tokens, hidden]`` tensors, where dim 0 *is* the sequence). Correct
    for 2-D input; a ``[batch, seq, hidden]`` input gets sliced along the batch. Visible only with
    3-D (or deeper) input. Diagnosis: ``wrong-shard-dim``."""

    def scatter_dim(self, x: torch.Tensor) -> int:
        return 0


class SequenceRowBiasGradNotReduced(CorrectSequenceRow):
    """Adds the replicated bias to its sequence shard directly, without the all-reduce of its grad
    (TransformerEngine #530, Megatron's ``sequence_parallel`` parameter attribute forgotten): each
    rank's bias grad covers only its own tokens, so the replicas drift apart. Diagnosis:
    ``grad-not-reduced`` naming ``bias``."""

    def enter_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias


class SequenceRowBiasGradHookReduce(CorrectSequenceRow):
    """Adds the replicated bias to its sequence shard directly and all-reduces its grad in a
    ``register_post_accumulate_grad_hook`` instead of in the backward of the bias's copy: right for one
    backward per step, but the hook runs after every micro-batch on the grad accumulated so far, so
    each micro-batch reduces the earlier ones' again (a grad-reduction hook written for ``.grad``
    rather than for the fresh grad, as in hand-rolled sequence-parallel layer-norm reductions). After
    two micro-batches the bias grad is the correct one plus (tp-1) times the first micro-batch's.
    Diagnosis: ``grad-reduced-after-accumulation`` naming ``bias``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            self.bias.register_post_accumulate_grad_hook(self._reduce_grad)

    def _reduce_grad(self, p: torch.Tensor) -> None:
        dist.all_reduce(p.grad, group=self.group)  # type: ignore[arg-type]  # the whole accumulated grad

    def enter_bias(self, bias: torch.Tensor) -> torch.Tensor:
        return bias


# --- norms -------------------------------------------------------------------------------------


class CorrectSequenceNorm(nn.Module):
    """A LayerNorm on sequence-sharded activations with replicated ``weight`` and ``bias``
    (``(hidden, *, group, dtype)``): each parameter enters through a copy whose backward all-reduces
    its grad over the group, so every rank ends with the full, identical grad."""

    def __init__(self, hidden: int, *, group: Any = None, dtype: torch.dtype = torch.float32, eps: float = 1e-5):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(hidden, dtype=dtype))

    def enter(self, p: torch.Tensor) -> torch.Tensor:
        return copy_to_region(p, self.group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.enter(self.weight), self.enter(self.bias), self.eps)


class SequenceNormNoGradReduce(CorrectSequenceNorm):
    """Uses its replicated weight and bias on the local sequence shard without all-reducing their
    grads (NeMo #7184, gpt-neox #1257: LayerNorm grads never reduced across the tensor-parallel group
    under sequence parallelism): the replicas diverge after the first step. Diagnosis:
    ``grad-not-reduced`` naming ``weight`` (the first such parameter)."""

    def enter(self, p: torch.Tensor) -> torch.Tensor:
        return p
