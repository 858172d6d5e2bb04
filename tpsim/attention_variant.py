"""Attention variants: how a head-sharded attention block is built from the dense parameters.

An :class:`AttentionVariant` describes a tensor-parallel self-attention block whose parameters are
those of :class:`tpsim.layers.DenseAttention`: a packed ``qkv`` projection (rows ``[Q; K; V]``,
each part head-major) and an out-projection ``proj``. Its ``build`` receives the full (master)
parameters and returns one rank's module, slicing them itself — so a layer's own split of the heads
is what is checked (:mod:`tpsim.props.attention`). Every rank is expected to hold the heads of
:func:`tpsim.layers.attention.head_layout`: query heads in contiguous blocks, and exactly the
key/value heads those queries use (a block of them, or one replicated head when there are fewer
key/value heads than ranks); the out-projection's columns of its query heads.

A user's attention block whose constructor takes sizes and a group keyword is checked as a whole
module instead (``tpsim check FILE:Class --kind module``, :mod:`tpsim.module_variant`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from tpsim import _derive
from tpsim.errors import InvalidArgument

__all__ = ["ATTENTION_KIND", "ATTENTION_PARAMS", "AttentionVariant", "from_dense_builder"]

#: The ``--kind`` that selects attention variants.
ATTENTION_KIND = "attention"
#: The parameters of an attention block, by dotted name, as :class:`tpsim.layers.DenseAttention` names them.
ATTENTION_PARAMS = ("qkv.weight", "qkv.bias", "proj.weight", "proj.bias")


@dataclass(frozen=True)
class AttentionVariant:
    """How one head-sharded attention block is built (see the module docstring).

    - ``build(hidden, num_heads, num_kv_heads, head_dim, *, bias, causal, sequence_parallel, group,
      dtype, masters) -> nn.Module``: one rank's block; ``masters`` maps each name of
      :data:`ATTENTION_PARAMS` to the full tensor (biases absent without ``bias``), in ``dtype``.
    - ``sequence_parallel``: the block takes and returns its slice of the sequence (dim -2).
    - ``bias``: None (cases draw both), True or False (the block always / never has biases).
    - ``params``: the block's own names for :data:`ATTENTION_PARAMS`, in that order.
    - ``forward(module, x)``: replaces ``module(x)``.
    """

    name: str
    build: Callable[..., nn.Module]
    sequence_parallel: bool = False
    bias: bool | None = None
    params: tuple[str, str, str, str] = ATTENTION_PARAMS
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    rank_local: tuple[str, ...] = ()
    description: str = ""
    notes: tuple[str, ...] = ()
    target: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())

    kind: ClassVar[str] = ATTENTION_KIND
    input_grad: ClassVar[str] = "complete"

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"AttentionVariant(name={self.name!r}): expected a non-empty string")
        if not callable(self.build):
            raise InvalidArgument(f"AttentionVariant {self.name!r}: build={self.build!r}; expected a callable builder")
        if self.bias not in (None, True, False):
            raise InvalidArgument(f"AttentionVariant {self.name!r}: bias={self.bias!r}; expected None, True or False")
        params = tuple(self.params)
        if len(params) != 4 or not all(isinstance(p, str) and p for p in params):
            raise InvalidArgument(f"AttentionVariant {self.name!r}: params={self.params!r}; expected the block's "
                                  f"names for {', '.join(ATTENTION_PARAMS)}")
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "sequence_parallel", bool(self.sequence_parallel))
        object.__setattr__(self, "rank_local", (self.rank_local,) if isinstance(self.rank_local, str)
                           else tuple(self.rank_local))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "options", tuple(self.options))

    @property
    def input(self) -> str:
        """What each rank is given: the whole sequence, or its slice of it."""
        return "sequence-sharded" if self.sequence_parallel else "replicated"

    @property
    def output(self) -> str:
        """What each rank returns (the same as its input)."""
        return self.input

    def describe(self) -> str:
        """One line: what it is and how its input and output are laid out."""
        return f"{self.name}: head-sharded attention, input and output {self.input}"

    def replace(self, **changes: Any) -> AttentionVariant:
        """A copy with ``changes`` applied (validation runs again), remembered for the worker
        processes that resolve its target again (:mod:`tpsim._derive`)."""
        return _derive.replace(self, changes)

    def call(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run the block on ``x``."""
        return self.forward(module, x) if self.forward is not None else module(x)


def from_dense_builder(cls: Any) -> Callable[..., nn.Module]:
    """A ``build`` for a class with ``from_dense(DenseAttention, *, group, sequence_parallel)`` (tpsim's
    :class:`~tpsim.layers.ParallelAttention` and its subclasses): the masters go into a
    :class:`~tpsim.layers.DenseAttention`, and the class shards it itself."""
    from tpsim.layers import DenseAttention

    def build(hidden: int, num_heads: int, num_kv_heads: int, head_dim: int, *, bias: bool, causal: bool,
              sequence_parallel: bool, group: Any, dtype: torch.dtype, masters: dict[str, Any]) -> nn.Module:
        with torch.device("meta"):
            dense = DenseAttention(hidden, num_heads, num_kv_heads, head_dim=head_dim, bias=bias, causal=causal,
                                   dtype=dtype)
        device = masters["qkv.weight"].device
        dense = dense.to_empty(device=device)
        with torch.no_grad():
            for name, value in masters.items():
                if value is not None:
                    dense.get_parameter(name).copy_(value)
        return cls.from_dense(dense, group=group, sequence_parallel=sequence_parallel)

    return build
