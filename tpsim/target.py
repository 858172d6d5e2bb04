"""Resolve a TARGET string (as given to ``tpsim check``) into variants.

Forms:

- ``package.module:Name`` or ``path/to/file.py:Name`` — ``Name`` (a dotted attribute path) is a
  :class:`~tpsim.variant.Variant`, a list/tuple of variants, or a plain ``nn.Module`` class of one
  of the two conventions (see :mod:`tpsim.conventions`);
- ``package.module`` or ``path/to/file.py`` (a bare module) — every variant the module declares:
  the module-level list ``TPSIM_VARIANTS`` when present, otherwise every module-level
  :class:`Variant` object, in definition order.

``tpsim.layers`` is special: the layer core must not import the harness, so the variants of
tpsim's own layers are declared in :mod:`tpsim.builtin_variants`; ``tpsim.layers`` resolves there,
and ``tpsim.layers:ColumnParallelLinear`` names the variant of that name.

Options (``convention``, ``kind``, ``input``, ``output``, ``input_grad``) adapt plain classes;
``input``/``output``/``input_grad`` also override a declared variant's placements.

Every resolved variant remembers its target and options, so that a worker process (gloo/nccl) can
resolve the same variant again by name with :func:`resolve_variant`.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
import threading
from collections.abc import Mapping
from types import ModuleType
from typing import Any

from torch import nn

from tpsim.conventions import variant_from_class
from tpsim.errors import InvalidArgument
from tpsim.variant import Variant

__all__ = ["TargetError", "resolve_target", "resolve_variant"]

_OPTION_NAMES = ("convention", "kind", "input", "output", "input_grad", "packed", "sequence_dim")
#: Options that override a variant's layout after it is built (plain classes and declared variants).
_LAYOUT_OPTIONS = ("packed", "sequence_dim")
#: Modules whose variants are declared elsewhere (the layer core never imports the harness).
_DECLARED_IN = {"tpsim.layers": "tpsim.builtin_variants"}
_lock = threading.Lock()
_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], list[Variant]] = {}


class TargetError(InvalidArgument):
    """A TARGET string cannot be imported or does not name something checkable."""


def _import_path(path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise TargetError(f"target file {path!r} does not exist")
    # A stable, unique module name per file: importing the same file twice reuses the module.
    mod_name = "tpsim_target_" + "".join(c if c.isalnum() else "_" for c in full)
    if mod_name in sys.modules:
        return sys.modules[mod_name]
    spec = importlib.util.spec_from_file_location(mod_name, full)
    if spec is None or spec.loader is None:
        raise TargetError(f"cannot import {path!r} as a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        del sys.modules[mod_name]
        raise TargetError(f"importing {path!r} failed: {type(err).__name__}: {err}") from err
    return module


def _import(module_part: str) -> ModuleType:
    if module_part.endswith(".py") or os.sep in module_part or "/" in module_part:
        return _import_path(module_part)
    try:
        return importlib.import_module(module_part)
    except ImportError as err:
        raise TargetError(f"cannot import module {module_part!r}: {err}") from err
    except Exception as err:
        raise TargetError(f"importing module {module_part!r} failed: {type(err).__name__}: {err}") from err


def declared_variants(module: ModuleType) -> list[Variant]:
    """The variants a module declares: ``TPSIM_VARIANTS`` if present, else its Variant objects."""
    declared = getattr(module, "TPSIM_VARIANTS", None)
    if declared is not None:
        items = list(declared)
        bad = [v for v in items if not isinstance(v, Variant)]
        if bad:
            raise TargetError(f"{module.__name__}.TPSIM_VARIANTS holds {bad[0]!r}, which is not a tpsim Variant")
        return items
    seen: list[Variant] = []
    for value in vars(module).values():
        if isinstance(value, Variant) and not any(value is s for s in seen):
            seen.append(value)
    return seen


def _adapt(obj: Any, where: str, options: Mapping[str, Any]) -> list[Variant]:
    overrides = {k: options[k] for k in ("input", "output", "input_grad") if options.get(k) is not None}
    layout = {k: options[k] for k in _LAYOUT_OPTIONS if options.get(k) is not None}
    if layout:
        return [v.replace(**layout) for v in _adapt(obj, where, {k: v for k, v in options.items() if k not in layout})]
    if isinstance(obj, Variant):
        if options.get("convention") is not None:
            raise TargetError(f"{where} is a tpsim Variant; --convention applies to plain nn.Module classes only")
        if options.get("kind") not in (None, obj.kind):
            raise TargetError(f"{where} is a {obj.kind} variant; --kind {options['kind']} contradicts it")
        return [obj.replace(**overrides) if overrides else obj]
    if isinstance(obj, (list, tuple)) and obj and all(isinstance(v, Variant) for v in obj):
        return [v for item in obj for v in _adapt(item, where, options)]
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        return [
            variant_from_class(
                obj,
                convention=options.get("convention"),
                kind=options.get("kind"),
                input=options.get("input"),
                output=options.get("output"),
                input_grad=options.get("input_grad"),
            )
        ]
    raise TargetError(
        f"{where} is {type(obj).__name__}, not a tpsim Variant or an nn.Module class; see docs/cli.md"
    )


def _resolve_uncached(target: str, options: Mapping[str, Any]) -> list[Variant]:
    if not isinstance(target, str) or not target.strip():
        raise TargetError(f"target={target!r}; expected package.module:Name, path/to/file.py:Name or a module")
    module_part, _, attr = target.partition(":")
    # "C:\\x.py:Name" style paths are not supported; a single colon separates module and name.
    if module_part in _DECLARED_IN:
        declared = declared_variants(_import(_DECLARED_IN[module_part]))
        if attr:
            match = [v for v in declared if v.name == attr]
            if not match:
                names = ", ".join(v.name for v in declared)
                raise TargetError(f"{module_part!r} declares no variant named {attr!r}; it declares: {names}")
            declared = match
        variants = [v for item in declared for v in _adapt(item, f"{module_part}:{item.name}", options)]
        return _finish(target, variants, options)
    module = _import(module_part)
    if attr:
        obj: Any = module
        for part in attr.split("."):
            if not hasattr(obj, part):
                raise TargetError(f"{module_part!r} has no attribute {attr!r}")
            obj = getattr(obj, part)
        variants = _adapt(obj, target, options)
    else:
        if any(options.get(k) is not None for k in ("convention", "kind")):
            raise TargetError(
                f"{target!r} is a bare module; --convention/--kind need a class: use {target}:ClassName"
            )
        variants = []
        for v in declared_variants(module):
            variants.extend(_adapt(v, f"{target}:{v.name}", options))
        if not variants:
            raise TargetError(
                f"module {module_part!r} declares no variants (no TPSIM_VARIANTS list and no Variant objects); "
                "name one with MODULE:Name"
            )
    return _finish(target, variants, options)


def _finish(target: str, variants: list[Variant], options: Mapping[str, Any]) -> list[Variant]:
    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TargetError(f"{target!r} declares several variants named {dupes[0]!r}; names must be unique")
    frozen = tuple(sorted((k, v) for k, v in options.items() if v is not None))
    return [v.replace(target=target, options=frozen) for v in variants]


def resolve_target(target: str, **options: Any) -> list[Variant]:
    """Every variant ``target`` names (see the module docstring), adapted with ``options``."""
    unknown = set(options) - set(_OPTION_NAMES)
    if unknown:
        raise InvalidArgument(f"unknown option(s) {sorted(unknown)}; expected some of {list(_OPTION_NAMES)}")
    if isinstance(options.get("packed"), list):  # a case file's JSON list: hashable again
        options = dict(options, packed=tuple(options["packed"]))
    key = (target, tuple(sorted((k, v) for k, v in options.items() if v is not None)))
    with _lock:
        cached = _cache.get(key)
    if cached is None:
        cached = _resolve_uncached(target, options)
        with _lock:
            _cache[key] = cached
    return list(cached)


def resolve_variant(target: str, name: str, options: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()) -> Variant:
    """The variant called ``name`` among those ``target`` resolves to (used inside ranks)."""
    opts = dict(options)
    for v in resolve_target(target, **opts):
        if v.name == name:
            return v
    raise TargetError(f"{target!r} declares no variant named {name!r}")
