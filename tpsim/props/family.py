"""Families of check targets: the one interface the search, the CLI, case files and the pytest suite use.

tpsim checks several kinds of target, each described by its own variant type: a single linear layer
(:class:`tpsim.variant.Variant`, family ``linear``), a whole module such as an MLP or a block
(:class:`tpsim.module_variant.ModuleVariant`, family ``module``). A **family** is one object that
knows everything about one kind: how a ``tpsim check`` TARGET resolves into its variants, which
cases Hypothesis draws for a variant, how one case is checked, which properties exist, and how its
cases are written to and read from case files. :func:`tpsim.props.search.search`, ``tpsim check``,
``tpsim replay`` and :func:`tpsim.props.suite.property_tests` only ever talk to a family through
:class:`Family`, so adding a kind of target never touches them (pytest-xdist's schedulers follow
the same pattern: interchangeable policies behind one small Protocol).

Adding a family (say, vocab-parallel embeddings) takes four pieces, each in its own module:

1. **A variant type**: a frozen dataclass describing one implementation. It needs ``name``,
   ``target`` and ``options`` (filled in when it was resolved from a TARGET, so gloo/NCCL workers
   and ``tpsim replay`` can resolve it again by name), ``notes`` (remarks for reports),
   ``kind``/``input``/``output``/``input_grad``/``bias`` (listed by ``--report json``; None where
   one does not apply), ``describe()`` and ``replace(**changes)``.
2. **A case type**: a frozen dataclass that is pure data: ``world_size``, ``seed``, ``target``,
   ``variant``, ``options``, ``property`` fields; a ``family`` class attribute (the family's
   ``name``); ``describe()`` (one line for reports), ``to_dict()`` (JSON-ready),
   ``replace(**changes)`` and ``key()`` (a short stable hash naming its case file). It must replay
   exactly from ``to_dict()``.
3. **The family object**, implementing every member of :class:`Family` below. ``check_case``
   returns :class:`tpsim.diagnosis.Failure` objects whose ``diagnosis`` is a registered name and
   whose ``case`` is the case; it raises only for errors of the harness itself (a bad option, a
   backend that cannot start), never for something the variant did wrong.
4. **Registration**: one line in :data:`_BUILTIN` (``"name": "package.module:OBJECT"``, imported
   lazily so that importing tpsim stays cheap), or :func:`register` at run time; and the family's
   ``kinds`` in the CLI's ``--kind`` choices (``KIND_CHOICES`` in :mod:`tpsim.cli`).

A bare-module target (``tpsim check mypkg.layers``) gives every family's declared variants: each
family decides how a module declares them (linear: ``TPSIM_VARIANTS`` or its ``Variant`` objects;
module: ``TPSIM_MODULES`` or its ``ModuleVariant`` objects).

Case files carry the family's ``name`` (``"family": "module"``); files without one (schema 1) are
linear cases. :func:`resolve_target` asks the families in registration order; ``--kind`` picks the
family that lists the kind in its ``kinds``.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from types import ModuleType
from typing import Any, Protocol, runtime_checkable

from tpsim.errors import InvalidArgument

__all__ = [
    "FAMILIES",
    "Family",
    "families",
    "family_named",
    "family_of",
    "family_of_case",
    "register",
    "resolve_target",
    "resolve_variant",
]


@runtime_checkable
class Family(Protocol):
    """What tpsim needs from a family of targets (see the module docstring for how to add one)."""

    #: Stable name, written into case files (``"linear"``, ``"module"``).
    name: str
    #: The ``--kind`` values that select this family (``("column", "row")`` for linear layers).
    kinds: tuple[str, ...]
    #: The variant type (``isinstance`` tells which family a variant belongs to).
    variant_type: type
    #: Every property name the family checks, in report order.
    properties: tuple[str, ...]

    def resolve(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        """The variants ``obj`` (the object ``target``, a ``MODULE:Name``, names) describes, adapted
        with ``options`` (the CLI's adapter flags, e.g. ``input``/``output``); None when ``obj`` is
        not this family's. Raises :class:`tpsim.InvalidArgument` when it is, but cannot be adapted."""

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        """The variants the bare-module ``target`` (imported as ``module``) declares for this family,
        adapted with ``options`` (empty: none)."""

    def plan(
        self, variant: Any, properties: tuple[str, ...], dtypes: tuple[str, ...]
    ) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        """The properties and dtypes that apply to ``variant`` out of those asked for, and the
        notes a report shows about what was left out and why. Raises
        :class:`tpsim.InvalidArgument` when nothing asked for applies."""

    def cases(
        self,
        variant: Any,
        *,
        world_sizes: tuple[int, ...],
        dtypes: tuple[str, ...],
        non_divisible: bool,
        tp_sizes: tuple[int, ...] | None,
        subgroups: bool,
        layouts: tuple[str, ...],
    ) -> Any:
        """A Hypothesis strategy of this family's cases for ``variant`` (shrinking toward the
        smallest, most readable case); ``non_divisible``: also sizes that do not divide."""

    def check_case(
        self, variant: Any, case: Any, *, backend: str, timeout: float, properties: Sequence[str] | None = None,
        isolate: bool = False,
    ) -> list[Any]:
        """Run ``case`` and evaluate ``properties`` (None: all); return the failures. ``isolate``:
        run inproc worlds in a supervised worker process (``tpsim.run(..., isolate=True)``)."""

    def case_from_dict(self, data: Any) -> Any:
        """The inverse of the case type's ``to_dict()``; raises :class:`tpsim.InvalidArgument`
        naming a bad field."""


#: Families that ship with tpsim: name -> ``module:attribute`` of the family object (imported lazily).
_BUILTIN: dict[str, str] = {
    "linear": "tpsim.props.linear:LINEAR",
    "module": "tpsim.props.module.family:MODULE",
    "embedding": "tpsim.props.vocab.family:EMBEDDING",
    "cross-entropy": "tpsim.props.vocab.family:CROSS_ENTROPY",
    "attention": "tpsim.props.attention.family:ATTENTION",
}
#: Registered families by name, in resolution order (filled lazily from ``_BUILTIN``).
FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` (after the built-in ones); returns it. Its name must be new."""
    if not isinstance(family, Family):
        raise InvalidArgument(f"family={family!r} does not implement tpsim.props.family.Family")
    _load_builtin()
    if family.name in FAMILIES and FAMILIES[family.name] is not family:
        raise InvalidArgument(f"a family named {family.name!r} is already registered")
    FAMILIES[family.name] = family
    return family


def _load_builtin() -> None:
    for name, where in _BUILTIN.items():
        if name not in FAMILIES:
            module, _, attr = where.partition(":")
            FAMILIES[name] = getattr(importlib.import_module(module), attr)


def families() -> list[Family]:
    """Every registered family, in resolution order."""
    _load_builtin()
    return list(FAMILIES.values())


def family_named(name: Any) -> Family:
    """The family called ``name``; raises :class:`tpsim.InvalidArgument` naming the known ones."""
    _load_builtin()
    family = FAMILIES.get(name) if isinstance(name, str) else None
    if family is None:
        raise InvalidArgument(f"family={name!r}; expected one of {', '.join(FAMILIES)}")
    return family


def family_of(variant: Any) -> Family:
    """The family whose variant type ``variant`` is."""
    for family in families():
        if isinstance(variant, family.variant_type):
            return family
    raise InvalidArgument(
        f"{variant!r} is not a variant of any tpsim family; expected one of "
        f"{', '.join(f.variant_type.__name__ for f in families())}"
    )


def family_of_case(case: Any) -> Family:
    """The family a case belongs to (its ``family`` attribute; linear cases have none to spare)."""
    return family_named(getattr(case, "family", "linear"))


#: Bare modules whose variants are declared elsewhere: the layer core never imports the harness,
#: so ``tpsim.layers`` declares its variants in :mod:`tpsim.builtin_variants`.
_DECLARED_IN = {"tpsim.layers": "tpsim.builtin_variants"}


def resolve_target(target: str, **options: Any) -> list[Any]:
    """Every variant ``target`` names, over all families (see :mod:`tpsim.target` for the forms).

    ``MODULE:Name`` goes to the family that claims the object it names; a bare module collects what
    every family declares in it, in family order (``tpsim.layers``: tpsim's own linear layers, then
    its MLPs). ``options`` are the CLI's adapter flags; ``kind`` picks the family that lists it in
    its ``kinds`` (``--kind module``: the module family).
    """
    from tpsim.target import TargetError, import_target_module

    if not isinstance(target, str) or not target.strip():
        raise TargetError(f"target={target!r}; expected package.module:Name, path/to/file.py:Name or a module")
    kind = options.get("kind")
    chosen = families()
    if kind is not None:
        chosen = [f for f in chosen if kind in f.kinds]
        if not chosen:
            kinds = sorted(k for f in families() for k in f.kinds)
            raise TargetError(f"kind={kind!r}; expected one of {', '.join(kinds)}")
    module_part, _, attr = target.partition(":")
    redirect = _DECLARED_IN.get(module_part)
    if redirect is not None or not attr:
        module = import_target_module(redirect or module_part)
        variants = [v for family in chosen for v in family.declared(module_part, module, options)]
        if attr:
            match = [v for v in variants if v.name == attr]
            if not match:
                names = ", ".join(v.name for v in variants)
                raise TargetError(f"{module_part!r} declares no variant named {attr!r}; it declares: {names}")
            variants = match
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
    for family in chosen:
        try:
            found = family.resolve(target, obj, options)
        except InvalidArgument as err:
            raise _with_module_hint(err, obj, options) from None
        if found is not None:
            return _finish(target, found, options)
    wanted = " or ".join(f.variant_type.__name__ for f in chosen)
    raise TargetError(f"{target} is {type(obj).__name__}, not a tpsim {wanted} or an nn.Module class; see docs/cli.md")


def _with_module_hint(err: InvalidArgument, obj: Any, options: Mapping[str, Any]) -> InvalidArgument:
    # A module class that fits no linear-layer convention may be a whole module: say how to check it.
    from torch import nn

    if isinstance(obj, type) and issubclass(obj, nn.Module) and options.get("kind") is None:
        return type(err)(f"{err}; if {obj.__name__} is a whole module (an MLP or a block), check it with --kind module")
    return err


def _finish(target: str, variants: list[Any], options: Mapping[str, Any]) -> list[Any]:
    from tpsim.target import TargetError

    names = [v.name for v in variants]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise TargetError(f"{target!r} declares several variants named {dupes[0]!r}; names must be unique")
    frozen = tuple(sorted((k, v) for k, v in options.items() if v is not None))
    # Every variant remembers its target and options, so that worker processes and replays resolve it again.
    return [v if (v.target, tuple(v.options)) == (target, frozen) else v.replace(target=target, options=frozen)
            for v in variants]


def resolve_variant(target: str, name: str, options: Sequence[tuple[str, Any]] | Mapping[str, Any] = ()) -> Any:
    """The variant called ``name`` among those ``target`` resolves to, in any family."""
    from tpsim.target import TargetError

    found = resolve_target(target, **dict(options))
    for v in found:
        if v.name == name:
            return v
    raise TargetError(f"{target!r} declares no variant named {name!r}")
