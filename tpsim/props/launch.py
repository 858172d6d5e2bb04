"""Running a family's rank function on a world: how the variant reaches the ranks, and warm workers.

Every family's world run goes through :func:`launch`. In this process (``inproc`` without
``isolate``) the ranks get the variant object itself; worker processes (gloo, nccl, the isolated
inproc worker) get its target string, name and options and resolve it again (:func:`variant_of`),
so a variant needs a target string there (:func:`target_ref` says so otherwise).

Importing a target is not part of a case: :func:`warm_workers` imports it once in the forker the
worker processes are forked from (:mod:`tpsim.comm.forker`), so every worker starts with it, and
then resolves it in the worker processes once, before the first case of that world size, so that a
slow import (Megatron-core takes seconds per process, many on a loaded machine) is never counted
against a case's timeout — or against the grace the ranks of a failed run get to report their own
error — where it would look like the variant's fault. A failed world may leave fresh workers
behind: they are warmed again before the next case.

The variant's ``rank_local`` modules are made per rank on inproc, and the other loaded modules of
their packages watched for sharing between ranks (:func:`watched`).
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from typing import Any

import tpsim
from tpsim.errors import InvalidArgument, RankError

__all__ = [
    "WARM_TIMEOUT",
    "for_ranks",
    "launch",
    "resolve_only",
    "run_options",
    "target_ref",
    "variant_of",
    "warm_workers",
    "watched",
]

#: Seconds worker processes get to import a target the first time.
WARM_TIMEOUT = 300.0
_warmed: set[tuple[Any, ...]] = set()
#: Targets (and options) the forker was asked to import, with the forker's pid at the time.
_preloaded: set[tuple[Any, ...]] = set()

#: ``(target, name, options, changes)``: a variant as worker processes resolve it (``changes``: the
#: fields the caller changed after resolving it, e.g. a parameter declared packed to confirm a layout).
Ref = tuple[str, str, tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]

#: Each variant as it was resolved, by ``(target, name, options)``: what a derived variant's changes
#: are measured against (:func:`target_ref`). Filled by the resolver, in this process or the judge's.
_ORIGINALS: dict[tuple[Any, ...], list[Any]] = {}
#: Resolutions of one target kept (a process that resolves a target again, as each rank under a launcher
#: does, may run a variant of an earlier resolution: a builder made anew is no change).
_KEPT = 4


def remember(variants: list[Any]) -> list[Any]:
    """Record ``variants`` as resolved (see :func:`target_ref`); returns them."""
    for v in variants:
        if v.target is not None:
            kept = _ORIGINALS.setdefault((v.target, v.name, tuple(v.options)), [])
            kept[:] = [*kept[-(_KEPT - 1):], v]
    return variants


def _shippable(value: Any) -> bool:
    """Whether ``value`` is data a worker can take (no stand-in of the checked code's objects in it)."""
    from tpsim.comm.plain import Foreign

    if isinstance(value, Foreign):
        return False
    if isinstance(value, (tuple, list)):
        return all(_shippable(v) for v in value)
    if isinstance(value, dict):
        return all(_shippable(v) for v in value.values())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return all(_shippable(getattr(value, f.name)) for f in dataclasses.fields(value))
    return True


def _changes(variant: Any, original: Any, where: str) -> tuple[tuple[str, Any], ...]:
    """The fields of ``variant`` that differ from ``original`` (its resolved self: a builder changed
    with the options, a plan's twin, resolves as such); a change a worker cannot receive (a function
    of the checked code, a lambda) is refused by name, never dropped."""
    if original is None or original is variant or type(original) is not type(variant):
        return ()
    out = []
    for f in dataclasses.fields(variant):
        if f.name in ("target", "options"):
            continue
        value = getattr(variant, f.name)
        if value is getattr(original, f.name) or value == getattr(original, f.name):
            continue
        try:
            from tpsim.comm import _wire

            ok = _shippable(value) and bool(_wire.dumps(value))
        except Exception:  # noqa: BLE001 - any reason it cannot be pickled
            ok = False
        if not ok:
            raise InvalidArgument(f"variant {variant.name!r} was derived with replace({f.name}=...), a value the {where} "
                                  "cannot receive (the workers resolve the variant again from its target and apply "
                                  "the changes); derive it with data, or declare it in the target")
        out.append((f.name, value))
    return tuple(out)


def target_ref(variant: Any, backend: str, isolate: bool) -> Ref:
    """``(target, name, options, changes)``: what worker processes resolve ``variant`` from (changes: its
    fields changed since it was resolved); raises :class:`tpsim.InvalidArgument` when it has no target
    string."""
    if variant.target is None:
        where = "the isolated inproc worker process" if backend == "inproc" else f"{backend} worker processes"
        raise InvalidArgument(
            f"variant {variant.name!r} has no target string, so {where} cannot import it; declare it at module "
            "level and check it by target (e.g. tpsim check mymodule:Name)"
        )
    options = tuple(variant.options)
    where = "isolated inproc worker process" if backend == "inproc" else f"{backend} worker processes"
    resolved = _ORIGINALS.get((variant.target, variant.name, options), [])
    if any(original is variant for original in resolved):
        return (variant.target, variant.name, options, ())
    return (variant.target, variant.name, options, _changes(variant, resolved[-1] if resolved else None, where))


def variant_of(payload: dict[str, Any]) -> Any:
    """The variant a rank runs: the object itself, or resolved again from ``payload["ref"]`` (once
    per worker process, as this process resolves it once for every case), with its changes."""
    variant = payload.get("variant")
    if variant is None:
        ref = payload["ref"]
        key = repr(ref)
        variant = _resolved.get(key)
        if variant is None:
            target, name, options, changes = ref
            variant = _resolver()(target, name, options)
            if changes:
                # Validated again, then exactly the caller's values: a field one of them derives (a
                # variant's ``packed`` from its params') must not be derived differently here.
                variant = variant.replace(**dict(changes))
                for field_name, value in changes:
                    if getattr(variant, field_name) != value:
                        object.__setattr__(variant, field_name, value)
            _resolved[key] = variant
    return variant


#: Variants resolved in this (worker) process, by their reference's repr.
_resolved: dict[str, Any] = {}
#: The one target resolver (:func:`tpsim.target.resolve_variant`). It sits above every family, and
#: the families launch their worlds through this module, so it is named here the way the built-in
#: families are named in :mod:`tpsim.props.family`: looked up when a worker first needs it.
_RESOLVER = "tpsim.target:resolve_variant"


def _resolver() -> Callable[..., Any]:
    module, _, name = _RESOLVER.partition(":")
    return getattr(importlib.import_module(module), name)


def for_ranks(variant: Any, payload: dict[str, Any], world_size: int, *, backend: str, isolate: bool,
              slot: str = "ranks") -> dict[str, Any]:
    """``payload`` with the variant added as the ranks of a world of ``world_size`` ranks of ``backend``
    get it (see the module docstring); the worker processes are warmed for it first."""
    if backend == "inproc" and not isolate:
        payload["variant"] = variant
    else:
        payload["ref"] = target_ref(variant, backend, isolate)
        warm_workers(payload["ref"], world_size, backend=backend, isolate=isolate, slot=slot)
    return payload


def run_options(variant: Any) -> dict[str, Any]:
    """The :func:`tpsim.run` options every world run of ``variant`` takes: its ``rank_local`` modules
    (module globals each rank owns in a real job: a library's parallel state, the module of a plain
    class) and the modules watched for sharing between ranks (:func:`watched`)."""
    return {"rank_local": variant.rank_local, "watch": watched(variant.rank_local)}


def launch(fn: Callable[[dict[str, Any]], Any], variant: Any, payload: dict[str, Any], world_size: int, *,
           backend: str = "inproc", timeout: float = tpsim.DEFAULT_TIMEOUT, isolate: bool = False,
           slot: str = "ranks") -> list[Any]:
    """``fn(payload)`` on every rank of a world of ``world_size`` ranks of ``backend``; the per-rank
    values, as plain data where they come from worker processes (:mod:`tpsim.comm.plain`: what this
    process judges never makes it import the checked code). ``slot``: the isolated worker an inproc
    world runs in (the dense reference has its own, ``"reference"``). The variant is added to
    ``payload`` (:func:`for_ranks`). Raises the run's :class:`tpsim.RankError`; a
    :class:`tpsim.SharedModuleState` (the harness's finding about the setup, not the variant's
    failure) propagates."""
    payload = for_ranks(variant, payload, world_size, backend=backend, isolate=isolate, slot=slot)
    ref = payload.get("ref")
    try:
        return tpsim.run(fn, world_size, backend=backend, args=(payload,), timeout=timeout, isolate=isolate,
                         plain=ref is not None, slot=slot, **run_options(variant))
    except RankError:
        if ref is not None:
            _warmed.discard(_warm_key(ref, world_size, backend, isolate, slot))
        raise


def resolve_only(ref: Ref) -> bool:
    """Resolve the variant ``ref`` names (a world's warm-up: the import is not part of any case)."""
    variant_of({"ref": ref})
    return True


def _warm_key(ref: Ref, world_size: int, backend: str, isolate: bool, slot: str) -> tuple[Any, ...]:
    return (ref[0], repr(ref[2]), world_size, backend, isolate, slot)


def warm_workers(ref: Ref, world_size: int, *, backend: str, isolate: bool, slot: str = "ranks") -> None:
    """Import the target ``ref`` names in the worker processes of a world of ``world_size`` ranks of
    ``backend`` (``isolate``: the isolated inproc worker), once per target, options, world size and
    backend: before its first case (see the module docstring). In-process worlds need nothing."""
    if backend == "inproc" and not isolate:
        return
    key = _warm_key(ref, world_size, backend, isolate, slot)
    if key in _warmed:
        return
    _warmed.add(key)
    _preload(ref, backend, isolate)
    try:
        tpsim.run(resolve_only, world_size, backend=backend, args=(ref,), timeout=WARM_TIMEOUT, isolate=isolate,
                  plain=True, slot=slot)
    except Exception:  # noqa: BLE001 - the case's own run reports whatever this is
        pass


def _preload(ref: Ref, backend: str, isolate: bool) -> None:
    """Import the target in the forker the workers are forked from (once per forker)."""
    from tpsim.comm import forker, procs

    if backend not in procs.PROCESS_BACKENDS and not isolate:
        return
    key = (ref[0], repr(ref[2]), forker.pid())  # the target's import: its changes need no preload
    if key in _preloaded:
        return
    _preloaded.add(key)
    procs.preload(resolve_only, (ref,), WARM_TIMEOUT)  # its error, if any, the workers report again


def watched(rank_local: tuple[str, ...]) -> tuple[Any, ...]:
    """What inproc watches for sharing between ranks besides the rank-local modules: the modules
    related to them (:class:`tpsim.comm.modstate.Related`, expanded where the world runs). A library
    preset declares its state itself and is not widened."""
    from tpsim.comm.modstate import Related
    from tpsim.presets import presets

    if not rank_local:
        return ()
    return (Related(tuple(sorted({t.split(".")[0] for p in presets() for t in p.targets}))),)
