"""A block with a per-head norm between a column and a row projection, in the style of transformers'
tensor-parallel plans for Qwen3's ``q_norm``/``k_norm``, and the ways its replicated weight's grad is reduced.

The column projection gives each rank its own heads; the norm (an RMSNorm over the head dim, one
weight ``[head_dim]`` shared by every head) runs on this rank's heads only, so its weight is
replicated while its grad on each rank covers only that rank's heads: a summand that must be summed
over the tp group. The block does that sum itself, in one of three ways (``reduce=``):

- ``"post_accumulate"``: a ``register_post_accumulate_grad_hook`` on the weight that all-reduces
  ``param.grad`` (transformers' ``ReplicatedWithGradAllReduce`` does exactly this). Right for one
  backward per optimizer step; with micro-batches accumulated, the hook reduces the grad accumulated
  so far after every backward, so the earlier micro-batches are reduced again: after two micro-batches
  the grad is the correct one plus (tp-1) times the first micro-batch's
  (``training-equivalence: grad-reduced-after-accumulation``).
- ``"tensor_hook"``: a ``Tensor.register_hook`` on the weight that returns the all-reduced *fresh*
  grad, before it is accumulated: correct under accumulation.
- ``"backward"``: the weight enters through a copy whose backward all-reduces its grad (Megatron's
  ``copy_to_tensor_model_parallel_region``): correct.

Sizes ``(hidden, heads)`` with a head dim of :data:`HEAD_DIM`; the module on a group of one rank is
the dense block. Written fresh for tpsim's wild tests; not a copy of any library's code.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpsim.module_variant import ModuleVariant

HEAD_DIM = 2


def _divide(n: int, tp: int, what: str) -> int:
    if n % tp:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {tp}")
    return n // tp


class _CopyToTp(torch.autograd.Function):
    """Identity forward; all-reduce of the grad over the group in backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTp(torch.autograd.Function):
    """All-reduce forward; identity backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


class HeadNorm(nn.Module):
    """RMSNorm over the last dim (the head dim) with one weight shared by every head, computed in
    float32 as Llama's and Qwen's RMSNorms are (a two-element head in float16 overflows otherwise)."""

    def __init__(self, dim: int, *, dtype: Any, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)


class HeadNormBlock(nn.Module):
    """``o_proj(norm(q_proj(x) per head))``: ``q_proj`` column-parallel (this rank's heads), ``o_proj``
    row-parallel with a replicated bias added after its all-reduce, ``norm`` replicated."""

    def __init__(self, hidden: int, heads: int, *, group: Any, dtype: Any, reduce: str) -> None:
        super().__init__()
        self.group = group
        tp = dist.get_world_size(group)
        self.local_heads = _divide(heads, tp, "heads")
        inner = self.local_heads * HEAD_DIM
        self.q_proj = nn.Linear(hidden, inner, bias=False, dtype=dtype)
        self.norm = HeadNorm(HEAD_DIM, dtype=dtype)
        self.o_proj = nn.Linear(inner, hidden, bias=True, dtype=dtype)
        self.reduce = reduce
        weight = self.norm.weight
        if reduce == "post_accumulate":
            weight.register_post_accumulate_grad_hook(self._all_reduce_accumulated)
        elif reduce == "tensor_hook":
            weight.register_hook(self._all_reduced)
        elif reduce != "backward":
            raise ValueError(f"reduce={reduce!r}; expected post_accumulate, tensor_hook or backward")

    def _all_reduce_accumulated(self, param: torch.Tensor) -> None:
        dist.all_reduce(param.grad, group=self.group)  # type: ignore[arg-type]

    def _all_reduced(self, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=self.group)
        return grad

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _CopyToTp.apply(x, self.group)
        q = nn.functional.linear(x, self.q_proj.weight)
        q = q.unflatten(-1, (self.local_heads, HEAD_DIM))
        weight = _CopyToTp.apply(self.norm.weight, self.group) if self.reduce == "backward" else self.norm.weight
        q = self.norm(q, weight).flatten(-2)
        out = _ReduceFromTp.apply(nn.functional.linear(q, self.o_proj.weight), self.group)
        return out + self.o_proj.bias


def _variant(name: str, reduce: str) -> ModuleVariant:
    def build(hidden: int, heads: int, *, group: Any, dtype: Any) -> nn.Module:
        return HeadNormBlock(hidden, heads, group=group, dtype=dtype, reduce=reduce)

    return ModuleVariant(name=name, build=build, sizes=("hidden", "heads"), min_batch_dims=1,
                         description=f"a per-head norm between column and row projections, its grad reduced by {reduce}")


#: The replicated norm weight's grad all-reduced in a post-accumulate-grad hook: wrong under accumulation.
head_norm_post_accumulate = _variant("head_norm_post_accumulate", "post_accumulate")
#: The fresh grad all-reduced in a tensor hook before it is accumulated: correct.
head_norm_tensor_hook = _variant("head_norm_tensor_hook", "tensor_hook")
#: The weight entering through a copy whose backward all-reduces its grad: correct.
head_norm_backward = _variant("head_norm_backward", "backward")
