"""Vocab-parallel cases: one concrete example an embedding or a cross-entropy is checked on.

Pure data that replays exactly: the tensors (table or logits, ids, upstream grads) are drawn from
``seed`` inside the run (:mod:`tpsim.props.vocab.world`). In a case file a case sits under
``"family": "embedding"`` or ``"family": "cross-entropy"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from tpsim.errors import InvalidArgument
from tpsim.props.case import CaseBase

__all__ = ["REDUCTIONS", "CrossEntropyCase", "EmbeddingCase"]

#: The reductions a cross-entropy case can ask for (``F.cross_entropy``'s).
REDUCTIONS = ("none", "mean", "sum")


@dataclass(frozen=True)
class EmbeddingCase(CaseBase):
    """One example for an :class:`~tpsim.vocab_variant.EmbeddingVariant`: a ``[vocab_size,
    embedding_dim]`` table, ids of ``batch_shape`` (the shard boundaries first), upstream grads.
    ``tp_size`` defaults to ``world_size``; a smaller one splits the world into tp groups laid out
    by ``tp_layout`` (:mod:`tpsim.props.groups`), each with its own ids and the same table."""

    world_size: int
    vocab_size: int
    embedding_dim: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"

    family: ClassVar[str] = "embedding"
    SIZES: ClassVar[tuple[str, ...]] = ("vocab_size", "embedding_dim")

    def _largest(self) -> int:
        # the table and the output
        return max(self.vocab_size, math.prod(self.batch_shape)) * self.embedding_dim


@dataclass(frozen=True)
class CrossEntropyCase(CaseBase):
    """One example for a :class:`~tpsim.vocab_variant.CrossEntropyVariant`: logits over
    ``vocab_size`` ids (padded to the tp size as the variant's layout says) or ``hidden``-sized
    hidden states and a classifier (``hidden > 0``), targets of ``batch_shape`` (the shard
    boundaries first, the last position ``ignore_index`` when there are two or more), and
    ``label_smoothing``, ``ignore_index`` and ``reduction`` as ``F.cross_entropy`` takes them."""

    world_size: int
    vocab_size: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    label_smoothing: float = 0.0
    ignore_index: int = -100
    reduction: str = "none"
    hidden: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"

    family: ClassVar[str] = "cross-entropy"
    SIZES: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden")
    MAY_BE_ZERO: ClassVar[tuple[str, ...]] = ("hidden",)
    MORE: ClassVar[tuple[str, ...]] = ("label_smoothing", "ignore_index", "reduction")

    def _check(self) -> None:
        ls = self.label_smoothing
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0.0 <= ls <= 1.0:
            raise InvalidArgument(f"label_smoothing={ls!r} must be a number in [0, 1]")
        object.__setattr__(self, "label_smoothing", float(ls))
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise InvalidArgument(f"ignore_index={self.ignore_index!r} must be an int")
        if self.reduction not in REDUCTIONS:
            raise InvalidArgument(f"reduction={self.reduction!r}; expected one of {', '.join(REDUCTIONS)}")

    def _largest(self) -> int:
        # the (padded) logits, the classifier and the hidden states
        tokens, padded = math.prod(self.batch_shape), self.vocab_size + self.world_size
        return max(tokens * padded, self.vocab_size * self.hidden, tokens * self.hidden)
