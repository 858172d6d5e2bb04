"""The properties of a whole module, checked on one case against its dense reference.

The same properties as for one linear layer (:data:`tpsim.props.checks.PROPERTIES`), at module level:

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
- ``training-equivalence``: after ``TRAIN_STEPS`` SGD steps every parameter, re-assembled, equals
  dense training (evaluated when the single-step properties hold);
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
    GRAD_SCALED,
    MISMATCH,
    MISSING_REDUCTION,
    NONDETERMINISTIC,
    OUTPUT_DETACHED,
    PACKED_SHARD_LAYOUT,
    QKV_HEAD_MISMATCH,
    REPLICA_DIVERGENCE,
    SHAPE_ERROR,
    WRONG_DTYPE,
    WRONG_SHARD_ORDER,
    Diagnosis,
    Failure,
    mismatch,
    recogniser,
)
from tpsim.diagnosis import spec as diagnosis_spec
from tpsim.errors import InvalidArgument, RankDied
from tpsim.module_variant import ModuleVariant
from tpsim.patterns import bias_multiple, block_mapping, close, rank_summands, scale_factor
from tpsim.placement import Placement, Replicate, Shard, part_sizes
from tpsim.props.blame import death_failure, refusal_failure, run_failure
from tpsim.props.case import MAX_SEED
from tpsim.props.groups import tp_groups
from tpsim.props.module.boundary import Capture
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.sharding import ParamLayout, UnknownLayout, assemble_pieces, piece
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
from tpsim.props.observation import DETACHED, OUTPUT_SHAPE, NotDeterministic, Observation
from tpsim.props.property_names import (
    BIAS_GRAD,
    DIVISIBILITY,
    FORWARD,
    INPUT_GRAD,
    PROPERTIES,
    REPLICA,
    TRAINING,
    WEIGHT_GRAD,
)
from tpsim.props.rank import LR, TRAIN_STEPS
from tpsim.props.tolerance import tolerance
from tpsim.variant import ParamSpec

__all__ = ["NUMERIC_PATTERNS", "evaluate", "grad_property", "localise"]

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


class _Ctx:
    """What the evaluators need about one tp group of one case."""

    def __init__(self, variant: ModuleVariant, obs: Observation, g: int, values: list[ModuleRankResult]):
        self.variant, self.obs, self.g, self.values = variant, obs, g, values
        self.case = obs.case
        self.tp = len(values)
        self.ref = obs.data.groups[g].value  # type: ignore[union-attr]
        self.mag = obs.data.groups[g].mag  # type: ignore[union-attr]
        self.dtype = obs.case.torch_dtype
        ref = obs.data
        self.k = ref.reduction + obs.case.rows  # type: ignore[union-attr]
        # A kink within rounding of a pre-activation flips its derivative: in a dtype narrower than
        # float64, grads through it are not determined by first-order bounds (see magnitude.py).
        # A module that casts down (ref.narrowed) rounds in the narrower dtype even in a float64 case.
        self.grads_bounded = not ref.kinked or (self.dtype == _F64 and not ref.narrowed)  # type: ignore[union-attr]
        self.layouts = dict(values[0].layouts)
        #: Replicated parameters whose grad the trainer sums (see tpsim.props.module.world).
        self.partial = set(values[0].partial)

    def tol(self, magnitude: torch.Tensor, kind: str) -> torch.Tensor:
        # ``kind`` (forward, grad, training) names what is compared; the magnitude run's first-order
        # propagation already carries each stage's rounding, so the bound is the same formula.
        del kind
        return tolerance(self.dtype, magnitude.to(_F64), reduction_length=self.k, world_size=self.tp)

    def fail(self, prop: str, diag: Diagnosis, rank: int | None = None, sublayer: str | None = None,
             **details: Any) -> Failure:
        return Failure(prop, diag.name, diag.message, case=self.case, rank=rank, variant=self.variant.name,
                       details={**diag.details, **details}, sublayer=sublayer)


# --- helpers over the pieces of one tensor --------------------------------------------------------


def _expected_pieces(full: torch.Tensor, placement: Placement, tp: int, uneven: bool | None = None) -> list[torch.Tensor]:
    if isinstance(placement, Shard):
        uneven = full.shape[placement.dim] % tp != 0 if uneven is None else uneven
        return [piece(full, placement, r, tp, uneven) for r in range(tp)]
    return [full] * tp


def _compare(pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, placement: Placement,
             summed: bool, uneven: bool | None = None) -> tuple[bool, torch.Tensor | None]:
    """Whether the ranks' ``pieces`` are ``full`` laid out by ``placement`` (``summed``: their sum
    is ``full``); returns the tensor compared with ``full`` (the sum or the assembly) or None."""
    if summed:
        if any(p.shape != full.shape for p in pieces):
            return False, None
        total = torch.stack(pieces).sum(0)
        return close(total, full, tol), total
    expected = _expected_pieces(full, placement, len(pieces), uneven)
    if any(p.shape != e.shape for p, e in zip(pieces, expected, strict=True)):
        return False, None
    if isinstance(placement, Shard):
        uneven_ = full.shape[placement.dim] % len(pieces) != 0 if uneven is None else uneven
        assembled = assemble_pieces(pieces, placement, uneven_)
        return close(assembled, full, tol), assembled
    return all(close(p, full, tol) for p in pieces), None


#: Elements compared at a time by :func:`_close_in_chunks` (a few MB: the chain of elementwise
#: passes stays in cache instead of streaming a lab-scale grad through memory once per pass).
_CHUNK = 1 << 19


def _close_in_chunks(actual: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor,
                     tol_of: Callable[[torch.Tensor], torch.Tensor]) -> bool:
    """``close(actual, expected, tol_of(mag))`` for large tensors, slice by slice along the first
    dim and in as few passes as possible: the tolerance is linear in the magnitude (see
    :mod:`tpsim.props.tolerance`), so it is ``mag`` times the tolerance of a unit magnitude; the
    floor for a zero magnitude is dropped, which only makes the comparison stricter there."""
    if actual.shape != expected.shape or mag.shape != expected.shape:
        return False
    if expected.dim() == 0 or expected.numel() <= _CHUNK:
        return close(actual, expected, tol_of(mag))
    unit = float(tol_of(torch.ones((), dtype=_F64)))
    step = max(1, _CHUNK // max(1, expected[0].numel()))
    # One thread: the chunks are cache-sized and memory-bound, where a parallel region per op
    # costs more than it gains (several times more on a loaded machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for i in range(0, expected.shape[0], step):
            diff = torch.sub(actual[i:i + step], expected[i:i + step]).abs_()  # float64: expected is
            if not bool((diff <= mag[i:i + step] * unit).all()):  # NaN never passes
                return False
        return True
    finally:
        torch.set_num_threads(threads)


def _holds(pieces: list[Any], full: torch.Tensor, mag: torch.Tensor, tol_of: Callable[[torch.Tensor], torch.Tensor],
           placement: Placement, summed: bool, uneven: bool) -> bool:
    """The fast path of :func:`_compare` for large tensors (a lab-scale weight grad): every rank's
    piece against its view of the reference and of the magnitude, in chunks; nothing is assembled
    and nothing converted before it is compared."""
    if any(p is None for p in pieces):
        return False
    if summed or not isinstance(placement, Shard):
        if any(p.shape != full.shape for p in pieces):
            return False
        if summed:
            return close(torch.stack([p.to(_F64) for p in pieces]).sum(0), full, tol_of(mag))
        return all(_close_in_chunks(p, full, mag, tol_of) for p in pieces)
    tp = len(pieces)
    if uneven or not placement.parts:
        expected = _expected_pieces(full, placement, tp, uneven)
        mags = _expected_pieces(mag, placement, tp, uneven)
        return all(p.shape == e.shape and _close_in_chunks(p, e, m, tol_of)
                   for p, e, m in zip(pieces, expected, mags, strict=True))
    # Packed parts: each part of a rank's piece against its view of the reference (no copies).
    dim = placement.dim % full.dim()
    sizes = part_sizes(full.shape[dim], placement)
    local = [size // tp for size in sizes]
    for r, p in enumerate(pieces):
        if p.dim() != full.dim() or p.shape[dim] != sum(local):
            return False
        for k in range(len(sizes)):
            start = sum(sizes[:k]) + r * local[k]
            mine = p.narrow(dim, sum(local[:k]), local[k])
            if mine.shape != full.narrow(dim, start, local[k]).shape or not _close_in_chunks(
                mine, full.narrow(dim, start, local[k]), mag.narrow(dim, start, local[k]), tol_of
            ):
                return False
    return True


def _first_bad(pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, placement: Placement) -> int:
    expected = _expected_pieces(full, placement, len(pieces))
    tols = _expected_pieces(tol, placement, len(pieces)) if tol.shape == full.shape else [tol] * len(pieces)
    for r, (p, e, t) in enumerate(zip(pieces, expected, tols, strict=True)):
        if p.shape != e.shape or not close(p, e, t):
            return r
    return 0


def _blocks(mapping: list[int]) -> str:
    wrong = [f"block {i} holds shard {j}" for i, j in enumerate(mapping) if i != j]
    return ", ".join(wrong[:6]) + (" ..." if len(wrong) > 6 else "")


# --- recognisers on module (or sublayer) tensors -------------------------------------------------


@recogniser(MISSING_REDUCTION, DOUBLE_REDUCTION, BIAS_DUPLICATION, BIAS_MISSING, WRONG_SHARD_ORDER)
def diagnose_output(pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, placement: Placement, *,
                    what: str, biases: Sequence[tuple[str, torch.Tensor]] = ()) -> Diagnosis:
    """Name the mechanism behind an output (of a module or a sublayer) that differs from the
    reference: a missing or doubled reduction, a bias added ``ws`` times or never, shards out of
    order; else ``mismatch``. ``biases``: ``(name, dense value)`` of the biases that may be involved."""
    tp = len(pieces)
    if isinstance(placement, Shard):
        try:
            actual: torch.Tensor | None = assemble_pieces(pieces, placement, full.shape[placement.dim] % tp != 0)
        except (RuntimeError, InvalidArgument, IndexError):
            actual = None
        label = what
    else:
        if tp > 1 and all(p.shape == full.shape for p in pieces) and rank_summands(pieces, full, tol):
            return Diagnosis(MISSING_REDUCTION,
                             f"{what}: each rank holds only its own summand (the ranks' outputs differ and add up to the "
                             "dense output): the all-reduce over the tp group is missing", {})
        r = _first_bad(pieces, full, tol, placement)
        actual = pieces[r]
        label = f"{what} on rank {r}" if tp > 1 else what
    if actual is None or actual.shape != full.shape:
        shape = None if actual is None else list(actual.shape)
        return Diagnosis(SHAPE_ERROR, f"{label} has shape {shape}, expected {list(full.shape)}", {"shape": shape})
    for bias_name, bias in biases:
        c = bias_multiple(actual - full, bias, tol)
        if c is not None and tp > 1 and abs(c - (tp - 1)) < 1e-2:
            return Diagnosis(BIAS_DUPLICATION,
                             f"{label} is off by exactly (world_size-1)*{bias_name} = {tp - 1}*{bias_name} (tp size "
                             f"{tp}): every rank adds the full bias to its summand before the reduction; add it once, "
                             "after the reduction", {"factor": c, "bias": bias_name})
        if c is not None and abs(c + 1) < 1e-2:
            return Diagnosis(BIAS_MISSING, f"{label} is off by exactly -{bias_name}: the bias is never added",
                             {"factor": c, "bias": bias_name})
    c = scale_factor(actual, full, tol, known=(tp,))
    if c is not None and tp > 1 and abs(c - tp) < 1e-2:
        return Diagnosis(DOUBLE_REDUCTION, f"{label} is {tp} x the dense output: it was reduced twice", {"factor": c})
    if isinstance(placement, Shard) and tp > 1:
        mapping = block_mapping(actual, full, tol, dim=placement.dim % full.dim(), parts=tp)
        if mapping is not None and mapping != list(range(tp)):
            return Diagnosis(WRONG_SHARD_ORDER, f"{label} has its {tp} blocks out of place ({_blocks(mapping)}): a rank "
                             "holds another rank's shard", {"mapping": mapping})
    return mismatch(actual, full, what=label, tol=tol)


@recogniser(GRAD_NOT_REDUCED, GRAD_SCALED)
def diagnose_grad(pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, placement: Placement, *,
                  what: str, replicated_param: str | None = None, sequence_parallel: bool = False) -> Diagnosis:
    """Name the mechanism behind a gradient that differs: only each rank's summand (the backward
    all-reduce is missing), a constant factor (averaged, or reduced twice); else ``mismatch``.
    ``sequence_parallel``: the module runs on sequence-sharded activations (said in the message)."""
    tp = len(pieces)
    if not isinstance(placement, Shard) and tp > 1 and rank_summands(pieces, full, tol):
        param = f" of the replicated parameter {replicated_param!r}" if replicated_param else ""
        why = (" (under sequence parallelism each rank uses it on its own slice of the sequence only; NeMo #7184, "
               "gpt-neox #1257)" if replicated_param and sequence_parallel else "")
        return Diagnosis(GRAD_NOT_REDUCED,
                         f"{what} on every rank is only its own summand (the ranks' grads differ and add up to the "
                         f"dense grad): the backward all-reduce{param} over the tp group is missing{why}",
                         {"param": replicated_param} if replicated_param else {})
    expected = _expected_pieces(full, placement, tp)
    tols = _expected_pieces(tol, placement, tp) if tol.shape == full.shape else [tol] * tp
    r = _first_bad(pieces, full, tol, placement)
    if pieces[r].shape != expected[r].shape:
        return Diagnosis(SHAPE_ERROR, f"{what} on rank {r} has shape {list(pieces[r].shape)}, expected "
                                      f"{list(expected[r].shape)}", {"shape": list(pieces[r].shape)})
    c = scale_factor(pieces[r], expected[r], tols[r], known=(tp, 1 / tp))
    if c is not None:
        hint = " (averaged instead of summed?)" if abs(c * tp - 1) < 1e-2 else " (reduced twice?)" if abs(c - tp) < 1e-2 else ""
        return Diagnosis(GRAD_SCALED, f"{what} on rank {r} is {c:.4g} x the dense grad{hint}", {"factor": c})
    return mismatch(pieces[r], expected[r], what=f"{what} on rank {r}", tol=tols[r])


# --- the properties on one tp group ---------------------------------------------------------------


def _forward(ctx: _Ctx) -> Failure | None:
    y = ctx.ref.y
    for r, v in enumerate(ctx.values):
        if v.status in (OUTPUT_SHAPE, DETACHED):
            if v.status == DETACHED:
                return ctx.fail(FORWARD, Diagnosis(OUTPUT_DETACHED,
                    f"the output on rank {r} is detached from the autograd graph (grad_fn None) although the input "
                    "requires grad: a collective or a copy runs outside autograd, so nothing flows back"), r)
            if v.output is None:
                return ctx.fail(FORWARD, Diagnosis(SHAPE_ERROR,
                                f"rank {r}'s forward returned {v.output_type}, not a tensor"), r)
    outs = [v.output for v in ctx.values]
    for r, o in enumerate(outs):
        if o.dtype != ctx.dtype:
            return ctx.fail(FORWARD, Diagnosis(WRONG_DTYPE,
                            f"the output on rank {r} is {str(o.dtype).replace('torch.', '')}, not the case's "
                            f"{ctx.case.dtype}: part of the module computes or communicates in another dtype"), r)
    pieces = [o.to(_F64) for o in outs]
    placement = output_placement(ctx.variant, y.dim())
    tol = ctx.tol(ctx.mag.y, "forward")
    summed = ctx.variant.output == "partial"
    ok, _ = _compare(pieces, y, tol, placement, summed)
    if ok:
        return None
    if summed and all(p.shape == y.shape for p in pieces):
        total = torch.stack(pieces).sum(0)
        c = scale_factor(total, y, tol, known=(ctx.tp,))
        if c is not None and ctx.tp > 1 and abs(c - ctx.tp) < 1e-2:
            return ctx.fail(FORWARD, Diagnosis(DOUBLE_REDUCTION,
                            f"the output summed over ranks is {ctx.tp} x the dense output: the module already reduces; "
                            "declare output='replicated'", {"factor": c}))
        return ctx.fail(FORWARD, mismatch(total, y, what="the output (summed over ranks)", tol=tol))
    what = "the output" + (" (rank pieces assembled)" if isinstance(placement, Shard) else "")
    return ctx.fail(FORWARD, diagnose_output(pieces, y, tol, placement, what=what))


def _input_grad(ctx: _Ctx) -> Failure | None:
    dx = ctx.ref.dx
    if dx is None or not ctx.grads_bounded:
        return None
    grads = [_f64(v.input_grad) for v in ctx.values]
    for r, g in enumerate(grads):
        if g is None:
            return ctx.fail(INPUT_GRAD, Diagnosis(GRAD_MISSING,
                            f"the input received no gradient on rank {r} (x.grad is None)"), r)
    placement = input_placement(ctx.variant, dx.dim())
    summed = ctx.variant.input == "replicated" and ctx.variant.input_grad == "partial"
    tol = ctx.tol(ctx.mag.dx, "grad")
    ok, total = _compare(grads, dx, tol, placement, summed)  # type: ignore[arg-type]
    if ok:
        return None
    if summed:
        if total is None:
            return ctx.fail(INPUT_GRAD, Diagnosis(SHAPE_ERROR, "the input grads do not have the input's shape"))
        if ctx.tp > 1 and all(close(g, dx, tol) for g in grads):  # type: ignore[arg-type]
            return ctx.fail(INPUT_GRAD, Diagnosis(GRAD_SCALED,
                            f"the input grad summed over ranks is {ctx.tp} x the dense grad: every rank already holds "
                            "the complete grad; declare input_grad='complete'", {"factor": float(ctx.tp)}))
        return ctx.fail(INPUT_GRAD, mismatch(total, dx, what="the input grad summed over ranks", tol=tol))
    return ctx.fail(INPUT_GRAD, diagnose_grad(grads, dx, tol, placement, what="the input grad"))  # type: ignore[arg-type]


def param_grad_diagnosis(ctx: _Ctx, name: str, grads: list[torch.Tensor | None], full: torch.Tensor,
                         mag: torch.Tensor) -> Diagnosis | None:
    """None when every rank's grad of parameter ``name`` is its piece of the dense grad ``full``
    (``mag``: its magnitude); else what is wrong (the rank it shows on in ``details["rank"]``)."""
    layout = ctx.layouts[name]
    placement, tp = layout.placement, ctx.tp
    summed = name in ctx.partial
    if _holds(grads, full, mag, lambda m: ctx.tol(m, "grad"), placement, summed, layout.uneven):
        return None
    grads = [_f64(g) for g in grads]
    tol = ctx.tol(mag, "grad")
    missing = [r for r, g in enumerate(grads) if g is None]
    if not missing:
        ok, _ = _compare(grads, full, tol, placement, summed, layout.uneven)  # type: ignore[arg-type]
        if ok:
            return None
    what = f"the {name} grad"
    if isinstance(placement, Replicate) and tp > 1 and grads[0] is not None and close(grads[0], full, tol) and all(
        g is None or not bool(g.abs().gt(0).any()) for g in grads[1:]
    ):
        return Diagnosis(BIAS_GRAD_RANK0_ONLY,
                         f"only rank 0's {name} received its gradient (rank{'s 1..' if tp > 2 else ' '}{tp - 1} "
                         f"{'have' if tp > 2 else 'has'} "
                         f"{'None' if grads[1] is None else 'zeros'}): it is added on rank 0 only, so the other "
                         "replicas never learn; add it on every rank", {"rank": 1})
    if missing:
        return Diagnosis(GRAD_MISSING, f"{name} received no gradient on rank {missing[0]} (.grad is None)",
                         {"rank": missing[0]})
    if summed:
        total = torch.stack(grads).sum(0)  # type: ignore[arg-type]
        return mismatch(total, full, what=f"{what} summed over ranks", tol=tol)
    diag = diagnose_grad(grads, full, tol, placement, what=what,  # type: ignore[arg-type]
                         replicated_param=name if isinstance(placement, Replicate) else None,
                         sequence_parallel="sequence-sharded" in (ctx.variant.input, ctx.variant.output))
    if isinstance(placement, Shard) and diag.name == MISMATCH and tp > 1:
        try:
            assembled = assemble_pieces(grads, placement, layout.uneven)  # type: ignore[arg-type]
            mapping = block_mapping(assembled, full, tol, dim=placement.dim % full.dim(), parts=tp)
        except (RuntimeError, InvalidArgument):
            mapping = None
        if mapping is not None and mapping != list(range(tp)):
            diag = Diagnosis(WRONG_SHARD_ORDER, f"{what} has its {tp} blocks out of place ({_blocks(mapping)}): "
                             f"a rank holds another rank's shard of {name}", {"mapping": mapping})
    return diag


def _param_grads(ctx: _Ctx, prop: str) -> Failure | None:
    if not ctx.grads_bounded:
        return None
    for name in ctx.layouts:
        full = ctx.ref.grads.get(name)
        if grad_property(ctx.variant, name) != prop or full is None:
            continue  # another property's, or the parameter takes no part in the dense forward
        grads = [v.grads.get(name) for v in ctx.values]
        diag = param_grad_diagnosis(ctx, name, grads, full, ctx.mag.grads[name])
        if diag is not None:
            return ctx.fail(prop, diag, diag.details.get("rank"), owner(name), param=name)
    return None


def _replica(ctx: _Ctx) -> Failure | None:
    items: list[tuple[str, list[Any], str | None]] = []
    for name, layout in ctx.layouts.items():
        if isinstance(layout.placement, Replicate):
            items.append((f"{name} right after construction", [v.init.get(name) for v in ctx.values],
                          name))
    if ctx.variant.output == "replicated":
        items.append(("the output", [v.output for v in ctx.values], None))
    if ctx.variant.input == "replicated" and ctx.variant.input_grad == "complete":
        items.append(("the input grad", [v.input_grad for v in ctx.values], None))
    for name, layout in ctx.layouts.items() if not ctx.variant.forward_only else ():  # forward-only: no grads, no steps
        if isinstance(layout.placement, Replicate):
            if name in ctx.partial:  # the trainer's sum must be the same bits everywhere
                items.append((f"the {name} grad summed by the trainer",
                              [v.summed_grads.get(name) for v in ctx.values], name))
            else:
                items.append((f"the {name} grad", [v.grads.get(name) for v in ctx.values], name))
            items.append((f"{name} after {TRAIN_STEPS} SGD steps", [v.final.get(name) for v in ctx.values], name))
    for what, tensors, param in items:
        if any(t is None for t in tensors) or len({tuple(t.shape) for t in tensors}) > 1:
            continue  # missing or mis-shaped tensors are the equivalence properties' findings
        bad = [r for r in range(1, len(tensors)) if not torch.equal(tensors[r], tensors[0])]
        if bad:
            diff = max(float((tensors[r].to(_F64) - tensors[0].to(_F64)).abs().max()) for r in bad)
            why = ""
            if what.endswith("construction"):
                why = (f", although every rank was seeded alike (torch.manual_seed({ctx.case.seed})) before the build: "
                       "its initialisation depends on the rank; draw it from the same RNG state on every rank or "
                       "broadcast it after construction")
            return ctx.fail(REPLICA, Diagnosis(REPLICA_DIVERGENCE,
                            f"{what} must be identical on every rank of the tp group, but ranks {bad} differ from rank 0 "
                            f"(max abs difference {diff:.3g}){why}", {"ranks": bad, "max_abs": diff, "tensor": what}),
                            bad[0], None if param is None else owner(param), **({"param": param} if param else {}))
    return None


def _training(ctx: _Ctx) -> Failure | None:
    if not ctx.grads_bounded:
        return None
    for name, layout in ctx.layouts.items():
        want, mag = ctx.ref.final[name], ctx.mag.final[name]
        raw = [v.final.get(name) for v in ctx.values]
        if _holds(raw, want, mag, lambda m: ctx.tol(m, "training"), layout.placement, False, layout.uneven):
            continue
        finals = [_f64(t) for t in raw]
        tol = ctx.tol(mag, "training")
        what = f"{name} after {TRAIN_STEPS} SGD steps (lr {LR})"
        if any(f is None for f in finals):
            return ctx.fail(TRAINING, Diagnosis(SHAPE_ERROR, f"{what}: the parameter disappeared on some rank"),
                            None, owner(name), param=name)
        ok, assembled = _compare(finals, want, tol, layout.placement, False, layout.uneven)  # type: ignore[arg-type]
        if ok:
            continue
        actual = assembled if assembled is not None else finals[_first_bad(finals, want, tol, layout.placement)]  # type: ignore[arg-type]
        if actual is None or actual.shape != want.shape:
            return ctx.fail(TRAINING, Diagnosis(SHAPE_ERROR, f"{what}: the pieces do not re-assemble to {list(want.shape)}"),
                            None, owner(name), param=name)
        return ctx.fail(TRAINING, mismatch(actual, want, what=what, tol=tol), None, owner(name), param=name)
    return None


# --- whole-run outcomes ---------------------------------------------------------------------------


def _offending(variant: ModuleVariant, case: ModuleCase) -> dict[str, int]:
    tp = case.tp_size or case.world_size
    out = {n: s for n, s in zip(variant.sizes, case.sizes, strict=True) if s % tp}
    d = variant.sequence_dim_of(len(case.batch_shape) + 1) if variant.input == "sequence-sharded" else None
    if d is not None and case.batch_shape[d] % tp:
        out[f"the sequence length (dim {d})"] = case.batch_shape[d]
    return out


def _truncated(problem: LayoutProblem, tp: int) -> bool:
    """A piece cut along a dim that does not divide by ``tp``, yet no ``torch.tensor_split`` piece:
    the evidence of a size silently truncated or padded (a dim that divides says nothing of the sort)."""
    shape, full = problem.shape, problem.full
    if shape is None or full is None or len(shape) != len(full):
        return False
    return any(s != f and f % tp for s, f in zip(shape, full, strict=True))


@recogniser(DIVISIBILITY_UNCHECKED)
def _divisibility(variant: ModuleVariant, obs: Observation) -> Failure | None:
    """Refused on every rank with a clear error: holds. Refused on some ranks, or without saying
    why, or accepted with pieces that are not pieces of the dense parameters: ``divisibility-unchecked``.
    A piece that no layout explains along a dim that divides is :class:`UnknownLayout`, as in a
    divisible case."""
    case = obs.case
    tp = case.tp_size or case.world_size
    offending = _offending(variant, case)
    size_name = "world_size" if tp == case.world_size else "tp_size"
    what = ", ".join(f"{n}={v}" for n, v in offending.items()) + f" is not divisible by {size_name}={tp}"
    if obs.error is not None:
        return refusal_failure(variant.name, case, obs.error, what, list(offending.values()), subject="module",
                               assert_refuses=variant.forward_only)
    for r, v in enumerate(obs.values or []):
        for problem in v.problems:
            if problem.kind == DECLARED or _truncated(problem, tp):
                return Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                               f"{what}, yet the module accepted it, and parameter {problem.param!r} has shape "
                               f"{list(problem.shape or ())} on rank {r} while the dense one is {list(problem.full or ())}: "
                               f"that is no 1/{tp} piece (nor a torch.tensor_split piece): the size was silently truncated "
                               "or padded; raise a ValueError naming the sizes at construction", case=case, rank=r,
                               variant=variant.name, sublayer=owner(problem.param), details={"param": problem.param})
    _refuse_unknown_layouts(obs)
    return None


def _refuse_unknown_layouts(obs: Observation) -> None:
    """Raise :class:`UnknownLayout` for the first parameter whose layout no shape explains."""
    tp = obs.case.tp_size or obs.case.world_size
    for r, v in enumerate(obs.values or []):
        for problem in v.problems:
            if problem.kind == UNKNOWN and problem.shape is not None and problem.full is not None:
                raise UnknownLayout(problem.param, problem.shape, problem.full, r, tp)


@recogniser(EXCEPTION, NONDETERMINISTIC)
def _failed_run(variant: ModuleVariant, obs: Observation) -> Failure:
    """The run failed: on the one-rank reference group (the module raised, or its rank died), else
    on the tp group (:func:`tpsim.props.blame.run_failure`, as in every family)."""
    failed = obs.reference_error
    if failed is None:
        return run_failure(variant.name, obs.case, obs.error)  # type: ignore[arg-type]
    where = "on a tp group of one rank (the dense reference, float64)"
    if isinstance(failed.error, NotDeterministic):
        return Failure(FORWARD, NONDETERMINISTIC,
                       f"the forward is not deterministic: run twice {where} on the same input, from the same "
                       f"parameters and buffers, its outputs differ by up to {failed.error.max_abs:.3g}; put the "
                       "module in eval mode (dropout) or seed it: nothing about its parallelism can be judged from "
                       "outputs that change from run to run", case=obs.case, variant=variant.name,
                       details={"phase": "reference", "max_abs": failed.error.max_abs})
    if isinstance(failed.error, RankDied):
        return death_failure(variant.name, obs.case, failed.error, context=f"{where}: ")
    return Failure(FORWARD, EXCEPTION, f"the module raised when built and run {where}: {failed}", case=obs.case,
                   variant=variant.name, traceback=failed.traceback_text.rstrip() or None,
                   details={"phase": "reference"})


def _layout_failure(variant: ModuleVariant, obs: Observation) -> Failure | None:
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
    _refuse_unknown_layouts(obs)
    layouts = [v.layouts for v in obs.values or []]
    for name in layouts[0] if layouts else {}:
        seen = {(str(lay[name].placement), lay[name].uneven) for lay in layouts if name in lay}
        if len(seen) > 1:
            return Failure(FORWARD, SHAPE_ERROR, f"parameter {name!r} is laid out differently on different ranks: "
                           f"{sorted(seen)}", case=obs.case, variant=variant.name, sublayer=owner(name),
                           details={"param": name})
    return None


def evaluate(variant: ModuleVariant, obs: Observation, properties: Sequence[str] | None = None) -> list[Failure]:
    """Evaluate ``properties`` (default: all) on one observation; the failures, one group's, in order."""
    wanted = tuple(properties or PROPERTIES)
    unknown = [p for p in wanted if p not in PROPERTIES]
    if unknown:
        raise InvalidArgument(f"unknown properties {unknown}; expected some of {list(PROPERTIES)}")
    if obs.reference_error is not None:
        return [_failed_run(variant, obs)]
    if not obs.divisible:
        f = _divisibility(variant, obs) if DIVISIBILITY in wanted else None
        if f is not None:
            return [f]
        if obs.error is not None or any(v.problems for v in obs.values or []):
            return []  # refused clearly: nothing else to check
    if obs.error is not None:
        return [_failed_run(variant, obs)]
    layout = _layout_failure(variant, obs)
    if layout is not None:
        return [layout]
    case, values = obs.case, obs.values or []
    for g, ranks in enumerate(tp_groups(case.world_size, case.tp_size or case.world_size, case.tp_layout)):
        ctx = _Ctx(variant, obs, g, [values[r] for r in ranks])
        failures = _evaluate_group(ctx, wanted)
        if failures:
            if len(ranks) != case.world_size:
                for f in failures:
                    if f.rank is not None:
                        f.details = dict(f.details, tp_rank=f.rank)
                        f.rank = ranks[f.rank]
                    f.details = dict(f.details, group=g, group_ranks=list(ranks))
                    f.message = f"in tp group {g} (global ranks {list(ranks)}; rank numbers below are tp ranks): {f.message}"
            return failures
    return []


def _evaluate_group(ctx: _Ctx, wanted: Sequence[str]) -> list[Failure]:
    evaluators: list[tuple[str, Callable[[], Failure | None]]] = [
        (FORWARD, lambda: _forward(ctx)),
        (INPUT_GRAD, lambda: _input_grad(ctx)),
        (WEIGHT_GRAD, lambda: _param_grads(ctx, WEIGHT_GRAD)),
        (BIAS_GRAD, lambda: _param_grads(ctx, BIAS_GRAD)),
        (REPLICA, lambda: _replica(ctx)),
    ]
    if any(v.status in (OUTPUT_SHAPE, DETACHED) for v in ctx.values):
        f = _forward(ctx)
        return [f] if f is not None else []
    failures = [f for name, fn in evaluators if name in wanted and (f := fn()) is not None]
    if TRAINING in wanted and not failures:
        f = _training(ctx)
        if f is not None:
            failures.append(f)
    return failures


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

    def __init__(self, ctx: _Ctx, obs: Observation):
        self.ctx = ctx
        group = obs.data.groups[ctx.g]  # type: ignore[union-attr]
        self.ref = Capture.from_payload(group.value.capture or {})
        self.mag = Capture.from_payload(group.mag.capture or {})
        ranks = tp_groups(obs.case.world_size, obs.case.tp_size or obs.case.world_size, obs.case.tp_layout)[ctx.g]
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
        kind = "forward" if key[1] in ("in", "out") else "grad"
        tol = self.ctx.tol(mag if mag is not None and mag.shape == full.shape else full.abs(), kind)
        return _boundary_match(pieces, full, tol, self.hints(key[0]))

    def biases(self, name: str) -> list[tuple[str, torch.Tensor]]:
        return [(p, t.to(_F64)) for p, t in self.masters.items() if owner(p) == name and t.dim() == 1]

    def diagnose(self, key: tuple[str, str], what: str) -> Diagnosis:
        pieces, full, mag = self.tensors(key)
        if full is None or any(p is None for p in pieces):
            return Diagnosis(GRAD_MISSING if key[1] in ("gin", "gout") else SHAPE_ERROR,
                             f"{what} is missing on some rank")
        ps = [p.to(_F64) for p in pieces]  # type: ignore[union-attr]
        kind = "forward" if key[1] in ("in", "out") else "grad"
        tol = self.ctx.tol(mag if mag is not None and mag.shape == full.shape else full.abs(), kind)
        placement = _piece_placement(ps, full)
        if key[1] == "out":
            return diagnose_output(ps, full, tol, placement, what=what, biases=self.biases(key[0]))
        if key[1] in ("gin", "gout"):
            return diagnose_grad(ps, full, tol, placement, what=what)
        return diagnose_output(ps, full, tol, placement, what=what)

    def param_culprit(self, name: str) -> _Culprit | None:
        for pname in self.ctx.layouts:
            full = self.ref_grads.get(pname)
            if owner(pname) != name or full is None:
                continue
            grads = [g.get(pname) for g in self.rank_grads]
            diag = param_grad_diagnosis(self.ctx, pname, grads, full, self.mag_grads[pname])
            if diag is not None:
                return _Culprit(name, "param", diag)
        return None


def _piece_placement(pieces: list[torch.Tensor], full: torch.Tensor) -> Placement:
    if all(p.shape == full.shape for p in pieces):
        return Replicate()
    for d in range(full.dim()):
        if sum(p.shape[d] for p in pieces) == full.shape[d]:
            return Shard(d)
    return Replicate()


_UNREDUCED = {"out": "the output of {s}", "gin": "the input grad of {s}", "gout": "the output grad of {s}",
              "in": "the input of {s}"}
_PHRASES = {"out": "the output of {s} (its input matches the reference's)",
            "in": "the input of {s} (the output of the sublayer before it matches)",
            "gin": "the input grad of {s} (its output grad matches the reference's)",
            "gout": "the output grad of {s} (the input grad of the sublayer after it matches)",
            "param": "a parameter grad of {s} (its output grad matches the reference's)"}


def _localise(ctx: _Ctx, obs: Observation) -> tuple[_Culprit | None, _Culprit | None]:
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
                fwd = _Culprit(where, key[1], b.diagnose(key, _PHRASES[key[1]].format(s=key[0])), suspects)
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
           layouts: dict[str, ParamLayout]) -> list[Failure]:
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
        if f.property == FORWARD or tensor == "the output":
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
        if d.name != MISMATCH and f.property in diagnosis_spec(d.name).properties:
            f.details = {**f.details, **d.details, "module_diagnosis": f.diagnosis, "module_message": f.message}
            f.diagnosis, f.message = d.name, d.message
        else:
            where = culprit.sublayer if culprit.sublayer.startswith(("before ", "after ")) else f"at {culprit.sublayer}"
            f.message = f"{f.message} — the values first diverge {where}: {d.message}"
            f.message += _layout_hint(layouts, culprit.suspects)
    return causes


def _layout_hint(layouts: dict[str, ParamLayout], suspects: Sequence[str]) -> str:
    """A mismatch right after a sublayer whose weight was sharded by its shape alone may be the
    harness's reading of a packed layout, not a bug: say how to declare it."""
    inferred = [n for n, lay in layouts.items() if owner(n) in suspects and not lay.declared
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
                              QKV_HEAD_MISMATCH})


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


#: ``confirm(changed, **how)``: whether a re-run with the variant ``changed`` (or run ``how``, e.g.
#: ``tie=``) passes the failing case and the corroborating one, which the variant as declared fails.
Confirm = Callable[..., bool]


def confirmer(variant: ModuleVariant, case: ModuleCase, rerun: Callable[..., list[Failure]]) -> Confirm:
    """The :data:`Confirm` of ``variant`` failing ``case``; ``rerun(variant, case=None, **how)``: the
    forward failures of a re-run (of ``case`` by default). The declared variant's run of the
    corroborating case is made once, when a change first passes the failing case."""
    declared: list[bool] = []

    def confirm(changed: ModuleVariant, **how: Any) -> bool:
        if rerun(changed, **how):
            return False
        other = corroborating_case(case)
        if other is None:
            return False
        if not declared:
            try:
                declared.append(bool(rerun(variant, case=other)))
            except Exception:  # noqa: BLE001 - a run the harness could not make is no evidence
                declared.append(False)
        return declared[0] and not rerun(changed, case=other, **how)

    return confirm


@recogniser(PACKED_SHARD_LAYOUT)
def _confirm_packed(variant: ModuleVariant, failure: Failure, layouts: dict[str, ParamLayout],
                    suspects: Sequence[str], confirm: Confirm) -> bool:
    """A forward that diverges right after a sublayer whose weight is a contiguous slice of its
    sharded dim (no ``parts`` said otherwise) is ``packed-shard-layout`` when the same case, with
    that sublayer's parameters loaded as the shard of each of 2 (or 3) equal packed parts, passes:
    the rank's rows are a contiguous slice of ``[gate; up]`` while its forward splits them into its
    gate shard and its up shard. Confirmed by that re-run, and by the corroborating case (see the
    module docstring), never guessed."""
    for sub in suspects:
        names = [n for n, lay in layouts.items() if owner(n) == sub and not lay.declared
                 and isinstance(lay.placement, Shard) and lay.placement.parts is None]
        if not names:
            continue
        for parts in _PACKINGS:
            specs = tuple(ParamSpec(n, "bias" if n.rpartition(".")[2] == "bias" else "weight",
                                    Shard(layouts[n].placement.dim, parts=parts)) for n in names)  # type: ignore[attr-defined]
            try:
                confirmed = confirm(variant.replace(params=(*variant.params, *specs)))
            except Exception:  # the declared layout does not fit these sizes: not this packing
                continue
            if confirmed:
                decl = ", ".join(f"ParamSpec({sp.name!r}, {sp.master!r}, Shard({sp.placement.dim}, parts={parts}))"  # type: ignore[attr-defined]
                                 for sp in specs)
                failure.details = {**failure.details, "module_diagnosis": failure.diagnosis,
                                   "module_message": failure.message, "parts": list(parts), "params": names}
                failure.diagnosis = PACKED_SHARD_LAYOUT
                failure.sublayer = sub
                failure.message = (
                    f"{sub} packs {len(parts)} parts in its sharded dim, but {', '.join(names)} says nothing of it "
                    f"(no `parts`), so each rank is given a contiguous 1/{case_tp(failure)} slice of the packed dim, "
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
    docstring's "where a failure comes from"). ``rerun(variant, case=None, **how)``: the forward
    failures of the same case (or of ``case``) with another variant (or run another way: ``tie=``), to
    confirm a diagnosis (:func:`_confirm_packed`, :func:`_confirm_head_pairing`, through
    :func:`confirmer`)."""
    value_failures = [f for f in failures if f.property in _VALUE_PROPERTIES or f.property == REPLICA]
    if value_failures and obs.values is not None and all(f.diagnosis != EXCEPTION for f in failures):
        traced = traced_run()
        if traced.values is not None and traced.data is not None:
            g = value_failures[0].details.get("group", 0)
            ranks = tp_groups(case.world_size, case.tp_size or case.world_size, case.tp_layout)[g]
            ctx = _Ctx(variant, traced, g, [traced.values[r] for r in ranks])
            fwd, bwd = _localise(ctx, traced)
            causes = _apply(failures, fwd, bwd, ctx.layouts)
            first = causes[0] if causes else None
            if (rerun is not None and fwd is not None and first is not None and first.property == FORWARD
                    and first.diagnosis == MISMATCH and ctx.tp > 1):
                confirm = confirmer(variant, case, rerun)
                _confirm_packed(variant, first, ctx.layouts, fwd.suspects, confirm)
                if first.diagnosis == MISMATCH and fwd.kind in ("in", "out"):
                    _confirm_head_pairing(variant, first, ctx.layouts, traced.data.shapes, fwd.sublayer, confirm)
            return causes
    return failures
