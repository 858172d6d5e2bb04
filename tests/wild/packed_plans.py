"""Fresh dense modules and plans in Hugging Face's and DeepSpeed's styles, whose libraries cut the weights.

- ``FusedGateUpMLP``: a gated MLP with one packed ``gate_up_proj`` (``[gate; up]``), as recent
  transformers models pack it. ``PACKED`` plans it ``packed_colwise`` (transformers stores it as a
  ``_StridedShard`` DTensor: the shard of each part), checked with no declaration; ``COLWISE`` plans it
  ``colwise``, which cuts the packed rows as one block (the inkling2 defect): each rank's "gate" and
  "up" then come from the wrong parts.
- ``crashing_uneven_plan``: a plan function that says sizes that do not divide are ordinary cases
  (``uneven_sizes_are_cases = True``) but raises at them: a crash there is a failure, never a pass.
  ``refusing_plan`` is the same plan without the claim: its refusal of those sizes counts.
- ``SlicingBuilder``/``ReversedSlicingBuilder``: a module built from pieces a builder cuts from the
  dense weights it is given (``load="build"``); the reversed one hands rank ``r`` the piece of rank
  ``tp-1-r``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tpsim import ModuleVariant


class FusedGateUpMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


PACKED = {"gate_up_proj": "packed_colwise", "down_proj": "rowwise"}
COLWISE = {"gate_up_proj": "colwise", "down_proj": "rowwise"}


class PlainMLP(nn.Module):
    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.up = nn.Linear(hidden, ffn)
        self.down = nn.Linear(ffn, hidden)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def refusing_plan(module: nn.Module, mesh) -> nn.Module:
    """Colwise up, rowwise down; sizes that do not divide by the tp size are refused."""
    if module.up.out_features % mesh.size():
        raise ValueError(f"ffn={module.up.out_features} is not divisible by the tp size {mesh.size()}")
    return parallelize_module(module, mesh, {"up": ColwiseParallel(), "down": RowwiseParallel()})


def crashing_uneven_plan(module: nn.Module, mesh) -> nn.Module:
    """Says it shards sizes that do not divide, and raises at them."""
    return refusing_plan(module, mesh)


crashing_uneven_plan.uneven_sizes_are_cases = True


# --- a builder that cuts the dense weights itself -------------------------------------------------


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class PieceMLP(nn.Module):
    """An MLP that holds the pieces it is given (``fc1`` rows and bias, ``fc2`` columns, ``fc2`` bias whole)."""

    def __init__(self, fc1_w, fc1_b, fc2_w, fc2_b, group):
        super().__init__()
        self.group = group
        self.fc1 = nn.Linear(fc1_w.shape[1], fc1_w.shape[0], dtype=fc1_w.dtype)
        self.fc2 = nn.Linear(fc2_w.shape[1], fc2_w.shape[0], dtype=fc2_w.dtype)
        with torch.no_grad():
            for p, v in ((self.fc1.weight, fc1_w), (self.fc1.bias, fc1_b), (self.fc2.weight, fc2_w), (self.fc2.bias, fc2_b)):
                p.copy_(v)

    def forward(self, x):
        h = F.gelu(self.fc1(_Copy.apply(x, self.group)))
        out = _Reduce.apply(F.linear(h, self.fc2.weight), self.group)
        return out + self.fc2.bias


def _dense(hidden: int, ffn: int, *, dtype):
    g = torch.Generator().manual_seed(0)
    return PieceMLP(torch.randn(ffn, hidden, generator=g, dtype=dtype), torch.zeros(ffn, dtype=dtype),
                    torch.randn(hidden, ffn, generator=g, dtype=dtype), torch.zeros(hidden, dtype=dtype),
                    dist.group.WORLD)


def _slicing(reverse: bool):
    def build(hidden: int, ffn: int, *, group, dtype, masters):
        if masters is None:  # the dense reference: its own init (tpsim assigns the case's weights)
            return _dense(hidden, ffn, dtype=dtype)
        rank, tp = dist.get_rank(group), dist.get_world_size(group)
        if ffn % tp:
            raise ValueError(f"ffn={ffn} is not divisible by the tp size {tp}")
        r = tp - 1 - rank if reverse else rank
        return PieceMLP(masters["fc1.weight"].chunk(tp, 0)[r], masters["fc1.bias"].chunk(tp, 0)[r],
                        masters["fc2.weight"].chunk(tp, 1)[r], masters["fc2.bias"], group)

    return build


SLICING_BUILDER = ModuleVariant(name="SlicingBuilder", build=_slicing(False), sizes=("hidden", "ffn"), load="build")
REVERSED_SLICING_BUILDER = ModuleVariant(name="ReversedSlicingBuilder", build=_slicing(True), sizes=("hidden", "ffn"),
                                         load="build")
