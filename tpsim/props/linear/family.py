"""The ``linear`` family: single tensor-parallel linear layers (:class:`tpsim.variant.Variant`).

Its hooks: targets are :class:`~tpsim.variant.Variant` objects, or plain ``nn.Module`` classes
adapted by their constructor convention (:mod:`tpsim.conventions`) or, for a class that derives from
a library's layer, by that library's preset (:mod:`tpsim.presets`); a bare module declares them in
``TPSIM_VARIANTS``. Cases are :class:`~tpsim.props.case.Case` objects drawn by
:mod:`tpsim.props.strategies`; one world run per case (:mod:`tpsim.props.linear.world`: the float64 dense
``x Wᵀ + b`` reference, the rank function) is judged by :mod:`tpsim.props.linear.checks`. A failing case
with a non-contiguous input layout is run again as its contiguous twin.
"""

from __future__ import annotations

import collections
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType
from typing import Any

from torch import nn

from tpsim.conventions import variant_from_class
from tpsim.diagnosis import Failure
from tpsim.errors import InvalidArgument
from tpsim.placement import Shard, part_sizes
from tpsim.presets import preset_for_class, preset_for_target
from tpsim.props.family import ADAPTER_OPTIONS, Family, World
from tpsim.props.linear.case import Case
from tpsim.props.linear.checks import (
    LINEAR_CHECKS,
    LinearContext,
    PropertyFailed,
    accepted,
    layout_failure,
    offending,
    wrong_group,
)
from tpsim.props.linear.strategies import cases
from tpsim.props.linear.world import expanded_out_features, is_divisible, make_masters, rank_main
from tpsim.props.observation import Observation
from tpsim.props.property_names import (
    BIAS_GRAD,
    DIVISIBILITY,
    FORWARD,
    FORWARD_ONLY,
    INPUT_GRAD,
    PROPERTIES,
    REPLICA,
    TRAINING,
    WEIGHT_GRAD,
)
from tpsim.props.strategies import DEFAULT_MAX_SIZE
from tpsim.runner import DEFAULT_TIMEOUT
from tpsim.variant import KINDS, Variant

__all__ = [
    "LINEAR",
    "LinearFamily",
    "bias_grad_equivalence",
    "check_case",
    "divisibility",
    "forward_equivalence",
    "input_grad_equivalence",
    "replica_consistency",
    "training_equivalence",
    "weight_grad_equivalence",
]

#: The options that override a declared variant's placements.
_OVERRIDES = ("input", "output", "input_grad")
#: The options that override a variant's layout after it is built (plain classes and declared variants).
_LAYOUT_OPTIONS = ("packed", "head_size", "sequence_dim", "forward_only")


class LinearFamily(Family, name="linear", kinds=KINDS, variant_type=Variant, case_type=Case, properties=PROPERTIES,
                   subject="a linear layer"):
    """Single linear layers: column- and row-parallel variants (see :mod:`tpsim.variant`)."""

    declared_list = "TPSIM_VARIANTS"
    adapter_options = tuple(k for k in ADAPTER_OPTIONS if k not in ("plan", "plan_twin"))
    checks = LINEAR_CHECKS
    context_type = LinearContext

    # --- targets -----------------------------------------------------------------------------------

    def from_object(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        if not (isinstance(obj, type) and issubclass(obj, nn.Module)):
            return None
        preset = preset_for_class(obj) if options.get("convention") is None else None
        if preset is not None:
            # A library class, or a subclass of one (a fork or a patch): the library's preset.
            library, kind = preset
            if kind not in KINDS:
                return None  # a library's embedding (a preset of another family's kind): that family's
            if options.get("kind") not in (None, kind):
                raise InvalidArgument(f"{target} derives from {library.name}'s {kind}-parallel layer; --kind "
                                      f"{options['kind']} contradicts it")
            return [self.adapt(v, options, target) for v in library.variants(obj, kind)]
        variant = variant_from_class(obj, convention=options.get("convention"), kind=options.get("kind"),
                                     ctor_args=options.get("ctor_arg") or (), **{k: options.get(k) for k in _OVERRIDES})
        return [self._layout(variant, options)]

    def adapt(self, variant: Variant, options: Mapping[str, Any], where: str) -> Variant:
        for flag in ("convention", "ctor_arg"):
            if options.get(flag) is not None:
                raise InvalidArgument(f"{where} is a tpsim Variant (or a library's layer, checked by its preset); "
                                      f"--{flag.replace('_', '-')} applies to plain nn.Module classes only")
        if options.get("kind") not in (None, variant.kind):
            raise InvalidArgument(f"{where} is a {variant.kind} variant; --kind {options['kind']} contradicts it")
        overrides = {k: options[k] for k in _OVERRIDES if options.get(k) is not None}
        return self._layout(variant.replace(**overrides) if overrides else variant, options)

    @staticmethod
    def _layout(variant: Variant, options: Mapping[str, Any]) -> Variant:
        layout = {k: options[k] for k in _LAYOUT_OPTIONS if options.get(k) is not None}
        return variant.replace(**layout) if layout else variant

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        from tpsim.target import DECLARED_IN

        if any(options.get(k) is not None for k in ("convention", "kind")):
            library = preset_for_target(target)
            if library is not None:
                raise InvalidArgument(f"{target!r} is {library.name}'s layers, checked by its preset; "
                                      "--convention/--kind apply to plain classes")
            # (tpsim.layers declares its variants elsewhere: each is adapted, and refuses on its own.)
            if target not in DECLARED_IN and super().declared(target, module, {}):
                raise InvalidArgument(f"{target!r} is a bare module; --convention/--kind need a class: use "
                                      f"{target}:ClassName")
        return super().declared(target, module, options)

    def declare_grads(self, variant: Variant, grads: dict[str, str]) -> Variant:
        # The grads of the parameters this variant has (the engine refuses a name no variant has).
        names = {n for s in variant.params or () for n in (s.name, s.master)}
        return variant.with_param_grads({k: v for k, v in grads.items() if k in names})

    # --- a search ----------------------------------------------------------------------------------

    def applicable(self, variant: Variant) -> tuple[str, ...]:
        # A variant that declares divisible cases only (a documented upstream limit): no case could
        # test divisibility, so it is dropped and the report's notes say so; likewise bias grads of a
        # layer without a bias.
        dropped = {DIVISIBILITY} if variant.divisible_only else set()
        if not variant.bias:
            dropped.add(BIAS_GRAD)
        if variant.forward_only:
            dropped |= set(self.properties) - set(FORWARD_ONLY)
        return tuple(p for p in self.properties if p not in dropped)

    def nothing_applies(self, variant: Variant, properties: tuple[str, ...], applies: tuple[str, ...]) -> str:
        why = []
        if variant.divisible_only and DIVISIBILITY in properties:
            why.append("declares divisible_only=True, so the divisibility property does not apply")
        if not variant.bias and BIAS_GRAD in properties:
            why.append("has no bias, so bias-grad-equivalence does not apply")
        if variant.forward_only:
            why.append(f"is forward-only, so only {', '.join(FORWARD_ONLY)} apply")
        return f"properties={list(properties)!r}: variant {variant.name!r} {' and '.join(why)}; choose other properties"

    def notes(self, variant: Variant) -> list[str]:
        notes = []
        if not variant.bias and not any("bias" in n for n in variant.notes):
            notes.append(f"{variant.name} has no bias: bias-free cases only")
        notes.extend(f"{variant.name} declares {r}" for r in variant.restrictions())
        if variant.forward_only and not variant.divisible_only:
            notes.append(f"{variant.name} is forward-only: a non-divisible case refused by an assert on every rank "
                         "counts as refused, but python -O strips asserts (raise a ValueError to refuse under -O too)")
        if variant.packed and variant.head_size is not None:
            partial = [s.name for s in variant.params or () if s.grad == "partial" and isinstance(s.placement, Shard)]
            who = (f"each replica's grad of {', '.join(partial)} is its own share, summed by the trainer" if partial
                   else "every replica's grad is the head's whole grad (the layer sums the shares)")
            notes.append(f"{variant.name} packs Q/K/V {list(variant.packed)} by heads of {variant.head_size} rows: "
                         f"key/value heads fewer than ranks are replicated (rank r holds head r*heads//tp); {who}")
        return notes

    def cases(self, variant: Variant, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...], non_divisible: bool,
              tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...],
              max_size: int = DEFAULT_MAX_SIZE) -> Any:
        if variant.contiguous_inputs:
            layouts = ("contiguous",)  # its declared precondition (see Variant.contiguous_inputs)
        return cases(variant, world_sizes=world_sizes, dtypes=dtypes, non_divisible=non_divisible,
                     tp_sizes=tp_sizes, subgroups=subgroups, layouts=layouts, max_per_rank=max_size)

    def cover_keys(self, variant: Variant, case: Case, world_sizes: tuple[int, ...]) -> list[Any]:
        """The shared buckets, and for a head-packed Q/K/V variant (``head_size``) how its key/value heads
        sit on the ranks, in the attention family's words: ``("kv-heads", "replicated, one" | "replicated,
        several" | "N per rank")``; so fewer key/value heads than ranks are checked early at every seed."""
        keys = super().cover_keys(variant, case, world_sizes)
        tp = case.tp_size or case.world_size
        if keys and tp > 1 and variant.packed and variant.head_size is not None:
            kv = part_sizes(case.out_features, Shard(0, parts=variant.packed))[1] // variant.head_size
            keys.append(("kv-heads", f"{kv // tp} per rank" if kv >= tp else
                         "replicated, one" if kv == 1 else "replicated, several"))
        return keys

    def fault_case(self, variant: Variant, world_size: int, seed: int) -> Case:
        features = 2 * world_size * (sum(variant.packed) if variant.packed else 1)
        # Head-packed: world_size heads per unit of the proportions (every part divides).
        out = features if variant.head_size is None else features * variant.head_size // 2
        return Case(world_size=world_size, in_features=features, out_features=out, batch_shape=(2,), bias=True,
                    seed=seed)

    # --- one case ----------------------------------------------------------------------------------

    def divisible(self, variant: Variant, case: Case) -> bool:
        return is_divisible(variant, case)

    def observe(self, variant: Variant, case: Case, **how: Any) -> Observation:
        """The world run of ``case``; a non-divisible case whose ranks' parameters all have
        ``torch.chunk``'s pieces, and not all ``torch.tensor_split``'s, runs again with every rank
        loaded and fed by chunk's (a rank whose piece has the same size in both layouts cannot tell
        alone which one the layer uses: its peers' shapes say)."""
        obs = super().observe(variant, case, **how)
        values = obs.values or []
        if (not obs.divisible and how.get("pieces") is None and values
                and all("chunk" in getattr(v, "fits", ()) for v in values)
                and not all("tensor_split" in getattr(v, "fits", ()) for v in values)):
            return super().observe(variant, case, **how, pieces="chunk")
        return obs

    def world(self, variant: Variant, case: Case, *, layout: str | None = None, pieces: str | None = None,
              **_: Any) -> World:
        """``layout`` overrides the memory layout of the case's tensors (same values): ``"contiguous"``
        runs the contiguous twin of a non-contiguous case; ``pieces`` (``"chunk"``) the layout every
        rank of a non-divisible case is loaded and fed by (see :meth:`observe`)."""
        if variant.packed and case.out_features % sum(variant.packed):
            raise InvalidArgument(
                f"case out_features={case.out_features} is not a multiple of variant {variant.name!r}'s packed part "
                f"proportions {list(variant.packed)} (sum {sum(variant.packed)}); use out_features = k * "
                f"{sum(variant.packed)}"
            )
        masters = make_masters(case, expanded_out_features(variant, case))
        payload = {"case": case, "data": masters, "divisible": is_divisible(variant, case), "layout": layout,
                   "pieces": pieces}
        return World(rank_main, payload, masters)

    def offending(self, variant: Variant, case: Case) -> tuple[str, list[int]]:
        return offending(variant, case)

    def accepted(self, variant: Variant, obs: Observation, wanted: Sequence[str]) -> list[Any]:
        return accepted(self, variant, obs, wanted)

    def failed_run(self, variant: Variant, obs: Observation) -> Any:
        return layout_failure(variant, obs) or super().failed_run(variant, obs)

    def wrong_group(self, variant: Variant, obs: Observation, groups: list[list[int]]) -> dict[str, dict[str, Any]]:
        return wrong_group(variant, obs, groups)

    def follow_up(self, variant: Variant, case: Case, obs: Observation, failures: list[Any], *, backend: str,
                  timeout: float, isolate: bool, properties: Sequence[str] | None) -> list[Any]:
        """A failing case with a non-contiguous ``input_layout`` is run again as its contiguous twin
        (same values, contiguous tensors): a failure the twin does not show appears only for
        non-contiguous layouts, and says so."""
        from tpsim.diagnosis import group_causes

        failures = group_causes(failures)
        if case.input_layout == "contiguous":
            return failures
        twin = self.observe(variant, case, backend=backend, timeout=timeout, isolate=isolate, layout="contiguous")
        seen = {f.property for f in group_causes(self.judge(variant, twin, properties))}
        for f in failures:
            if f.property not in seen:
                f.message += (
                    f" — the bug appears only for non-contiguous layouts: the contiguous twin of this case (same "
                    f"values, input_layout=contiguous instead of {case.input_layout}) passes"
                )
                f.details = dict(f.details, contiguous_twin="passes")
        return failures


#: The linear family object (registered as ``"linear"`` in :mod:`tpsim.props.family`).
LINEAR = LinearFamily()


# --- public, one function per property -----------------------------------------------------------

_CACHE: collections.OrderedDict[tuple[int, Case, str], tuple[Variant, Observation]] = collections.OrderedDict()
_CACHE_SIZE = 8


def _observation(variant: Variant, case: Case, backend: str, timeout: float) -> Observation:
    # The property functions of one case share one world run (pytest calls them one by one).
    key = (id(variant), case, backend)
    hit = _CACHE.get(key)
    if hit is not None and hit[0] is variant:
        _CACHE.move_to_end(key)
        return hit[1]
    obs = LINEAR.observe(variant, case, backend=backend, timeout=timeout)
    _CACHE[key] = (variant, obs)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return obs


def check_case(
    variant: Variant,
    case: Case,
    *,
    backend: str = "inproc",
    timeout: float = DEFAULT_TIMEOUT,
    properties: Sequence[str] | None = None,
    isolate: bool = False,
) -> list[Failure]:
    """Run ``case`` once and evaluate every property (or ``properties``); return the failures (the
    linear family's :meth:`~tpsim.props.family.Family.check_case`: a failing case with a non-contiguous
    ``input_layout`` is run again as its contiguous twin). ``isolate=True``: run inproc worlds in a
    supervised worker process (see :func:`tpsim.run`)."""
    return LINEAR.check_case(variant, case, backend=backend, timeout=timeout, properties=properties, isolate=isolate)


def _one(prop: str) -> Callable[..., None]:
    def check(variant: Variant, case: Case, *, backend: str = "inproc", timeout: float = DEFAULT_TIMEOUT) -> None:
        obs = _observation(variant, case, backend, timeout)
        if prop == DIVISIBILITY and obs.divisible:
            raise InvalidArgument(
                f"divisibility needs a case whose sharded sizes do not divide by world_size={case.world_size}; "
                f"got {case.describe()}"
            )
        for failure in LINEAR.judge(variant, obs, (prop,)):
            raise PropertyFailed(failure)

    check.__name__ = prop.replace("-", "_")
    return check


forward_equivalence = _one(FORWARD)
forward_equivalence.__doc__ = "The output (assembled by the output placement) equals the dense float64 output."
input_grad_equivalence = _one(INPUT_GRAD)
input_grad_equivalence.__doc__ = "Each rank's input grad matches the dense input grad (complete/partial/sharded)."
weight_grad_equivalence = _one(WEIGHT_GRAD)
weight_grad_equivalence.__doc__ = "Each rank's weight grad equals its slice of the dense weight grad (layout honoured)."
bias_grad_equivalence = _one(BIAS_GRAD)
bias_grad_equivalence.__doc__ = "Each rank's bias grad equals its slice (column) or the whole (row) dense bias grad."
replica_consistency = _one(REPLICA)
replica_consistency.__doc__ = "Replicated outputs, input grads and replicated parameters agree bit for bit across ranks."
training_equivalence = _one(TRAINING)
training_equivalence.__doc__ = ("Trained as people train (micro-batches accumulated, then an SGD step), the accumulated "
                                "grads and the re-assembled parameters match dense training.")
divisibility = _one(DIVISIBILITY)
divisibility.__doc__ = "A non-divisible case raises on every rank (no hang, no silent truncation)."
