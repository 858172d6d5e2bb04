"""torchtitan's feed-forward used the way its trainer does not: under the spmd_types backend without
``get_spmd_context``, its collectives are skipped without an error."""

from __future__ import annotations

from torchtitan.models.common.feed_forward import FeedForward

from tpsim.presets.torchtitan import ffn_variant

NO_CONTEXT = ffn_variant(FeedForward, "spmd_types", False)
