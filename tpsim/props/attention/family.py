"""The ``attention`` family (:class:`tpsim.props.family.Family`): head-sharded attention blocks.

Targets: an :class:`~tpsim.attention_variant.AttentionVariant` (or a list of them) named
``MODULE:Name``; a bare module's module-level attention variants (``tpsim.layers``: tpsim's own,
declared in :mod:`tpsim.builtin_variants`). A user's own attention block is a whole module:
``tpsim check FILE:Class --kind module`` (the module family's magnitude run bounds
``scaled_dot_product_attention`` with the rule of :mod:`tpsim.props.attention.magnitude`).

One world run per case (:mod:`tpsim.props.attention.world`: the masters drawn in the parent, the
rank function), judged by :mod:`tpsim.props.attention.checks` against tpsim's own dense attention in
float64, within its dense twin's bound (:mod:`tpsim.props.attention.reference`), in every dtype.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tpsim.attention_variant import ATTENTION_KIND, AttentionVariant
from tpsim.diagnosis import ATTENTION_SCALE, KV_HEADS_NOT_REPLICATED, QKV_HEAD_MISMATCH
from tpsim.errors import InvalidArgument
from tpsim.props.attention.case import AttentionCase
from tpsim.props.attention.checks import ATTENTION_CHECKS, ATTENTION_PROPERTIES, AttentionContext, divides
from tpsim.props.attention.strategies import attention_cases
from tpsim.props.attention.world import attention_data, attention_rank
from tpsim.props.family import Family, World
from tpsim.props.observation import Observation

__all__ = ["ATTENTION", "AttentionFamily"]


class AttentionFamily(Family, name="attention", kinds=(ATTENTION_KIND,), variant_type=AttentionVariant,
                      case_type=AttentionCase, properties=ATTENTION_PROPERTIES, subject="an attention block"):
    """Head-sharded attention blocks against float64 attention (see :mod:`tpsim.props.attention.checks`)."""

    strategy = staticmethod(attention_cases)
    checks = ATTENTION_CHECKS
    context_type = AttentionContext
    noun = "block"
    # Every dtype: the dense twin bounds the rounding through the softmax (tpsim.props.attention.reference);
    # a mechanism read from a narrower case's numbers is named as float64 shows it.
    confirmed_in_float64 = frozenset({ATTENTION_SCALE, QKV_HEAD_MISMATCH, KV_HEADS_NOT_REPLICATED})

    def from_object(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        if options.get("kind") == ATTENTION_KIND:
            raise InvalidArgument(f"{target} is not a tpsim AttentionVariant; check an attention block class as a "
                                  "whole module: --kind module")
        return None

    def fault_case(self, variant: AttentionVariant, world_size: int, seed: int) -> AttentionCase:
        ws = world_size
        return AttentionCase(ws, hidden=4, num_heads=ws, num_kv_heads=ws, head_dim=2, seq=2 * ws, batch_shape=(1,),
                             bias=True if variant.bias is None else variant.bias, seed=seed)

    def divisible(self, variant: AttentionVariant, case: AttentionCase) -> bool:
        return divides(case)

    def cover_keys(self, variant: AttentionVariant, case: AttentionCase, world_sizes: tuple[int, ...]) -> list[Any]:
        """The shared buckets, and how the key/value heads sit on the ranks: replicated (fewer heads than
        ranks: one head, several each on the same number of ranks, or several the tp size does not
        divide), or one or two heads per rank; so grouped-query attention at a large tp size is checked
        early at every seed."""
        keys = super().cover_keys(variant, case, world_sizes)
        if keys and case.tp_size > 1:
            kv, tp = case.num_kv_heads, case.tp_size
            if kv >= tp:
                where = f"{kv // tp} per rank"
            elif kv == 1:
                where = "replicated, one"
            else:
                # Several heads, each replicated on tp / kv ranks; a tp size they do not divide is its
                # own regime (a rank's query heads then straddle two key/value heads).
                where = "replicated, several" if tp % kv == 0 else "replicated, straddling"
            keys.append(("kv-heads", where))
        return keys

    def world(self, variant: AttentionVariant, case: AttentionCase, **_: Any) -> World:
        data = attention_data(case)
        return World(attention_rank, {"case": case, "data": data}, data)

    def offending(self, variant: AttentionVariant, case: AttentionCase) -> tuple[str, list[int]]:
        tp = case.tp_size or case.world_size
        return (f"num_heads={case.num_heads}, num_kv_heads={case.num_kv_heads} cannot be split over tp_size={tp} "
                "(num_heads divisible by it, num_kv_heads and it dividing one another)",
                [case.num_heads, case.num_kv_heads, tp])

    def accepted(self, variant: AttentionVariant, obs: Observation, wanted: Sequence[str]) -> list[Any]:
        return [self.truncated(variant, obs)]


#: The attention family object (registered as ``"attention"`` in :mod:`tpsim.props.family`).
ATTENTION = AttentionFamily()
