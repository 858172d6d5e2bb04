"""torchtitan's layers used the way its trainer does not: the feed-forward under the spmd_types backend
without ``get_spmd_context`` (its collectives are skipped without an error), and an attention whose
output projection's sharding drops the reduction."""

from __future__ import annotations

from torchtitan.models.common.attention import GQAttention
from torchtitan.models.common.feed_forward import FeedForward
from torchtitan.protocols.sharding import ShardingConfig

from tpsim.presets.torchtitan import ffn_variant

NO_CONTEXT = ffn_variant(FeedForward, "spmd_types", False)


class UnreducedOutputAttention(GQAttention):
    """Llama 3's attention whose output projection keeps torchtitan's rowwise weight sharding but
    declares no output redistribution: its partial sums are never all-reduced (a seeded bug)."""

    def __init__(self, config):
        rowwise = config.wo.sharding_config
        config.wo.sharding_config = ShardingConfig(state_shardings=rowwise.state_shardings,
                                                   out_src_shardings=rowwise.out_src_shardings)
        super().__init__(config)
