"""Packed-weight mutants: column layers whose weight packs several projections (gate/up, Q/K/V).

A correct packed layer shards each part on its own, so rank ``r`` holds shard ``r`` of every part
(Megatron's partition stride). Each mutant changes one thing, as real code did; its docstring cites
the report and names the diagnosis tpsim must give.
"""

from __future__ import annotations

import torch

from tpsim.mutants.column import CorrectColumn

__all__ = [
    "CorrectPackedGateUp",
    "CorrectPackedQKV",
    "PackedDivisibilityOnTotal",
    "PackedGateUpContiguous",
    "PackedQKVContiguous",
]


def _part_sizes(out_features: int, proportions: tuple[int, ...]) -> tuple[int, ...]:
    total = sum(proportions)
    if out_features % total:
        raise ValueError(
            f"out_features={out_features} is not a multiple of the packed proportions {proportions} (sum {total})"
        )
    return tuple(p * (out_features // total) for p in proportions)


class CorrectPackedGateUp(CorrectColumn):
    """The correct packed base (master-weight convention): the ``[out, in]`` master packs parts in the
    proportions ``PARTS`` (gate/up: ``(1, 1)``); rank ``r`` keeps shard ``r`` of every part, in
    part order; every part must divide by the world size (``ValueError`` naming the part)."""

    PARTS: tuple[int, ...] = (1, 1)

    def check_sizes(self, in_features: int, out_features: int, ws: int) -> None:
        for i, size in enumerate(_part_sizes(out_features, self.PARTS)):
            if size % ws:
                raise ValueError(f"packed part {i} has size {size}, not divisible by world_size={ws}")

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        parts = master.split(_part_sizes(master.shape[0], self.PARTS), dim=0)
        return torch.cat([p.chunk(ws, dim=0)[rank] for p in parts], dim=0)


class CorrectPackedQKV(CorrectPackedGateUp):
    """The correct packed QKV base for grouped-query attention: Q, K, V in proportions 8:2:2."""

    PARTS = (8, 2, 2)


class PackedGateUpContiguous(CorrectPackedGateUp):
    """Splits the packed ``[gate; up]`` weight into ``ws`` contiguous blocks, as for an unpacked
    weight (vllm #3775: OLMo gave wrong output at tp > 1 because its fused gate/up weight was
    sharded as one tensor). At ws=2 rank 0 holds all of gate and rank 1 all of up, so ``act(gate) *
    up`` mixes the wrong halves. Diagnosis: ``packed-shard-layout``."""

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        return master.chunk(ws, dim=0)[rank]


class PackedQKVContiguous(CorrectPackedQKV):
    """Splits a packed grouped-query ``[Q; K; V]`` weight (8:2:2 heads) into ``ws`` contiguous blocks
    (vllm #3775's mechanism with unequal parts): rank 0 gets only query heads, the last rank a mix
    of K and V. Diagnosis: ``packed-shard-layout``."""

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        return master.chunk(ws, dim=0)[rank]


class PackedDivisibilityOnTotal(CorrectPackedGateUp):
    """Checks that the packed ``2F`` divides by the world size instead of each part ``F``
    (torchtitan #4535), then floors each part's shard: with F=3 at ws=2 the check passes (6 % 2 ==
    0) and each rank silently keeps 1 of the 1.5 rows per part. Diagnosis: ``divisibility-unchecked``."""

    def check_sizes(self, in_features: int, out_features: int, ws: int) -> None:
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={ws}")

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        pieces = []
        for part in master.split(_part_sizes(master.shape[0], self.PARTS), dim=0):
            local = part.shape[0] // ws
            pieces.append(part[rank * local : (rank + 1) * local])
        return torch.cat(pieces, dim=0)
