"""The ``module`` family: whole tensor-parallel modules (:class:`tpsim.module_variant.ModuleVariant`).

Targets: a :class:`ModuleVariant` (or a list of them) named ``MODULE:Name``; a plain ``nn.Module``
class with ``--kind module`` (its constructor takes the sizes and a group keyword, see
:func:`tpsim.module_variant.module_from_class`); a bare module's ``TPSIM_MODULES`` list, else its
module-level :class:`ModuleVariant` objects (``tpsim.layers``: tpsim's own MLPs). The CLI's
``--input``/``--output``/``--input-grad``/``--sequence-dim`` adapt them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.module_variant import MODULE_KIND, ModuleVariant, module_from_class
from tpsim.placement import Replicate
from tpsim.props.checks import PROPERTIES
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.checks import check_case
from tpsim.props.module.strategies import module_cases
from tpsim.variant import ParamSpec

__all__ = ["MODULE", "MODULE_DTYPES", "ModuleFamily"]

#: The dtypes module targets are checked in (see :meth:`ModuleFamily.plan`).
MODULE_DTYPES = ("float64", "float32")
_ADAPT = ("input", "output", "input_grad", "sequence_dim")
_LINEAR_ONLY = ("convention", "packed")
#: Packages whose globals are not made per rank (the same rule as for linear targets).
_NOT_RANK_LOCAL = ("tpsim", "torch", "__main__", "builtins")


def _adapt(variant: ModuleVariant, options: Mapping[str, Any], where: str,
           module: ModuleType | None = None) -> ModuleVariant:
    """``variant`` with the CLI's adapter flags applied (see the module docstring)."""
    linear = [k for k in _LINEAR_ONLY if options.get(k) is not None]
    if linear:
        raise InvalidArgument(
            f"{where} is a whole module; --{linear[0].replace('_', '-')} applies to single linear layers (declare a "
            "packed parameter with ModuleVariant(params=(ParamSpec(name, 'weight', Shard(0, parts=...)),)))"
        )
    changes: dict[str, Any] = {k: options[k] for k in _ADAPT if options.get(k) is not None}
    local = list(variant.rank_local)
    if module is not None and module.__name__.split(".")[0] not in _NOT_RANK_LOCAL:
        # A user's module is per process in a real job: its globals are made per rank, as for layers.
        local.append(module.__name__)
    for spec in options.get("rank_local") or ():
        local.append(_module_name(spec))
    if tuple(local) != variant.rank_local:
        changes["rank_local"] = tuple(dict.fromkeys(local))
    pairs = [tuple(p) for p in options.get("param_grad") or ()]
    if pairs:
        declared = {s.name: s for s in variant.params}
        for name, mode in pairs:
            master = "bias" if name.rpartition(".")[2] == "bias" else "weight"
            base = declared.get(name) or ParamSpec(name, master, Replicate())
            declared[name] = dataclasses.replace(base, grad=mode)
        changes["params"] = tuple(declared.values())
    return variant.replace(**changes) if changes else variant


def _module_name(spec: Any) -> str:
    """A ``--rank-local`` value as a module name (a target file: the name tpsim imports it under)."""
    from tpsim.target import import_target_module, module_name_of_path

    if not isinstance(spec, str) or not spec.strip():
        raise InvalidArgument(f"rank_local={spec!r}; expected a module name (pkg.module) or a target file path")
    if spec.endswith(".py") or "/" in spec:
        import_target_module(spec)
        return module_name_of_path(spec)
    import_target_module(spec)
    return spec


class ModuleFamily:
    """Whole modules, checked against themselves on a one-rank tp group (see :mod:`tpsim.props.module`)."""

    name = "module"
    kinds: tuple[str, ...] = (MODULE_KIND,)
    variant_type = ModuleVariant
    properties = PROPERTIES

    def resolve(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        from tpsim.target import import_target_module

        if isinstance(obj, ModuleVariant):
            found = [obj]
        elif isinstance(obj, (list, tuple)) and obj and all(isinstance(v, ModuleVariant) for v in obj):
            found = list(obj)
        elif options.get("kind") == MODULE_KIND and isinstance(obj, type) and issubclass(obj, nn.Module):
            found = [module_from_class(obj)]
        else:
            return None
        module = import_target_module(target.partition(":")[0])
        return [_adapt(v, options, target, module) for v in found]

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        adapting = (*_ADAPT, *_LINEAR_ONLY, "param_grad")
        if options.get("kind") != MODULE_KIND and any(options.get(k) is not None for k in adapting):
            return []  # the options adapt the linear variants of a bare module, not its modules
        declared = getattr(module, "TPSIM_MODULES", None)
        if declared is not None:
            items = list(declared)
            bad = [v for v in items if not isinstance(v, ModuleVariant)]
            if bad:
                raise InvalidArgument(f"{module.__name__}.TPSIM_MODULES holds {bad[0]!r}, which is not a tpsim ModuleVariant")
        else:
            items = []
            for value in vars(module).values():
                if isinstance(value, ModuleVariant) and not any(value is s for s in items):
                    items.append(value)
        return [_adapt(v, options, f"{target}:{v.name}", module) for v in items]

    def plan(self, variant: ModuleVariant, properties: tuple[str, ...],
             dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        notes = list(variant.notes)
        kept = tuple(d for d in dtypes if d in MODULE_DTYPES)
        if not kept:
            raise InvalidArgument(
                f"dtypes={list(dtypes)!r}: module targets are checked in {' and '.join(MODULE_DTYPES)} (the rounding "
                "bound derived through several sublayers is, in bfloat16 or float16, as large as the bugs it looks for)"
            )
        if kept != tuple(dtypes):
            notes.append(f"dtypes {', '.join(kept)} only: the rounding bound derived through several sublayers is, "
                         "in bfloat16 or float16, as large as the bugs it looks for")
        return properties, kept, notes

    def cases(self, variant: ModuleVariant, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...],
              non_divisible: bool, tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...]) -> Any:
        # Inputs are contiguous: memory layouts are a property of the layers, checked on each of them.
        return module_cases(variant, world_sizes=world_sizes, dtypes=dtypes, non_divisible=non_divisible,
                            tp_sizes=tp_sizes, subgroups=subgroups)

    def check_case(self, variant: ModuleVariant, case: ModuleCase, *, backend: str, timeout: float,
                   properties: Sequence[str] | None = None, isolate: bool = False) -> list[Any]:
        return check_case(variant, case, backend=backend, timeout=timeout, properties=properties, isolate=isolate)

    def case_from_dict(self, data: Any) -> ModuleCase:
        return ModuleCase.from_dict(data)


#: The module family object (registered as ``"module"`` in :mod:`tpsim.props.family`).
MODULE = ModuleFamily()
