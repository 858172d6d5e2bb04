"""Seeded bugs in the Llama-style block of ``examples/llama_block.py``: each one a real TP mistake.

Each class is a correct block with one sublayer changed; tpsim names the sublayer and the mechanism::

    tpsim check examples/llama_block_bugs.py:OProjBiasBeforeReduce --kind module   # exit 1: self_attn.o_proj: bias-duplication
    tpsim check examples/llama_block_bugs.py:DownProjNotReduced --kind module      # exit 1: mlp.down_proj: missing-reduction
    tpsim check examples/llama_block_bugs.py:GateUpContiguous --kind module        # exit 1: mlp.gate_up_proj: packed-shard-layout
    tpsim check examples/llama_block_bugs.py:KVHeadsTiled --kind module            # exit 1: self_attn: qkv-head-mismatch
    tpsim check examples/llama_block_bugs.py:NormGradNotReducedSP --kind module --input sequence-sharded --output sequence-sharded --sequence-dim 0   # exit 1: input_layernorm: grad-not-reduced

(``TPSIM_MODULES`` below lists them with their placements: ``tpsim check examples/llama_block_bugs.py --kind module``.)
"""

from __future__ import annotations

import os
import sys

import torch.nn.functional as F

from tpsim.module_variant import module_from_class

# tpsim imports example files by path (also inside gloo workers): make the block importable.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from llama_block import Attention, LlamaBlock, LlamaBlockSP, RowParallelLinear, sequence_parallel  # noqa: E402


class _BiasBeforeReduce(RowParallelLinear):
    """The row layer that adds its full bias to its summand, before the all-reduce."""

    def forward(self, x):
        return self.reduce(F.linear(x, self.weight, self.bias)), None


class _NoReduce(RowParallelLinear):
    """The row layer that forgets the all-reduce: each rank keeps its own summand."""

    def forward(self, x):
        return F.linear(x, self.weight, self.bias), None


class _TiledKV(Attention):
    """Attention that repeats its key/value heads with ``repeat`` (the block ``[kv0, kv1, kv0, kv1]``)
    instead of ``repeat_interleave`` (``[kv0, kv0, kv1, kv1]``): on one rank that is merely another
    grouping of query heads, but the tp shards hold contiguous blocks of query heads and of key/value
    heads, which only ``repeat_interleave``'s grouping keeps together, so at tp >= 2 a rank's query
    heads attend with key/value heads of other groups."""

    def repeat_kv(self, t):
        return t.repeat(1, self.q_per_kv, 1, 1)  # the seeded bug: tiles [kv0, kv1] into [kv0, kv1, kv0, kv1]


class OProjBiasBeforeReduce(LlamaBlock):
    """Attention with biases (as Qwen's), whose ``o_proj`` adds its bias before the all-reduce."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None):
        super().__init__(hidden, ffn, kv_heads, bias=True, process_group=process_group)
        self.self_attn.o_proj.__class__ = _BiasBeforeReduce  # the seeded bug: same parameters, other forward


class DownProjNotReduced(LlamaBlock):
    """The MLP's ``down_proj`` never all-reduces its partial output."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None):
        super().__init__(hidden, ffn, kv_heads, process_group=process_group)
        self.mlp.down_proj.__class__ = _NoReduce


class GateUpContiguous(LlamaBlock):
    """``gate_up_proj`` does not say that it packs gate and up (no ``parts``), so a loader that reads its
    layout gives each rank a contiguous slice of ``[gate; up]``, while its forward splits the rank's
    rows into its gate shard and its up shard."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None):
        super().__init__(hidden, ffn, kv_heads, process_group=process_group)
        del self.mlp.gate_up_proj.parts


class KVHeadsTiled(LlamaBlock):
    """``self_attn`` repeats its key/value heads for grouped-query attention with ``repeat`` instead of
    ``repeat_interleave``: right on one rank (another grouping of the same heads), wrong at tp >= 2."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None):
        super().__init__(hidden, ffn, kv_heads, process_group=process_group)
        self.self_attn.__class__ = _TiledKV


class NormGradNotReducedSP(LlamaBlockSP):
    """Sequence parallelism: ``input_layernorm``'s weight lacks the ``sequence_parallel`` marker, so its
    grad (each rank's summand over its slice of the sequence) is never summed over the tp group."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None):
        super().__init__(hidden, ffn, kv_heads, process_group=process_group)
        del self.input_layernorm.weight.sequence_parallel


#: What ``tpsim check examples/llama_block_bugs.py --kind module`` checks (every one fails).
TPSIM_MODULES = [
    module_from_class(OProjBiasBeforeReduce),
    module_from_class(DownProjNotReduced),
    module_from_class(GateUpContiguous),
    module_from_class(KVHeadsTiled),
    sequence_parallel(NormGradNotReducedSP),
]
