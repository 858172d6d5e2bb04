"""Plans as targets: a dense module checked against itself parallelised by a tensor-parallel plan.

``tpsim check MODULE:DenseClass --plan MODULE:PLAN`` builds the dense class from the case's sizes
(read from its constructor, as for ``--kind module``), applies the plan on each rank over a 1-D mesh
of the tp group, and checks the result as a whole module (the ``module`` family) against the dense
class itself — the dense reference needs no parallel code at all. A plan is one of:

- a ``parallelize_module`` dict: module path -> a ``torch.distributed.tensor.parallel`` style
  (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput``,
  ``PrepareModuleOutput``, ...);
- a Hugging Face style-string dict: module or parameter path (``*`` for a layer number) -> a style
  name of ``transformers``' ``ALL_PARALLEL_STYLES`` (``"colwise"``, ``"rowwise"``, ``"colwise_rep"``,
  ``"rowwise_rep"``, ``"sequence_parallel"``, ``"packed_colwise"``, ...), applied with
  ``transformers``' own ``apply_tensor_parallelism`` after expanding the wildcards as
  ``from_pretrained`` does;
- a callable ``(module, mesh) -> module`` (None: the module parallelised in place), or a callable
  of no arguments returning one of the dicts above (fresh style objects per rank). A callable's
  ``rank_local`` attribute names the modules whose globals it sets per process (a library's parallel
  state): they are rank-local on inproc; ``uneven_sizes_are_cases = True`` says it splits sizes that
  do not divide into ``torch.tensor_split`` pieces, so those are drawn as cases that must be exact
  (``tpsim.presets.deepspeed.autotp``, DeepSpeed's AutoTP, declares both).

The dense module is built holding the case's weights and the plan's library cuts every rank's
pieces (a style-string plan's are then loaded as ``from_pretrained`` loads them); tpsim writes none
of them, and judges them against the dense weights right after construction
(:mod:`tpsim.props.module.construction`). Parameters become DTensors: :mod:`tpsim.props.module.dtensors`
reads and updates them in their own placements. A failing plan is re-checked on twins of the failing case that change one entry of
the plan (:func:`name_plan_entry`): when only the twin that plans a projection the other way round
passes, the failure is named with that path (``down_proj: wrong-shard-dim — planned colwise;
planned rowwise it passes``).
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import nn

from tpsim.diagnosis import recogniser
from tpsim.errors import InvalidArgument
from tpsim.module_variant import LOAD_IN_BUILD, ModuleVariant, constructor_sizes

__all__ = ["PlanVariant", "apply_plan", "describe_plan", "plan_variant", "resolve_plan", "twin_plans"]


@dataclass(frozen=True)
class PlanVariant(ModuleVariant):
    """A :class:`ModuleVariant` whose ranks hold ``dense`` parallelised by ``plan`` (see the module
    docstring); ``plan_name`` says where the plan comes from in reports."""

    plan: Any = None
    plan_name: str = ""
    #: torch 2.13.0's ``RowwiseParallel`` fails in backward on a 1-D input (docs/dtensor.md): inputs
    #: get at least one batch dim.
    min_batch_dims: int = 1
    #: False: the plan builds its own mesh over the whole world (torchtitan): one tp group spanning it.
    subgroups: bool = True
    #: True: the plan splits a size that does not divide by the tp size into ``torch.tensor_split``
    #: pieces (DeepSpeed AutoTP), which tpsim lays out too: such sizes are ordinary cases, which must be
    #: exact (a plan function declares it with an ``uneven_sizes_are_cases`` attribute).
    uneven_sizes_are_cases: bool = False
    #: True: a rule of a style-string plan that names nothing in the built module is skipped, as
    #: ``from_pretrained`` skips it (a model's plan, whose rules for one layer kind name nothing in
    #: another); False (a plan given with ``--plan``): such a rule is a usage error naming it.
    skip_unmatched: bool = False

    #: Why the divisibility property does not apply (DTensor shards uneven sizes by design).
    UNEVEN_NOTE: ClassVar[str] = ("a plan's DTensor shards a size that does not divide by the tp size unevenly "
                                  "(torch.chunk pieces) by design instead of refusing it: divisible cases only, "
                                  "the divisibility property does not apply")
    #: The note of a plan whose uneven pieces are ``torch.tensor_split``'s (``uneven_sizes_are_cases``).
    UNEVEN_CASES_NOTE: ClassVar[str] = ("the plan splits a size that does not divide by the tp size unevenly "
                                        "(torch.tensor_split pieces) by design instead of refusing it: such sizes "
                                        "are ordinary cases and must be exact; the divisibility property does not "
                                        "apply")

    def describe(self) -> str:
        return f"{super().describe()}; plan {self.plan_name or 'given'}: {describe_plan(self.plan)}"


def _style_name(style: Any) -> str:
    if isinstance(style, str):
        return repr(style)
    fields = []
    for attr in ("input_layouts", "output_layouts", "desired_input_layouts", "desired_output_layouts"):
        value = getattr(style, attr, None)
        if value is not None and attr.startswith("desired"):
            fields.append(f"{attr}={value}")
    if getattr(style, "use_local_output", True) is False:
        fields.append("use_local_output=False")
    return f"{type(style).__name__}({', '.join(fields)})"


def describe_plan(plan: Any) -> str:
    """One line: the plan's entries, or the callable's name."""
    if isinstance(plan, Mapping):
        return ", ".join(f"{path or '(root)'}: {_style_name(s)}" for path, s in plan.items())
    return getattr(plan, "__qualname__", type(plan).__name__)


def _is_factory(plan: Any) -> bool:
    try:
        sig = inspect.signature(plan)
    except (TypeError, ValueError):
        return False
    return not any(p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                   for p in sig.parameters.values())


def _check_plan(plan: Any, where: str) -> Any:
    if isinstance(plan, Mapping):
        if not plan:
            raise InvalidArgument(f"plan {where} is an empty dict; expected module paths mapped to parallel styles")
        strings = [isinstance(s, str) for s in plan.values()]
        if any(strings) and not all(strings):
            raise InvalidArgument(f"plan {where} mixes style strings and style objects; use one kind per plan")
        if not all(strings):
            from torch.distributed.tensor.parallel import ParallelStyle

            bad = [(k, s) for k, s in plan.items() if not isinstance(s, ParallelStyle)]
            if bad:
                raise InvalidArgument(f"plan {where}: entry {bad[0][0]!r} is {bad[0][1]!r}; expected a "
                                      "torch.distributed.tensor.parallel ParallelStyle or a style-name string")
        return dict(plan)
    if callable(plan):
        return plan
    raise InvalidArgument(f"plan {where} is {type(plan).__name__}; expected a dict of parallel styles, a dict of "
                          "Hugging Face style strings or a callable (module, mesh) -> module")


def resolve_plan(spec: str) -> tuple[Any, str]:
    """The plan ``spec`` (``package.module:NAME`` or ``path/to/file.py:NAME``) names, and its name."""
    from tpsim._target_files import import_target_module

    if not isinstance(spec, str) or ":" not in spec:
        raise InvalidArgument(f"--plan {spec!r}; expected MODULE:NAME or path/to/file.py:NAME naming a plan dict or "
                              "a function")
    module_part, _, attr = spec.partition(":")
    obj: Any = import_target_module(module_part)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise InvalidArgument(f"--plan {spec}: {module_part!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return _check_plan(obj, spec), spec


def _hf_expand(module: nn.Module, plan: Mapping[str, str]) -> dict[str, str]:
    """``plan``'s rules as ``from_pretrained`` expands them: one entry per module and parameter it
    names (``*`` matches a layer number), the parameters first."""
    from transformers.distributed.parallel_utils import _get_parameter_plan

    out: dict[str, str] = {}
    for name, sub in module.named_modules():
        for pname, _ in sub.named_parameters(recurse=False):
            full = f"{name}.{pname}" if name else pname
            style = _get_parameter_plan(parameter_name=full, plan=plan, is_weight=True)
            if style is not None:
                out[full] = style
        style = _get_parameter_plan(parameter_name=name, plan=plan, is_weight=False)
        if style is not None:
            out[name] = style
    return out


def _hf_apply(module: nn.Module, plan: Mapping[str, str], mesh: Any, skip_unmatched: bool = False) -> nn.Module:
    try:
        from transformers.distributed.tensor_parallel import ALL_PARALLEL_STYLES, apply_tensor_parallelism
    except ImportError as err:
        raise InvalidArgument(f"a plan of style strings is applied with transformers' tensor_parallel module, which "
                              f"cannot be imported ({err}); pip install -c constraints.txt transformers") from None
    unknown = sorted({s for s in plan.values() if s not in ALL_PARALLEL_STYLES})
    if unknown:
        raise InvalidArgument(f"plan style {unknown[0]!r} is not a transformers parallel style; expected one of "
                              f"{', '.join(ALL_PARALLEL_STYLES)}")
    expanded = _hf_expand(module, plan)
    unused = sorted(k for k in plan if not any(_matches(k, e) for e in expanded))
    if unused and not skip_unmatched:
        paths = ", ".join(n for n, _ in module.named_modules() if n)
        raise InvalidArgument(f"plan entry {unused[0]!r} names nothing in {type(module).__name__} (its modules: "
                              f"{paths})")
    return apply_tensor_parallelism(module, mesh, expanded)


def _matches(rule: str, name: str) -> bool:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    generic = replace_layer_number_by_wildcard(name)
    return generic == rule or generic.rpartition(".")[0] == rule


def apply_plan(module: nn.Module, plan: Any, mesh: Any, skip_unmatched: bool = False) -> nn.Module:
    """``module`` parallelised over the 1-D ``mesh`` by ``plan`` (see the module docstring);
    ``skip_unmatched``: a style-string rule that names nothing is skipped, as ``from_pretrained`` does."""
    if callable(plan) and not isinstance(plan, Mapping):
        if _is_factory(plan):
            plan = _check_plan(plan(), getattr(plan, "__qualname__", repr(plan)))
        else:
            result = plan(module, mesh)
            return module if result is None else result
    if not isinstance(plan, Mapping):
        raise InvalidArgument(f"plan={plan!r}; expected a dict or a callable")
    if all(isinstance(s, str) for s in plan.values()):
        return _hf_apply(module, plan, mesh, skip_unmatched)
    from torch.distributed.tensor.parallel import parallelize_module

    # parallelize_module only warns about a path that names nothing: a plan with a typo would
    # silently leave a layer dense. (A path with a wildcard is left to parallelize_module.)
    names = {n for n, _ in module.named_modules()}
    missing = [k for k in plan if "*" not in k and k not in names]
    if missing:
        raise InvalidArgument(f"plan entry {missing[0]!r} names nothing in {type(module).__name__} (its modules: "
                              f"{', '.join(n for n in names if n)})")
    # Fresh style objects per rank: a style may keep state between its hooks.
    return parallelize_module(module, mesh, copy.deepcopy(dict(plan)))


def _mesh_of(group: Any) -> Any:
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh.from_group(group, "cpu")


@dataclass(frozen=True)
class _PlanBuild:
    """The builder of a plan variant's rank (picklable: it is data): the dense module built holding
    the case's weights (``masters``), then parallelised by the plan — the plan's library cuts each
    rank's pieces (``parallelize_module``'s ``distribute_tensor``, a plan function's own slicing), and
    a style-string plan's pieces are then loaded as ``from_pretrained`` loads a checkpoint
    (:func:`tpsim.props.module.loading.load_like_from_pretrained`). tpsim writes none of them."""

    dense: Callable[..., nn.Module]
    plan: Any
    skip_unmatched: bool = False

    def __call__(self, *sizes: int, group: Any, dtype: torch.dtype,
                 masters: dict[str, torch.Tensor] | None = None) -> nn.Module:
        # DTensor logs a traceback at ERROR level for every op whose sharding it cannot propagate,
        # then raises it: the report quotes the exception once, the log would repeat it per rank.
        logging.getLogger("torch._subclasses.fake_tensor").setLevel(logging.CRITICAL)
        module = self.dense(*sizes, dtype=dtype)
        if masters is not None:
            with torch.no_grad():
                for name, p in module.named_parameters():
                    if name in masters:
                        p.copy_(masters[name])
        result = apply_plan(module, self.plan, _mesh_of(group), self.skip_unmatched)
        if not isinstance(result, nn.Module):
            raise InvalidArgument(f"the plan returned {type(result).__name__}; expected the parallelised nn.Module")
        if masters is not None and _is_style_strings(self.plan):
            from tpsim.props.module.loading import load_like_from_pretrained

            load_like_from_pretrained(result, masters)
        return result


def _is_style_strings(plan: Any) -> bool:
    return isinstance(plan, Mapping) and all(isinstance(s, str) for s in plan.values())


@dataclass(frozen=True)
class _DenseClass:
    cls: type
    takes_dtype: bool

    def __call__(self, *sizes: int, dtype: torch.dtype) -> nn.Module:
        module = self.cls(*sizes, dtype=dtype) if self.takes_dtype else self.cls(*sizes)
        return module.to(dtype)


def plan_variant(dense: Callable[..., nn.Module] | type, plan: Any, *, sizes: tuple[str, ...] | None = None,
                 name: str | None = None, plan_name: str = "", **fields: Any) -> PlanVariant:
    """A module variant for ``dense`` parallelised by ``plan``. ``dense`` is an ``nn.Module`` class whose
    constructor takes the integer sizes (read from its signature, as for ``--kind module``; a ``dtype``
    keyword gets the case's dtype), or a builder ``dense(*sizes, dtype) -> nn.Module`` with ``sizes``
    naming its sizes. ``fields``: other :class:`ModuleVariant` fields (``input``, ``output``,
    ``min_sizes``, ``size_strategy``, ``forward``, ...)."""
    plan = _check_plan(plan, plan_name or "given")
    if isinstance(dense, type):
        if not issubclass(dense, nn.Module):
            raise InvalidArgument(f"{dense!r} is not an nn.Module class")
        found = constructor_sizes(dense)
        if not found:
            raise InvalidArgument(f"{dense.__qualname__} takes no integer sizes; a plan target's dense class is "
                                  "built from its required int constructor parameters (hidden, ffn, ...)")
        takes_dtype = "dtype" in inspect.signature(dense.__init__).parameters
        sizes = sizes or tuple(found)
        name = name or dense.__qualname__
        builder: Callable[..., nn.Module] = _DenseClass(dense, takes_dtype)
        fields.setdefault("description", f"{dense.__module__}.{dense.__qualname__}({', '.join(sizes)}) under a plan")
    else:
        if not callable(dense) or sizes is None or name is None:
            raise InvalidArgument("plan_variant(dense, plan): a dense builder needs sizes=(...) and name=...")
        builder = dense
    # torch 2.13.0's DTensor refuses a sharded dim of global size 1 (docs/dtensor.md): sizes of at least 2.
    fields.setdefault("min_sizes", (2,) * len(sizes))
    # A plan function's library state (its ``rank_local`` attribute: module names) is per rank.
    declared = getattr(plan, "rank_local", ())
    if declared:
        fields["rank_local"] = tuple(dict.fromkeys((*fields.get("rank_local", ()), *declared)))
    if getattr(plan, "uneven_sizes_are_cases", False) is True:
        fields.setdefault("uneven_sizes_are_cases", True)
    fields.setdefault("load", LOAD_IN_BUILD)  # the plan's library cuts the pieces (_PlanBuild)
    build = _PlanBuild(builder, plan, bool(fields.get("skip_unmatched", False)))
    return PlanVariant(name=name, build=build, dense=builder, sizes=tuple(sizes), plan=plan, plan_name=plan_name,
                       **fields)


# --- naming a plan entry ---------------------------------------------------------------------------

#: For each style, the styles a twin plan tries in its place, and what the finding is then called.
_DUAL_STRINGS = {"colwise": "rowwise", "rowwise": "colwise", "colwise_rep": "rowwise_rep",
                 "rowwise_rep": "colwise_rep"}
#: The packed style a twin plan tries for a style that cuts a weight as one block (``packed-shard-layout``).
_PACKED_STRINGS = {"colwise": "packed_colwise", "rowwise": "packed_rowwise"}
#: The prefix of a packed twin's key (``packed:PATH``).
_PACKED = "packed"
#: The style with the gather (or the split) a twin plan tries for a style that leaves its output sharded
#: where the code after it needs the whole tensor, or takes its shard where it is handed the whole input
#: (``plan-input-layout``: GLM's packed gate/up projection is ``colwise_gather_output`` because a ``chunk``
#: follows it; planned ``colwise``, each rank chunks its own shard).
_LAYOUT_STRINGS = {"colwise": "colwise_gather_output", "rowwise": "rowwise_split_input"}
#: The prefix of such a twin's key (``layout:PATH``).
_LAYOUT = "layout"


def _dual_style(style: Any) -> Any | None:
    """The style that shards a linear layer along its other dim (None: no such twin)."""
    if isinstance(style, str):
        return _DUAL_STRINGS.get(style)
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if type(style) is ColwiseParallel:
        return RowwiseParallel(use_local_output=style.use_local_output)
    if type(style) is RowwiseParallel:
        return ColwiseParallel(use_local_output=style.use_local_output)
    return None


def _style_label(style: Any) -> str:
    return style if isinstance(style, str) else type(style).__name__


#: The prefix of a twin that adds a ``PrepareModuleInput`` (``prepare-input:PATH:DIM``).
_PREPARE = "prepare-input"


def _prepare_twins(plan: Mapping[str, Any], seq_dim: int) -> list[tuple[str, str, str, Any]]:
    """Twins adding ``PrepareModuleInput(Shard(seq_dim) -> Replicate())`` on a module that holds planned
    sublayers and has no entry of its own (the all-gather a sequence-parallel plan needs before them)."""
    from torch.distributed.tensor import Replicate as DReplicate
    from torch.distributed.tensor import Shard as DShard
    from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput

    parents = []
    for path, style in plan.items():
        if type(style) is ColwiseParallel and "." in path:
            parent = path.rpartition(".")[0]
            if parent not in plan and parent not in parents:
                parents.append(parent)
    out = []
    for parent in parents:
        prepare = PrepareModuleInput(input_layouts=(DShard(seq_dim),), desired_input_layouts=(DReplicate(),))
        out.append((f"{_PREPARE}:{parent}:{seq_dim}", parent, "plan-input-layout",
                    {**plan, parent: prepare}))
    return out


def twin_plans(plan: Any, seq_dim: int | None = None) -> list[tuple[str, str, str, Any]]:
    """Plans that differ from ``plan`` in one entry: ``(key, path, diagnosis, twin)``. The key names
    the twin in a variant's options (a worker resolves the same twin from it); the diagnosis is what
    the failure is called when only that twin passes: ``wrong-shard-dim`` (a linear entry planned
    along its other dim), ``packed-shard-layout`` (a style string that cuts a packed weight as one
    block, planned as its packed style: the shard of each part) or ``plan-input-layout`` (a ``PrepareModuleInput`` that gathers a sequence
    shard, ``seq_dim``, added on a module above planned layers; or a style string with its gather or split,
    :data:`_LAYOUT_STRINGS`). A callable plan has no twins."""
    if not isinstance(plan, Mapping):
        return []
    twins = []
    for path, style in plan.items():
        dual = _dual_style(style)
        if dual is not None:
            twins.append((path, path, "wrong-shard-dim", {**plan, path: dual}))
        packed = _PACKED_STRINGS.get(style) if isinstance(style, str) else None
        if packed is not None:
            twins.append((f"{_PACKED}:{path}", path, "packed-shard-layout", {**plan, path: packed}))
        layout = _LAYOUT_STRINGS.get(style) if isinstance(style, str) else None
        if layout is not None:
            twins.append((f"{_LAYOUT}:{path}", path, "plan-input-layout", {**plan, path: layout}))
    if seq_dim is not None and not all(isinstance(s, str) for s in plan.values()):
        twins.extend(_prepare_twins(plan, seq_dim))
    return twins


def _twin_reason(plan: Mapping[str, Any], twin: Mapping[str, Any], path: str) -> str:
    if path in plan and twin[path] in _LAYOUT_STRINGS.values() and _LAYOUT_STRINGS.get(plan[path]) == twin[path]:
        what = ("leaves its output sharded where the code after it needs the whole tensor"
                if plan[path] == "colwise" else "takes its shard of an input it is handed whole")
        return (f"the plan entry {path!r} {what}: planned {plan[path]} the case fails, planned {twin[path]} "
                "(nothing else changed) it passes")
    if path in plan and twin[path] in _PACKED_STRINGS.values():
        return (f"the plan entry {path!r} cuts a packed weight (gate/up, Q/K/V) as one block: planned "
                f"{_style_label(plan[path])} the case fails, planned {_style_label(twin[path])} (the shard of each "
                "packed part; nothing else changed) it passes")
    if path in plan:
        return (f"the plan entry {path!r} shards along the wrong dim: planned {_style_label(plan[path])} the case "
                f"fails, planned {_style_label(twin[path])} (nothing else changed) it passes")
    return (f"the planned layers under {path!r} get a sequence shard where they need the whole input: with "
            f"{_style_name(twin[path])} on {path!r} (nothing else changed) the case passes")


def with_plan(variant: PlanVariant, plan: Any) -> PlanVariant:
    """``variant`` with its ranks parallelised by ``plan`` instead (the dense reference unchanged)."""
    return dataclasses.replace(variant, plan=plan, build=_PlanBuild(variant.dense, plan, variant.skip_unmatched))


def twin_variant(variant: PlanVariant, key: str) -> PlanVariant:
    """``variant`` under its twin plan ``key`` (:func:`twin_plans`)."""
    seq_dim = int(key.rpartition(":")[2]) if key.startswith(f"{_PREPARE}:") else None
    for twin_key, _, _, plan in twin_plans(variant.plan, seq_dim):
        if twin_key == key:
            return with_plan(variant, plan)
    raise InvalidArgument(f"plan_twin={key!r}: the plan of {variant.name!r} has no such twin")


@recogniser("wrong-shard-dim", "plan-input-layout", "packed-shard-layout")
def name_plan_entry(family: Any, variant: PlanVariant, case: Any, failures: list[Any], *, backend: str,
                    timeout: float, isolate: bool, properties: Any) -> list[Any]:
    """``failures`` of ``case`` named after the plan entry that explains them, when exactly one twin
    plan (:func:`twin_plans`) passes the same case: one cause ``PATH: DIAGNOSIS`` with the other
    failures as its consequences. Otherwise ``failures`` unchanged (a twin is evidence, not a guess)."""
    from tpsim.diagnosis import Failure

    seq_dim = None
    if "sequence-sharded" in (variant.input, variant.output):
        seq_dim = variant.sequence_dim_of(len(case.batch_shape) + 1)
    passing: list[tuple[str, str, Any]] = []
    twins = twin_plans(variant.plan, seq_dim)
    # A style with its gather or split is tried only where no other twin passes: it names what nothing else
    # names (a dropped gather), and never competes with a dim or a packing that explains the case already.
    tiers = [[t for t in twins if not t[0].startswith(f"{_LAYOUT}:")], [t for t in twins if t[0].startswith(f"{_LAYOUT}:")]]
    for tier in tiers:
        for key, path, diagnosis, plan in tier:
            options = tuple(sorted((*variant.options, ("plan_twin", key))))
            twin = with_plan(variant, plan).replace(options=options)
            try:
                obs = family.observe(twin, case, backend=backend, timeout=timeout, isolate=isolate)
                if not family.judge(twin, obs, properties):
                    passing.append((path, diagnosis, plan))
            except Exception:  # noqa: BLE001 - a twin that cannot run is no evidence either way
                continue
        if passing:
            break
    if len(passing) != 1:
        return failures
    path, diagnosis, plan = passing[0]
    first = failures[0]
    return [Failure(
        property=first.property,
        diagnosis=diagnosis,
        message=f"{_twin_reason(variant.plan, plan, path)}. What was measured: {first.label}: {first.message}",
        case=first.case, rank=first.rank, details=dict(first.details), variant=first.variant,
        sublayer=path, consequences=list(failures[1:]),  # the measured exception is quoted above
    )]
