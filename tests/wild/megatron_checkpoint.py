"""A Megatron-core patch whose checkpoint metadata misplaces its shards (checked with the preset).

``ReversedOffsetsColumnParallelLinear`` says, in its ``sharded_state_dict()``, that tp rank ``r`` holds
the rows of rank ``tp-1-r``: a checkpoint then loads every rank with another rank's shard (its forward is
Megatron's own). The preset loads the case's weights through that metadata, as Megatron's
``dist_checkpointing`` does: ``wrong-shard-order`` right after construction.
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import ColumnParallelLinear


class ReversedOffsetsColumnParallelLinear(ColumnParallelLinear):
    def sharded_state_dict(self, prefix="", sharded_offsets=(), metadata=None):
        out = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        tp = self.tp_group.size()
        for key in ("weight", "bias"):
            entry = out.get(prefix + key)
            if entry is None or entry.data is None:
                continue
            rows = entry.data.shape[0]
            rank = entry.global_offset[0] // rows
            entry.global_offset = ((tp - 1 - rank) * rows, *entry.global_offset[1:])
        return out
