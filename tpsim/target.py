"""Resolve a TARGET string (as given to ``tpsim check``) into variants.

Forms:

- ``package.module:Name`` or ``path/to/file.py:Name`` — ``Name`` (a dotted attribute path) is a
  :class:`~tpsim.variant.Variant`, a list/tuple of variants, or a plain ``nn.Module`` class: a class
  that derives from a library layer (Megatron-core's or fairscale's Column/RowParallelLinear, see
  :mod:`tpsim.presets`) gets that library's preset, every option combination; any other class one
  of the three constructor conventions (see :mod:`tpsim.conventions`);
- ``package.module`` or ``path/to/file.py`` (a bare module) — every variant the module declares:
  the module-level list ``TPSIM_VARIANTS`` when present, otherwise every module-level
  :class:`Variant` object, in definition order;
- a library's layer module (``megatron.core.tensor_parallel``, ``fairscale.nn.model_parallel.layers``):
  its preset's variants of the library's own layers. A library that is not installed is a usage
  error naming the install command.

``tpsim.layers`` is special: the layer core must not import the harness, so the variants of
tpsim's own layers are declared in :mod:`tpsim.builtin_variants`; ``tpsim.layers`` resolves there,
and ``tpsim.layers:ColumnParallelLinear`` names the variant of that name.

Options (``convention``, ``kind``, ``input``, ``output``, ``input_grad``) adapt plain classes;
``input``/``output``/``input_grad`` also override a declared variant's placements. ``rank_local``
(module names, or target files by path) adds modules whose globals are per rank on inproc;
``param_grad`` (``(name, mode)`` pairs, e.g. ``("bias", "partial")``) declares how a parameter's
grad is left for the trainer. Rank-local automatically: the module that defines a plain class, the
module a declared variant comes from (not tpsim's own), and each preset's library state.

Every resolved variant remembers its target and options, so that a worker process (gloo/nccl) can
resolve the same variant again by name with :func:`resolve_variant`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import importlib.util
import io
import os
import sys
import threading
import warnings
from collections.abc import Iterator, Mapping
from types import ModuleType
from typing import Any

from torch import nn

from tpsim._target_files import module_name_of_path
from tpsim.conventions import own_module_state, variant_from_class
from tpsim.errors import InvalidArgument
from tpsim.presets import LibraryMissing, library_variants, preset_for_class, preset_for_target, presets
from tpsim.variant import KINDS, Variant

__all__ = ["TargetError", "import_target_module", "module_name_of_path", "resolve_target", "resolve_variant"]

_OPTION_NAMES = ("convention", "kind", "input", "output", "input_grad", "packed", "sequence_dim", "rank_local",
                 "param_grad")
#: Options that override a variant's layout after it is built (plain classes and declared variants).
_LAYOUT_OPTIONS = ("packed", "sequence_dim")
#: Modules whose variants are declared elsewhere (the layer core never imports the harness).
_DECLARED_IN = {"tpsim.layers": "tpsim.builtin_variants"}
_lock = threading.Lock()
_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], list[Variant]] = {}


class TargetError(InvalidArgument):
    """A TARGET string cannot be imported or does not name something checkable."""


@contextlib.contextmanager
def _import_noise() -> Iterator[list[str]]:
    """Capture what importing a target prints and warns (libraries warn about optional accelerators
    they did not find, and every gloo worker imports the target again): hidden when the import
    works; the caller quotes it when it fails."""
    printed = io.StringIO()
    noise: list[str] = []
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        try:
            yield noise
        finally:
            noise.extend([printed.getvalue()] + [f"{w.category.__name__}: {w.message}\n" for w in caught])


def _quoted(noise: list[str]) -> str:
    text = "".join(noise).strip()
    return f"\nwhile importing it printed:\n{text}" if text else ""


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def _import_path(path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise TargetError(f"target file {path!r} does not exist")
    # Imported by its name, through the finder of tpsim._target_files: the same name imports the
    # same file in a worker process (and importing it twice reuses the module).
    mod_name = module_name_of_path(full)
    try:
        return importlib.import_module(mod_name)
    except Exception as err:
        sys.modules.pop(mod_name, None)
        notes = "".join(f"\n{n}" for n in getattr(err, "__notes__", ()))
        raise TargetError(f"importing {path!r} failed: {type(err).__name__}: {err}{notes}") from err


def _import(module_part: str) -> ModuleType:
    if _is_path(module_part):
        return _import_path(module_part)
    try:
        with _import_noise():
            return importlib.import_module(module_part)
    except ImportError as err:
        library = _library_of(module_part)
        if library is not None and not _installed(module_part.split(".")[0]):
            raise LibraryMissing(library, err) from err
        raise TargetError(f"cannot import module {module_part!r}: {err}") from err
    except Exception as err:
        raise TargetError(f"importing module {module_part!r} failed: {type(err).__name__}: {err}") from err


def import_target_module(module_part: str) -> ModuleType:
    """Import the module part of a TARGET (``package.module`` or ``path/to/file.py``), once per file:
    the families of :mod:`tpsim.props.family` resolve targets through it, so a file is imported once."""
    return _import(module_part)


def _library_of(module_part: str) -> Any:
    """The preset whose library ``module_part`` belongs to (same top-level package), or None."""
    root = module_part.split(".")[0]
    return next((p for p in presets() if any(t.split(".")[0] == root for t in p.targets)), None)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def _own_rank_local(module: ModuleType) -> tuple[str, ...]:
    """A user module a target names: its globals are per process in a real job (made rank-local)."""
    return own_module_state(module.__name__)


def declares_variants(module_part: str, module: ModuleType) -> bool:
    """Whether the bare module target ``module_part`` resolves to linear-layer variants: a library a
    preset covers, or a module that declares variants."""
    return preset_for_target(module_part) is not None or bool(declared_variants(module))


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
        preset = preset_for_class(obj) if options.get("convention") is None else None
        if preset is not None:
            # A library class, or a subclass of one (a fork or a patch): the library's preset.
            lib, kind = preset
            if options.get("kind") not in (None, kind):
                raise TargetError(f"{where} derives from {lib.name}'s {kind}-parallel layer; --kind {options['kind']} "
                                  "contradicts it")
            return [v.replace(**overrides) if overrides else v for v in lib.variants(obj, kind)]
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
    library = None if attr or _is_path(module_part) else preset_for_target(module_part)
    if library is not None:
        # A library's own layers (tpsim check megatron.core.tensor_parallel): its preset's variants.
        if any(options.get(k) is not None for k in ("convention", "kind")):
            raise TargetError(f"{target!r} is {library.name}'s layers, checked by its preset; --convention/--kind "
                              "apply to plain classes")
        overrides = {k: options[k] for k in ("input", "output", "input_grad") if options.get(k) is not None}
        # Its linear layers (its embedding and cross-entropy belong to the families of tpsim.props.vocab).
        variants = [v.replace(**overrides) if overrides else v for v in library_variants(library, KINDS, module_part)]
        return _finish(target, variants, options)
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
        if not isinstance(obj, type):  # declared variants: their builders live in this module
            variants = [v.replace(rank_local=(*v.rank_local, *_own_rank_local(module))) for v in variants]
    else:
        if any(options.get(k) is not None for k in ("convention", "kind")):
            raise TargetError(
                f"{target!r} is a bare module; --convention/--kind need a class: use {target}:ClassName"
            )
        variants = []
        for v in declared_variants(module):
            variants.extend(_adapt(v, f"{target}:{v.name}", options))
        variants = [v.replace(rank_local=(*v.rank_local, *_own_rank_local(module))) for v in variants]
        if not variants:
            raise TargetError(
                f"module {module_part!r} declares no variants (no TPSIM_VARIANTS list and no Variant objects); "
                "name one with MODULE:Name"
            )
    return _finish(target, variants, options)


def _rank_local_modules(specs: Any) -> tuple[str, ...]:
    """Module names for ``--rank-local`` values: dotted names, or target files named by their path."""
    out = []
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise TargetError(f"rank_local={spec!r}; expected a module name (pkg.module) or a target file path")
        if _is_path(spec):
            _import_path(spec)  # a file is rank-local under the name tpsim imports it by
            out.append(module_name_of_path(spec))
            continue
        try:
            importlib.import_module(spec)
        except Exception as err:  # noqa: BLE001 - any failure to import is a usage error here
            raise TargetError(f"--rank-local {spec}: cannot import module {spec!r} ({type(err).__name__}: {err})") from err
        out.append(spec)
    return tuple(out)


def _param_grads(variants: list[Variant], pairs: Any) -> list[Variant]:
    """Declare the grads named by ``--param-grad NAME=MODE`` (e.g. ``bias=partial``: left as per-rank
    summands for the trainer to sum) on every variant that has a parameter of that name."""
    from tpsim.variant import ParamSpec

    if "grad" not in {f.name for f in dataclasses.fields(ParamSpec)}:
        raise TargetError("--param-grad needs ParamSpec(grad=...), which this tpsim does not have yet")
    pairs = [tuple(p) for p in pairs]
    for name, _mode in pairs:
        if not any(spec.name == name for v in variants for spec in v.params or ()):
            have = sorted({spec.name for v in variants for spec in v.params or ()})
            raise TargetError(f"--param-grad {name}=...: no variant has a parameter named {name!r}; "
                              f"the parameters are: {', '.join(have)}")
    out = []
    for v in variants:
        specs = tuple(
            dataclasses.replace(spec, grad=dict(pairs)[spec.name]) if spec.name in dict(pairs) else spec
            for spec in v.params or ()
        )
        out.append(v.replace(params=specs))
    return out


def _finish(target: str, variants: list[Variant], options: Mapping[str, Any]) -> list[Variant]:
    if options.get("rank_local"):
        extra = _rank_local_modules(options["rank_local"])
        variants = [v.replace(rank_local=(*v.rank_local, *extra)) for v in variants]
    if options.get("param_grad"):
        try:
            variants = _param_grads(variants, options["param_grad"])
        except InvalidArgument as err:
            raise TargetError(str(err)) from None
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
    if isinstance(options.get("rank_local"), (list, str)):
        value = options["rank_local"]
        options = dict(options, rank_local=(value,) if isinstance(value, str) else tuple(value))
    if isinstance(options.get("param_grad"), list):
        options = dict(options, param_grad=tuple(tuple(p) for p in options["param_grad"]))
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
