"""Gradient clipping by global norm: a distributed clip that counts replicated parameters once per rank.

A tensor-parallel model's total grad norm is ``sqrt(sum over every parameter of |grad|^2)`` of the
dense model: each rank holds a shard of the sharded parameters (their squares summed across the
ranks make the dense ones) and a whole copy of the replicated ones (a row layer's bias, a norm's
weight), which must be counted once. Megatron's ``get_grad_norm_fp32`` counts a parameter on every
rank only where it is ``tensor_model_parallel`` and on tp rank 0 otherwise
(``param_is_not_tensor_parallel_duplicate``). :func:`clip_grad_norm` is that clip written fresh, with
the signature a :class:`~tpsim.module_variant.ModuleVariant`'s ``clip`` takes; its mutant counts every
parameter on every rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpsim.layers import ParallelMLP

__all__ = ["clip_grad_norm", "clip_grad_norm_counting_replicas", "clip_grad_norm_local", "marked_mlp"]


def _clip(parameters: Any, max_norm: float, group: Any, counted: Any, reduce: bool = True) -> torch.Tensor:
    params = [p for p in parameters if p.grad is not None]
    if not params:
        return torch.zeros(())
    dtype = params[0].grad.dtype
    total = torch.zeros((), dtype=dtype)
    for p in params:
        if counted(p):
            total = total + p.grad.detach().pow(2).sum()
    if reduce:
        dist.all_reduce(total, group=group)
    norm = total.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for p in params:
        p.grad.detach().mul_(coef.to(p.grad.dtype))
    return norm


def clip_grad_norm(parameters: Any, max_norm: float, *, group: Any) -> torch.Tensor:
    """Clip the grads of ``parameters`` in place to a total norm of at most ``max_norm`` over the tp
    ``group`` and return that total norm: a replicated parameter (one without Megatron's
    ``tensor_model_parallel`` marker) is counted on tp rank 0 only."""
    rank = dist.get_rank(group)
    return _clip(parameters, max_norm, group, lambda p: getattr(p, "tensor_model_parallel", False) or rank == 0)


def clip_grad_norm_counting_replicas(parameters: Any, max_norm: float, *, group: Any) -> torch.Tensor:
    """The same clip, summing every parameter's squares on every rank before the all-reduce, so a
    replicated parameter (the row layer's bias) is counted once per rank: the total norm is too large
    and the grads are clipped too hard (a plain ``clip_grad_norm_`` on each rank's parameters followed by
    an all-reduce of the squares, without Megatron's ``param_is_not_tensor_parallel_duplicate``
    filter). Diagnosis: ``norm-counts-replicas``."""
    return _clip(parameters, max_norm, group, lambda p: True)


def clip_grad_norm_local(parameters: Any, max_norm: float, *, group: Any) -> torch.Tensor:
    """The clip without the all-reduce: each rank's norm is that of its own pieces, and it clips by its
    own coefficient (``torch.nn.utils.clip_grad_norm_`` on plain local tensors, as a tp layer's parameters
    are unless they are DTensors). Diagnosis: ``norm-not-reduced``."""
    rank = dist.get_rank(group)
    return _clip(parameters, max_norm, None, lambda p: getattr(p, "tensor_model_parallel", False) or rank == 0,
                 reduce=False)


def marked_mlp(hidden: int, ffn: int, *, group: Any, dtype: Any) -> nn.Module:
    """tpsim's GELU :class:`~tpsim.layers.ParallelMLP` with Megatron's ``tensor_model_parallel`` marker on
    its sharded parameters (every one but the row layer's bias ``fc2.bias``)."""
    mlp = ParallelMLP(hidden, ffn, activation="gelu", group=group, dtype=dtype)
    for name, p in mlp.named_parameters():
        p.tensor_model_parallel = name != "fc2.bias"  # type: ignore[attr-defined]
    return mlp
