"""The ``attention`` family (:class:`tpsim.props.family.Family`): head-sharded attention blocks.

Targets: an :class:`~tpsim.attention_variant.AttentionVariant` (or a list of them) named
``MODULE:Name``; a bare module's module-level attention variants (``tpsim.layers``: tpsim's own,
declared in :mod:`tpsim.builtin_variants`). A user's own attention block is a whole module:
``tpsim check FILE:Class --kind module``; loading this family registers the magnitude rule those
checks need (:mod:`tpsim.props.attention.magnitude`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

import tpsim
from tpsim.attention_variant import ATTENTION_KIND, AttentionVariant
from tpsim.errors import InvalidArgument
from tpsim.props.attention.case import AttentionCase
from tpsim.props.attention.checks import ATTENTION_PROPERTIES, evaluate_attention
from tpsim.props.attention.magnitude import register as register_attention_rule
from tpsim.props.attention.strategies import attention_cases
from tpsim.props.attention.world import observe

__all__ = ["ATTENTION", "ATTENTION_DTYPES", "AttentionFamily"]

#: The dtypes attention is checked in (see :mod:`tpsim.props.attention.oracle`).
ATTENTION_DTYPES = ("float64", "float32")
_FOREIGN = ("convention", "packed", "input", "output", "input_grad", "sequence_dim")


class AttentionFamily:
    """Head-sharded attention blocks against float64 attention (see :mod:`tpsim.props.attention.checks`)."""

    name = "attention"
    kinds: tuple[str, ...] = (ATTENTION_KIND,)
    variant_type = AttentionVariant
    properties = ATTENTION_PROPERTIES

    def _adapt(self, variant: AttentionVariant, options: Mapping[str, Any], where: str) -> AttentionVariant:
        foreign = [k for k in _FOREIGN if options.get(k) is not None]
        if foreign:
            raise InvalidArgument(f"{where} is an attention target; --{foreign[0].replace('_', '-')} applies to "
                                  "linear layers and modules")
        return variant

    def resolve(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        if isinstance(obj, AttentionVariant):
            found = [obj]
        elif isinstance(obj, (list, tuple)) and obj and all(isinstance(v, AttentionVariant) for v in obj):
            found = list(obj)
        elif options.get("kind") == ATTENTION_KIND:
            raise InvalidArgument(f"{target} is not a tpsim AttentionVariant; check an attention block class as a "
                                  "whole module: --kind module")
        else:
            return None
        return [self._adapt(v, options, target) for v in found]

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        if options.get("kind") not in (None, ATTENTION_KIND) or any(options.get(k) is not None for k in _FOREIGN):
            return []
        items: list[AttentionVariant] = []
        for value in vars(module).values():
            if isinstance(value, AttentionVariant) and not any(value is s for s in items):
                items.append(value)
        return [self._adapt(v, options, f"{target}:{v.name}") for v in items]

    def plan(self, variant: AttentionVariant, properties: tuple[str, ...],
             dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        kept_props = tuple(p for p in properties if p in self.properties)
        if not kept_props:
            raise InvalidArgument(f"properties={list(properties)!r}: attention is checked for {', '.join(self.properties)}")
        kept = tuple(d for d in dtypes if d in ATTENTION_DTYPES)
        if not kept:
            raise InvalidArgument(f"dtypes={list(dtypes)!r}: attention is checked in {' and '.join(ATTENTION_DTYPES)} "
                                  "(through a softmax the bfloat16/float16 rounding bound is as large as the bugs)")
        notes = list(variant.notes)
        if kept != tuple(dtypes):
            notes.append(f"dtypes {', '.join(kept)} only: through a softmax the bfloat16/float16 rounding bound is as "
                         "large as the bugs it looks for")
        return kept_props, kept, notes

    def cases(self, variant: AttentionVariant, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...],
              non_divisible: bool, tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...]) -> Any:
        return attention_cases(variant, world_sizes=world_sizes, dtypes=dtypes, non_divisible=non_divisible,
                               tp_sizes=tp_sizes, subgroups=subgroups)

    def check_case(self, variant: AttentionVariant, case: AttentionCase, *, backend: str,
                   timeout: float = tpsim.DEFAULT_TIMEOUT, properties: Sequence[str] | None = None,
                   isolate: bool = False) -> list[Any]:
        return evaluate_attention(variant, observe(variant, case, backend=backend, timeout=timeout, isolate=isolate),
                                  properties)

    def case_from_dict(self, data: Any) -> AttentionCase:
        return AttentionCase.from_dict(data)

    def resolve_variant(self, target: str, name: str, options: Mapping[str, Any]) -> Any:
        from tpsim.props.family import resolve_variant

        variant = resolve_variant(target, name, options)
        if not isinstance(variant, AttentionVariant):
            raise InvalidArgument(f"{target!r}: {name!r} is not an attention variant")
        return variant


#: The attention family object (registered as ``"attention"`` in :mod:`tpsim.props.family`).
ATTENTION = AttentionFamily()

# Whole-module checks of attention blocks need the magnitude rule of scaled_dot_product_attention;
# every search and every CLI command loads all the families (tpsim.props.family), this one included.
register_attention_rule()
