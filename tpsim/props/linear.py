"""The ``linear`` family: single tensor-parallel linear layers (:class:`tpsim.variant.Variant`).

The first implementation of :class:`tpsim.props.family.Family`. It owns no logic of its own: each
member delegates to the modules that always did the work — :mod:`tpsim.target` resolves targets,
:mod:`tpsim.props.strategies` draws :class:`~tpsim.props.case.Case` objects,
:mod:`tpsim.props.checks` checks them — so the family protocol is the only thing it adds.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.presets import preset_for_class
from tpsim.props.case import Case
from tpsim.props.checks import DIVISIBILITY, PROPERTIES, check_case
from tpsim.props.strategies import cases
from tpsim.variant import KINDS, Variant

__all__ = ["LINEAR", "LinearFamily"]


class LinearFamily:
    """Single linear layers: column- and row-parallel variants (see :mod:`tpsim.variant`)."""

    name = "linear"
    kinds: tuple[str, ...] = KINDS
    variant_type = Variant
    properties = PROPERTIES

    def resolve(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        from tpsim.target import resolve_target

        variants = isinstance(obj, (list, tuple)) and bool(obj) and all(isinstance(v, Variant) for v in obj)
        if not (isinstance(obj, Variant) or variants or (isinstance(obj, type) and issubclass(obj, nn.Module))):
            return None
        preset = preset_for_class(obj) if isinstance(obj, type) else None
        if preset is not None and preset[1] not in KINDS:
            return None  # a library's embedding (a preset of another family's kind): that family's
        return resolve_target(target, **{k: v for k, v in options.items() if v is not None})

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        from tpsim.target import declares_variants, resolve_target

        if not declares_variants(target, module):  # declared variants, or a library with a preset
            return []
        return resolve_target(target, **{k: v for k, v in options.items() if v is not None})

    def plan(self, variant: Variant, properties: tuple[str, ...],
             dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        notes = list(variant.notes)
        if variant.divisible_only:
            # The variant declares divisible cases only (a documented upstream limit): no case could
            # test divisibility, so it is dropped and the report's notes say so.
            if properties == (DIVISIBILITY,):
                raise InvalidArgument(
                    f"properties={list(properties)!r}: variant {variant.name!r} declares divisible_only=True, "
                    "so the divisibility property does not apply; choose other properties"
                )
            properties = tuple(p for p in properties if p != DIVISIBILITY)
        if not variant.bias and not any("bias" in n for n in notes):
            notes.append(f"{variant.name} has no bias: bias-free cases only")
        notes.extend(f"{variant.name} declares {r}" for r in variant.restrictions())
        return properties, dtypes, notes

    def cases(self, variant: Variant, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...], non_divisible: bool,
              tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...]) -> Any:
        return cases(variant, world_sizes=world_sizes, dtypes=dtypes, non_divisible=non_divisible,
                     tp_sizes=tp_sizes, subgroups=subgroups, layouts=layouts)

    def check_case(self, variant: Variant, case: Case, *, backend: str, timeout: float,
                   properties: Sequence[str] | None = None, isolate: bool = False) -> list[Any]:
        return check_case(variant, case, backend=backend, timeout=timeout, properties=properties, isolate=isolate)

    def case_from_dict(self, data: Any) -> Case:
        return Case.from_dict(data)


#: The linear family object (registered as ``"linear"`` in :mod:`tpsim.props.family`).
LINEAR = LinearFamily()
