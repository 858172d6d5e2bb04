"""torchtitan's layers used the way its trainer does not: the feed-forward under the spmd_types backend
without ``get_spmd_context`` (its collectives are skipped without an error), and an attention and a
transformer block whose output projection's sharding drops the reduction."""

from __future__ import annotations

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
