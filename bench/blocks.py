"""The decoder block the modules section checks two ways: a dense Llama-style block parallelised by a
DTensor plan (:class:`PlanBlock` under :data:`BLOCK_PLAN`), and the same block built from tpsim's own
layers (:class:`OwnBlock`: :class:`tpsim.layers.RMSNorm`, :class:`tpsim.layers.ParallelAttention`,
:class:`tpsim.layers.ParallelMLP`). Both compute ``h = x + attn(norm1(x))``, ``h + mlp(norm2(h))``
with grouped-query causal attention (:data:`HEADS` query heads, :data:`KV_HEADS` key/value heads,
``head_dim = hidden / HEADS``) and a SwiGLU MLP; their parameters differ only in packing (tpsim's
layers pack Q/K/V and gate/up in one weight each, sharded part by part).

Check them by hand::

    tpsim check bench/blocks.py:PlanBlock --plan bench/blocks.py:BLOCK_PLAN --world-sizes 2
    tpsim check bench/blocks.py:OwnBlock --kind module --world-sizes 2
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from tpsim.layers import ParallelAttention, ParallelMLP, RMSNorm
from tpsim.layers.attention import attend

__all__ = ["BLOCK_PLAN", "HEADS", "KV_HEADS", "OwnBlock", "PlanBlock"]

#: Query and key/value heads of both blocks (each divisible by the tp sizes the section uses).
HEADS = 4
KV_HEADS = 2


class PlanBlock(nn.Module):
    """A dense pre-norm decoder block, Llama's layout (separate ``q/k/v/o_proj`` and
    ``gate/up/down_proj``); its heads are read from the projections' output widths, so that the same
    forward runs on a rank's column shards under :data:`BLOCK_PLAN`."""

    def __init__(self, hidden: int, ffn: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = hidden // HEADS
        self.head_dim = d
        f = {"dtype": dtype}
        self.input_layernorm = nn.RMSNorm(hidden, **f)
        self.q_proj = nn.Linear(hidden, HEADS * d, bias=False, **f)
        self.k_proj = nn.Linear(hidden, KV_HEADS * d, bias=False, **f)
        self.v_proj = nn.Linear(hidden, KV_HEADS * d, bias=False, **f)
        self.o_proj = nn.Linear(HEADS * d, hidden, bias=False, **f)
        self.post_attention_layernorm = nn.RMSNorm(hidden, **f)
        self.gate_proj = nn.Linear(hidden, ffn, bias=False, **f)
        self.up_proj = nn.Linear(hidden, ffn, bias=False, **f)
        self.down_proj = nn.Linear(ffn, hidden, bias=False, **f)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = self.input_layernorm(x)
        context = attend(self.q_proj(a), self.k_proj(a), self.v_proj(a), self.head_dim, causal=True,
                         scale=self.head_dim ** -0.5)
        h = x + self.o_proj(context)
        m = self.post_attention_layernorm(h)
        return h + self.down_proj(F.silu(self.gate_proj(m)) * self.up_proj(m))


#: Megatron's layout as a DTensor plan: the projections into heads and the MLP's first layer
#: column-parallel, the projections back row-parallel; the norms replicated (left alone).
BLOCK_PLAN = {"q_proj": ColwiseParallel(), "k_proj": ColwiseParallel(), "v_proj": ColwiseParallel(),
              "o_proj": RowwiseParallel(), "gate_proj": ColwiseParallel(), "up_proj": ColwiseParallel(),
              "down_proj": RowwiseParallel()}


class OwnBlock(nn.Module):
    """:class:`PlanBlock` built from tpsim's own tensor-parallel layers over ``group``."""

    def __init__(self, hidden: int, ffn: int, *, group: Any = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        d = hidden // HEADS
        common: dict[str, Any] = {"group": group, "dtype": dtype}
        self.input_layernorm = RMSNorm(hidden, sequence_parallel=False, **common)
        self.attention = ParallelAttention(hidden, HEADS, KV_HEADS, head_dim=d, bias=False, **common)
        self.post_attention_layernorm = RMSNorm(hidden, sequence_parallel=False, **common)
        self.mlp = ParallelMLP(hidden, ffn, activation="swiglu", bias=False, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.input_layernorm(x))
        return h + self.mlp(self.post_attention_layernorm(h))
