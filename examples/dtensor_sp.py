"""PyTorch's sequence parallelism for a norm -> MLP block, as PyTorch's TP tutorial writes it, built
from the same dense modules as tpsim's sequence-parallel layers (for the differential property in
``tests/test_dtensor_sp.py``).

The plan (``plan()``), on a 1-D mesh over the tp group, for activations sharded along the sequence
dim (``Shard(1)`` of ``[batch, seq, hidden]``)::

    norm: SequenceParallel()                          # per-token norm on the local sequence shard
    w1:   ColwiseParallel(input_layouts=Shard(1))     # all-gather the sequence, shard features
    w3:   ColwiseParallel(input_layouts=Shard(1))     # (gated MLPs: the up projection)
    w2:   RowwiseParallel(output_layouts=Shard(1))    # reduce-scatter back to sequence shards

The tpsim counterpart is ``LayerNorm``/``RMSNorm(sequence_parallel=True)`` followed by
``ParallelMLP(..., sequence_parallel=True)``. A gated ``DenseMLP`` packs ``[gate; up]`` in one
``fc1``; DTensor's ``ColwiseParallel`` shards a weight contiguously, which would hand rank 0 the
gate and rank 1 the up projection (the packed-weight bug of vllm #3775), so the DTensor block
splits it into ``w1`` (gate) and ``w3`` (up), as Llama's feed-forward does.

A DTensor detail the property accounts for: the gradients of the ``SequenceParallel`` norm's
replicated parameters are left ``Partial(sum)`` (each rank holds the sum over its own tokens;
DTensor reduces when the optimizer's DTensor ops need the value), while tpsim's norm all-reduces
them in backward. :func:`grad_value` returns what the optimizer would apply: the grad
redistributed to the parameter's own placement.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from tpsim.layers.mlp import ACTIVATIONS

__all__ = ["SequenceParallelBlock", "grad_value", "parallelize_block", "plan"]


def plan(gated: bool) -> dict[str, Any]:
    """The tutorial's plan for :class:`SequenceParallelBlock` (fresh style objects)."""
    out = {
        "norm": SequenceParallel(),
        "w1": ColwiseParallel(input_layouts=Shard(1)),
        "w2": RowwiseParallel(output_layouts=Shard(1)),
    }
    if gated:
        out["w3"] = ColwiseParallel(input_layouts=Shard(1))
    return out


class SequenceParallelBlock(nn.Module):
    """``w2(act(w1(norm(x))) [* w3(norm(x))])``: a copy of a dense norm and a ``tpsim.layers.DenseMLP``
    (``fc1`` split into ``w1``/``w3`` when the MLP is gated)."""

    def __init__(self, norm: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.norm = copy.deepcopy(norm)
        act = mlp.activation
        self.fn, self.gated = (ACTIVATIONS[act] if isinstance(act, str) else act), mlp.gated
        fc1 = mlp.fc1
        n = mlp.intermediate
        has_bias = fc1.bias is not None
        factory = {"dtype": fc1.weight.dtype, "device": fc1.weight.device}
        self.w1 = nn.Linear(mlp.hidden, n, bias=has_bias, **factory)
        self.w3 = nn.Linear(mlp.hidden, n, bias=has_bias, **factory) if self.gated else None
        with torch.no_grad():
            self.w1.weight.copy_(fc1.weight[:n])
            if has_bias:
                self.w1.bias.copy_(fc1.bias[:n])
            if self.w3 is not None:
                self.w3.weight.copy_(fc1.weight[n:])
                if has_bias:
                    self.w3.bias.copy_(fc1.bias[n:])
        self.w2 = copy.deepcopy(mlp.fc2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        a = self.fn(self.w1(h))
        if self.w3 is not None:
            a = a * self.w3(h)
        return self.w2(a)


def parallelize_block(norm: nn.Module, mlp: nn.Module, group: Any) -> SequenceParallelBlock:
    """A :class:`SequenceParallelBlock` of ``norm`` and ``mlp`` parallelised with :func:`plan` over
    ``group``; it takes and returns the local sequence shard ``[batch, seq/ws, hidden]``."""
    block = SequenceParallelBlock(norm, mlp)
    return parallelize_module(block, DeviceMesh.from_group(group, "cpu"), plan(block.gated))


def grad_value(param: Any) -> torch.Tensor | None:
    """The local value of ``param.grad`` the optimizer applies: a DTensor grad redistributed to the
    parameter's placements (a ``Partial`` grad reduced), then its local tensor."""
    grad = param.grad
    if grad is None or not hasattr(grad, "redistribute"):
        return grad
    return grad.redistribute(grad.device_mesh, param.placements).to_local()
