"""The one target resolver: a TARGET string (as given to ``tpsim check``) into variants of any family.

Forms:

- ``package.module:Name`` or ``path/to/file.py:Name`` — ``Name`` (a dotted attribute path) is a
  variant of a family (a :class:`~tpsim.variant.Variant`, a :class:`~tpsim.module_variant.ModuleVariant`,
  ...), a list/tuple of them, or what a family adapts: a plain ``nn.Module`` class (a linear layer by
  its constructor convention or the library preset of the layer it derives from, see
  :mod:`tpsim.props.linear`; a whole module with ``--kind module``; an embedding with
  ``--kind embedding``), a cross-entropy function (``--kind cross-entropy``);
- ``package.module`` or ``path/to/file.py`` (a bare module) — every variant the module declares, for
  every family in turn (``TPSIM_VARIANTS``, ``TPSIM_MODULES``, ``TPSIM_VOCAB`` lists, else its
  module-level variant objects, in definition order);
- a library's layer module (``megatron.core.tensor_parallel``, ``fairscale.nn.model_parallel.layers``):
  its preset's variants of the library's own layers. A library that is not installed is a usage
  error naming the install command.

``tpsim.layers`` is special: the layer core must not import the harness, so the variants of
tpsim's own layers are declared in :mod:`tpsim.builtin_variants`; ``tpsim.layers`` resolves there,
and ``tpsim.layers:ColumnParallelLinear`` names the variant of that name.

Options: ``kind`` picks the family that lists it in its ``kinds``; the adapter flags (``convention``,
``input``, ``output``, ``input_grad``, ``packed``, ``sequence_dim``, ``param_grad``) adapt the
variants of the families that take them (:meth:`tpsim.props.family.Family.adapt`) and are refused by
the others. Applied here, once, to every family's variants: ``rank_local`` (module names, or target
files by path) adds modules whose globals are per rank on inproc; ``param_grad`` (``(name, mode)``
pairs, e.g. ``("bias", "partial")``) declares how a parameter's grad is left for the trainer.
Rank-local automatically: the module that defines a plain class, the module a declared variant comes
from (not tpsim's own), and each preset's library state.

Every resolved variant remembers its target and options, so that a worker process (gloo/nccl, the
isolated worker) can resolve the same variant again by name with :func:`resolve_variant`.
"""

from __future__ import annotations

import importlib
import importlib.util
import threading
from collections.abc import Mapping
from typing import Any

from torch import nn

from tpsim._target_files import (
    TargetError,
    import_target_file,
    import_target_module,
    is_target_path,
    module_name_of_path,
)
from tpsim.errors import InvalidArgument

__all__ = [
    "DECLARED_IN",
    "TargetError",
    "import_target_module",
    "module_name_of_path",
    "resolve_target",
    "resolve_variant",
]

_OPTION_NAMES = ("convention", "kind", "input", "output", "input_grad", "packed", "head_size", "sequence_dim",
                 "rank_local",
                 "param_grad", "plan", "plan_twin", "forward_only", "ctor_arg")
#: Modules whose variants are declared elsewhere (the layer core never imports the harness).
DECLARED_IN = {"tpsim.layers": "tpsim.builtin_variants"}
_lock = threading.Lock()
_cache: dict[tuple[str, tuple[tuple[str, Any], ...]], list[Any]] = {}


def _with_module_hint(err: InvalidArgument, obj: Any, options: Mapping[str, Any]) -> InvalidArgument:
    # A module class that fits no linear-layer convention may be a whole module: say how to check it.
    from tpsim.presets import preset_for_class

    # (A library's module, or a subclass of one, is its preset's: --kind module would not change that.)
    if (isinstance(obj, type) and issubclass(obj, nn.Module) and options.get("kind") is None
            and options.get("plan") is None and preset_for_class(obj) is None):
        return type(err)(f"{err}; if {obj.__name__} is a whole module (an MLP or a block), check it with --kind module")
    return err


def _resolve_uncached(target: str, options: Mapping[str, Any]) -> list[Any]:
    from tpsim.props.family import ADAPTER_OPTIONS, families

    if not isinstance(target, str) or not target.strip():
        raise TargetError(f"target={target!r}; expected package.module:Name, path/to/file.py:Name or a module")
    kind = options.get("kind")
    chosen = families()
    if options.get("plan") is not None and kind is None:
        # A dense class under a plan is a whole module: only the families that take plans resolve it.
        chosen = [f for f in chosen if "plan" in f.adapter_options]
    if kind is not None:
        chosen = [f for f in chosen if kind in f.kinds]
        if not chosen:
            kinds = sorted(k for f in families() for k in f.kinds)
            raise TargetError(f"kind={kind!r}; expected one of {', '.join(kinds)}")
    # "C:\\x.py:Name" style paths are not supported; a single colon separates module and name.
    module_part, _, attr = target.partition(":")
    redirect = DECLARED_IN.get(module_part)
    if redirect is not None or not attr:
        module = import_target_module(redirect or module_part)
        if attr:
            # One declared variant by name: found whatever the adapter flags, then adapted by its family
            # (which refuses a flag it does not take).
            plain = {k: v for k, v in options.items() if k not in ADAPTER_OPTIONS}
            found = [(family, v) for family in chosen for v in family.declared(module_part, module, plain)]
            match = [(family, v) for family, v in found if v.name == attr]
            if not match:
                names = ", ".join(v.name for _, v in found)
                raise TargetError(f"{module_part!r} declares no variant named {attr!r}; it declares: {names}")
            try:
                return _finish(target, [family.adapt(v, options, target) for family, v in match], options)
            except InvalidArgument as err:
                raise TargetError(str(err)) from None
        variants = [v for family in chosen for v in family.declared(module_part, module, options)]
        if not variants:
            raise TargetError(
                f"module {module_part!r} declares no variants (no TPSIM_VARIANTS or TPSIM_MODULES list and no "
                "variant objects); name one with MODULE:Name"
            )
        return _finish(target, variants, options)
    obj: Any = import_target_module(module_part)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise TargetError(f"{module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if isinstance(obj, type):
        _check_introspection(obj)
    for family in chosen:
        try:
            found = family.resolve(target, obj, options)
        except InvalidArgument as err:
            raise _with_module_hint(err, obj, options) from None
        if found is not None:
            return _finish(target, found, options)
    wanted = " or ".join(f.variant_type.__name__ for f in chosen)
    what = f"a class of metaclass {type(obj).__name__}" if isinstance(obj, type) else type(obj).__name__
    raise TargetError(f"{target} is {what}, not a tpsim {wanted} or an nn.Module class; see docs/cli.md")


#: What tpsim reads of every class it checks (to name it, find its module's state, adapt and import it
#: again in worker processes), with the type each must have.
_CLASS_FACTS: tuple[tuple[str, type | tuple[type, ...]], ...] = (
    ("__module__", str), ("__qualname__", str), ("__name__", str), ("__mro__", tuple), ("__bases__", tuple),
    ("__init__", object))


def _check_introspection(cls: type) -> None:
    """Refuse a class whose basic facts cannot be read: a metaclass whose ``__getattribute__`` or
    properties raise (or answer ``__module__ = 42``) would otherwise fail deep inside a check, where it
    looks like tpsim's bug. :class:`TargetError` names the attribute and what reading it did."""
    from tpsim.session import raised_at, safe_text

    facts = ", ".join(n for n, _ in _CLASS_FACTS)
    label = f"class {type.__dict__['__name__'].__get__(cls)}"  # type's own field: no metaclass code runs
    for name, expected in _CLASS_FACTS:
        try:
            value = getattr(cls, name)
            ok = isinstance(value, expected)
        except Exception as err:  # noqa: BLE001 - the class's own code (its metaclass): anything may come out
            raise TargetError(
                f"reading {name} of {label} raised {type(err).__name__}{raised_at(err, basename=True)}: "
                f"{safe_text(err, 500)}; tpsim reads a class's {facts} to check it") from None
        if not ok:
            kinds = expected if isinstance(expected, tuple) else (expected,)
            raise TargetError(
                f"{name} of {label} is of type {type(value).__name__}, not {' or '.join(k.__name__ for k in kinds)}; "
                f"tpsim reads a class's {facts} to check it")


def _rank_local_modules(specs: Any) -> tuple[str, ...]:
    """Module names for ``--rank-local`` values: dotted names, or target files named by their path."""
    out = []
    for spec in specs:
        if not isinstance(spec, str) or not spec.strip():
            raise TargetError(f"rank_local={spec!r}; expected a module name (pkg.module) or a target file path")
        if is_target_path(spec):
            import_target_file(spec)  # a file is rank-local under the name tpsim imports it by
            out.append(module_name_of_path(spec))
            continue
        try:
            importlib.import_module(spec)
        except Exception as err:  # noqa: BLE001 - any failure to import is a usage error here
            raise TargetError(f"--rank-local {spec}: cannot import module {spec!r} ({type(err).__name__}: {err})") from err
        out.append(spec)
    return tuple(out)


def _param_grads(variants: list[Any], pairs: Any) -> list[Any]:
    """Declare the grads named by ``--param-grad NAME=MODE`` (e.g. ``bias=partial``: left as per-rank
    summands for the trainer to sum), by each variant's family; a name no variant has is refused
    where the parameters are declared (a whole module's are read from the built module)."""
    from tpsim.props.family import family_of

    grads = dict(tuple(p) for p in pairs)
    fixed = [v for v in variants if not family_of(v).params_inferred]
    if fixed and len(fixed) == len(variants):
        have = sorted({n for v in fixed for spec in v.params or () for n in (spec.name, spec.master)})
        for name in grads:
            if name not in have:
                raise TargetError(f"--param-grad {name}=...: no variant has a parameter named {name!r}; "
                                  f"the parameters are: {', '.join(have)}")
    try:
        return [family_of(v).declare_grads(v, grads) for v in variants]
    except InvalidArgument as err:
        raise TargetError(str(err)) from None


def _finish(target: str, variants: list[Any], options: Mapping[str, Any]) -> list[Any]:
    if options.get("rank_local"):
        extra = _rank_local_modules(options["rank_local"])
        variants = [v.replace(rank_local=tuple(dict.fromkeys((*v.rank_local, *extra)))) for v in variants]
    if options.get("param_grad"):
        variants = _param_grads(variants, options["param_grad"])
    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TargetError(f"{target!r} declares several variants named {dupes[0]!r}; names must be unique")
    from tpsim.props.launch import remember

    frozen = tuple(sorted((k, v) for k, v in options.items() if v is not None))
    # Every variant remembers its target and options, so that worker processes and replays resolve it again.
    return remember([v if (v.target, tuple(v.options)) == (target, frozen) else v.replace(target=target,
                                                                                           options=frozen)
                     for v in variants])


def resolve_target(target: str, **options: Any) -> list[Any]:
    """Every variant ``target`` names, over all families (see the module docstring), adapted with ``options``."""
    unknown = set(options) - set(_OPTION_NAMES)
    if unknown:
        raise InvalidArgument(f"unknown option(s) {sorted(unknown)}; expected some of {list(_OPTION_NAMES)}")
    if isinstance(options.get("packed"), list):  # a case file's JSON list: hashable again
        options = dict(options, packed=tuple(options["packed"]))
    if isinstance(options.get("rank_local"), (list, str)):
        value = options["rank_local"]
        options = dict(options, rank_local=(value,) if isinstance(value, str) else tuple(value))
    for key in ("param_grad", "ctor_arg"):  # a case file's JSON lists of pairs: hashable again
        if isinstance(options.get(key), list):
            options = dict(options, **{key: tuple(tuple(p) for p in options[key])})
    key = (target, tuple(sorted((k, v) for k, v in options.items() if v is not None)))
    with _lock:
        cached = _cache.get(key)
    if cached is None:
        cached = _resolve_uncached(target, options)
        with _lock:
            _cache[key] = cached
    return list(cached)


def resolve_variant(target: str, name: str, options: tuple[tuple[str, Any], ...] | Mapping[str, Any] = ()) -> Any:
    """The variant called ``name`` among those ``target`` resolves to, in any family (used inside ranks)."""
    for v in resolve_target(target, **dict(options)):
        if v.name == name:
            return v
    raise TargetError(f"{target!r} declares no variant named {name!r}")
