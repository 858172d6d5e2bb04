"""An attention case: one concrete example an attention block is checked on (pure data, replays exactly).

The parameters (packed ``[Q; K; V]`` and the out-projection, with or without biases), the input
``[*batch_shape, seq, hidden]`` and its upstream grad are drawn from ``seed`` inside the run
(:mod:`tpsim.props.attention.world`). In a case file it sits under ``"family": "attention"``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from tpsim.errors import InvalidArgument
from tpsim.props.case import CaseBase

__all__ = ["AttentionCase"]


@dataclass(frozen=True)
class AttentionCase(CaseBase):
    """One example for an :class:`~tpsim.attention_variant.AttentionVariant`: ``num_heads`` query
    heads, ``num_kv_heads`` key/value heads of ``head_dim`` features, ``hidden`` features in and
    out, a sequence of ``seq`` tokens after ``batch_shape``, ``causal`` masking and ``bias``.
    ``tp_size`` defaults to ``world_size``; a smaller one splits the world into tp groups laid out
    by ``tp_layout`` (:mod:`tpsim.props.groups`), each with its own input and the same parameters."""

    world_size: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    seq: int
    batch_shape: tuple[int, ...] = ()
    causal: bool = True
    bias: bool = True
    dtype: str = "float64"
    seed: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"

    family: ClassVar[str] = "attention"
    SIZES: ClassVar[tuple[str, ...]] = ("hidden", "num_heads", "num_kv_heads", "head_dim", "seq")
    SHOWN: ClassVar[tuple[str, ...] | None] = (*SIZES, "causal", "bias")

    def _check(self) -> None:
        for name in ("causal", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidArgument(f"{name}={getattr(self, name)!r} must be true or false")

    def _largest(self) -> int:
        # the packed weight, the scores, the input
        rows = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        tokens = math.prod(self.batch_shape) * self.seq
        return max(rows * self.hidden, tokens * self.num_heads * self.seq, tokens * max(self.hidden, rows))
