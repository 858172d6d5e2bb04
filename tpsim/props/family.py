"""Families of check targets: one base class, whose hooks each kind of target fills in.

tpsim checks several kinds of target, each described by its own variant type: a single linear layer
(:class:`tpsim.variant.Variant`, family ``linear``), a whole module (:class:`tpsim.module_variant.ModuleVariant`,
``module``), a vocab-parallel embedding or cross-entropy (``embedding``, ``cross-entropy``), a
head-sharded attention block (``attention``). :func:`tpsim.props.search.search`, ``tpsim check``,
``tpsim replay``, fault plans and :func:`tpsim.props.suite.property_tests` only ever talk to a
:class:`Family`. The engine here does, once for every family: resolving a target's objects into
variants (:meth:`Family.resolve`, :meth:`Family.declared`; the TARGET forms, ``--rank-local`` and
``--param-grad`` are :mod:`tpsim.target`'s), planning a search (:meth:`Family.plan`), one world run
per case (:meth:`Family.observe`: data drawn from the seed, the rank function on the world, one
:class:`~tpsim.props.observation.Observation`), judging it (:meth:`Family.judge`: what every family
shares, then the family's properties), holding every name a failure gives to its confirmation rule
(:meth:`Family.confirm_claims`: a numeric pattern to the float64 re-run of a narrower case, a factor
of the tp size to the same case on one rank) and case files (:meth:`Family.case_from_dict`).

**Adding a family** (the recipe of docs/design.md): a variant type (a frozen dataclass with ``name``,
``target``, ``options``, ``rank_local``, ``notes``, ``kind``/``input``/``output``/``input_grad``/``bias``,
``describe()``, ``replace()``), a case type (a frozen dataclass deriving from
:class:`tpsim.props.case.CaseBase`), a rank function (built on :mod:`tpsim.props.rank`), a dense
reference and its diagnoses, then a subclass of :class:`Family` that names them — ``name``, ``kinds``,
``variant_type``, ``case_type``, ``properties`` — and fills in :meth:`Family.world` (the data and
the rank function of one case), :meth:`Family.divisible`, :meth:`Family.evaluate` (its properties
and recognisers), :meth:`Family.cases` (its Hypothesis strategy) and :meth:`Family.fault_case`;
plus one line in :data:`_BUILTIN`. The other hooks have defaults that fit most families.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any, ClassVar

from tpsim.errors import InvalidArgument, RankError
from tpsim.props.judging import GroupContext, judge
from tpsim.props.layouts import cover_bucket, shows
from tpsim.props.observation import DenseReferenceFailed, Observation
from tpsim.props.property_names import DIVISIBILITY
from tpsim.props.sizes import DEFAULT_MAX_SIZE
from tpsim.runner import DEFAULT_TIMEOUT

__all__ = [
    "ADAPTER_OPTIONS",
    "FAMILIES",
    "Family",
    "World",
    "families",
    "family_named",
    "family_of",
    "family_of_case",
    "kind_choices",
    "register",
]

#: The CLI's adapter flags (``--convention``, ``--packed``, ...): each family takes some of them
#: (:attr:`Family.adapter_options`) and refuses the others.
ADAPTER_OPTIONS = ("convention", "packed", "head_size", "input", "output", "input_grad", "sequence_dim", "param_grad", "plan",
                   "plan_twin", "forward_only", "ctor_arg")


@dataclass
class World:
    """One case's world run, as a family prepares it: the rank function ``fn`` (module-level: worker
    processes import it), the ``payload`` every rank gets (the engine adds the variant) and the
    ``data`` the parent keeps for judging the run (what it drew from the seed)."""

    fn: Any
    payload: dict[str, Any]
    data: Any


class Family:
    """A family of check targets (see the module docstring for the hooks a family fills in)."""

    #: Stable name, written into case files (``"linear"``, ``"module"``).
    name: ClassVar[str]
    #: The ``--kind`` values that select this family (``("column", "row")`` for linear layers).
    kinds: ClassVar[tuple[str, ...]]
    #: The variant type (``isinstance`` tells which family a variant belongs to).
    variant_type: ClassVar[type]
    #: The case type (a :class:`tpsim.props.case.CaseBase`).
    case_type: ClassVar[type]
    #: Every property the family checks, in report order: the ones it is searched, reported and
    #: tested on (:func:`tpsim.props.suite.property_tests` generates a test for each).
    properties: ClassVar[tuple[str, ...]]
    #: How messages name a variant of the family (``"an embedding"``: "an embedding is checked for ...").
    subject: ClassVar[str]
    #: The list a bare module declares this family's variants in (else its module-level variants),
    #: and whether other families' variants share it.
    declared_list: ClassVar[str | None] = None
    declared_list_shared: ClassVar[bool] = False
    #: The CLI adapter flags (:data:`ADAPTER_OPTIONS`) this family's variants take.
    adapter_options: ClassVar[tuple[str, ...]] = ()
    #: Whether the family reads its variants' parameters from the built module (any name may be
    #: declared with ``--param-grad``) rather than from the variant's declared ``params``.
    params_inferred: ClassVar[bool] = False
    #: The dtypes the family is checked in (None: all), and why no others.
    dtypes: ClassVar[tuple[str, ...] | None] = None
    dtype_reason: ClassVar[str] = ""

    def __init_subclass__(cls, *, name: str | None = None, kinds: tuple[str, ...] | None = None,
                          variant_type: type | None = None, case_type: type | None = None,
                          properties: tuple[str, ...] | None = None, subject: str | None = None,
                          **kwargs: Any) -> None:
        """A family says what it is in its class statement: ``class AttentionFamily(Family,
        name="attention", kinds=("attention",), variant_type=AttentionVariant, case_type=AttentionCase,
        properties=ATTENTION_PROPERTIES, subject="an attention block")``."""
        super().__init_subclass__(**kwargs)
        given = {"name": name, "kinds": kinds, "variant_type": variant_type, "case_type": case_type,
                 "properties": properties, "subject": subject}
        for attr, value in given.items():
            if value is not None:
                setattr(cls, attr, value)
        # The registry and the properties tell one story: every property but divisibility (judged on
        # the whole run) has its check, and every check is a property the family reports.
        registry = set(cls.__dict__.get("checks", {}) or ())
        declared = set(getattr(cls, "properties", ()) or ())
        if registry and (registry - declared or declared - registry - {DIVISIBILITY}):
            raise TypeError(f"family {cls.__name__}: checks {sorted(registry)} and properties {sorted(declared)} "
                            "disagree (every property but divisibility needs a check)")

    # --- targets -----------------------------------------------------------------------------------

    def resolve(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        """The variants the object ``obj`` (what ``target``, a ``MODULE:Name``, names) describes, adapted
        with ``options``; None when ``obj`` is not this family's. Raises :class:`tpsim.InvalidArgument`
        when it is, but cannot be adapted."""
        if isinstance(obj, self.variant_type):
            found = [obj]
        elif isinstance(obj, (list, tuple)) and obj and all(isinstance(v, self.variant_type) for v in obj):
            found = list(obj)
        else:
            return self.from_object(target, obj, options)
        from tpsim._target_files import import_target_module

        module = import_target_module(target.partition(":")[0])
        return [self.own_module(self.adapt(v, options, target), module) for v in found]

    def declared(self, target: str, module: ModuleType, options: Mapping[str, Any]) -> list[Any]:
        """The variants the bare-module ``target`` (imported as ``module``) declares for this family,
        adapted with ``options``: a library's layers (its preset's variants of this family's kinds),
        else the module's :attr:`declared_list`, else its module-level variants of this family. Empty
        when the options adapt another family's variants."""
        if options.get("kind") not in (None, *self.kinds) or not self.takes(options):
            return []
        from tpsim.presets import library_variants, preset_for_target

        library = preset_for_target(target)
        if library is not None:
            return [self.adapt(v, options, f"{target}:{v.name}")
                    for v in library_variants(library, self.kinds, target)]
        listed = getattr(module, self.declared_list, None) if self.declared_list else None
        if listed is not None:
            if not isinstance(listed, (list, tuple)):
                # list("ab") would be ['a', 'b']: a string (or one variant, a dict) is a declaration error.
                shown = repr(listed)
                shown = shown if len(shown) <= 80 else shown[:77] + "..."
                raise InvalidArgument(f"{_shown(module, self.declared_list)} is a {type(listed).__name__} "
                                      f"({shown}); expected a list (or tuple) of tpsim variants")
            items = self.declared_items(module, list(listed))
        else:
            items = []
            for value in vars(module).values():
                if isinstance(value, self.variant_type) and not any(value is s for s in items):
                    items.append(value)
        return [self.own_module(self.adapt(v, options, f"{target}:{v.name}"), module) for v in items]

    def declared_items(self, module: ModuleType, items: list[Any]) -> list[Any]:
        """The variants of this family in ``module``'s :attr:`declared_list`: its own list must hold
        nothing else; a list several families share (:attr:`declared_list_shared`) is filtered."""
        if not self.declared_list_shared:
            bad = [v for v in items if not isinstance(v, self.variant_type)]
            if bad:
                raise InvalidArgument(f"{_shown(module, self.declared_list)} holds {bad[0]!r}, which is not a tpsim "
                                      f"{self.variant_type.__name__}")
        return [v for v in items if isinstance(v, self.variant_type)]

    def takes(self, options: Mapping[str, Any]) -> bool:
        """Whether every adapter flag set in ``options`` is one this family takes (on a bare module,
        other flags adapt another family's variants)."""
        return all(k in self.adapter_options for k in ADAPTER_OPTIONS if options.get(k) is not None)

    def from_object(self, target: str, obj: Any, options: Mapping[str, Any]) -> list[Any] | None:
        """The variants of an object that is not a variant of this family (a class, a function, a
        library's layer), None when it is not this family's (default: never)."""
        return None

    def adapt(self, variant: Any, options: Mapping[str, Any], where: str) -> Any:
        """``variant`` with the CLI's adapter flags applied; a flag the family does not take is refused
        (:meth:`foreign_option`). ``where`` names the target in messages."""
        for k in ADAPTER_OPTIONS:
            if k not in self.adapter_options and options.get(k) is not None:
                raise InvalidArgument(self.foreign_option(where, k))
        return variant

    def foreign_option(self, where: str, option: str) -> str:
        """The message refusing ``--option`` for the target ``where``."""
        return f"{where} is {self.subject}; --{option.replace('_', '-')} applies to linear layers and modules"

    @staticmethod
    def own_module(variant: Any, module: ModuleType | None) -> Any:
        """``variant`` with the globals of ``module`` (the user's module that declares it) made per
        rank: in a real job each rank is a process with its own (tpsim's and torch's modules are not)."""
        from tpsim.conventions import own_module_state

        local = (*variant.rank_local, *own_module_state(None if module is None else module.__name__))
        local = tuple(dict.fromkeys(local))
        return variant if local == tuple(variant.rank_local) else variant.replace(rank_local=local)

    def declare_grads(self, variant: Any, pairs: Sequence[tuple[str, str]]) -> Any:
        """``variant`` with the grads ``--param-grad NAME=MODE`` names declared (a family whose variants
        take the flag overrides this; see :attr:`adapter_options`)."""
        raise InvalidArgument(f"{variant.name!r} is {self.subject}; --param-grad applies to linear layers and modules")

    # --- a search ----------------------------------------------------------------------------------

    def prepared(self, variant: Any) -> Any:
        """``variant`` with what the family reads once before a search (default: as it is; a module's
        parameter names, where it was not described by a worker already)."""
        return variant

    def applicable(self, variant: Any) -> tuple[str, ...]:
        """The properties ``variant`` is checked for (default: all of :attr:`properties`)."""
        return self.properties

    def plan(self, variant: Any, properties: tuple[str, ...],
             dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...], list[str]]:
        """The properties and dtypes that apply to ``variant`` out of those asked for, and the notes a
        report shows about what was left out and why. Raises :class:`tpsim.InvalidArgument` when
        nothing asked for applies."""
        applies = self.applicable(variant)
        kept = tuple(p for p in properties if p in applies)
        if not kept:
            raise InvalidArgument(self.nothing_applies(variant, properties, applies))
        kept_dtypes, dtype_notes = self.plan_dtypes(variant, tuple(dtypes))
        return kept, kept_dtypes, [*variant.notes, *dtype_notes, *self.notes(variant)]

    def nothing_applies(self, variant: Any, properties: tuple[str, ...], applies: tuple[str, ...]) -> str:
        """Why none of ``properties`` applies to ``variant``."""
        return f"properties={list(properties)!r}: {self.subject} is checked for {', '.join(applies)}"

    def plan_dtypes(self, variant: Any, dtypes: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]]:
        """The dtypes ``variant`` is checked in out of ``dtypes``, and a note when some are left out."""
        if self.dtypes is None:
            return dtypes, []
        kept = tuple(d for d in dtypes if d in self.dtypes)
        if not kept:
            raise InvalidArgument(f"dtypes={list(dtypes)!r}: {self.name} targets are checked in {' and '.join(self.dtypes)} "
                                  f"({self.dtype_reason})")
        if kept == dtypes:
            return kept, []
        return kept, [f"dtypes {', '.join(kept)} only: {self.dtype_reason}"]

    def notes(self, variant: Any) -> list[str]:
        """The family's remarks about ``variant`` a report shows (default: none)."""
        return []

    def cases(self, variant: Any, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...], non_divisible: bool,
              tp_sizes: tuple[int, ...] | None, subgroups: bool, layouts: tuple[str, ...],
              max_size: int = DEFAULT_MAX_SIZE) -> Any:
        """A Hypothesis strategy of this family's cases for ``variant`` (shrinking toward the smallest,
        most readable case); ``non_divisible``: also sizes that do not divide (the divisibility
        property is asked for); ``max_size``: the largest size per rank a sharded dim draws
        (:func:`tpsim.props.strategies.per_rank`). Default: :attr:`strategy`, whose inputs are
        contiguous (memory layouts are a property of the layers, checked on each of them)."""
        return self.strategy(variant, world_sizes=world_sizes, dtypes=dtypes,
                             non_divisible=non_divisible or self.uneven_sizes_are_cases, tp_sizes=tp_sizes,
                             subgroups=subgroups, max_size=max_size)

    def cover_keys(self, variant: Any, case: Any, world_sizes: tuple[int, ...]) -> list[tuple[Any, ...]]:
        """The coverage buckets ``case`` fills in a search's cover phase (:mod:`tpsim.props.cover`).
        Default, for every family: a divisible case whose tp group spans the world fills
        ``("world", world size, bias)`` (bias: the case's, None where cases have none) and, on more
        than one rank (unless only one is asked for), ``("layout", its input layout)`` where cases have
        one (a non-contiguous one with more than one row; :func:`tpsim.props.layouts.cover_bucket`); a case whose sizes do not divide, on
        several ranks, fills ``("not divisible", world size)``; any other case fills none. So each
        world size asked for, with and without a bias, each memory layout and the sizes to refuse are
        checked early at every seed."""
        if getattr(case, "tp_size", case.world_size) != case.world_size:
            return []
        if not self.divisible(variant, case):
            # Sizes the variant must refuse (or split unevenly), on each world size of several ranks.
            return [("not divisible", case.world_size)] if case.world_size > 1 else []
        keys: list[tuple[Any, ...]] = [("world", case.world_size, getattr(case, "bias", None))]
        layout = getattr(case, "input_layout", None)
        batch = getattr(case, "batch_shape", ())
        # A layout counts where it shows: several ranks, and a view that is really not contiguous (a
        # transposed input whose swapped dims include a size 1, or a one-row expand, is contiguous memory:
        # it must not fill the bucket a layer that mishandles non-contiguous inputs fails in).
        features = getattr(case, "in_features", None) or 2
        if layout is not None and shows(layout, (*batch, features)) and (case.world_size > 1 or max(world_sizes) == 1):
            keys.append(("layout", cover_bucket(layout, tuple(batch))))
        return keys

    #: The family's case strategy, ``strategy(variant, *, world_sizes, dtypes, non_divisible, tp_sizes,
    #: subgroups)`` (see :meth:`cases`).
    strategy: ClassVar[Any] = None
    #: Whether a size that does not divide by the tp size is an ordinary case of the family (padded,
    #: split unevenly: it must be exact), drawn whatever the divisibility property says.
    uneven_sizes_are_cases: ClassVar[bool] = False

    def fault_case(self, variant: Any, world_size: int, seed: int) -> Any:
        """One small divisible case of ``world_size`` ranks whose run issues collectives, for fault
        plans (:func:`tpsim.props.faults.check_faults`)."""
        raise NotImplementedError

    def case_from_dict(self, data: Any) -> Any:
        """The inverse of the case type's ``to_dict()``; raises :class:`tpsim.InvalidArgument` naming
        a bad field."""
        return self.case_type.from_dict(data)

    # --- one case ----------------------------------------------------------------------------------

    def divisible(self, variant: Any, case: Any) -> bool:
        """Whether ``variant`` can shard the sizes of ``case`` (default: always)."""
        return True

    def world(self, variant: Any, case: Any, *, timeout: float = DEFAULT_TIMEOUT, isolate: bool = False,
              layout: str | None = None, pieces: str | None = None, capture: bool = False, tie: Any = ()) -> World:
        """The world run of ``case``: the data drawn from its seed and the rank function. A family whose
        dense reference is itself a run raises :class:`~tpsim.props.observation.DenseReferenceFailed`
        when that reference fails. The other options are those of a family's re-runs, each read by the
        family that has it: ``layout`` and ``pieces`` (linear: the contiguous twin of a case, the
        ``torch.chunk`` pieces of a non-divisible one), ``capture`` and ``tie`` (module: every sublayer's
        boundaries recorded, rows of masters made equal)."""
        raise NotImplementedError

    def observe(self, variant: Any, case: Any, *, backend: str = "inproc", timeout: float = DEFAULT_TIMEOUT,
                isolate: bool = False, layout: str | None = None, pieces: str | None = None, capture: bool = False,
                tie: Any = ()) -> Observation:
        """Run ``case`` once on a world of ``case.world_size`` ranks of ``backend`` (``isolate``: an
        inproc world in a supervised worker process, :func:`tpsim.run`); the other options go to
        :meth:`world`."""
        from tpsim.props.launch import launch

        divisible = self.divisible(variant, case)
        try:
            world = self.world(variant, case, timeout=timeout, isolate=isolate, layout=layout, pieces=pieces,
                               capture=capture, tie=tie)
        except DenseReferenceFailed as failed:
            return Observation(case, divisible=divisible, reference_error=failed)
        try:
            values = launch(world.fn, variant, world.payload, case.world_size, backend=backend, timeout=timeout,
                            isolate=isolate)
        except RankError as err:
            return Observation(case, world.data, error=err, divisible=divisible)
        return Observation(case, world.data, values=values, divisible=divisible)

    # --- judging: the engine's (tpsim.props.judging); the family fills in its checks and contexts -------

    #: The registry: each property the family checks on a tp group, and its check
    #: (``check(ctx) -> Failure | None``, ``ctx`` the family's :class:`~tpsim.props.judging.GroupContext`),
    #: in report order. ``divisibility`` is judged on the whole run (:meth:`refused`).
    checks: ClassVar[Mapping[str, Any]] = {}
    #: The family's group context (its dense reference of one tp group, what is replicated).
    context_type: ClassVar[type] = GroupContext
    #: How messages name the variant when it refuses sizes (``layer``, ``module``, ``block``).
    noun: ClassVar[str] = "layer"

    def judge(self, variant: Any, obs: Observation, properties: Sequence[str] | None = None) -> list[Any]:
        """The failures of one observation: the engine's one path (:func:`tpsim.props.judging.judge`)."""
        return judge(self, variant, obs, properties)

    def why_not_applicable(self, variant: Any) -> dict[str, str]:
        """Why properties of the family do not apply to ``variant``, by name, where the family can say
        (reports show it beside the verdict; default: nothing to add)."""
        return {}

    def wanted(self, variant: Any, properties: Sequence[str] | None) -> tuple[str, ...]:
        """The properties to judge: those asked for (None: all) that apply to ``variant``; an unknown
        name is refused."""
        asked = tuple(properties or self.properties)
        unknown = [p for p in asked if p not in self.properties]
        if unknown:
            raise InvalidArgument(f"unknown properties {unknown}; expected some of {list(self.properties)}")
        applies = self.applicable(variant)
        return tuple(p for p in asked if p in applies)

    def context(self, variant: Any, obs: Observation, group_index: int, ranks: Sequence[int], values: list[Any]) -> Any:
        """The :attr:`context_type` of tp group ``group_index`` (global ``ranks``, ``values`` in tp rank order)."""
        return self.context_type(variant, obs, group_index, ranks, values)

    def offending(self, variant: Any, case: Any) -> tuple[str, list[int]]:
        """What does not divide in ``case`` (``"out_features=3 is not divisible by world_size=2"``) and
        the sizes a clear refusal may name (default: the family has no sizes to shard)."""
        tp = case.tp_size or case.world_size
        return f"the case is not divisible by tp_size={tp}", [tp]

    def refused(self, variant: Any, obs: Observation) -> list[Any]:
        """``divisibility`` of a case whose sizes do not divide and whose run failed: every rank refused it
        with an error that names a size or divisibility (holds); it failed only after every rank accepted
        it, or some ranks refused and others did not (``divisibility-unchecked``), or a rank died."""
        from tpsim.diagnosis import DIVISIBILITY_UNCHECKED, Failure
        from tpsim.props.blame import failed_after_acceptance, refusal_failure

        case = obs.case
        what, sizes = self.offending(variant, case)
        late = failed_after_acceptance(obs.error)  # type: ignore[arg-type]
        if late is not None:
            return [Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                            f"{what}; every rank built the {self.noun} and ran its first forward without refusing it, "
                            f"but then {late[1]}; refuse the sizes on every rank at construction, or compute them "
                            "right", case=case, rank=late[0], variant=variant.name, details={"accepted": True})]
        found = refusal_failure(variant.name, case, obs.error, what, sizes, subject=self.noun,  # type: ignore[arg-type]
                                assert_refuses=bool(getattr(variant, "forward_only", False)))
        return [found] if found is not None else []

    def accepted(self, variant: Any, obs: Observation, wanted: Sequence[str]) -> list[Any]:
        """A case whose sizes do not divide that every rank accepted (default: judged on the pieces the
        ranks hold, as any case: a padded vocabulary must be exact). A family whose variants must refuse
        such sizes says ``divisibility-unchecked`` (:meth:`truncated`)."""
        from tpsim.props.judging import judge_groups

        return judge_groups(self, variant, obs, [p for p in wanted if p != DIVISIBILITY])

    def truncated(self, variant: Any, obs: Observation) -> Any:
        """``divisibility-unchecked``: every rank accepted sizes that do not divide without an error,
        holding no pieces the family can judge (silently truncated or padded)."""
        from tpsim.diagnosis import DIVISIBILITY_UNCHECKED, Failure

        what, _ = self.offending(variant, obs.case)
        return Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                       f"{what}, yet every rank built the {self.noun} and ran it without an error: the sizes were "
                       "silently truncated or split unevenly; raise a ValueError naming the sizes",
                       case=obs.case, variant=variant.name)

    def failed_run(self, variant: Any, obs: Observation) -> Any:
        """The one failure of a run that failed (default: :func:`tpsim.props.blame.run_failure`)."""
        from tpsim.props.blame import run_failure

        return run_failure(variant.name, obs.case, obs.error)  # type: ignore[arg-type]

    def layout_failure(self, variant: Any, obs: Observation) -> Any:
        """A parameter no rank could hold as the variant holds it, before anything is compared (default:
        none)."""
        return None

    def wrong_group(self, variant: Any, obs: Observation, groups: list[list[int]]) -> dict[str, dict[str, Any]]:
        """Per property, a collective over another set of ranks than the tp group, recognised in the
        numbers (:mod:`tpsim.props.groups`; default: not recognised)."""
        return {}

    def explain_failures(self, variant: Any, case: Any, obs: Observation, failures: list[Any], *, backend: str,
                         timeout: float, isolate: bool, properties: Sequence[str] | None) -> list[Any]:
        """A failing case run again to say more about its failures (default: nothing more)."""
        return failures

    def check_case(self, variant: Any, case: Any, *, backend: str = "inproc", timeout: float = DEFAULT_TIMEOUT,
                   properties: Sequence[str] | None = None, isolate: bool = False) -> list[Any]:
        """Run ``case`` and evaluate ``properties`` (None: all); return the failures, each cause once
        with the failures that follow from it listed under it. Every mechanism a failure names is a
        claim, confirmed before it is reported (:meth:`confirm_claims`). Raises only for errors of the
        harness itself (a bad option, a backend that cannot start), never for what the variant did wrong."""
        from tpsim.diagnosis import group_causes
        from tpsim.props.memory import measured

        # Measured to the end of the explaining: a confirming run judges and explains too (a traced run beside
        # its observation can be its peak), so this whole run is what it is estimated from.
        with measured() as took:
            obs = self.observe(variant, case, backend=backend, timeout=timeout, isolate=isolate)
        with measured() as judged:
            failures = self.judge(variant, obs, properties)
            if failures:
                failures = self.explain_failures(variant, case, obs, failures, backend=backend, timeout=timeout,
                                                 isolate=isolate, properties=properties)
        took.judging = judged.grown
        if failures:
            # The confirming runs are whole runs again (float64: twice the memory at the lab note's size):
            # this run's observation is not kept alive beside them.
            del obs
            failures = self.confirm_claims(variant, case, failures, backend=backend, timeout=timeout,
                                           isolate=isolate, properties=properties, took=took)
        return group_causes(failures)

    def confirm_claims(self, variant: Any, case: Any, failures: list[Any], *, backend: str, timeout: float,
                       isolate: bool, properties: Sequence[str] | None, took: Any = None) -> list[Any]:
        """Hold every name ``failures`` give to its confirmation rule (:data:`tpsim.diagnosis.CONFIRMATIONS`):
        a numeric pattern on a case narrower than float64 to the same case in float64
        (:meth:`confirm_in_float64`), a factor of the tp size to the same case on one rank
        (:meth:`confirm_on_one_rank`); what is not confirmed becomes ``mismatch`` with the facts. ``took``:
        the memory the case's own run took (:class:`tpsim.props.memory.RunMemory`): a confirming run that
        would not fit in the machine's available memory is not started (:func:`tpsim.props.memory.too_big`)."""
        failures = self.confirm_in_float64(variant, case, failures, backend=backend, timeout=timeout,
                                           isolate=isolate, properties=properties, took=took)
        return self.confirm_on_one_rank(variant, case, failures, backend=backend, timeout=timeout, isolate=isolate,
                                        took=took)

    #: Diagnoses this family reads from numeric patterns beyond those the registry says are
    #: (:func:`tpsim.diagnosis.claims`: every name confirmed in float64, in every family), claimed on a case
    #: narrower than float64 only when the same case in float64 shows them (:func:`tpsim.diagnosis.confirm`).
    confirmed_in_float64: ClassVar[frozenset[str]] = frozenset()

    def float64_claims(self) -> frozenset[str]:
        """The names held to the float64 re-run of a narrower case: the registry's numeric patterns
        (:func:`tpsim.diagnosis.claims`) and the family's own :attr:`confirmed_in_float64`."""
        from tpsim.diagnosis import claims

        return claims() | self.confirmed_in_float64

    def confirm_in_float64(self, variant: Any, case: Any, failures: list[Any], *, backend: str, timeout: float,
                           isolate: bool, properties: Sequence[str] | None, took: Any = None) -> list[Any]:
        """Run the float64 twin of a narrower ``case`` whose failures name one of :meth:`float64_claims`,
        and hold those names to what it shows (:func:`tpsim.diagnosis.confirm`). A plain ``mismatch``
        is run there too: a narrower dtype's bound can be too wide to tell a mechanism's value from the
        dense one (a bfloat16 loss over a padded vocabulary), where float64 names it."""
        from tpsim.diagnosis import MISMATCH, confirm, each_failure, not_confirmed
        from tpsim.props.memory import too_big

        patterns = self.float64_claims()
        if getattr(case, "dtype", "float64") == "float64" or not any(
                f.diagnosis in patterns or f.diagnosis == MISMATCH for f in each_failure(failures)):
            return failures
        twin = case.replace(dtype="float64")
        big = too_big(took, 8 / twin_itemsize(case))
        if big:
            not_confirmed(failures, patterns, f"it needs the same case in float64, where rounding cannot fake it, "
                                              f"and {big}")
            return failures
        obs = self.observe(variant, twin, backend=backend, timeout=timeout, isolate=isolate)
        found = self.judge(variant, obs, properties)
        if found:
            found = self.explain_failures(variant, twin, obs, found, backend=backend, timeout=timeout,
                                          isolate=isolate, properties=properties)
        del obs  # before the one-rank run that may follow (see check_case)
        confirm(failures, found, patterns, case.dtype)
        return failures

    def one_rank_case(self, variant: Any, case: Any) -> tuple[Any | None, str]:
        """The same case on one rank, in float64 (what a factor of the tp size is confirmed on), or None
        and why it cannot be run (a variant that declares a larger tp group)."""
        least = int(getattr(variant, "min_tp_size", 1) or 1)
        if least > 1:
            return None, f"{variant.name} declares min_tp_size={least}"
        from tpsim.comm._torchrun import launched_world

        launched = launched_world()
        try:
            if launched is not None and launched[1] > 1 and getattr(variant, "subgroups", False):
                # Under a launcher the world is the launched one: every rank its own tp group of one.
                return case.replace(world_size=launched[1], tp_size=1, dtype="float64", faults=()), ""
            return case.replace(world_size=1, tp_size=None, dtype="float64", faults=()), ""
        except InvalidArgument as err:
            return None, f"the case on one rank is refused: {err}"

    def more_ranks_case(self, variant: Any, case: Any) -> Any | None:
        """Where one rank cannot run (:meth:`one_rank_case`): the same case, float64, on twice the ranks,
        with twice the tp size and every size and batch dim doubled (each stays divisible by the tp size,
        a sequence dim included); None when no such case can be made. A factor of the tp size grows with it."""
        tp = case.tp_size or case.world_size
        doubled = {n: getattr(case, n) * 2 for n in case.SIZES}
        if isinstance(getattr(case, "sizes", None), tuple):  # a module's sizes, by position
            doubled["sizes"] = tuple(n * 2 for n in case.sizes)
        try:
            return case.replace(world_size=case.world_size * 2, tp_size=tp * 2, dtype="float64", faults=(),
                                batch_shape=tuple(b * 2 for b in case.batch_shape), **doubled)
        except (InvalidArgument, TypeError):
            return None

    def one_rank_informative(self, variant: Any) -> bool:
        """Whether a run on one rank can fail where a factor of the tp size is claimed (default: yes; a
        family whose dense reference is the variant itself on one rank says no: it passes by construction)."""
        return True

    def confirm_on_one_rank(self, variant: Any, case: Any, failures: list[Any], *, backend: str, timeout: float,
                            isolate: bool, took: Any = None) -> list[Any]:
        """Run the same case on one rank (float64) where ``failures`` claim a factor of the tp size
        (:func:`tpsim.diagnosis.tp_factor_claim`): such a factor vanishes there, so a claim whose property
        fails on one rank too is not confirmed (:func:`tpsim.diagnosis.confirm_on_one_rank`). A variant that
        cannot run on one rank (``min_tp_size``) is run on twice the ranks instead (:meth:`more_ranks_case`),
        where the same name must show with the factor of that tp size."""
        from tpsim.diagnosis import confirm_on_one_rank, each_failure, tp_factor_claim

        claimed = [f for f in each_failure(failures) if tp_factor_claim(f)]
        if not claimed or not self.one_rank_informative(variant):
            return failures
        wanted = tuple(dict.fromkeys(f.property for f in claimed))

        def run(other: Any) -> list[Any]:
            return self.judge(variant, self.observe(variant, other, backend=backend, timeout=timeout, isolate=isolate),
                              wanted)

        from tpsim.props.memory import too_big

        single, why_not = self.one_rank_case(variant, case)
        big = too_big(took, 8 / twin_itemsize(case))  # the one-rank run is float64, the whole module on it
        if big:
            single, why_not = None, big
            confirm_on_one_rank(failures, None, why_not, None)
            return failures
        found, more = None, None
        try:
            if single is not None:
                found = run(single)
            else:
                larger = self.more_ranks_case(variant, case)
                if larger is not None:
                    more = (larger.tp_size, run(larger))
        except InvalidArgument as err:  # the variant's own limits refuse it: no confirmation, no harness error
            why_not = f"{why_not + '; ' if why_not else ''}the case is refused: {err}"
        confirm_on_one_rank(failures, found, why_not, more)
        return failures


def twin_itemsize(case: Any) -> int:
    """Bytes per element of ``case``'s dtype (8 where the case has none: nothing to scale)."""
    import torch

    dtype = getattr(case, "dtype", "float64")
    return torch.empty((), dtype=getattr(torch, dtype, torch.float64)).element_size()


#: Families that ship with tpsim: name -> ``module:attribute`` of the family object (imported lazily).
_BUILTIN: dict[str, str] = {
    "linear": "tpsim.props.linear.family:LINEAR",
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
        raise InvalidArgument(f"family={family!r} is not a tpsim.props.family.Family")
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


def kind_choices() -> tuple[str, ...]:
    """Every family's ``--kind`` values, in family order."""
    return tuple(k for f in families() for k in f.kinds)


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
    """The family a case belongs to (its ``family`` class attribute)."""
    return family_named(getattr(case, "family", "linear"))


def _shown(module: ModuleType, attribute: str) -> str:
    """``module.attribute`` as the user wrote the module: ``path.py: attribute`` for a target given as
    a path (its module name is an encoding of that path), else ``dotted.name.attribute``."""
    from tpsim._target_files import path_of_module_name  # lazily: it imports the presets

    path = path_of_module_name(module.__name__)
    return f"{path}: {attribute}" if path else f"{module.__name__}.{attribute}"
