"""torchtitan's layers used the way its trainer does not: the feed-forward under the spmd_types backend
without ``get_spmd_context`` (its collectives are skipped without an error), and an attention and a
transformer block whose output projection's sharding drops the reduction."""

from __future__ import annotations

import dataclasses

from torchtitan.models.common.attention import GQAttention
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.models.llama3.model import Llama3TransformerBlock
from torchtitan.protocols.sharding import ShardingConfig

from tpsim.presets.torchtitan import ffn_variant

NO_CONTEXT = ffn_variant(FeedForward, "spmd_types", False)


class UnreducedOutputAttention(GQAttention):
    """Llama 3's attention whose output projection keeps torchtitan's rowwise weight sharding but
    declares no output redistribution: its partial sums are never all-reduced (a seeded bug)."""

    def __init__(self, config):
        _unreduced(config.wo)
        super().__init__(config)


class UnreducedFeedForwardBlock(Llama3TransformerBlock):
    """Llama 3's transformer block whose feed-forward down projection ``w2`` keeps its rowwise weight
    sharding but is never all-reduced (a seeded bug)."""

    def __init__(self, config):
        _unreduced(config.feed_forward.w2)
        super().__init__(config)


def _unreduced(linear_config) -> None:
    rowwise = linear_config.sharding_config
    linear_config.sharding_config = ShardingConfig(state_shardings=rowwise.state_shardings,
                                                   out_src_shardings=rowwise.out_src_shardings)



def reduced_clip(parameters, max_norm: float):
    """torchtitan's clip with the fix for plain local parameters: the local sums of squares are
    all-reduced over the tp group (the whole world here) before the square root, so every rank clips by
    the dense norm. Right for a module whose every parameter is sharded (no replicas)."""
    import torch
    import torch.distributed as dist

    grads = [p.grad for p in parameters if p.grad is not None]
    squares = torch.stack([g.detach().to(torch.float64).square().sum() for g in grads]).sum()
    dist.all_reduce(squares)
    norm = squares.sqrt()
    coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return norm


#: The feed-forward with the fixed clip: training-equivalence holds.
REDUCED_CLIP = dataclasses.replace(ffn_variant(FeedForward, "spmd_types", True), clip=reduced_clip)
