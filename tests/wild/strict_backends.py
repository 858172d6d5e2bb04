"""Layers that are wrong only on a real backend, each beside its correct twin.

Each buggy layer computes the right numbers on a backend that forgives it (a buffered ``send``, a
collective that reads a view element by element, one process whose classes every rank shares), and
fails on gloo or NCCL. tpsim must fail them on inproc too, naming the finding, and pass the twins.
Master-weight convention ``(in_features, out_features, bias, master_weight, *, group)``; row layers
take a sharded input and return the reduced output. Written for tests/test_strict_backends.py.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class _Row(nn.Module):
    """The correct row-parallel shape: weight ``[out, in/ws]`` from the master, bias added once after
    the reduction; subclasses say how the summands are reduced (:meth:`reduce`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *,
                 group: Any = None) -> None:
        super().__init__()
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        if in_features % ws:
            raise ValueError(f"in_features={in_features} is not divisible by world_size={ws}")
        self.weight = nn.Parameter(master_weight.chunk(ws, dim=1)[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=master_weight.dtype)) if bias else None

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = _Reduce.apply(F.linear(x, self.weight), self)
        return y + self.bias if self.bias is not None else y


class _Reduce(torch.autograd.Function):
    """``layer.reduce`` forward (a sum over the group), identity backward."""

    @staticmethod
    def forward(ctx: Any, y: torch.Tensor, layer: _Row) -> torch.Tensor:
        return layer.reduce(y)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return grad, None


# --- point to point: a ring all-reduce -------------------------------------------------------------

def _ring_sum(y: torch.Tensor, group: Any, *, blocking: bool) -> torch.Tensor:
    """Sum ``y`` over ``group``: each rank's summand travels once around the ring (ws - 1 steps), then
    every rank adds them in rank order (so the ranks' sums are bit-identical)."""
    ws, rank = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (rank + 1) % ws) if group is not None else (rank + 1) % ws
    prv = dist.get_global_rank(group, (rank - 1) % ws) if group is not None else (rank - 1) % ws
    parts = {rank: y.contiguous().clone()}
    passing = parts[rank]
    for step in range(ws - 1):
        got = torch.empty_like(passing)
        if blocking:  # every rank sends first: fine with buffered sends, a deadlock on gloo and NCCL
            dist.send(passing, nxt, group=group)
            dist.recv(got, prv, group=group)
        else:
            works = [dist.isend(passing, nxt, group=group), dist.irecv(got, prv, group=group)]
            for w in works:
                w.wait()
        parts[(rank - step - 1) % ws] = got
        passing = got
    total = parts[0].clone()
    for r in range(1, ws):
        total += parts[r]
    return total


class RingSendRow(_Row):
    """Reduces with a ring of blocking ``send`` then ``recv`` on every rank: each send waits for a recv
    its peer posts only after its own send completes, so the ring deadlocks on a real backend."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return _ring_sum(y, self.group, blocking=True)


class RingIsendRow(_Row):
    """The twin: ``isend`` and ``irecv`` posted together, then waited for."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return _ring_sum(y, self.group, blocking=False)


# --- collectives on views ----------------------------------------------------------------------------

class PaddedViewRow(_Row):
    """All-reduces in place in the first ``out`` columns of a buffer one column wider
    (``all_reduce(big[..., :out])``): a view that is not dense. Plain gloo reduces the first ``numel``
    elements of the storage instead; NCCL refuses it."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        out = y.shape[-1]
        big = y.new_zeros(*y.shape[:-1], out + 1)
        big[..., :out] = y
        dist.all_reduce(big[..., :out], group=self.group)
        return big[..., :out].clone()


class EveryOtherRow(_Row):
    """All-reduces the even columns of an interleaved buffer (``all_reduce(x[..., ::2])``), where the odd
    columns hold something else: a strided view, reduced wrongly by gloo and refused by NCCL."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        mixed = torch.stack([y, torch.zeros_like(y)], dim=-1).flatten(-2)  # y in the even columns
        dist.all_reduce(mixed[..., ::2], group=self.group)
        return mixed[..., ::2].clone()


class PaddedContiguousRow(_Row):
    """The twin of both: the padded buffer is reduced whole (it is contiguous), then sliced."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        out = y.shape[-1]
        big = y.new_zeros(*y.shape[:-1], out + 1)
        big[..., :out] = y
        dist.all_reduce(big, group=self.group)
        return big[..., :out].clone()


# --- state kept on a class ---------------------------------------------------------------------------

class ClassAttrColumn(nn.Module):
    """Rank 0 slices every rank's weight shard and keeps them on the class; the other ranks read
    theirs from there instead of receiving it (on gloo each rank is a process: the class has no
    ``shards`` there). Column-parallel: weight ``[out/ws, in]``, output sharded, input replicated."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *,
                 group: Any = None) -> None:
        super().__init__()
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={ws}")
        if rank == 0:
            type(self).shards = [w.clone() for w in master_weight.chunk(ws, dim=0)]
        dist.barrier(group=group)
        self.weight = nn.Parameter(type(self).shards[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features // ws, dtype=master_weight.dtype)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(_CopyIn.apply(x, self.group), self.weight, self.bias)


class BroadcastColumn(ClassAttrColumn):
    """The twin: rank 0 sends each rank its shard (a scatter); nothing is kept on the class."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *,
                 group: Any = None) -> None:
        nn.Module.__init__(self)
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={ws}")
        root = dist.get_global_rank(group, 0) if group is not None else 0
        shard = torch.empty(out_features // ws, in_features, dtype=master_weight.dtype)
        pieces = [w.contiguous() for w in master_weight.chunk(ws, dim=0)] if rank == 0 else None
        dist.scatter(shard, pieces, src=root, group=group)
        self.weight = nn.Parameter(shard)
        self.bias = nn.Parameter(torch.zeros(out_features // ws, dtype=master_weight.dtype)) if bias else None


class _CopyIn(torch.autograd.Function):
    """Identity forward; all-reduce of the input grad backward (the input is replicated)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# --- correct code that real backends run: must pass ----------------------------------------------------

class BackendAwareRow(PaddedContiguousRow):
    """Asks the backend what it is (CPU tensors on gloo, as real code picks a device) and checks that
    every rank arrived with ``dist.monitored_barrier`` (a gloo-only call)."""

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        if dist.get_backend(self.group) != "gloo":
            raise RuntimeError(f"this layer runs its CPU path on gloo only, got {dist.get_backend(self.group)!r}")
        dist.monitored_barrier(self.group, timeout=datetime.timedelta(seconds=30))
        return super().reduce(y)


@torch.compile
def _compiled_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, w, b)


class CompiledColumn(BroadcastColumn):
    """Its matmul is ``torch.compile``'d (the default inductor backend)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_linear(_CopyIn.apply(x, self.group), self.weight, self.bias)
