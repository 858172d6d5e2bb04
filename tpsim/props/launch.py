"""Running a family's rank function on a world: how the variant reaches the ranks, and warm workers.

Every family's world run goes through :func:`launch`. In this process (``inproc`` without
``isolate``) the ranks get the variant object itself; worker processes (gloo, nccl, the isolated
inproc worker) get its target string, name and options and resolve it again (:func:`variant_of`),
so a variant needs a target string there (:func:`target_ref` says so otherwise).

Importing a target is not part of a case: :func:`warm_workers` imports it once in the zygote the
worker processes are forked from (:mod:`tpsim.comm.zygote`), so every worker starts with it, and
then resolves it in the worker processes once, before the first case of that world size, so that a
slow import (Megatron-core takes seconds per process, many on a loaded machine) is never counted
against a case's timeout — or against the grace the ranks of a failed run get to report their own
error — where it would look like the variant's fault. A failed world may leave fresh workers
behind: they are warmed again before the next case.

The variant's ``rank_local`` modules are made per rank on inproc, and the other loaded modules of
their packages watched for sharing between ranks (:func:`watched`).
"""

from __future__ import annotations

import importlib
import sys
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
#: Targets (and options) the zygote was asked to import, with the zygote's pid at the time.
_preloaded: set[tuple[Any, ...]] = set()

Ref = tuple[str, str, tuple[tuple[str, Any], ...]]


def target_ref(variant: Any, backend: str, isolate: bool) -> Ref:
    """``(target, name, options)``: what worker processes resolve ``variant`` from; raises
    :class:`tpsim.InvalidArgument` when it has no target string."""
    if variant.target is None:
        where = "the isolated inproc worker process" if backend == "inproc" else f"{backend} worker processes"
        raise InvalidArgument(
            f"variant {variant.name!r} has no target string, so {where} cannot import it; declare it at module "
            "level and check it by target (e.g. tpsim check mymodule:Name)"
        )
    return (variant.target, variant.name, tuple(variant.options))


def variant_of(payload: dict[str, Any]) -> Any:
    """The variant a rank runs: the object itself, or resolved again from ``payload["ref"]`` (once
    per worker process, as this process resolves it once for every case)."""
    variant = payload.get("variant")
    if variant is None:
        ref = payload["ref"]
        key = repr(ref)
        variant = _resolved.get(key)
        if variant is None:
            variant = _resolved[key] = _resolver()(*ref)
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


def for_ranks(variant: Any, payload: dict[str, Any], world_size: int, *, backend: str, isolate: bool) -> dict[str, Any]:
    """``payload`` with the variant added as the ranks of a world of ``world_size`` ranks of ``backend``
    get it (see the module docstring); the worker processes are warmed for it first."""
    if backend == "inproc" and not isolate:
        payload["variant"] = variant
    else:
        payload["ref"] = target_ref(variant, backend, isolate)
        warm_workers(payload["ref"], world_size, backend=backend, isolate=isolate)
    return payload


def run_options(variant: Any) -> dict[str, Any]:
    """The :func:`tpsim.run` options every world run of ``variant`` takes: its ``rank_local`` modules
    (module globals each rank owns in a real job: a library's parallel state, the module of a plain
    class) and the modules watched for sharing between ranks (:func:`watched`)."""
    return {"rank_local": variant.rank_local, "watch": watched(variant.rank_local)}


def launch(fn: Callable[[dict[str, Any]], Any], variant: Any, payload: dict[str, Any], world_size: int, *,
           backend: str = "inproc", timeout: float = tpsim.DEFAULT_TIMEOUT, isolate: bool = False) -> list[Any]:
    """``fn(payload)`` on every rank of a world of ``world_size`` ranks of ``backend``; the per-rank
    values. The variant is added to ``payload`` (:func:`for_ranks`). Raises the run's
    :class:`tpsim.RankError`; a :class:`tpsim.SharedModuleState` (the harness's finding about the
    setup, not the variant's failure) propagates."""
    payload = for_ranks(variant, payload, world_size, backend=backend, isolate=isolate)
    ref = payload.get("ref")
    try:
        return tpsim.run(fn, world_size, backend=backend, args=(payload,), timeout=timeout, isolate=isolate,
                         **run_options(variant))
    except RankError:
        if ref is not None:
            _warmed.discard(_warm_key(ref, world_size, backend, isolate))
        raise


def resolve_only(ref: Ref) -> bool:
    """Resolve the variant ``ref`` names (a world's warm-up: the import is not part of any case)."""
    variant_of({"ref": ref})
    return True


def _warm_key(ref: Ref, world_size: int, backend: str, isolate: bool) -> tuple[Any, ...]:
    return (ref[0], repr(ref[2]), world_size, backend, isolate)


def warm_workers(ref: Ref, world_size: int, *, backend: str, isolate: bool) -> None:
    """Import the target ``ref`` names in the worker processes of a world of ``world_size`` ranks of
    ``backend`` (``isolate``: the isolated inproc worker), once per target, options, world size and
    backend: before its first case (see the module docstring). In-process worlds need nothing."""
    if backend == "inproc" and not isolate:
        return
    key = _warm_key(ref, world_size, backend, isolate)
    if key in _warmed:
        return
    _warmed.add(key)
    _preload(ref, backend, isolate)
    try:
        tpsim.run(resolve_only, world_size, backend=backend, args=(ref,), timeout=WARM_TIMEOUT, isolate=isolate)
    except Exception:  # noqa: BLE001 - the case's own run reports whatever this is
        pass


def _preload(ref: Ref, backend: str, isolate: bool) -> None:
    """Import the target in the zygote the workers are forked from (once per zygote)."""
    from tpsim.comm import procs, zygote

    if backend not in procs.PROCESS_BACKENDS and not isolate:
        return
    key = (ref[0], repr(ref[2]), zygote.pid())
    if key in _preloaded:
        return
    _preloaded.add(key)
    procs.preload(resolve_only, (ref,), WARM_TIMEOUT)  # its error, if any, the workers report again


def watched(rank_local: tuple[str, ...]) -> tuple[str, ...]:
    """The loaded modules of the packages a variant's rank-local modules belong to: a layer class in
    ``pkg.layers`` may keep its tp group in ``pkg.state``, which inproc then watches for sharing
    between ranks. A library preset declares its state itself and is not widened."""
    # Asked once per world run: remembered while no module is imported (sys.modules only grows in
    # a check, so its size tells when to look again).
    key = (rank_local, len(sys.modules))
    if _watched[0] is not None and _watched[0][0] == key:
        return _watched[0][1]
    from tpsim.presets import presets

    declared = {t.split(".")[0] for p in presets() for t in p.targets}
    tops = {name.split(".")[0] for name in rank_local} - declared
    found = [name for name in list(sys.modules) if "." in name and name.split(".")[0] in tops]
    found += [name for name in _siblings_used(rank_local) if name not in found and name not in rank_local
              and name.split(".")[0] not in declared | {"tpsim"}]
    _watched[0] = (key, tuple(found))
    return tuple(found)


def _siblings_used(rank_local: tuple[str, ...]) -> list[str]:
    """The modules a rank-local module imports from beside it (a file in its directory or below: a
    script's ``import parallel_state as pgm``, where picotron and vLLM-style code keep the tp group;
    or ``from helpers import reduce``, whose module keeps its own state, a cached workspace)."""
    import os
    import types

    out = []
    for name in rank_local:
        module = sys.modules.get(name)
        where = os.path.dirname(getattr(module, "__file__", None) or "")
        if not where:
            continue
        for value in list(vars(module).values()):
            kind = type(value)  # not isinstance: it would ask a hostile object for its __class__
            if issubclass(kind, types.ModuleType):
                source = value
            elif issubclass(kind, (types.FunctionType, type)):
                try:
                    home = type.__dict__["__module__"].__get__(value) if issubclass(kind, type) else value.__module__
                except AttributeError:  # a class with no __module__ of its own
                    continue
                source = sys.modules.get(home) if type(home) is str else None
            else:
                continue
            path = getattr(source, "__file__", None)
            if isinstance(path, str) and os.path.dirname(path).startswith(where) and source.__name__ not in out \
                    and source.__name__ != name:
                out.append(source.__name__)
    return out


_watched: list[tuple[tuple[Any, ...], tuple[str, ...]] | None] = [None]
