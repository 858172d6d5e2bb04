"""Mutants correct only at small sizes: a tile, a chunk and a large-K code path.

Kernels, chunked losses and fused layers switch code paths at tile boundaries and for large
reductions, sizes a search of one to three features per rank never reaches. Each mutant here is
right below its threshold and wrong past it; the search must reach its sizes
(:func:`tpsim.props.strategies.per_rank`) and still shrink to the smallest that fails.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tpsim.mutants.column import CorrectColumn
from tpsim.mutants.row import CorrectRow

__all__ = ["ColumnTileReusesFirst", "RowChunkDropsRemainder", "RowLargeKReduceTwice"]

#: Output features per tile of :class:`ColumnTileReusesFirst`.
TILE = 4
#: Input features per chunk of :class:`RowChunkDropsRemainder`.
CHUNK = 8
#: Input features per rank from which :class:`RowLargeKReduceTwice` takes its split-K path.
LARGE_K = 16


class ColumnTileReusesFirst(CorrectColumn):
    """Computes its output in tiles of 4 features and indexes the weight tile with the tile's offset
    inside the tile instead of its position, so every tile reuses the first tile's weight rows: right
    while a rank holds at most 4 output features, wrong past them. Needs more than 4 output features
    per rank. Diagnosis: ``mismatch`` (no pattern of the tensor-parallel split explains it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.enter(x)
        tiles = []
        for start in range(0, self.weight.shape[0], TILE):
            width = min(TILE, self.weight.shape[0] - start)
            bias = None if self.bias is None else self.bias[start:start + width]
            tiles.append(F.linear(x, self.weight[:width], bias))  # should be weight[start:start + width]
        y = torch.cat(tiles, dim=-1)
        return self.gather_output(y) if self.gather else y


class RowChunkDropsRemainder(CorrectRow):
    """Multiplies its input slice in chunks of 8 features and counts the chunks with a floor
    division once there is more than one, so the last ``K mod 8`` features of a rank's slice are left
    out for K = 9..15, 17..23, ...: right for up to 8 features per rank and for multiples of 8.
    Diagnosis: ``mismatch``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.weight.shape[1]
        chunks = max(1, k // CHUNK) if k > CHUNK else 1
        width = CHUNK if k > CHUNK else k
        y = sum(F.linear(x[..., i * width:(i + 1) * width], self.weight[:, i * width:(i + 1) * width])
                for i in range(chunks))
        y = self.reduce(y)
        return y + self.bias if self.bias is not None else y


class RowLargeKReduceTwice(CorrectRow):
    """From 16 input features per rank it takes a split-K path whose kernel already all-reduces the
    partial sums, and the layer all-reduces them again: right for small K, ``ws`` times the product
    for large K. Needs at least 16 input features per rank and world size >= 2.
    Diagnosis: ``double-reduction``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.reduce(F.linear(x, self.weight))
        if self.weight.shape[1] >= LARGE_K:
            y = self.reduce(y)  # the split-K kernel reduced already
        return y + self.bias if self.bias is not None else y
