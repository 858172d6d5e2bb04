"""The ``module`` family: whole tensor-parallel modules (:class:`tpsim.module_variant.ModuleVariant`).

Targets: a :class:`ModuleVariant` (or a list of them) named ``MODULE:Name``; a plain ``nn.Module``
class with ``--kind module`` (its constructor takes the sizes and a group keyword, see
:func:`tpsim.module_variant.module_from_class`); a bare module's ``TPSIM_MODULES`` list, else its
module-level :class:`ModuleVariant` objects (``tpsim.layers``: tpsim's own MLPs). The CLI's
``--input``/``--output``/``--input-grad``/``--sequence-dim``/``--param-grad``/``--forward-only`` adapt them.

A forward-only variant (``ModuleVariant(forward_only=True)``, ``--forward-only``: an inference
module) runs one forward under ``torch.no_grad()`` in every world and is checked for
:data:`~tpsim.props.property_names.FORWARD_ONLY` only (a refusal by ``assert`` on every rank counts
for divisibility, as for a forward-only linear layer).

Its dense reference is the module itself on a tp group of one rank (:mod:`tpsim.props.module.world`);
its tolerances come from the magnitude run (:mod:`tpsim.props.module.magnitude`) where it bounds every
operation of a float64 or float32 case, else from the dense twin run in the case's precision
(:mod:`tpsim.props.module.twin`: any operation, every dtype, never a refusal); a failing case is
run again with its sublayers' boundaries recorded, so that the report names the first sublayer
that diverges (:func:`tpsim.props.module.checks.localise`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.module_variant import GROUP_KEYWORDS, MODULE_KIND, ModuleVariant, SizeCatalog, module_from_class
from tpsim.placement import Replicate
from tpsim.props.family import ADAPTER_OPTIONS, Family, World
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.checks import (
    MODULE_CHECKS,
    NUMERIC_PATTERNS,
    ModuleContext,
    grad_property,
    layout_failure,
    localise,
    offending,
    truncated_piece,
)
from tpsim.props.module.plans import PlanVariant, name_plan_entry, plan_variant, resolve_plan, twin_variant
from tpsim.props.module.strategies import MAX_PER_RANK, module_cases
from tpsim.props.module.world import ModuleData, Reference, Ties, is_divisible, rank_main, reference_run
from tpsim.props.observation import Observation
from tpsim.props.property_names import BIAS_GRAD, DIVISIBILITY, FORWARD, FORWARD_ONLY, PROPERTIES
from tpsim.variant import ParamSpec

__all__ = ["MODULE", "MODULE_DTYPES", "ModuleFamily"]

#: The dtypes module targets are checked in: every dtype (bfloat16 and float16 against the dense twin,
#: see :mod:`tpsim.props.module.twin`).
MODULE_DTYPES = ("float64", "float32", "bfloat16", "float16")


class ModuleFamily(Family, name="module", kinds=(MODULE_KIND,), variant_type=ModuleVariant, case_type=ModuleCase,
                   properties=PROPERTIES, subject="a whole module"):
    """Whole modules, checked against themselves on a one-rank tp group (see :mod:`tpsim.props.module`)."""

    strategy = staticmethod(module_cases)
    declared_list = "TPSIM_MODULES"
    adapter_options = ("input", "output", "input_grad", "sequence_dim", "param_grad", "plan", "plan_twin", "forward_only")
    params_inferred = True
    dtypes = None  # every dtype: the dense twin judges what the derived bound cannot
    confirmed_in_float64 = NUMERIC_PATTERNS
    checks = MODULE_CHECKS
    context_type = ModuleContext
    noun = "module"

    # --- targets -----------------------------------------------------------------------------------

    def takes(self, options: Mapping[str, Any]) -> bool:
        # Without --kind module, the adapter flags adapt the linear variants of a bare module, not its modules.
        return options.get("kind") == MODULE_KIND or not any(
            options.get(k) is not None for k in ADAPTER_OPTIONS if k not in ("plan", "plan_twin", "forward_only"))

    def foreign_option(self, where: str, option: str) -> str:
        flag = f"--{option.replace('_', '-')}"
        if option == "packed":
            return (f"{where} is a whole module; {flag} applies to single linear layers: declare a module's packed "
                    "parameter with ModuleVariant(params=(ParamSpec(name, 'weight', Shard(0, parts=...)),)), or name "
                    "its packed parts in the layer's output_sizes/parts attribute")
        return (f"{where} is a whole module; {flag} applies to single linear layers (a module is built from its "
                f"constructor's sizes and its {'/'.join(GROUP_KEYWORDS)} keyword): check it without {flag}")

    def from_object(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        from tpsim.presets import preset_for_class

        preset = preset_for_class(obj) if options.get("plan") is None and isinstance(obj, type) else None
        if preset is not None and preset[1] in self.kinds:
            # A library's module, or a subclass of one (a patch): checked under the library's plan.
            return [self.adapt(v, options, target) for v in preset[0].variants(obj, preset[1])]
        plan = options.get("plan")
        if not ((options.get("kind") == MODULE_KIND or plan is not None) and isinstance(obj, type)
                and issubclass(obj, nn.Module)):
            return None
        from tpsim._target_files import import_target_module

        module = import_target_module(target.partition(":")[0])
        if plan is not None:  # a dense class under a plan (tpsim.props.module.plans)
            found, plan_name = resolve_plan(plan)
            variant = plan_variant(obj, found, plan_name=plan_name)
        else:
            variant = module_from_class(obj)
        return [self.own_module(self.adapt(variant, options, target), module)]

    def adapt(self, variant: ModuleVariant, options: Mapping[str, Any], where: str) -> ModuleVariant:
        super().adapt(variant, options, where)
        if options.get("plan") is not None and not isinstance(variant, PlanVariant):
            raise InvalidArgument(f"--plan applies to a dense nn.Module class (MODULE:DenseClass --plan MODULE:PLAN); "
                                  f"{where} is already a tensor-parallel module variant")
        changes = {k: options[k] for k in ("input", "output", "input_grad", "sequence_dim", "forward_only")
                   if options.get(k) is not None}
        variant = variant.replace(**changes) if changes else variant
        twin = options.get("plan_twin")
        if twin is not None and isinstance(variant, PlanVariant):
            variant = twin_variant(variant, twin)
        return variant

    def declare_grads(self, variant: ModuleVariant, grads: dict[str, str]) -> ModuleVariant:
        # A parameter the variant does not declare is declared replicated (its layout is read from
        # the built module anyway), a bias by its name.
        declared = {s.name: s for s in variant.params}
        for name, mode in grads.items():
            master = "bias" if name.rpartition(".")[2] == "bias" else "weight"
            base = declared.get(name) or ParamSpec(name, master, Replicate())
            declared[name] = dataclasses.replace(base, grad=mode)
        return variant.replace(params=tuple(declared.values()))

    # --- a search ----------------------------------------------------------------------------------

    def prepared(self, variant: ModuleVariant) -> ModuleVariant:
        from tpsim.module_variant import parameters_of

        return variant if variant.parameters is not None else variant.replace(parameters=parameters_of(variant))

    def applicable(self, variant: ModuleVariant) -> tuple[str, ...]:
        kept = FORWARD_ONLY if variant.forward_only else self.properties
        dropped = {DIVISIBILITY} if isinstance(variant, PlanVariant) else set()
        if variant.parameters is not None and not any(grad_property(variant, n) == BIAS_GRAD
                                                      for n in variant.parameters):
            dropped.add(BIAS_GRAD)  # no bias: no bias grad that could be wrong
        return tuple(p for p in self.properties if p in kept and p not in dropped)

    def why_not_applicable(self, variant: ModuleVariant) -> dict[str, str]:
        why = {}
        if isinstance(variant, PlanVariant):
            why[DIVISIBILITY] = variant.UNEVEN_CASES_NOTE if variant.uneven_sizes_are_cases else variant.UNEVEN_NOTE
        if BIAS_GRAD not in self.applicable(variant) and not variant.forward_only:
            why[BIAS_GRAD] = "the module has no bias parameter"
        return why

    def nothing_applies(self, variant: ModuleVariant, properties: tuple[str, ...], applies: tuple[str, ...]) -> str:
        why = f"variant {variant.name!r} is forward-only, so only" if variant.forward_only else f"{self.subject} is checked for"
        return f"properties={list(properties)!r}: {why} {', '.join(applies)}; choose other properties"

    def plan_dtypes(self, variant: ModuleVariant, dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
        # A variant may be checked in some dtypes only (ModuleVariant.dtypes; its notes say why).
        if variant.dtypes is None:
            return super().plan_dtypes(variant, dtypes)
        kept = tuple(d for d in dtypes if d in variant.dtypes)
        if not kept:
            raise InvalidArgument(f"dtypes={list(dtypes)!r}: {variant.name!r} is checked in {', '.join(variant.dtypes)} "
                                  "only (see its notes)")
        return kept, ([] if kept == dtypes else [f"dtypes {', '.join(kept)} only"])

    def notes(self, variant: ModuleVariant) -> list[str]:
        notes = []
        if variant.forward_only:
            notes.append(f"{variant.name} is forward-only: one forward under torch.no_grad() per case, no backward and "
                         f"no training steps; only {', '.join(self.applicable(variant))} apply"
                         + ("; a non-divisible case refused by an assert on every rank counts as refused, but "
                            "python -O strips asserts (raise a ValueError to refuse under -O too)"
                            if DIVISIBILITY in self.applicable(variant) else ""))
        if not isinstance(variant, PlanVariant):
            return notes
        world = [] if variant.subgroups else ["tp groups spanning the whole world only (the plan builds its own mesh "
                                              "over the world)"]
        uneven = PlanVariant.UNEVEN_CASES_NOTE if variant.uneven_sizes_are_cases else PlanVariant.UNEVEN_NOTE
        return [*notes, uneven, *world]

    def cases(self, variant: ModuleVariant, **kwargs: Any) -> Any:
        # A plan that builds its mesh over the whole world is checked on one tp group spanning it.
        kwargs["subgroups"] = kwargs["subgroups"] and getattr(variant, "subgroups", True)
        if not kwargs["subgroups"]:
            kwargs["tp_sizes"] = None
        # The input memory layouts asked for (a search's ``layouts``) narrow the module cases too.
        kwargs["non_divisible"] = (kwargs["non_divisible"] or self.uneven_sizes_are_cases
                                   or getattr(variant, "uneven_sizes_are_cases", False))
        return module_cases(variant, **kwargs)

    def fault_case(self, variant: ModuleVariant, world_size: int, seed: int) -> ModuleCase:
        ws = world_size
        sizes = tuple(ws * max(2, -(-low // ws)) for low in variant.min_sizes or (1,) * len(variant.sizes))
        drawn = dict(variant.size_strategy.drawn_by).get((ws, True)) if isinstance(variant.size_strategy,
                                                                                  SizeCatalog) else None
        if drawn:  # sizes that constrain each other: the smallest tuple the variant's own strategy drew
            sizes = drawn[0]
        batch: tuple[int, ...] = (2,) * max(1, variant.min_batch_dims)
        if "sequence-sharded" in (variant.input, variant.output):
            # The fewest batch dims that put the sequence dim before the features (as the cases draw them).
            sd = variant.sequence_dim
            batch = (2,) * (max(1, -sd - 1) if sd < 0 else sd + 1)
            d = variant.sequence_dim_of(len(batch) + 1)
            if d is not None:
                batch = (*batch[:d], ws * MAX_PER_RANK, *batch[d + 1:])  # the sequence: a few tokens per rank
        return ModuleCase(world_size=ws, sizes=sizes, batch_shape=batch, seed=seed, size_names=variant.sizes,
                          unsharded=variant.unsharded)

    # --- one case ----------------------------------------------------------------------------------

    def divisible(self, variant: ModuleVariant, case: ModuleCase) -> bool:
        return is_divisible(variant, case)

    def world(self, variant: ModuleVariant, case: ModuleCase, *, timeout: float, isolate: bool = False,
              capture: bool = False, ref: Reference | None = None, tie: Ties = (), **_: Any) -> World:
        """The reference world first (unless ``ref`` is given: it raises
        :class:`~tpsim.props.observation.DenseReferenceFailed` when the module fails on one rank),
        then the tp world on its data; ``capture``: both record every sublayer's boundaries; ``tie``:
        rows of masters made equal (:data:`tpsim.props.module.world.Ties`)."""
        if ref is None:
            ref = reference_run(variant, case, timeout=timeout, capture=capture, isolate=isolate, tie=tie)
        data = ModuleData(ref.shapes, ref.masters, ref.inputs, ref.grads,
                          max_norms=[group.value.max_norm for group in ref.groups])
        return World(rank_main, {"case": case, "data": data, "capture": capture}, ref)

    def offending(self, variant: ModuleVariant, case: ModuleCase) -> tuple[str, list[int]]:
        return offending(variant, case)

    def accepted(self, variant: ModuleVariant, obs: Observation, wanted: Sequence[str]) -> list[Any]:
        # Consistent pieces (torch.tensor_split's for an uneven dim) must compute the dense result.
        found = truncated_piece(variant, obs, offending(variant, obs.case)[0])
        if found is not None or any(v.problems for v in obs.values or []):
            return [found] if found is not None else []  # a parameter missing or extra: refused
        return super().accepted(variant, obs, wanted)

    def layout_failure(self, variant: ModuleVariant, obs: Observation) -> Any:
        return layout_failure(variant, obs)

    def one_rank_informative(self, variant: ModuleVariant) -> bool:
        # The dense reference is the module itself on a tp group of one rank (unless a dense builder is given):
        # on one rank it passes by construction, so only a factor that grows with the tp size fails at all.
        return variant.dense is not None

    def explain_failures(self, variant: ModuleVariant, case: ModuleCase, obs: Observation, failures: list[Any], *,
                  backend: str, timeout: float, isolate: bool, properties: Sequence[str] | None) -> list[Any]:
        def traced() -> Observation:
            return self.observe(variant, case, backend=backend, timeout=timeout, capture=True, isolate=isolate)

        def rerun(other: ModuleVariant, case: ModuleCase = case, tie: Ties = ()) -> list[Any]:
            seen = self.observe(other, case, backend=backend, timeout=timeout, isolate=isolate, tie=tie)
            if any(getattr(v, "problems", None) for v in seen.values or []):
                # A re-run that could not lay out every parameter was not judged: it is no evidence.
                raise InvalidArgument(f"the re-run of {other.name!r} could not lay out every parameter")
            return self.judge(other, seen, (FORWARD,))

        failures = localise(variant, case, obs, failures, traced, rerun)
        if not variant.forward_only and obs.values and all(getattr(v, "frozen", False) for v in obs.values):
            for f in failures[:1]:  # the first cause: its consequences follow from it
                if f.property != FORWARD:
                    f.message += (f"; note: every parameter of {variant.name} has requires_grad=False (an inference "
                                  "module?): check it forward-only with --forward-only "
                                  "(ModuleVariant(forward_only=True)), which runs no backward")
        if isinstance(variant, PlanVariant) and not dict(variant.options).get("plan_twin"):
            failures = name_plan_entry(self, variant, case, failures, backend=backend, timeout=timeout,
                                       isolate=isolate, properties=properties)
        return failures


#: The module family object (registered as ``"module"`` in :mod:`tpsim.props.family`).
MODULE = ModuleFamily()
