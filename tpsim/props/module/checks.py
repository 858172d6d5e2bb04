"""The properties of a whole module, checked on one case against its dense reference.

The same properties as for one linear layer (:data:`tpsim.props.linear.checks.PROPERTIES`), at module level:

- ``forward-equivalence``: the output, assembled by the variant's output placement (replicated:
  every rank's; partial: summed over ranks; sharded / sequence-sharded: concatenated), equals the
  dense module's float64 output;
- ``input-grad-equivalence``: the input's grad (complete on every rank, summed, or each rank's slice);
- ``weight-grad-equivalence`` / ``bias-grad-equivalence``: every parameter's grad, by dotted name,
  equals its piece of the dense grad (a replicated parameter: the whole grad on every rank); the
  parameters named ``...bias`` (or declared ``ParamSpec(..., "bias", ...)``) count as biases;
- ``replica-consistency``: everything replicated (the output, a complete input grad, replicated
  parameters right after construction, their grads and values after training) is bit-identical
  across the ranks of a tp group;
- ``training-equivalence``: trained as people train (:func:`tpsim.props.rank.schedule`: two
  SGD steps, the first accumulating the case's ``micro_batches`` micro-batches,
  ``zero_grad`` in the case's mode after each, the target's clip where it has one), every grad
  accumulated over the first step, the clip's total norm, and every parameter after training,
  re-assembled, equal dense training's (evaluated when the single-step properties hold);
- ``divisibility``: when a size (or a sequence-sharded input's length) does not divide by the tp
  size, every rank refuses it with an error naming a size or divisibility, or every rank accepts it
  with parameters that are consistent pieces of the dense ones (``torch.tensor_split`` pieces for
  an uneven dim) and then satisfies every property above. Truncated or padded pieces, a refusal on
  some ranks only, or a refusal that does not say why are ``divisibility-unchecked``.

Tolerances come from the magnitude run (:mod:`tpsim.props.module.magnitude`). Gradients through an
activation with a kink (ReLU) are compared in float64 cases only (see there).

**Where a failure comes from.** When a value property fails, the case is run again with every
sublayer's boundary recorded (:mod:`tpsim.props.module.boundary`), on the reference and on every
rank. The forward events are walked in the reference's order: the first sublayer whose output no
longer assembles to the reference's, while its input still does, is where the forward breaks; the
backward events likewise (a sublayer whose output grad matches but whose input grad or parameter
grad does not). The failure is then named with that sublayer (``Failure.sublayer``, rendered
``fc2: bias-duplication``) and diagnosed by the recognisers of :mod:`tpsim.diagnosis` on that
sublayer's tensors (its bias for ``bias-duplication``). A divergence that first shows in the code
between two sublayers (an activation, a residual) is named ``before fc2`` / ``after fc1``.
Failures that follow from the same cause are listed under it (:func:`tpsim.diagnosis.group_causes`).

**A mechanism is confirmed by a re-run, on two cases.** A forward that diverges with no numeric
pattern is named ``packed-shard-layout`` or ``qkv-head-mismatch`` only when a re-run shows it: the
same case, with the suspect sublayer's parameters declared packed (:func:`_confirm_packed`) or with
every key/value head made the same head (:func:`_confirm_head_pairing`), passes. One passing re-run
of a minimal case can be a coincidence of its degenerate shape — over a one-token sequence an
attention's output does not depend on its queries, so packing the out-projection's input heads
undoes a wrong query/key-value head pairing exactly — so the change must also make a second case
pass that the module as declared fails (:func:`corroborating_case`: every batch dim grown by the tp
size, another seed). The packed layout is tried first: it names the parameter and its declaration,
and once corroborated no head pairing explains the same failure (the second case has several
tokens, where a packed out-projection's permuted heads fail even with one key/value head).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpsim.diagnosis import (
    BIAS_DUPLICATION,
    BIAS_GRAD_RANK0_ONLY,
    BIAS_MISSING,
    DIVISIBILITY_UNCHECKED,
    DOUBLE_REDUCTION,
    EXCEPTION,
    GRAD_MISSING,
    GRAD_NOT_REDUCED,
    GRAD_REDUCED_AFTER_ACCUMULATION,
    GRAD_SCALED,
    MISMATCH,
    MISSING_REDUCTION,
    NORM_COUNTS_REPLICAS,
    NORM_NOT_REDUCED,
    OUTPUT_DETACHED,
    PACKED_SHARD_LAYOUT,
    QKV_HEAD_MISMATCH,
    SHAPE_ERROR,
    WRONG_SHARD_ORDER,
    Diagnosis,
    Failure,
    recogniser,
)
from tpsim.diagnosis import spec as diagnosis_spec
from tpsim.errors import InvalidArgument
from tpsim.module_variant import ModuleVariant
from tpsim.patterns import close, is_bias_multiple
from tpsim.placement import Partial, Placement, Replicate, Shard, assemble_pieces, part_sizes, piece
from tpsim.props.case import MAX_SEED
from tpsim.props.groups import tp_groups
from tpsim.props.judging import Check, GroupContext, Replicated, replica_consistency
from tpsim.props.module.boundary import Capture
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.construction import construction_failure, drift_failure, refined
from tpsim.props.module.sharding import ParamLayout, UnknownLayout
from tpsim.props.module.world import (
    DECLARED,
    EXTRA,
    MISSING,
    UNKNOWN,
    LayoutProblem,
    ModuleRankResult,
    Ties,
    input_placement,
    output_placement,
)
from tpsim.props.observation import DETACHED, OUTPUT_SHAPE, Observation
from tpsim.props.placed import Placed, Recogniser, holds_fast, verdict
from tpsim.props.property_names import (
    BIAS_GRAD,
    DIVISIBILITY,
    FORWARD,
    INPUT_GRAD,
    REPLICA,
    TRAINING,
    WEIGHT_GRAD,
)
from tpsim.props.rank import LR, schedule, zero_grad_of
from tpsim.props.tolerance import FACTOR
from tpsim.props.tolerance import eps as eps_of
from tpsim.props.training import (
    accumulated_what,
    norm_counts_replicas,
    norm_not_reduced,
    reduced_after_accumulation,
)
from tpsim.variant import ParamSpec

__all__ = ["MODULE_CHECKS", "NUMERIC_PATTERNS", "ModuleContext", "grad_property", "layout_failure", "localise",
           "offending", "refuse_unknown_layouts", "truncated_piece"]

_F64 = torch.float64
_VALUE_PROPERTIES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BIAS_GRAD)


def _f64(t: Any) -> torch.Tensor | None:
    return t.detach().to(_F64) if isinstance(t, torch.Tensor) else None


def grad_property(variant: ModuleVariant, name: str) -> str:
    """The property a parameter's grad counts under: bias-grad for a bias, weight-grad otherwise."""
    spec = variant.param(name)
    if spec is not None:
        return BIAS_GRAD if spec.master == "bias" else WEIGHT_GRAD
    return BIAS_GRAD if name.rpartition(".")[2] == "bias" else WEIGHT_GRAD


def owner(name: str) -> str | None:
    """The sublayer that owns parameter ``name`` (None: the module itself)."""
    return name.rpartition(".")[0] or None


class ModuleContext(GroupContext):
    """One tp group of a module case: the dense reference of the group (float64 values ``ref`` and
    their magnitudes ``mag``, from the reference world), each parameter's layout as the ranks hold it,
    and the parameters whose grads the trainer sums."""

    def __init__(self, variant: ModuleVariant, obs: Observation, group_index: int, ranks: Sequence[int],
                 values: list[ModuleRankResult]):
        super().__init__(variant, obs, group_index, ranks, values)
        ref = obs.data
        self.ref = ref.groups[group_index].value  # type: ignore[union-attr]
        self.mag = ref.groups[group_index].mag  # type: ignore[union-attr]
        #: The reduction length of the magnitude run's first-order bound (its stages' longest sum).
        self.k = ref.reduction + obs.case.rows  # type: ignore[union-attr]
        # A kink within rounding of a pre-activation flips its derivative: in a dtype narrower than
        # float64, grads through it are not determined by first-order bounds (see magnitude.py).
        # A module that casts down (ref.narrowed) rounds in the narrower dtype even in a float64 case.
        self.grads_bounded = not ref.kinked or (self.dtype == _F64 and not ref.narrowed)  # type: ignore[union-attr]
        self.layouts = dict(values[0].layouts)
        #: What the library loaded, per rank (tpsim.props.module.loading): layouts read from shapes alone
        #: are read again from these values (tpsim.props.module.construction).
        self.loaded = [v.loaded for v in values]
        if any(self.loaded):
            self.layouts = refined(self.layouts, self.loaded, ref.masters, self.loaded_bound)  # type: ignore[union-attr]
        #: Replicated parameters whose grad the trainer sums (see tpsim.props.module.world).
        self.partial = set(values[0].partial)
        #: Parameters the dense module keeps in a dtype of its own (ModuleVariant.own_dtypes).
        self.own_dtypes = {n: getattr(torch, d) for n, d in getattr(variant, "own_dtypes", ())}

    def dtype_of(self, param: str | None) -> torch.dtype:
        """The dtype ``param`` (and its grad) is held in: the case's, or the module's own for it."""
        return self.own_dtypes.get(param, self.dtype) if param else self.dtype

    def loaded_bound(self, full: torch.Tensor) -> torch.Tensor:
        """The bound of a loaded parameter of dense value ``full``: a copy is exact, a sum of ``tp``
        terms (a Partial parameter's) rounds like a reduction of that length."""
        return self.tol(full.abs(), self.tp)

    def bound(self, magnitude: torch.Tensor) -> torch.Tensor:
        """The bound of a compared tensor of ``magnitude``: the magnitude run's first-order propagation
        (or the twin's equivalent magnitude) already carries each stage's rounding."""
        return self.tol(magnitude.to(_F64), self.k)

    def replicated(self) -> list[Replicated]:
        items = [Replicated(f"{name} right after construction", [v.init.get(name) for v in self.values], name,
                            f", although every rank was seeded alike (torch.manual_seed({self.case.seed})) before the "
                            "build: its initialisation depends on the rank; draw it from the same RNG state on every "
                            "rank or broadcast it after construction")
                 for name, layout in self.layouts.items() if isinstance(layout.placement, Replicate)]
        if self.variant.output == "replicated":
            items.append(Replicated("the output", [v.output for v in self.values]))
        if self.variant.input == "replicated" and self.variant.input_grad == "complete":
            items.append(Replicated("the input grad", [v.input_grad for v in self.values]))
        for name, layout in self.layouts.items() if not self.variant.forward_only else ():  # no grads, no steps
            if isinstance(layout.placement, Replicate):
                if name in self.partial:  # the trainer's sum must be the same bits everywhere
                    items.append(Replicated(f"the {name} grad summed by the trainer",
                                            [v.summed_grads.get(name) for v in self.values], name))
                else:
                    items.append(Replicated(f"the {name} grad", [v.grads.get(name) for v in self.values], name))
                items.append(Replicated(f"{name} after training", [v.final.get(name) for v in self.values], name))
        return items


# --- the properties on one tp group ---------------------------------------------------------------


def judged(ctx: ModuleContext, prop: str, placed: Placed, fast_mag: torch.Tensor | None = None,
           recognisers: Sequence[Recogniser] = ()) -> Failure | None:
    """The failure of ``prop`` on ``placed`` (:func:`tpsim.props.placed.verdict`, with the family's
    ``recognisers`` first), named with the sublayer that owns its parameter. ``fast_mag``: the magnitude
    to try the chunked comparison with first (a lab-scale tensor is compared without being assembled or
    converted)."""
    if fast_mag is not None and holds_fast(placed.pieces, placed.full, fast_mag, ctx.bound, placed.placement,
                                           placed.summed, placed.uneven):
        return None
    if fast_mag is not None:
        placed.tol = ctx.bound(fast_mag)
    found = verdict(placed, ctx.dtype_of(placed.param), recognisers)
    if found is None:
        return None
    diag, rank = found
    extra = {"param": placed.param} if placed.param else {}
    return ctx.fail(prop, diag, rank, placed.sublayer or (owner(placed.param) if placed.param else None), **extra)


@recogniser(OUTPUT_DETACHED)
def _forward(ctx: ModuleContext) -> Failure | None:
    for r, v in enumerate(ctx.values):
        if v.status == DETACHED:
            return ctx.fail(FORWARD, Diagnosis(OUTPUT_DETACHED,
                f"the output on rank {r} is detached from the autograd graph (grad_fn None) although the input "
                "requires grad: a collective or a copy runs outside autograd, so nothing flows back"), r)
        if v.status == OUTPUT_SHAPE and v.output is None:
            return ctx.fail(FORWARD, Diagnosis(SHAPE_ERROR, f"rank {r}'s forward returned {v.output_type}, not a tensor"), r)
    y = ctx.ref.y
    placement = output_placement(ctx.variant, y.dim())
    summed = ctx.variant.output == "partial"
    what = "the output" + (" (rank pieces assembled)" if isinstance(placement, Shard) else
                           " (summed over ranks)" if summed else "")
    # A module's replicated or partial output is a reduction's (or the caller's): reduced twice is a name there.
    # Every bias of the module may have been added before the last reduction (a parent's included): the
    # output is then off by (tp-1) times it, named where the bias is added (its owner).
    found = judged(ctx, FORWARD, Placed(what, [v.output for v in ctx.values], y, ctx.bound(ctx.mag.y), placement,
                                        summed=summed, reduced=_reduces(placement, y.dim()), biases=_biases(ctx),
                                        sequence_dim=ctx.variant.sequence_dim_of(y.dim())))
    return found if found is not None else _no_grad_forward(ctx, what, placement, summed)


def _no_grad_forward(ctx: ModuleContext, what: str, placement: Placement, summed: bool) -> Failure | None:
    """The output of the forward every rank ran under ``torch.no_grad()`` before training (on the first
    micro-batch's input, from the same parameters), judged like the training forward's: a module may
    take another code path with grad disabled (transformers' ColwiseParallel runs a local kernel then)."""
    if ctx.variant.forward_only or all(v.no_grad_type is None for v in ctx.values):
        return None  # forward-only: its one forward is under torch.no_grad() already
    for r, v in enumerate(ctx.values):
        if v.no_grad_output is None:
            return ctx.fail(FORWARD, Diagnosis(SHAPE_ERROR, f"under torch.no_grad() (the inference path) the forward on "
                                               f"rank {r} returned {v.no_grad_type}, not a tensor"), r)
    y = ctx.ref.y
    return judged(ctx, FORWARD, Placed(f"{what.replace('the output', 'the output under torch.no_grad()', 1)} (the "
                                       "inference path: one forward with grad disabled, before training, on the first "
                                       "micro-batch's input)", [v.no_grad_output for v in ctx.values], y,
                                       ctx.bound(ctx.mag.y), placement, summed=summed,
                                       reduced=_reduces(placement, y.dim()), biases=_biases(ctx),
                                       sequence_dim=ctx.variant.sequence_dim_of(y.dim())))


def _biases(ctx: ModuleContext) -> list[tuple[str, torch.Tensor]]:
    """Every bias of the module (a one-dim master named ``bias``), as the dense module holds it."""
    masters = getattr(ctx.obs.data, "masters", None) or {}
    return [(n, t.to(_F64)) for n, t in masters.items() if t.dim() == 1 and n.rpartition(".")[2] == "bias"]


def _input_grad(ctx: ModuleContext) -> Failure | None:
    dx = ctx.ref.dx
    if dx is None or not ctx.grads_bounded:
        return None
    summed = ctx.variant.input == "replicated" and ctx.variant.input_grad == "partial"
    return judged(ctx, INPUT_GRAD, Placed(
        "the input grad" + (" summed over ranks" if summed else ""), [v.input_grad for v in ctx.values], dx,
        ctx.bound(ctx.mag.dx), input_placement(ctx.variant, dx.dim()), summed=summed, grad=True,
        sequence_dim=ctx.variant.sequence_dim_of(dx.dim())))


def param_placed(ctx: ModuleContext, name: str, grads: list[Any], full: torch.Tensor) -> Placed:
    """Parameter ``name``'s grads (each rank's) as they are compared with the dense grad ``full``."""
    layout = ctx.layouts[name]
    summed = name in ctx.partial
    return Placed(f"the {name} grad" + (" summed over ranks" if summed else ""), grads, full, full, layout.placement,
                  summed=summed, uneven=layout.uneven, grad=True, param=name,
                  sequence_parallel="sequence-sharded" in (ctx.variant.input, ctx.variant.output))


def _param_grads(ctx: ModuleContext, prop: str) -> Failure | None:
    if not ctx.grads_bounded:
        return None
    for name in ctx.layouts:
        full = ctx.ref.grads.get(name)
        if grad_property(ctx.variant, name) != prop or full is None:
            continue  # another property's, or the parameter takes no part in the dense forward
        found = judged(ctx, prop, param_placed(ctx, name, [v.grads.get(name) for v in ctx.values], full),
                       ctx.mag.grads[name])
        if found is not None:
            return found
    return None


def _accumulated(ctx: ModuleContext) -> Failure | None:
    """Every parameter's grad accumulated over the first optimizer step's micro-batches, as the trainer
    sees it, against the dense accumulated grad; an earlier micro-batch counted again is named
    (:func:`tpsim.props.training.reduced_after_accumulation`). The bound is that of the sum of the
    micro-batches' magnitudes (the tolerance is linear in the magnitude)."""
    micro = schedule(ctx.case)[0]
    for name in ctx.layouts:
        full = ctx.ref.accumulated.get(name)
        mag = ctx.mag.accumulated.get(name)
        if full is None or mag is None:
            continue  # the parameter takes no part in the dense forward
        placed = param_placed(ctx, name, [v.accumulated.get(name) for v in ctx.values], full)
        placed.what = accumulated_what(name, micro) + (" summed over ranks" if placed.summed else "")
        earlier, first_mag = ctx.ref.micro_grads(name), ctx.mag.grads.get(name)
        # The earlier micro-batches' bounds are made only where the recogniser needs them (a grad that differs):
        # made up front each was a float64 tensor the size of every weight, for every passing case. The
        # first's is its own; a later one's that of the whole accumulation (which bounds each of its parts).
        bounds = [None if first_mag is None else functools.partial(ctx.bound, first_mag),
                  *[functools.partial(ctx.bound, mag)] * (len(earlier) - 1)]
        found = judged(ctx, TRAINING, placed, mag, [reduced_after_accumulation(earlier, bounds, ctx.tp, micro)])
        if found is not None:
            return found
    return None


def _local_norm(v: ModuleRankResult) -> float:
    """The 2-norm of one rank's own accumulated grads (its local pieces) after the trainer's sum."""
    grads = {**v.accumulated, **v.summed_grads}
    return math.sqrt(sum(float(g.to(_F64).square().sum()) for g in grads.values() if g is not None))


def _clip_norm(ctx: ModuleContext) -> Failure | None:
    """Where the target clips by global norm: the total norm its clip returned on every rank at the first
    optimizer step against the dense total norm of the same (accumulated, trainer-summed) grads.

    The bound: each grad errs within the bound of its magnitude, which moves the norm by at most the
    2-norm of those bounds; the sum of ``n`` squares rounds like any reduction of length ``n``
    (:mod:`tpsim.props.tolerance`'s model, relative to the norm). A norm that counts replicated
    parameters once per rank is ``norm-counts-replicas``."""
    if ctx.variant.clip is None or ctx.ref.max_norm is None or not ctx.ref.norms:
        return None
    dense = ctx.ref.norms[0]
    bounds = [ctx.bound(m) for n, m in ctx.mag.accumulated.items() if m is not None and n in ctx.layouts]
    n = sum(b.numel() for b in bounds)
    bound = (float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(b) for b in bounds]))) if bounds
             else 0.0) + FACTOR * eps_of(ctx.dtype) * math.sqrt(n + ctx.tp) * dense
    replicated = [name for name, lay in ctx.layouts.items() if isinstance(lay.placement, Replicate)
                  and ctx.ref.accumulated.get(name) is not None]
    replicated_sq = sum(float(ctx.ref.accumulated[name].to(_F64).square().sum()) for name in replicated)  # type: ignore[union-attr]
    for r, v in enumerate(ctx.values):
        got = v.norms[0] if v.norms else None
        if not isinstance(got, float):
            raise InvalidArgument(
                f"the clip function of {ctx.variant.name!r} returned {'no norm' if got is None else f'a {got}'} on "
                f"rank {r}; clip(parameters, max_norm) must return the total grad norm over the tp group (a tensor, a "
                "DTensor or a float), as torch.nn.utils.clip_grad_norm_ does")
        if abs(got - dense) <= bound:
            continue
        diag = norm_counts_replicas(got, dense, replicated_sq, ctx.tp, bound, replicated) or norm_not_reduced(
            got, dense, _local_norm(v), ctx.tp, bound, r)
        if diag is None:
            diag = Diagnosis(MISMATCH, f"the total grad norm the clip returned on rank {r} is {got:.9g}, the dense total "
                             f"norm of the same grads (torch.nn.utils.clip_grad_norm_ in float64) is {dense:.9g}: off by "
                             f"{abs(got - dense):.3g}, beyond its bound {bound:.3g}",
                             {"norm": got, "dense_norm": dense, "bound": bound})
        return ctx.fail(TRAINING, diag, r)
    return None


def _training(ctx: ModuleContext) -> Failure | None:
    if not ctx.grads_bounded:
        return None
    found = _accumulated(ctx) or _clip_norm(ctx)
    if found is not None:
        return found
    for name, layout in ctx.layouts.items():
        want = ctx.ref.final[name]
        summed = isinstance(layout.placement, Partial)  # the ranks' copies add up to the parameter
        found = judged(ctx, TRAINING, Placed(f"{name} after training ({trained(ctx.case, ctx.ref.max_norm)}, lr {LR})"
                                             + (" summed over ranks" if summed else ""),
                                             [v.final.get(name) for v in ctx.values], want, want, layout.placement,
                                             summed=summed, uneven=layout.uneven, param=name), ctx.mag.final[name])
        if found is not None:
            return (drift_failure(ctx, name, layout, _initial(ctx, name, layout), len(schedule(ctx.case))) if summed else None) \
                or found
    return None


def _initial(ctx: ModuleContext, name: str, layout: ParamLayout) -> list[torch.Tensor | None]:
    """Each rank's copy of ``name`` right after loading: what the library loaded, or the piece tpsim
    wrote by ``layout``."""
    if all(name in v for v in ctx.loaded):
        return [v[name] for v in ctx.loaded]
    master = ctx.obs.data.masters[name]  # type: ignore[union-attr]
    return [piece(master, layout.placement, r, ctx.tp, layout.uneven) for r in range(ctx.tp)]
def trained(case: Any, max_norm: float | None = None) -> str:
    """How a case's training is described in messages."""
    plan = schedule(case)
    zero = "set_to_none" if zero_grad_of(case) else "zeroed in place"
    clip = "" if max_norm is None else f", clipped to max_norm {max_norm:.4g}"
    return f"{len(plan)} SGD steps of {'+'.join(str(n) for n in plan)} micro-batches{clip}, grads {zero} after each"


# --- whole-run outcomes ---------------------------------------------------------------------------


def offending(variant: ModuleVariant, case: ModuleCase) -> tuple[str, list[int]]:
    """What does not divide by the tp size in ``case`` (its sizes, a sequence-sharded input's length)."""
    tp = case.tp_size or case.world_size
    out = {n: s for n, s in zip(variant.sizes, case.sizes, strict=True) if s % tp and n not in variant.unsharded}
    d = variant.sequence_dim_of(len(case.batch_shape) + 1) if variant.input == "sequence-sharded" else None
    if d is not None and case.batch_shape[d] % tp:
        out[f"the sequence length (dim {d})"] = case.batch_shape[d]
    size_name = "world_size" if tp == case.world_size else "tp_size"
    return ", ".join(f"{n}={v}" for n, v in out.items()) + f" is not divisible by {size_name}={tp}", list(out.values())


def _truncated(problem: LayoutProblem, tp: int) -> bool:
    """A piece cut along a dim that does not divide by ``tp``, yet no ``torch.tensor_split`` piece:
    the evidence of a size silently truncated or padded (a dim that divides says nothing of the sort)."""
    shape, full = problem.shape, problem.full
    if shape is None or full is None or len(shape) != len(full):
        return False
    return any(s != f and f % tp for s, f in zip(shape, full, strict=True))


@recogniser(DIVISIBILITY_UNCHECKED)
def truncated_piece(variant: ModuleVariant, obs: Observation, what: str) -> Failure | None:
    """A module that accepted sizes that do not divide must hold consistent pieces of the dense
    parameters (``torch.tensor_split``'s for an uneven dim); a piece that is not one is
    ``divisibility-unchecked``. A piece that no layout explains along a dim that divides is
    :class:`UnknownLayout`, as in a divisible case."""
    tp = obs.case.tp_size or obs.case.world_size
    for r, v in enumerate(obs.values or []):
        for problem in v.problems:
            if problem.kind == DECLARED or _truncated(problem, tp):
                return Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                               f"{what}, yet the module accepted it, and parameter {problem.param!r} has shape "
                               f"{list(problem.shape or ())} on rank {r} while the dense one is {list(problem.full or ())}: "
                               f"that is no 1/{tp} piece (nor a torch.tensor_split piece): the size was silently truncated "
                               "or padded; raise a ValueError naming the sizes at construction", case=obs.case, rank=r,
                               variant=variant.name, sublayer=owner(problem.param), details={"param": problem.param})
    refuse_unknown_layouts(obs)
    return None


def refuse_unknown_layouts(obs: Observation) -> None:
    """Raise :class:`UnknownLayout` for the first parameter whose layout no shape explains."""
    tp = obs.case.tp_size or obs.case.world_size
    for r, v in enumerate(obs.values or []):
        for problem in v.problems:
            if problem.kind == UNKNOWN and problem.shape is not None and problem.full is not None:
                raise UnknownLayout(problem.param, problem.shape, problem.full, r, tp)


def layout_failure(variant: ModuleVariant, obs: Observation) -> Failure | None:
    """A parameter missing or extra on a rank, or whose shape contradicts its declared placement, in a
    case whose sizes all divide; one laid out differently on different ranks. A shape no layout
    explains is a usage error (:class:`UnknownLayout`), raised when nothing else is wrong."""
    for r, v in enumerate(obs.values or []):
        for problem in v.problems:
            name = problem.param
            if problem.kind == DECLARED:
                spec = variant.param(name)
                why = f"its declared placement {spec.placement if spec else '?'} implies another shape"
            elif problem.kind == MISSING:
                why = "missing: the dense module has it, this rank's module does not"
            elif problem.kind == EXTRA:
                why = "extra: this rank's module has it, the dense module does not"
            else:
                continue
            shape = None if problem.shape is None else list(problem.shape)
            full = None if problem.full is None else list(problem.full)
            return Failure(FORWARD, SHAPE_ERROR,
                           f"parameter {name!r} has shape {shape} on rank {r}, the dense module's is {full}: {why}",
                           case=obs.case, rank=r, variant=variant.name, sublayer=owner(name),
                           details={"param": name, "shape": shape, "expected_shape": full})
    refuse_unknown_layouts(obs)
    layouts = [v.layouts for v in obs.values or []]
    for name in layouts[0] if layouts else {}:
        seen = {(str(lay[name].placement), lay[name].uneven) for lay in layouts if name in lay}
        if len(seen) > 1:
            return Failure(FORWARD, SHAPE_ERROR, f"parameter {name!r} is laid out differently on different ranks: "
                           f"{sorted(seen)}", case=obs.case, variant=variant.name, sublayer=owner(name),
                           details={"param": name})
    return None


#: The registry: the module family's check of each property on one tp group, in report order.
def _forward_from_construction(ctx: ModuleContext) -> Failure | None:
    """What the library loaded, then the output: a mis-slice is named where it happens."""
    if any(ctx.loaded):
        found = construction_failure(ctx.layouts, ctx.loaded, ctx.obs.data.masters, ctx.loaded_bound,  # type: ignore[union-attr]
                                     ctx.dtype, ctx.fail, own=ctx.own_dtypes)
        if found is not None:
            return found
    return _forward(ctx)


MODULE_CHECKS: dict[str, Check] = {
    FORWARD: _forward_from_construction,
    INPUT_GRAD: _input_grad,
    WEIGHT_GRAD: lambda ctx: _param_grads(ctx, WEIGHT_GRAD),
    BIAS_GRAD: lambda ctx: _param_grads(ctx, BIAS_GRAD),
    REPLICA: replica_consistency,
    TRAINING: _training,
}


# --- where: the first sublayer boundary that diverges ----------------------------------------------


def _boundary_match(pieces: list[torch.Tensor | None], full: torch.Tensor, tol: torch.Tensor,
                    hints: Sequence[tuple[int, ...]]) -> str | None:
    """How the ranks' pieces make ``full``: ``"R"`` (each is it), ``"S"`` (shards along one dim,
    packed like the sublayer's parameters where they say so), ``"P"`` (each a summand: something
    after this boundary must reduce them) or None (they do not)."""
    if any(p is None for p in pieces):
        return None
    ps = [p.to(_F64) for p in pieces]  # type: ignore[union-attr]
    tp = len(ps)
    if all(p.shape == full.shape for p in ps):
        if all(close(p, full, tol) for p in ps):
            return "R"
        return "P" if tp > 1 and close(torch.stack(ps).sum(0), full, tol) else None
    if any(p.dim() != full.dim() for p in ps):
        return None
    for d in range(full.dim()):
        others = [i for i in range(full.dim()) if i != d]
        if sum(p.shape[d] for p in ps) != full.shape[d] or any(p.shape[i] != full.shape[i] for p in ps for i in others):
            continue
        uneven = full.shape[d] % tp != 0
        candidates: list[Placement] = [Shard(d)]
        candidates += [Shard(d, parts=h) for h in hints if sum(h) == full.shape[d] and not uneven]
        for placement in candidates:
            try:
                if close(assemble_pieces(ps, placement, uneven), full, tol):
                    return "S"
            except (RuntimeError, InvalidArgument):
                continue
    return None


@dataclass
class _Culprit:
    """Where a divergence first shows: ``sublayer`` (its dotted name, or ``before X`` / ``after X``
    for the code between sublayers), the boundary ``kind`` and the diagnosis on its tensors."""

    sublayer: str
    kind: str
    diagnosis: Diagnosis
    #: The sublayers whose parameters may be loaded in the wrong layout (see :func:`_layout_hint`).
    suspects: tuple[str, ...] = ()


class _Boundaries:
    """The captured boundaries of one tp group: reference, magnitudes, and every rank's."""

    def __init__(self, ctx: ModuleContext, obs: Observation):
        self.ctx = ctx
        group = obs.data.groups[ctx.group_index]  # type: ignore[union-attr]
        self.ref = Capture.from_payload(group.value.capture or {})
        self.mag = Capture.from_payload(group.mag.capture or {})
        ranks = tp_groups(obs.case.world_size, obs.case.tp_size or obs.case.world_size, obs.case.tp_layout)[ctx.group_index]
        self.ranks = [Capture.from_payload((obs.values or [])[r].capture or {}) for r in ranks]
        self.masters = obs.data.masters  # type: ignore[union-attr]
        self.rank_grads = [(obs.values or [])[r].grads for r in ranks]
        self.ref_grads = group.value.grads
        self.mag_grads = group.mag.grads

    def hints(self, name: str) -> list[tuple[int, ...]]:
        out = []
        for pname, layout in self.ctx.layouts.items():
            if owner(pname) == name and isinstance(layout.placement, Shard) and layout.placement.parts:
                out.append(tuple(layout.placement.parts))
        return out

    def tensors(self, key: tuple[str, str]) -> tuple[list[torch.Tensor | None], torch.Tensor | None, torch.Tensor | None]:
        return ([c.tensors.get(key) for c in self.ranks], self.ref.tensors.get(key), self.mag.tensors.get(key))

    def matches(self, key: tuple[str, str]) -> str | None:
        """:func:`_boundary_match` of the boundary ``key`` (``"-"``: the reference has no such tensor)."""
        pieces, full, mag = self.tensors(key)
        if full is None:
            return "-"
        tol = self.ctx.bound(mag if mag is not None and mag.shape == full.shape else full.abs())
        return _boundary_match(pieces, full, tol, self.hints(key[0]))

    def biases(self, name: str) -> list[tuple[str, torch.Tensor]]:
        """The biases of sublayer ``name`` and of every sublayer inside it first, then every other bias of the
        module: one added on every rank before a reduction shows at the output of the sublayer that adds it
        (its summands are off by it), or after the module that reduces (its parent, maybe)."""
        inside = f"{name}."
        every = [(p, t.to(_F64)) for p, t in self.masters.items() if t.dim() == 1 and p.rpartition(".")[2] == "bias"]
        own = [(p, t) for p, t in every if owner(p) == name or p.startswith(inside)]
        return own + [(p, t) for p, t in every if (p, t) not in own]

    def reduced_after(self, key: tuple[str, str]) -> bool:
        """Whether the ranks' values are reduced after the forward boundary ``key``: a later boundary, or
        the module's output, that every rank holds whole and alike (summands that differ become the same
        only through a reduction), or an output sharded along the sequence (a reduce-scatter's)."""
        events = [k for k in self.ref.events if k[1] in ("in", "out")]
        later = events[events.index(key) + 1:] if key in events else []
        candidates = [self.tensors(k)[:2] for k in later]
        candidates.append(([v.output for v in self.ctx.values], self.ctx.ref.y))
        for pieces, full in candidates:
            if full is None or any(not isinstance(p, torch.Tensor) or p.shape != full.shape for p in pieces):
                continue
            first = pieces[0].to(_F64)  # type: ignore[union-attr]
            tol = self.ctx.bound(full.abs().to(_F64))
            if all(close(p.to(_F64), first, tol) for p in pieces[1:]):  # type: ignore[union-attr]
                return True
        return self.ctx.variant.output == "sequence-sharded"

    def diagnose(self, key: tuple[str, str], what: str) -> Diagnosis:
        pieces, full, mag = self.tensors(key)
        if full is None or any(p is None for p in pieces):
            return Diagnosis(GRAD_MISSING if key[1] in ("gin", "gout") else SHAPE_ERROR,
                             f"{what} is missing on some rank")
        tol = self.ctx.bound(mag if mag is not None and mag.shape == full.shape else full.abs())
        placement = _piece_placement(pieces, full)  # type: ignore[arg-type]
        grad = key[1] in ("gin", "gout")
        biases = () if grad else self.biases(key[0])
        found = verdict(Placed(what, pieces, full, tol, placement, grad=grad, reduced=not grad and _reduces(placement, full.dim()),
                               biases=biases), self.ctx.dtype,
                        [] if grad else [_summed_bias(key[0], biases, lambda: self.reduced_after(key))])
        return found[0] if found is not None else Diagnosis(MISMATCH, f"{what} differs from the reference")

    def param_culprit(self, name: str) -> _Culprit | None:
        for pname in self.ctx.layouts:
            full = self.ref_grads.get(pname)
            if owner(pname) != name or full is None:
                continue
            placed = param_placed(self.ctx, pname, [g.get(pname) for g in self.rank_grads], full)
            placed.tol = self.ctx.bound(self.mag_grads[pname])
            found = verdict(placed, self.ctx.dtype_of(pname))
            if found is not None:
                return _Culprit(name, "param", found[0])
        return None


def _piece_placement(pieces: list[torch.Tensor], full: torch.Tensor) -> Placement:
    if all(p.shape == full.shape for p in pieces):
        return Replicate()
    for d in range(full.dim()):
        if sum(p.shape[d] for p in pieces) == full.shape[d]:
            return Shard(d)
    return Replicate()


def _reduces(placement: Placement, ndim: int) -> bool:
    """Whether pieces in ``placement`` (of a tensor of ``ndim`` dims) can be a reduction's result: whole on
    every rank, or sharded along another dim than the features (a reduce-scatter's); a shard of the
    features is a column split's, which reduces nothing (a forward that is 2x there is no double reduction)."""
    return not isinstance(placement, Shard) or ndim == 0 or placement.dim % ndim != ndim - 1


def _summed_bias(sublayer: str, biases: Sequence[tuple[str, torch.Tensor]], reduced_after: Callable[[], bool]) -> Any:
    """The summands of a sublayer's output, each carrying a whole bias: every rank holds a tensor of the
    full shape, they differ, and their sum is the dense one plus exactly ``(tp-1)`` times one of the
    ``biases``. A reduction after it (``reduced_after``: the sublayer's parent's, or any later one) adds
    them: ``bias-duplication``, named where the bias is added; with no reduction after it,
    ``missing-reduction`` (each rank's summand, with the bias)."""

    @recogniser(BIAS_DUPLICATION, MISSING_REDUCTION)
    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
        tp, full = placed.tp, placed.full
        if placed.sharded or placed.summed or tp < 2 or any(p.shape != full.shape for p in pieces):
            return None
        if all(close(p, pieces[0], placed.tol) for p in pieces[1:]):
            return None  # the ranks hold the same values: no summands
        total = pieces[0]
        for p in pieces[1:]:
            total = total + p
        for name, bias in biases:
            if not is_bias_multiple(total - full, bias, tp - 1, placed.tol * tp):
                continue
            if reduced_after():
                return Diagnosis(BIAS_DUPLICATION,
                                 f"{placed.what}: every rank's summand carries the whole {name}, so the reduction "
                                 f"after {sublayer} (its parent's, or a later one) adds it world_size times: their sum is "
                                 f"off by exactly (world_size-1)*{name} = {tp - 1}*{name} (tp size {tp}); add it "
                                 "once, after the reduction", {"factor": float(tp - 1), "bias": name, "summed": True})
            return Diagnosis(MISSING_REDUCTION,
                             f"{placed.what}: each rank holds only its own summand plus the whole {name} (the "
                             f"ranks' values differ and add up to the dense one plus {tp - 1}*{name}), and nothing "
                             "after it reduces them: the all-reduce over the tp group is missing (and the bias must "
                             "be added once, after it)", {"bias": name})
        return None

    return recognise


_UNREDUCED = {"out": "the output of {s}", "gin": "the input grad of {s}", "gout": "the output grad of {s}",
              "in": "the input of {s}"}
_PHRASES = {"out": "the output of {s} (its input matches the reference's)",
            "in": "the input of {s} (the output of the sublayer before it matches)",
            "gin": "the input grad of {s} (its output grad matches the reference's)",
            "gout": "the output grad of {s} (the input grad of the sublayer after it matches)",
            "param": "a parameter grad of {s} (its output grad matches the reference's)"}


def _localise(ctx: ModuleContext, obs: Observation) -> tuple[_Culprit | None, _Culprit | None]:
    """The first forward and the first backward divergence (see the module docstring).

    A boundary whose pieces are each only a summand is consistent (the code after it may reduce
    them); when no boundary diverges, the last such boundary is where the reduction went missing."""
    b = _Boundaries(ctx, obs)
    forward = [k for k in b.ref.events if k[1] in ("in", "out")]
    backward = [k for k in b.ref.events if k[1] in ("gout", "gin")]
    fwd: _Culprit | None = None
    diverged: set[str] = set()
    partial: tuple[str, str] | None = None
    previous: str | None = None
    for key in forward:
        kind = b.matches(key)
        if kind == "P":
            partial = key
        if kind is None:
            diverged.add(key[0])
            if fwd is None:
                where = key[0] if key[1] == "out" else f"before {key[0]}"
                suspects = (key[0],) if key[1] == "out" or previous is None else (previous, key[0])
                diag = b.diagnose(key, _PHRASES[key[1]].format(s=key[0]))
                if diag.name in (BIAS_DUPLICATION, BIAS_MISSING) and diag.details.get("bias"):
                    where = owner(diag.details["bias"]) or where  # named where the bias is added
                fwd = _Culprit(where, key[1], diag, suspects)
        if key[1] == "out":
            previous = key[0]
    if fwd is None and partial is not None:
        fwd = _Culprit(partial[0], partial[1], b.diagnose(partial, _UNREDUCED[partial[1]].format(s=partial[0])))
    elif fwd is None and previous is not None:
        # Every sublayer boundary matches: the code after the last sublayer diverges.
        fwd = _Culprit(f"after {previous}", "after", Diagnosis(MISMATCH, "every sublayer boundary before it matches"),
                       (previous,))
    bwd: _Culprit | None = None
    partial = None
    for key in backward:
        name, boundary = key
        kind = b.matches(key)
        if kind == "P":
            partial = key
        if kind is None:
            if name in diverged and fwd is not None:
                bwd = fwd
            elif boundary == "gin":
                bwd = _Culprit(name, boundary, b.diagnose(key, _PHRASES[boundary].format(s=name)))
            else:
                bwd = _Culprit(f"after {name}", boundary, b.diagnose(key, _PHRASES[boundary].format(s=name)))
            break
        if boundary == "gout":
            culprit = b.param_culprit(name)
            if culprit is not None:
                bwd = fwd if (name in diverged and fwd is not None) else culprit
                break
    if bwd is None and partial is not None:
        bwd = _Culprit(partial[0], partial[1], b.diagnose(partial, _UNREDUCED[partial[1]].format(s=partial[0])))
    return fwd, bwd


def _apply(failures: list[Failure], fwd: _Culprit | None, bwd: _Culprit | None,
           layouts: dict[str, ParamLayout], loaded: Sequence[str] = ()) -> list[Failure]:
    """Name the sublayer of every failure. Where the sublayer's tensors show a known mechanism that
    explains a failure's property, that is its diagnosis (the module-level one is kept in
    ``details``); otherwise the first failure traced to it says where the values first diverge.
    Said once per culprit: the other failures it explains follow from it (their consequences)."""
    told: set[int] = set()
    causes: list[Failure] = []
    forward_cause: Failure | None = None
    for f in failures:
        causes.append(f)
        tensor = f.details.get("tensor") if f.property == REPLICA else None
        if f.details.get("construction"):
            culprit = None  # named where the library loaded it, before any forward ran
        elif f.property == FORWARD or tensor == "the output":
            culprit = fwd
        elif f.property in (INPUT_GRAD, WEIGHT_GRAD, BIAS_GRAD) or tensor == "the input grad":
            culprit = bwd
        else:
            culprit = None  # a parameter's failure already names the sublayer that owns it
        if culprit is None:
            continue
        f.sublayer = culprit.sublayer
        if culprit is fwd and forward_cause is not None and f.property != FORWARD:
            # The grads of a module whose forward diverged at this sublayer differ because of it
            # (everything after it saw other values): one cause, its consequences under it.
            causes.pop()
            forward_cause.consequences.append(f)
            continue
        if culprit is fwd and f.property == FORWARD:
            forward_cause = f
        if id(culprit) in told:
            continue
        told.add(id(culprit))
        d = culprit.diagnosis
        bias = f.details.get("bias") if f.property == FORWARD and f.diagnosis == BIAS_DUPLICATION else None
        if bias is not None and d.name != BIAS_DUPLICATION:
            # The module's output is off by (tp-1) times a bias: it was added before a reduction, named where
            # it is added (its owner; None: the module itself), whatever the boundaries before that reduction
            # show (summands that sum right until the bias joins them in the parent's code).
            f.sublayer = owner(bias)
            if d.name in (MISSING_REDUCTION, GRAD_NOT_REDUCED):
                f.message = (f"{f.message} (the output of {culprit.sublayer} is each rank's own summand, right for "
                             "the reduction after it; the bias joins the summands before that reduction)")
            else:
                f.message = f"{f.message} (the values first diverge {culprit.sublayer}: {d.message})"
            continue
        if d.name != MISMATCH and f.property in diagnosis_spec(d.name).properties:
            f.details = {**f.details, **d.details, "module_diagnosis": f.diagnosis, "module_message": f.message}
            f.diagnosis, f.message = d.name, d.message
        else:
            where = culprit.sublayer if culprit.sublayer.startswith(("before ", "after ")) else f"at {culprit.sublayer}"
            f.message = f"{f.message} — the values first diverge {where}: {d.message}"
            f.message += _layout_hint(layouts, culprit.suspects, loaded)
    return causes


def _layout_hint(layouts: dict[str, ParamLayout], suspects: Sequence[str], loaded: Sequence[str] = ()) -> str:
    """A mismatch right after a sublayer whose weight tpsim wrote by its shape alone may be the
    harness's reading of a packed layout, not a bug: say how to declare it. Never for a parameter
    the library loaded: its values are the library's whatever is declared, so a declaration could
    only hide a mis-slice."""
    inferred = [n for n, lay in layouts.items() if owner(n) in suspects and not lay.declared and n not in loaded
                and isinstance(lay.placement, Shard) and lay.placement.parts is None]
    if not inferred:
        return ""
    name = inferred[0]
    dim = layouts[name].placement.dim  # type: ignore[attr-defined]
    return (f"; note: the layout of {', '.join(inferred)} was read from shapes as one contiguous shard per rank — if "
            f"{name} packs several parts (gate/up, Q/K/V) each sharded on its own, declare it: "
            f"ModuleVariant(params=(ParamSpec({name!r}, 'weight', Shard({dim}, parts=(1, 1))), ...))")


#: Diagnoses read from numeric patterns (a factor, a bias multiple, summands, blocks): in a case narrower
#: than float64 they are claimed only when the same case in float64 shows them too
#: (:func:`tpsim.diagnosis.confirm`, the family's ``confirmed_in_float64``).
NUMERIC_PATTERNS = frozenset({BIAS_DUPLICATION, BIAS_MISSING, MISSING_REDUCTION, DOUBLE_REDUCTION, GRAD_SCALED,
                              GRAD_NOT_REDUCED, WRONG_SHARD_ORDER, PACKED_SHARD_LAYOUT, BIAS_GRAD_RANK0_ONLY,
                              QKV_HEAD_MISMATCH, GRAD_REDUCED_AFTER_ACCUMULATION, NORM_COUNTS_REPLICAS,
                              NORM_NOT_REDUCED})


#: The packings a contiguous-looking packed weight is tried with (gate/up; Q/K/V of equal sizes).
_PACKINGS = ((1, 1), (1, 1, 1))


def corroborating_case(case: ModuleCase) -> ModuleCase | None:
    """The second case a confirming re-run must pass (see the module docstring): the same sizes, dtype
    and tp layout, every batch dim grown by the tp size (a one-token sequence gets several; a
    sequence sharded over the tp group stays divisible) and another seed; None when no such case
    can be made (too large)."""
    tp = case.tp_size or case.world_size
    try:
        return case.replace(batch_shape=tuple(b + tp for b in case.batch_shape),
                            seed=case.seed + 1 if case.seed < MAX_SEED else case.seed - 1)
    except InvalidArgument:
        return None


#: ``confirm(changed, tie=())``: whether a re-run with the variant ``changed`` (or with rows of masters
#: tied, ``tie=``) passes the failing case and the corroborating one, which the variant as declared fails.
Confirm = Callable[..., bool]


def confirmer(variant: ModuleVariant, case: ModuleCase, rerun: Callable[..., list[Failure]]) -> Confirm:
    """The :data:`Confirm` of ``variant`` failing ``case``; ``rerun(variant, case=None, tie=())``: the
    forward failures of a re-run (of ``case`` by default). The declared variant's run of the
    corroborating case is made once, when a change first passes the failing case."""
    declared: list[bool] = []

    def confirm(changed: ModuleVariant, tie: Ties = ()) -> bool:
        if rerun(changed, tie=tie):
            return False
        other = corroborating_case(case)
        if other is None:
            return False
        if not declared:
            try:
                declared.append(bool(rerun(variant, case=other)))
            except Exception:  # noqa: BLE001 - a run the harness could not make is no evidence
                declared.append(False)
        return declared[0] and not rerun(changed, case=other, tie=tie)

    return confirm


@recogniser(PACKED_SHARD_LAYOUT)
def _confirm_packed(variant: ModuleVariant, failure: Failure, layouts: dict[str, ParamLayout],
                    suspects: Sequence[str], confirm: Confirm, loaded: Sequence[str] = ()) -> bool:
    """A forward that diverges right after a sublayer whose weight is a contiguous slice of its
    sharded dim (no ``parts`` said otherwise) is ``packed-shard-layout`` when the same case, with
    that sublayer's parameters loaded as the shard of each of 2 (or 3) equal packed parts, passes:
    the rank's rows are a contiguous slice of ``[gate; up]`` while its forward splits them into its
    gate shard and its up shard. Confirmed by that re-run, and by the corroborating case (see the
    module docstring), never guessed. Where the library loaded those parameters (``loaded``), the
    re-run has tpsim write the packed pieces instead of the library's loader, and the name is the
    loader's: it cut contiguous slices where its own forward wants the shard of each part."""
    for sub in suspects:
        names = [n for n, lay in layouts.items() if owner(n) == sub and not lay.declared
                 and isinstance(lay.placement, Shard) and lay.placement.parts is None]
        if not names:
            continue
        by_library = any(n in loaded for n in names)
        for parts in _PACKINGS:
            specs = tuple(ParamSpec(n, "bias" if n.rpartition(".")[2] == "bias" else "weight",
                                    Shard(layouts[n].placement.dim, parts=parts)) for n in names)  # type: ignore[attr-defined]
            try:
                changed = variant.replace(params=(*variant.params, *specs))
                confirmed = confirm(changed.replace(load=None) if by_library else changed)
            except Exception:  # the declared layout does not fit these sizes: not this packing
                continue
            if not confirmed:
                continue
            failure.details = {**failure.details, "module_diagnosis": failure.diagnosis,
                               "module_message": failure.message, "parts": list(parts), "params": names}
            failure.diagnosis = PACKED_SHARD_LAYOUT
            failure.sublayer = sub
            tp = case_tp(failure)
            if by_library:
                failure.message = (
                    f"the library's loader cuts {', '.join(names)} into contiguous 1/{tp} slices of the packed dim, "
                    f"while {sub}'s forward splits its rows into its shard of each of {len(parts)} packed parts: with "
                    "the shard of each part written in their place (nothing else changed) the same case passes (and "
                    "so does a larger one it fails as loaded). Fix the loader: cut each packed part on its own and "
                    f"concatenate this rank's shards of them. (before: {failure.message})")
                return True
            decl = ", ".join(f"ParamSpec({sp.name!r}, {sp.master!r}, Shard({sp.placement.dim}, parts={parts}))"  # type: ignore[attr-defined]
                             for sp in specs)
            failure.message = (
                f"{sub} packs {len(parts)} parts in its sharded dim, but {', '.join(names)} says nothing of it "
                f"(no `parts`), so each rank is given a contiguous 1/{tp} slice of the packed dim, "
                f"while its forward splits its rows into its shard of each part; loaded as the shard of each of "
                f"{len(parts)} equal parts, the same case passes (and so does a larger one it fails as "
                f"declared). Give the layer a `parts` attribute (the full "
                f"sizes of its parts), or declare it: ModuleVariant(params=({decl},)). "
                f"(before: {failure.message})")
            return True
    return False


#: Last components of the names of separate key and value projections (q/k/v each its own column layer).
KEY_PROJECTIONS = frozenset({"k_proj", "key", "wk", "k", "key_proj", "linear_k", "k_lin"})
VALUE_PROJECTIONS = frozenset({"v_proj", "value", "wv", "v", "value_proj", "linear_v", "v_lin"})


def kv_ties(layouts: dict[str, ParamLayout], shapes: dict[str, tuple[int, ...]], root: str) -> Ties:
    """The key and value rows of the attention module ``root`` (``""``: the whole module), as
    :data:`~tpsim.props.module.world.Ties` making every key row one row and every value row one row
    (so that every key/value head is the same head); ``()`` when it has no recognisable key and value
    projections. Read from the layouts: a packed Q/K/V parameter sharded as three parts whose last two
    (K and V) have one size, or separate column-sharded projections named like ``k_proj``/``v_proj``."""
    prefix = f"{root}." if root else ""
    keys: list[tuple[str, int, tuple[tuple[int, int], ...]]] = []
    values: list[tuple[str, int, tuple[tuple[int, int], ...]]] = []
    for name, layout in layouts.items():
        placement = layout.placement
        if not name.startswith(prefix) or not isinstance(placement, Shard) or layout.uneven or name not in shapes:
            continue
        dim = placement.dim % len(shapes[name])
        size = shapes[name][dim]
        parts = part_sizes(size, placement)
        if len(parts) == 3 and parts[1] == parts[2]:
            q, kv = parts[0], parts[1]
            keys.append((name, dim, ((q, q + kv),)))
            values.append((name, dim, ((q + kv, q + 2 * kv),)))
        elif len(parts) == 1:
            leaf = (owner(name) or "").rpartition(".")[2]
            if leaf in KEY_PROJECTIONS:
                keys.append((name, dim, ((0, size),)))
            elif leaf in VALUE_PROJECTIONS:
                values.append((name, dim, ((0, size),)))
    return (*keys, *values) if keys and values else ()


@recogniser(QKV_HEAD_MISMATCH)
def _confirm_head_pairing(variant: ModuleVariant, failure: Failure, layouts: dict[str, ParamLayout],
                          shapes: dict[str, tuple[int, ...]], where: str, confirm: Confirm) -> bool:
    """A forward that first diverges inside an attention module (``where``: a sublayer of it, or the
    code between two of them), with its query, key and value projections all matching the
    reference, is ``qkv-head-mismatch`` when the same case, with every key row and every value row of
    that attention's masters made one row (every key/value head the same head, so that no pairing of
    query heads with key/value heads can differ from another), passes: the ranks pair their query
    heads with other key/value heads than the dense module does. Confirmed by that re-run, and by the
    corroborating case (see the module docstring), never guessed; tried from the nearest enclosing
    module that has key and value projections outwards."""
    name = where.removeprefix("before ").removeprefix("after ")
    candidates = [name]
    while candidates[-1]:
        candidates.append(candidates[-1].rpartition(".")[0])
    for root in candidates:
        ties = kv_ties(layouts, shapes, root)
        if not ties:
            continue
        try:
            confirmed = confirm(variant, tie=ties)
        except Exception:  # noqa: BLE001 - a re-run the harness could not make is no evidence
            return False
        if not confirmed:
            return False
        old = failure.sublayer
        params = sorted({t[0] for t in ties})
        failure.details = {**failure.details, "module_diagnosis": failure.diagnosis, "module_message": failure.message,
                           "params": params}
        failure.diagnosis = QKV_HEAD_MISMATCH
        failure.sublayer = root or None
        for c in failure.consequences:
            if c.sublayer == old:
                c.sublayer = root or None
        failure.message = (
            f"{root or 'the module'} pairs its query heads with other key/value heads at tp={case_tp(failure)} than on "
            f"one rank: the same case passes once every key/value head is made the same head (every key row and "
            f"every value row of {', '.join(params)} one row; so does a larger case it fails as declared), so "
            "the outputs differ only in which key/value head "
            "each query head attends with. The tp shards hold contiguous blocks of query heads and of key/value "
            "heads: query head i must use key/value head i // (query heads per key/value head), on one rank as on "
            f"every tp rank (repeat_interleave, not repeat). (before: {failure.message})")
        return True
    return False


def case_tp(failure: Failure) -> int:
    case = failure.case
    return int(getattr(case, "tp_size", None) or getattr(case, "world_size", 1))


def localise(variant: ModuleVariant, case: ModuleCase, obs: Observation, failures: list[Failure],
             traced_run: Callable[[], Observation],
             rerun: Callable[..., list[Failure]] | None = None) -> list[Failure]:
    """Name the sublayer of every value failure of ``case``: the case is run again with every sublayer's
    boundaries recorded (``traced_run``, the family's observation with capture on; the module
    docstring's "where a failure comes from"). ``rerun(variant, case=None, tie=())``: the forward
    failures of the same case (or of ``case``) with another variant (or run another way: ``tie=``), to
    confirm a diagnosis (:func:`_confirm_packed`, :func:`_confirm_head_pairing`, through
    :func:`confirmer`)."""
    value_failures = [f for f in failures if f.property in _VALUE_PROPERTIES or f.property == REPLICA]
    if value_failures and obs.values is not None and all(f.diagnosis != EXCEPTION for f in failures):
        traced = traced_run()
        if traced.values is not None and traced.data is not None:
            group_index = value_failures[0].details.get("group", 0)
            ranks = tp_groups(case.world_size, case.tp_size or case.world_size, case.tp_layout)[group_index]
            ctx = ModuleContext(variant, traced, group_index, ranks, [traced.values[r] for r in ranks])
            fwd, bwd = _localise(ctx, traced)
            loaded = tuple(ctx.loaded[0]) if ctx.loaded else ()
            causes = _apply(failures, fwd, bwd, ctx.layouts, loaded)
            first = causes[0] if causes else None
            if (rerun is not None and fwd is not None and first is not None and first.property == FORWARD
                    and first.diagnosis == MISMATCH and ctx.tp > 1):
                confirm = confirmer(variant, case, rerun)
                _confirm_packed(variant, first, ctx.layouts, fwd.suspects, confirm, loaded)
                if first.diagnosis == MISMATCH and fwd.kind in ("in", "out"):
                    _confirm_head_pairing(variant, first, ctx.layouts, traced.data.shapes, fwd.sublayer, confirm)
            return causes
    return failures
