"""A dense Llama-style gated MLP and norm->MLP block, and the tensor-parallel plans that parallelise them.

No parallel code is written here: each plan is checked against the dense module it parallelises::

    tpsim check examples/plan_mlp.py:GatedMLP --plan examples/plan_mlp.py:PLAN
    tpsim check examples/plan_mlp.py:GatedMLP --plan examples/plan_mlp.py:HF_PLAN
    tpsim check examples/plan_mlp.py:GatedMLP --plan examples/plan_mlp.py:parallelize
    tpsim check examples/plan_mlp.py:NormMLP --plan examples/plan_mlp.py:SP_PLAN --input sequence-sharded --output sequence-sharded --sequence-dim 1

(DTensor styles, Hugging Face style strings, a function; sequence parallelism), and the buggy plans
are caught with the path of the entry at fault::

    tpsim check examples/plan_mlp.py:GatedMLP --plan examples/plan_mlp.py:BUGGY_PLAN    # exit 1: down_proj: wrong-shard-dim
    tpsim check examples/plan_mlp.py:NormMLP --plan examples/plan_mlp.py:BUGGY_SP_PLAN --input sequence-sharded --output sequence-sharded --sequence-dim 1    # exit 1: mlp: plan-input-layout

The sizes (``hidden``, ``ffn``) come from each class's constructor.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

__all__ = ["BUGGY_PLAN", "BUGGY_SP_PLAN", "GatedMLP", "HF_PLAN", "NormMLP", "PLAN", "SP_PLAN", "parallelize"]


class GatedMLP(nn.Module):
    """``down_proj(silu(gate_proj(x)) * up_proj(x))``, Llama's MLP (with a bias on the down projection,
    so that a bias added on every rank would show)."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, ffn, bias=False)
        self.up_proj = nn.Linear(hidden, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, hidden)

    def forward(self, x: Any) -> Any:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class NormMLP(nn.Module):
    """``x + mlp(norm(x))``: a pre-norm residual MLP block, as in a decoder layer."""

    def __init__(self, hidden: int, ffn: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(hidden)
        self.mlp = GatedMLP(hidden, ffn)

    def forward(self, x: Any) -> Any:
        return x + self.mlp(self.norm(x))


#: The gate/up projections column-parallel, the down projection row-parallel: one all-reduce.
PLAN = {"gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(), "down_proj": RowwiseParallel()}

#: The same plan as Hugging Face writes it (``base_model_tp_plan`` style strings).
HF_PLAN = {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}


def parallelize(module: nn.Module, mesh: Any) -> nn.Module:
    """The plan as a function ``(module, mesh) -> module``, as torchtitan writes them."""
    return parallelize_module(module, mesh, PLAN)


#: Sequence parallelism (PyTorch's TP tutorial): the norm on a sequence shard, an all-gather before
#: the MLP, a reduce-scatter back to sequence shards after it.
SP_PLAN = {
    "norm": SequenceParallel(),
    "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "mlp.gate_proj": ColwiseParallel(),
    "mlp.up_proj": ColwiseParallel(),
    "mlp.down_proj": RowwiseParallel(output_layouts=Shard(1)),
}

#: Bug: the down projection planned column-parallel (its weight split along the wrong dim).
BUGGY_PLAN = {**PLAN, "down_proj": ColwiseParallel()}

#: Bug: no PrepareModuleInput on ``mlp``: the projections get each rank's sequence shard, not the
#: whole sequence.
BUGGY_SP_PLAN = {k: v for k, v in SP_PLAN.items() if k != "mlp"}
