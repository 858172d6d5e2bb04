"""Attention mutants: head-sharded attention blocks that get one thing wrong, as published code did.

Each is a subclass of :class:`tpsim.layers.ParallelAttention` (``from_dense`` builds it, so its own
slicing of the dense weights is what is checked) that changes one thing. Each docstring cites the
report and names the diagnosis tpsim must give.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tpsim.attention_variant import AttentionVariant, from_dense_builder
from tpsim.diagnosis import ATTENTION_SCALE, KV_HEADS_NOT_REPLICATED, QKV_HEAD_MISMATCH
from tpsim.layers import ParallelAttention, QKVParallelLinear

__all__ = ["ATTENTION_MUTANTS", "AttentionKVHeadsRoundRobin", "AttentionKVNotReplicated", "AttentionLocalHeadDimScale"]


class _QKVRoundRobinKV(QKVParallelLinear):
    """Q heads in contiguous blocks (rank r: heads r*h/ws ...), K/V heads dealt round-robin (head j on rank j % ws)."""

    def _kv_rows(self, part: torch.Tensor) -> torch.Tensor:
        d, g, ws, r = self.head_dim, self.num_kv_heads, self.tp_world_size, self.tp_rank
        if g < ws:
            return super()._kv_rows(part)
        return torch.cat([part[j * d : (j + 1) * d] for j in range(r, g, ws)])  # heads r, r + ws, ...: strided


class AttentionKVHeadsRoundRobin(ParallelAttention):
    """Shards the query heads in contiguous blocks but deals the key/value heads out round-robin
    (head ``j`` to rank ``j % ws``, a strided ``weight[rank::ws]``-style split), so a rank's query
    heads attend with key/value heads of other groups: Q, K and V are not split along the same
    heads (the packed-QKV layout class of bug; vllm #3775 is its packed gate/up instance). Shows
    with at least two key/value heads per rank. Diagnosis: ``qkv-head-mismatch``."""

    _qkv_class = _QKVRoundRobinKV


class _QKVKVModulo(QKVParallelLinear):
    """With fewer K/V heads than ranks, rank r keeps K/V head ``r % g`` instead of ``r // (ws/g)``."""

    def _layout(self, owner: str) -> dict[str, int]:
        layout = super()._layout(owner)
        if layout["kv_replicas"] > 1:
            layout["kv_start"] = self.tp_rank % self.num_kv_heads  # dealt out like shards, not replicated
        return layout


class AttentionKVNotReplicated(ParallelAttention):
    """With fewer key/value heads than ranks (grouped-query attention at a large tp size), keeps key/value
    head ``rank % num_kv_heads``, as if the heads could be dealt out like shards, instead of replicating
    head ``rank // (ws / num_kv_heads)`` on the ranks whose query heads use it (vLLM's
    QKVParallelLinear replicates: ``num_kv_head_replicas = tp_size // num_kv_heads``; sgl-project/sglang
    #19086 fixed wrong outputs from head offsets computed as if replicated heads were distinct, and
    huggingface/transformers #48307 reports native TP without KV-head replication). At
    ``num_kv_heads=2, ws=4`` ranks 1 and 2 attend with the wrong key/value head. Diagnosis:
    ``kv-heads-not-replicated``."""

    _qkv_class = _QKVKVModulo


class AttentionLocalHeadDimScale(ParallelAttention):
    """Scales the attention scores by ``1/sqrt(local projection width / num_heads)``, the head dim
    computed from this rank's share of the projection and the *global* head count (Megatron derives
    ``hidden_size_per_attention_head`` from the global sizes, which avoids the mix-up), i.e.
    ``sqrt(ws / head_dim)`` instead of ``1/sqrt(head_dim)``: the softmax is ``sqrt(ws)`` times too
    sharp at tp > 1, and right at tp = 1. Diagnosis: ``attention-scale``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        local_width = self.qkv.q_heads * self.head_dim
        self.softmax_scale = 1.0 / math.sqrt(local_width / self.num_heads)


# ------------------------------------------------------------------------------ their variants


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


def _variant(name: str, cls: type[ParallelAttention]) -> AttentionVariant:
    return AttentionVariant(name=name, build=from_dense_builder(cls), target=f"tpsim.mutants:{name}",
                            description=_first_paragraph(cls.__doc__))


#: ``(mutant name, variant, intended diagnosis, what a case needs)`` of every attention mutant
#: (registered in :data:`tpsim.mutants.CATALOG`).
ATTENTION_MUTANTS: list[tuple[str, AttentionVariant, str, str]] = [
    ("attention-kv-heads-round-robin", _variant("attention_kv_heads_round_robin", AttentionKVHeadsRoundRobin),
     QKV_HEAD_MISMATCH, "at least 2 key/value heads per rank (num_kv_heads >= 2 * tp)"),
    ("attention-kv-not-replicated", _variant("attention_kv_not_replicated", AttentionKVNotReplicated),
     KV_HEADS_NOT_REPLICATED, "2 <= num_kv_heads < tp (e.g. 2 key/value heads on 4 ranks)"),
    ("attention-local-head-dim-scale", _variant("attention_local_head_dim_scale", AttentionLocalHeadDimScale),
     ATTENTION_SCALE, "tp >= 2"),
]
