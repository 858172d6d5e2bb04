"""Two world runs per module case: the dense reference on one rank, then the module on the tp group.

**The reference world** (one rank, always ``inproc``: it is the oracle, not the code under test)
builds the module on its one-rank group in float64 — every collective is then the identity, so it
*is* the dense module — or the variant's ``dense`` builder. It draws the case's master values from
``seed``: every parameter (in ``named_parameters`` order; a 2-D or larger one scaled by
``1/sqrt(last dim)`` like ``nn.Linear``'s init, a vector by 0.5, so activations stay O(1)), then
for every tp group and micro-batch the input ``[*batch, sizes[0]]`` and, after the forward, the
upstream grad in the output's shape (scaled so that an SGD step moves each weight by about a tenth
of its scale) — all float32 normal draws, in the case's dtype. Per tp group it trains from the
masters as people train (:func:`tpsim.props.module.steps.step_plan`: two SGD steps (:class:`tpsim.props.rank.SGD`),
the first accumulating the case's ``micro_batches`` micro-batches, ``zero_grad`` in the case's mode
after each, clipped by ``torch.nn.utils.clip_grad_norm_`` to half the first step's total norm where
the variant has a ``clip``), recording the first micro-batch's output, input grad and parameter
grads, the grads accumulated over the first step, the total norms and the final parameters, then
repeats the training as the magnitude run (:mod:`tpsim.props.module.magnitude`) for the tolerances.

**The tp world** (``world_size`` ranks of the case's backend) builds the module on each rank's tp
group, reads how each parameter is sharded (:mod:`tpsim.props.module.sharding`), lets the library
load the masters where it has a loader (its builder, a loader method, a ``weight_loader``: tpsim then
only reads back what it loaded) and writes each rank's piece of the others
(:mod:`tpsim.props.module.loading`), runs one forward under ``torch.no_grad()`` on the first
micro-batch's input (the inference path), then trains the same way on the group's data: plain
``backward()`` per micro-batch, so the module's grad hooks fire as in training; the trainer's sum of
partial grads once per step; the variant's ``clip`` (given the reference's ``max_norm``); SGD.
Ranks return tensors, as a :class:`ModuleRankResult`; everything is compared in the parent
(:mod:`tpsim.props.module.checks`).

A forward-only variant (``ModuleVariant(forward_only=True)``: an inference module, weights without
grads, collectives outside autograd) runs one step in both worlds, its forward under
``torch.no_grad()``: no backward, no SGD step; the reference still draws that step's upstream
grad (unused: the ranks read the output's shape from it), so a case draws the same numbers either
way (:func:`tpsim.props.module.steps.step_plan`).

With ``capture=True`` both worlds also record every sublayer's boundary tensors on the first micro-batch
(:mod:`tpsim.props.module.boundary`); the checks ask for that only for a case that fails, and read only
that micro-batch of it: such a traced run runs the first micro-batch alone (at the lab note's size a
whole second training run beside the first one's observation was 7 GB more at the peak).

With ``tie`` (:data:`Ties`) the reference world makes rows of some masters equal before anything
runs (every row of a range becomes the range's first row), so both worlds run on those values: a
failing case run again so, to see whether a failure depends on which of those rows a rank pairs
with which (:func:`tpsim.props.module.checks.localise`).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from tpsim.errors import RankError
from tpsim.module_variant import ModuleVariant
from tpsim.placement import Replicate, Shard, piece
from tpsim.props.launch import launch, variant_of
from tpsim.props.layouts import apply_layout, needs_batch
from tpsim.props.module.boundary import Capture
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.dtensors import dtensor_layout, is_dtensor, local_grad, local_shape, local_value
from tpsim.props.module.loading import load_weights, read_back
from tpsim.props.module.magnitude import MagnitudeMode, TapeEntry, UnboundedOp, ValueTape
from tpsim.props.module.sharding import ParamLayout, declared_layout, infer_layout
from tpsim.props.module.steps import CLIP_FRACTION, StepTensors, assign, dense_step, step_plan, total_norm
from tpsim.props.module.twin import twin_magnitudes, twin_run
from tpsim.props.observation import DenseReferenceFailed, NotDeterministic, NotRealOutput, RankOutput
from tpsim.props.rank import (
    LR,
    enter_rank,
    kept_grad,
    optimizer_of,
    rank_phase,
    trainer_step,
    zero_grad_of,
)
from tpsim.props.tolerance import eps as eps_of
from tpsim.seeding import manual_seed

__all__ = [
    "DECLARED",
    "EXTRA",
    "MISSING",
    "UNKNOWN",
    "GroupReference",
    "LayoutProblem",
    "ModuleData",
    "ModuleRankResult",
    "Reference",
    "StepTensors",
    "input_placement",
    "is_divisible",
    "output_placement",
    "rank_main",
    "reference_main",
    "reference_run",
]

_F64 = torch.float64


def grad_mode(variant: ModuleVariant) -> Any:
    """The context a forward runs in: ``torch.no_grad()`` for a forward-only variant."""
    return torch.no_grad() if variant.forward_only else contextlib.nullcontext()


def _n_groups(case: ModuleCase) -> int:
    return case.world_size // (case.tp_size or case.world_size)


def _scale(shape: tuple[int, ...]) -> float:
    if len(shape) >= 2:
        return float(shape[-1]) ** -0.5
    return 0.5 if len(shape) == 1 else 1.0


class _Overflow(ArithmeticError):
    """A magnitude overflowed its dtype (the run is repeated in float64)."""


def _check_magnitude(t: torch.Tensor | None, what: str) -> None:
    if t is None:
        return
    if bool(torch.isnan(t).any() or (t < 0).any()):
        raise UnboundedOp(f"an operation that makes {what} negative or NaN in the magnitude run")
    if not bool(torch.isfinite(t).all()):
        raise _Overflow(what)


# --- the reference world ---------------------------------------------------------------------------

#: Rows of masters made equal: ``(parameter name, dim, ((start, stop), ...))`` entries; in every
#: range of the dim, every row becomes the range's first row.
Ties = tuple[tuple[str, int, tuple[tuple[int, int], ...]], ...]


def tie_rows(masters: dict[str, torch.Tensor], ties: Ties) -> None:
    """Apply ``ties`` to ``masters`` in place (see :data:`Ties`)."""
    for name, dim, ranges in ties:
        t = masters[name]
        for start, stop in ranges:
            t.narrow(dim, start, stop - start).copy_(t.narrow(dim, start, 1).expand_as(t.narrow(dim, start, stop - start)))


@dataclass
class GroupReference:
    """The reference of one tp group: its float64 values, and their magnitudes (for the tolerances)."""

    value: StepTensors
    mag: StepTensors


def reference_main(payload: dict[str, Any]) -> Reference:
    """The one rank of the reference world (see the module docstring). Returns tensors only.

    Large modules (the lab note's MLP) make every full-size pass count: parameters are swapped in
    (``p.data = ...``) rather than copied, and final values are kept, not cloned (the recorded grads
    are copies: training changes grads in place)."""
    case: ModuleCase = payload["case"]
    variant: ModuleVariant = variant_of(payload)
    manual_seed(case.seed)
    dense = variant.reference(case.sizes, group=dist.group.WORLD, dtype=_F64)
    dtype = case.torch_dtype
    gen = torch.Generator().manual_seed(case.seed)

    def draw(shape: tuple[int, ...], scale: float = 1.0) -> torch.Tensor:
        # float32 normal draws (half the work of float64 at the lab note's size), in the case's
        # dtype: the ranks and the reference get exactly these numbers.
        # Scaled in place: the same values without a second full-size temporary.
        return torch.randn(*shape, generator=gen, dtype=torch.float32).mul_(scale).to(dtype)

    masters = {n: draw(tuple(p.shape), _scale(tuple(p.shape))) for n, p in dense.named_parameters()}
    tie_rows(masters, payload.get("tie") or ())
    _check_deterministic(variant, dense, masters, case)
    # Upstream grads small enough that an SGD step moves every weight by about a tenth of its
    # scale (lr 0.1, summed over the rows): the trained parameters stay in the regime of the
    # initial ones at every size, instead of diverging at the lab note's.
    g_scale = min((_scale(tuple(t.shape)) for t in masters.values() if t.dim() >= 2), default=1.0) / max(case.rows, 1)
    inputs: list[list[torch.Tensor]] = []
    grads: list[list[torch.Tensor]] = []
    values: list[StepTensors] = []
    capture_on = bool(payload.get("capture"))
    kinked: set[str] = set()
    precision = case.torch_dtype
    tapes: list[list[list[TapeEntry]]] = []
    forward_only = variant.forward_only
    plan = step_plan(variant, case)
    set_to_none = zero_grad_of(case)
    for _g in range(_n_groups(case)):
        assign(dense, {n: t.to(_F64, copy=True) for n, t in masters.items()})
        _drop_grads(dense)  # every group starts as a freshly built module (zero_grad may have left zeros)
        optimizer = None if forward_only else optimizer_of(dense)
        xs, gs, group_tapes = [], [], []
        first: tuple[Any, ...] = ()
        accumulated: dict[str, torch.Tensor | None] = {}
        prefixes: list[dict[str, torch.Tensor | None]] = []
        norms: list[float] = []
        max_norm = None
        micro = 0
        for step, count in enumerate(plan):
            for _ in range(count):
                x_master = draw((*case.batch_shape, case.sizes[0]))
                if capture_on and micro > 0:
                    # A traced run (capture) needs the first micro-batch only (its boundaries, its grads):
                    # the rest is drawn, not run, so every later draw (another tp group's) is the same
                    # numbers as in the run being explained.
                    xs.append(x_master)
                    gs.append(draw(tuple(first[0].shape), g_scale))
                    micro += 1
                    continue
                x = x_master.to(_F64, copy=True).requires_grad_(not forward_only)
                capture = Capture().install(dense) if capture_on and micro == 0 else None
                tape = ValueTape()
                with tape, grad_mode(variant):
                    y = variant.call(dense, x)
                if isinstance(y, torch.Tensor) and not y.is_floating_point():
                    raise NotRealOutput(str(y.dtype).replace("torch.", ""))  # wrong-dtype: nothing to compare with
                g_master = draw(tuple(y.shape), g_scale)
                if not forward_only:
                    y.backward(g_master.to(_F64))  # accumulated: nothing is cleared between micro-batches
                group_tapes.append(tape.entries)
                kinked |= tape.kinked
                if tape.narrowed is not None and eps_of(tape.narrowed) > eps_of(precision):
                    precision = tape.narrowed
                if capture is not None:
                    capture.remove()
                if micro == 0:
                    # Copies: later micro-batches accumulate into the grads, a clip scales them, zero_grad may
                    # zero them in place, and a module may keep them in a buffer it reuses (a main_grad).
                    first = (y.detach(), None if x.grad is None else x.grad.detach(),
                             {} if forward_only else {n: kept_grad(p) for n, p in dense.named_parameters()},
                             None if capture is None else capture.as_payload())
                elif step == 0 and micro < count - 1:
                    # The grads so far, between the first and the last micro-batch of the first step: each
                    # micro-batch's own grad is what an earlier one counted again is fitted with.
                    prefixes.append({n: kept_grad(p) for n, p in dense.named_parameters()})
                xs.append(x_master)
                gs.append(g_master)
                micro += 1
            if forward_only or capture_on:
                continue  # drawn to the end; nothing trained (a traced run: see above)
            if step == 0:
                accumulated = {n: kept_grad(p) for n, p in dense.named_parameters()}
                if variant.clip is not None:
                    # Half the first step's dense total norm: clipping happens (ranks get it in ModuleData).
                    start_norm = total_norm([p.grad for p in dense.parameters() if p.grad is not None])
                    max_norm = CLIP_FRACTION * start_norm if start_norm > 0 else None
            norm = dense_step(dense, optimizer, set_to_none=set_to_none, max_norm=max_norm)
            if norm is not None:
                norms.append(norm)
        values.append(StepTensors(*first, final={} if forward_only or capture_on else {
            n: p.detach() for n, p in dense.named_parameters()}, accumulated=accumulated, norms=norms,
            max_norm=max_norm, prefixes=prefixes))
        tapes.append(group_tapes)
        inputs.append(xs)
        grads.append(gs)
    groups = [GroupReference(v, m) for v, m in zip(values, _oracle(
        variant, case, dense, masters, inputs, grads, values, tapes, capture_on, precision), strict=True)]
    narrowed = None if precision == case.torch_dtype else str(precision).replace("torch.", "")
    if groups and groups[0].mag.derived is not None:
        measured = groups[0].mag.derived
        return Reference(masters, inputs, grads, groups, measured.reduction, measured.stages,
                         sorted(measured.kinked | kinked), oracle=DERIVED)
    return Reference(masters, inputs, grads, groups, 0, 0, sorted(kinked), oracle=TWIN, narrowed=narrowed)


#: :attr:`Reference.oracle` values: the tolerances came from the magnitude run, or from the dense twin.
DERIVED = "derived"
TWIN = "twin"


def _finite(mag: StepTensors) -> bool:
    """Every magnitude finite. Magnitudes are non-negative, so one sum per tensor tells: an inf or a
    NaN anywhere makes it inf or NaN (no cancellation). A sum that overflows with every element
    finite says "not finite" too, which only sends the case to the dense twin (never a looser
    bound). In the tensor's own dtype: at the lab note's size an ``isfinite`` mask per tensor was
    2.5 s of a 15 s check, a float64 sum 1.4 s, this one about 0.1 s."""
    tensors = [mag.y, mag.dx, *mag.grads.values(), *mag.final.values(), *mag.accumulated.values()]
    return all(t is None or bool(torch.isfinite(t.sum())) for t in tensors)


def _oracle(variant: ModuleVariant, case: ModuleCase, dense: nn.Module, masters: dict[str, torch.Tensor],
            inputs: list[list[torch.Tensor]], grads: list[list[torch.Tensor]], values: list[StepTensors],
            tapes: list[list[list[TapeEntry]]], capture_on: bool, precision: torch.dtype) -> list[StepTensors]:
    """Every tp group's magnitudes: from the magnitude run where it bounds every operation and the
    case is float64 or float32 (the derived bound, tighter), else from the dense twin
    (:mod:`tpsim.props.module.twin`). An operation without a rule is never a refusal. ``precision``:
    the narrowest dtype the module rounds to in this case (the case's, or one it casts down to, as
    Llama's RMSNorm computes in float32 in a float64 case): a case the module narrows is judged by
    the twin at that dtype (the derived bound assumes the case's roundings throughout)."""
    if precision == case.torch_dtype and case.torch_dtype in (_F64, torch.float32):
        # The magnitude run in float32 (half the memory traffic of float64 at the lab note's size; a
        # bound of non-negative sums needs no more precision), or float64 for a module that cannot
        # run in float32 once built in float64.
        for mag_dtype in (torch.float32, _F64):
            try:
                mags = []
                for g in range(len(values)):
                    mag, measured = _magnitudes(variant, case, dense, masters, inputs[g], grads[g], tapes[g],
                                                capture_on, mag_dtype, values[g])
                    mag.derived = measured
                    mags.append(mag)
                if all(_finite(m) for m in mags):
                    return mags
                break
            except (UnboundedOp, _Overflow):
                break
            except Exception:
                if mag_dtype == _F64:
                    break
    return [twin_magnitudes(values[g], twin_run(variant, case, masters, inputs[g], grads[g], capture_on, precision,
                                                max_norm=values[g].max_norm), case, precision)
            for g in range(len(values))]


def _check_deterministic(variant: ModuleVariant, dense: nn.Module, masters: dict[str, torch.Tensor],
                         case: ModuleCase) -> None:
    """Run the dense module twice on one input from the same parameters and buffers: outputs that
    are not bit-identical (dropout in train mode, unseeded noise) raise :class:`NotDeterministic`,
    before anything is compared (a tp run of such a module differs from any reference). The input
    is drawn from its own generator: the case's draws are untouched; buffers are restored."""
    assign(dense, {n: t.to(_F64, copy=True) for n, t in masters.items()})
    # Only the state that is not a parameter is saved and restored: every tp group's steps assign
    # fresh parameters from the masters afterwards (a clone of every weight was 1 GB at the lab
    # note's size).
    params = {n for n, _ in dense.named_parameters(remove_duplicate=False)}
    saved = {k: v.detach().clone() if isinstance(v, torch.Tensor) else v
             for k, v in dense.state_dict().items() if k not in params}
    gen = torch.Generator().manual_seed(case.seed ^ 0x5EED)
    x = torch.randn(*case.batch_shape, case.sizes[0], generator=gen, dtype=torch.float32).to(_F64)
    outs = []
    with torch.no_grad():
        for _ in range(2):
            y = variant.call(dense, x)
            outs.append(y.detach().clone() if isinstance(y, torch.Tensor) else y)
    dense.load_state_dict(saved, strict=False)  # the parameters are missing on purpose (above)
    a, b = outs
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and not torch.equal(a, b):
        diff = (a.to(_F64) - b.to(_F64)).abs()
        raise NotDeterministic(float(diff[torch.isfinite(diff)].max()) if bool(torch.isfinite(diff).any()) else
                               float("nan"))


def _magnitudes(variant: ModuleVariant, case: ModuleCase, dense: nn.Module, masters: dict[str, torch.Tensor],
                inputs: list[torch.Tensor], grads: list[torch.Tensor], tapes: list[list[TapeEntry]],
                capture_on: bool, dtype: torch.dtype, ref: StepTensors) -> tuple[StepTensors, Any]:
    """The magnitude run of one tp group's training: magnitudes of the first micro-batch's output,
    input grad and parameter grads, of the grads accumulated over the first optimizer step's
    micro-batches (non-negative grads add up as the micro-batches accumulate), and of the parameters
    after every step (first-order: each step's update adds ``LR`` times its grad's magnitude, clipped
    where the target clips: :func:`clipped_magnitude`, from the float64 reference ``ref``'s norms),
    computed in ``dtype``; parameter magnitudes are returned in float32 (they are as large as the
    weights)."""
    current = {n: t.to(dtype, copy=True).abs_() for n, t in masters.items()}
    _drop_grads(dense)  # the reference's last zero_grad may have left zeros of its dtype
    first: tuple[Any, ...] = ()
    accumulated: dict[str, torch.Tensor | None] = {}
    measured = None
    forward_only = variant.forward_only
    plan = step_plan(variant, case, traced=capture_on)
    micro = 0
    for step, count in enumerate(plan):
        assign(dense, current)
        for _ in range(count):
            if micro == 0:
                # Its real floating buffers (the parameters are in ``dtype`` already: no copy); a complex
                # buffer (a rotary table) is left complex, not cast to its real part: arithmetic on it is
                # refused (UnboundedOp) and the dense twin judges the module.
                dense._apply(lambda t: t.to(dtype) if t.is_floating_point() else t)
                with torch.no_grad():
                    for buffer in dense.buffers():
                        if buffer.is_floating_point():
                            buffer.abs_()  # constants enter as magnitudes too (a rotary table's signs)
            for p in dense.parameters():
                p._tpsim_stages = 0  # type: ignore[attr-defined]
            x = inputs[micro].detach().to(dtype, copy=True).abs_().requires_grad_(not forward_only)
            x._tpsim_stages = 0  # type: ignore[attr-defined]
            capture = Capture().install(dense) if capture_on and micro == 0 else None
            mode = MagnitudeMode(tapes[micro])
            with mode, grad_mode(variant):
                y = variant.call(dense, x)
            _check_magnitude(y, "the output")
            # Grads of non-negative outputs through the bounding rules are non-negative: checking the
            # output and the input grad covers every op the run went through.
            if not forward_only:
                y.backward(grads[micro].to(dtype).abs())
            if capture is not None:
                capture.remove()
            if micro == 0:
                measured = mode.measured
                _check_magnitude(x.grad, "the input grad")
                # Copies (float32 of a float32 grad would be the grad itself, which later micro-batches add to).
                first = (y.detach().to(_F64), None if x.grad is None else x.grad.detach().to(_F64),
                         {} if forward_only else {n: None if p.grad is None else p.grad.to(torch.float32, copy=True)
                                                  for n, p in dense.named_parameters()},
                         None if capture is None else capture.as_payload())
            micro += 1
        if forward_only or capture_on:
            break
        if step == 0:
            accumulated = {n: None if p.grad is None else p.grad.to(torch.float32, copy=True)
                           for n, p in dense.named_parameters()}
        scale = None
        if ref.max_norm is not None and step < len(ref.norms):
            k = (measured.reduction if measured is not None else 0) + case.rows
            scale = clipped_magnitude([p.grad for p in dense.parameters() if p.grad is not None], ref.norms[step],
                                      ref.max_norm, k, case.tp_size or case.world_size)
        for name, p in dense.named_parameters():
            if p.grad is not None:
                # also the parameter: it shares the storage
                current[name].add_(p.grad, alpha=LR if scale is None else LR * scale)
            p.grad = None
    final = {} if forward_only or capture_on else {n: t.float() for n, t in current.items()}
    return StepTensors(*first, final=final, accumulated=accumulated), measured


def _drop_grads(module: nn.Module) -> None:
    for p in module.parameters():
        p.grad = None


def clipped_magnitude(mags: list[torch.Tensor], norm: float, max_norm: float, k: int, tp: int) -> float:
    """The factor ``s`` that makes ``s * M`` the magnitude of a grad of magnitude ``M`` once clipped by
    global norm (``g * c``, ``c = min(1, max_norm / (N + 1e-6))``, ``N`` the float64 reference's total
    norm ``norm``): the tp run's clip coefficient errs by the grads' own errors (bounded by the
    tolerance of their magnitudes, ``||tol(M)||_2 / N`` relative) and by the rounding of its sum of
    ``n`` squares (the tolerance model with reduction length ``n``: ``sqrt(n + tp) / sqrt(k + tp)``
    times the unit of a reduction of length ``k``), each times ``|g| <= M``::

        s = c * (1 + ||M||_2 / N + sqrt((n + tp) / (k + tp)))

    ``k``: the reduction length the grads are compared with (the magnitude run's, plus the rows)."""
    c = min(1.0, max_norm / (norm + 1e-6))
    n = sum(m.numel() for m in mags)
    spread = total_norm([m.to(_F64) for m in mags]) / norm if norm > 0 else 0.0
    return c * (1.0 + spread + math.sqrt((n + tp) / (max(k, 1) + tp)))


@dataclass
class Reference:
    """What the reference world returned (see :func:`reference_main`)."""

    masters: dict[str, torch.Tensor]
    inputs: list[list[torch.Tensor]]
    grads: list[list[torch.Tensor]]
    groups: list[GroupReference]
    reduction: int
    stages: int
    kinked: list[str] = field(default_factory=list)
    #: Where the tolerances came from: :data:`DERIVED` (the magnitude run) or :data:`TWIN` (the dense twin).
    oracle: str = "derived"
    #: The dtype the module casts down to in this case (e.g. ``"float32"`` for a norm computed in
    #: float32 in a float64 case), where the twin judged the case at that dtype; else None.
    narrowed: str | None = None

    @property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every parameter's dense shape, by dotted name."""
        return {n: tuple(t.shape) for n, t in self.masters.items()}


def reference_run(variant: ModuleVariant, case: ModuleCase, *, timeout: float, capture: bool = False,
                  isolate: bool = False, tie: Ties = ()) -> Reference:
    """Run the reference world. Raises :class:`DenseReferenceFailed` when the module raises (or its rank
    dies) on its one-rank group (a finding: it fails without any parallelism) and
    :class:`UnboundedOp` when the magnitude run cannot bound an operation (the harness's limit,
    reported as a usage error). ``tie``: masters' rows made equal (:data:`Ties`)."""
    try:
        # A worker of its own (isolated): nothing the tp ranks did to their process reaches the oracle.
        (out,) = launch(reference_main, variant, {"case": case, "capture": capture, "tie": tie}, 1, timeout=timeout,
                        isolate=isolate, slot="reference")
    except RankError as err:
        cause = err.errors.get(0, err)
        if isinstance(cause, UnboundedOp):
            raise cause from None
        if isinstance(cause, NotDeterministic):
            raise DenseReferenceFailed(cause, "") from None
        raise DenseReferenceFailed(cause, err.remote_traceback or "") from None
    return out


# --- the tp world ----------------------------------------------------------------------------------


def input_placement(variant: ModuleVariant, ndim: int) -> Any:
    """Placement of the module input over the tp group."""
    if variant.input == "sharded":
        return Shard(ndim - 1)
    if variant.input == "sequence-sharded":
        d = variant.sequence_dim_of(ndim)
        return Shard(d) if d is not None else Replicate()
    return Replicate()


def output_placement(variant: ModuleVariant, ndim: int) -> Any:
    """Placement of the module output over the tp group (``partial``: reported as Replicate; the
    checks sum it)."""
    if variant.output == "sharded":
        return Shard(ndim - 1)
    if variant.output == "sequence-sharded":
        d = variant.sequence_dim_of(ndim)
        return Shard(d) if d is not None else Replicate()
    return Replicate()


def _cut(t: torch.Tensor, placement: Any, rank: int, tp: int) -> torch.Tensor:
    if isinstance(placement, Shard):
        uneven = t.shape[placement.dim] % tp != 0
        return piece(t, placement, rank, tp, uneven=uneven)
    return t


def _laid_out(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t``'s values in the case's memory layout (a tensor with too few dims for it stays contiguous)."""
    if needs_batch(layout) and t.dim() < 2:
        layout = "contiguous"
    return apply_layout(t, layout)


#: :attr:`LayoutProblem.kind` values.
MISSING = "missing"  # the dense module has the parameter, this rank's module does not
EXTRA = "extra"  # this rank's module has the parameter, the dense module does not
DECLARED = "declared"  # its declared placement implies another shape than the rank's
UNKNOWN = "unknown"  # neither the dense shape nor a 1/tp (or torch.tensor_split) piece along one dim


@dataclass(frozen=True)
class LayoutProblem:
    """A parameter whose layout on a rank cannot be explained: ``kind`` (:data:`MISSING`,
    :data:`EXTRA`, :data:`DECLARED`, :data:`UNKNOWN`), its shape on the rank (``shape``, None when
    missing) and the dense module's (``full``, None when extra)."""

    param: str
    kind: str
    shape: tuple[int, ...] | None
    full: tuple[int, ...] | None


def layouts_of(variant: ModuleVariant, module: nn.Module, shapes: dict[str, tuple[int, ...]], tp: int,
               rank: int) -> tuple[dict[str, ParamLayout], list[LayoutProblem]]:
    """Every parameter's layout on this rank, and the parameters whose layout cannot be explained."""
    layouts: dict[str, ParamLayout] = {}
    problems = [LayoutProblem(name, MISSING, None, tuple(full)) for name, full in shapes.items()
                if name not in dict(module.named_parameters())]
    modules = dict(module.named_modules())
    for name, p in module.named_parameters():
        full = shapes.get(name)
        if full is None:
            problems.append(LayoutProblem(name, EXTRA, tuple(p.shape), None))
            continue
        spec = variant.param(name)
        if is_dtensor(p):  # a plan's parameter: laid out as its placement says (tpsim.props.module.dtensors)
            layout = dtensor_layout(p, name, tuple(full), tp)
            if layout is None:
                problems.append(LayoutProblem(name, UNKNOWN, local_shape(p), tuple(full)))
            else:
                layouts[name] = layout
            continue
        if spec is not None:
            layout = declared_layout(variant.stored_placement(spec, len(full)), full, tuple(p.shape), tp)
        else:
            owner = modules.get(name.rpartition(".")[0], module)
            layout = infer_layout(full, tuple(p.shape), tp, rank, owner)
        if layout is None:
            problems.append(LayoutProblem(name, DECLARED if spec is not None else UNKNOWN, tuple(p.shape), tuple(full)))
        else:
            layouts[name] = layout
    return layouts, problems


@dataclass
class ModuleRankResult(RankOutput):
    """What one rank of the tp world returns (besides :class:`~tpsim.props.observation.RankOutput`'s
    fields; ``output`` is the step-0 output), parameters by dotted name:

    - ``layouts``: how each parameter it could explain is laid out; ``problems``: the others;
    - ``shapes``: every parameter's shape on this rank;
    - ``partial``: the replicated parameters whose grad the trainer sums;
    - ``init``: replicated parameters' own values right after construction (an initialised variant
      that the library does not load: its own init);
    - ``loaded``: every parameter the library loaded (:mod:`tpsim.props.module.loading`), as this rank
      holds it right after loading: judged against the dense weights;
    - ``input_grad``, ``grads``: the first micro-batch's grads (None where none came);
    - ``accumulated``: the grads after the first optimizer step's micro-batches (before the trainer's sum);
    - ``summed_grads``: the first step's accumulated grads of ``partial`` after the trainer's sum;
    - ``norms``: what the target's clip returned at each optimizer step (a float, or the type name of
      what it returned instead); empty without a clip;
    - ``no_grad_output``: the output of one forward under ``torch.no_grad()`` on the first micro-batch's
      input before training (``no_grad_type``: the type it returned);
    - ``final``: every parameter after the last optimizer step;
    - ``capture``: the sublayer boundaries of the first micro-batch (:meth:`Capture.as_payload`), when asked for;
    - ``frozen``: every parameter has ``requires_grad=False`` (an inference module: the report
      suggests ``--forward-only`` when it is not checked so).
    """

    layouts: dict[str, ParamLayout] = field(default_factory=dict)
    problems: list[LayoutProblem] = field(default_factory=list)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    partial: tuple[str, ...] = ()
    init: dict[str, torch.Tensor] = field(default_factory=dict)
    input_grad: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)
    accumulated: dict[str, torch.Tensor | None] = field(default_factory=dict)
    summed_grads: dict[str, torch.Tensor] = field(default_factory=dict)
    norms: list[float | str] = field(default_factory=list)
    no_grad_output: torch.Tensor | None = None
    no_grad_type: str | None = None
    final: dict[str, torch.Tensor] = field(default_factory=dict)
    capture: dict[str, Any] | None = None
    frozen: bool = False
    loaded: dict[str, torch.Tensor] = field(default_factory=dict)


def rank_main(payload: dict[str, Any]) -> ModuleRankResult:
    """What every rank of the tp world runs for one case (see the module docstring)."""
    this_rank = enter_rank(payload)
    case, variant, data, rank, tp = this_rank.case, this_rank.variant, this_rank.data, this_rank.rank, this_rank.tp
    inputs, upstream = data.inputs[this_rank.group_index], data.grads[this_rank.group_index]
    # A library may keep the tensors it is given (a parameter made from a view of one): each rank gets
    # its own copy, as each process reads its own from a checkpoint (thread-ranks share data.masters).
    masters = {n: t.clone() for n, t in data.masters.items()} if variant.library_loads else data.masters
    with rank_phase("build"):
        module = variant.instantiate(case.sizes, group=this_rank.group, dtype=case.torch_dtype, masters=masters)
    init = {}
    if variant.initialised and not variant.library_loads:  # the library's own init, before anything is loaded
        init = {n: local_value(p).clone() for n, p in module.named_parameters()}
    # The library loads what it has a loader for (tpsim.props.module.loading); tpsim writes the rest,
    # by the layouts read from the module as built.
    layouts, problems = layouts_of(variant, module, data.shapes, tp, rank)
    with rank_phase("build"):
        by_library = load_weights(variant, module, masters, layouts, rank, tp)
    if by_library:  # a loader may replace parameter objects (a DTensor's piece installed): read again
        layouts, problems = layouts_of(variant, module, data.shapes, tp, rank)
    # Problems are reported by the parent. The rank still runs its steps (on whatever it could
    # load), so that its collectives stay in step with the ranks that found nothing wrong.
    params = dict(module.named_parameters())
    # Replicated parameters whose grad the trainer sums (declared grad="partial", or Megatron's
    # ``sequence_parallel`` marker): summed over the tp group before each SGD step, as Megatron's
    # finalize_model_grads does.
    partial = tuple(n for n, lay in layouts.items() if isinstance(lay.placement, Replicate) and (
        getattr(variant.param(n), "grad", "complete") == "partial" or getattr(params[n], "sequence_parallel", False) is True))
    result = ModuleRankResult(group=this_rank.group_index, tp_rank=rank, layouts=layouts, problems=problems, partial=partial,
                              shapes={n: local_shape(p) for n, p in params.items()},
                              frozen=bool(params) and not any(p.requires_grad for p in params.values()),
                              loaded=read_back(module, by_library))
    # What a loader wrote is the library's loading, not its init (judged against the dense weights).
    result.init = {n: t for n, t in init.items() if n in layouts and isinstance(layouts[n].placement, Replicate)
                   and n not in by_library}
    forward_only = variant.forward_only
    if not forward_only:
        _no_grad_forward(variant, case, module, inputs[0], rank, tp, result)
    optimizer = None if forward_only else optimizer_of(module)
    set_to_none = zero_grad_of(case)
    max_norm = data.max_norms[this_rank.group_index] if variant.clip is not None and data.max_norms else None
    traced = bool(payload.get("capture"))
    micro = 0
    for step, count in enumerate(step_plan(variant, case, traced=traced)):
        for _ in range(count):
            x_full = inputs[micro]
            x = _laid_out(_cut(x_full, input_placement(variant, x_full.dim()), rank, tp), case.input_layout)
            x.requires_grad_(not forward_only)
            capture = Capture().install(module) if traced and micro == 0 else None
            with rank_phase("forward", micro), grad_mode(variant):
                out = result.read(variant.call(module, x))
            g_full = upstream[micro]
            want = _cut(g_full, output_placement(variant, g_full.dim()), rank, tp)
            if result.unusable(out, want.shape, graph=x):
                if capture is not None:
                    capture.remove()
                    result.capture = capture.as_payload()  # the forward's boundaries show where it went wrong
                return result  # nothing to back-propagate: a wrong shape or dtype, or an output cut off from autograd
            if not forward_only:
                # Plain backward per micro-batch, nothing cleared in between: grads accumulate and every
                # grad hook (post-accumulate, tensor, module backward hooks) fires as in training.
                with rank_phase("backward", micro):
                    out.backward(_laid_out(want.to(out.dtype), case.input_layout))
            if capture is not None:
                capture.remove()
                result.capture = capture.as_payload()
            if forward_only:  # one forward: no grads, nothing trained
                result.output = out.detach().clone()
                return result
            if micro == 0:
                result.output = out.detach().clone()
                result.input_grad = None if x.grad is None else x.grad.detach().clone()
                # Copies, as in the reference world (later micro-batches, the trainer's sum, a clip and
                # zero_grad change grads in place; a module may keep them in a buffer it reuses).
                result.grads = {n: _rank_grad(p) for n, p in params.items()}
            micro += 1
        if traced:  # the first micro-batch's boundaries and grads are all a traced run is read for
            return result
        if step == 0:
            result.accumulated = {n: _rank_grad(p) for n, p in params.items()}
        norm = trainer_step(optimizer, {name: params[name] for name in partial}, this_rank.group, step, result.summed_grads,
                            set_to_none=set_to_none, clip=variant.clip, max_norm=max_norm,
                            params=list(module.parameters()))
        if variant.clip is not None and max_norm is not None:
            result.norms.append(_read_norm(norm))
    result.final = {n: local_value(p) for n, p in params.items()}
    return result


def _rank_grad(p: Any) -> torch.Tensor | None:
    """A copy of ``p``'s grad as this rank stores it (:func:`local_grad`: a DTensor's local piece)."""
    if p.grad is None:
        return None
    return local_grad(p).detach().clone() if is_dtensor(p) else kept_grad(p)


def _read_norm(norm: Any) -> float | str:
    """What a clip function returned as the total norm: a float (a DTensor read whole), else its type
    name (the checks report a clip that returns no norm)."""
    if is_dtensor(norm):
        norm = norm.full_tensor()
    if isinstance(norm, torch.Tensor) and norm.numel() == 1:
        return float(norm.detach().to(_F64))
    if isinstance(norm, (int, float)) and not isinstance(norm, bool):
        return float(norm)
    return type(norm).__name__


def _no_grad_forward(variant: ModuleVariant, case: ModuleCase, module: nn.Module, x_full: torch.Tensor, rank: int,
                     tp: int, result: ModuleRankResult) -> None:
    """One forward under ``torch.no_grad()`` on the first micro-batch's input, before training: the
    inference path a module may take when grad is disabled (transformers' ColwiseParallel runs a local
    kernel then), judged like the forward output (:attr:`ModuleRankResult.no_grad_output`)."""
    x = _laid_out(_cut(x_full, input_placement(variant, x_full.dim()), rank, tp), case.input_layout)
    with rank_phase("forward", 0), torch.no_grad():
        out = result.read(variant.call(module, x))
    result.no_grad_type = type(out).__name__
    result.no_grad_output = out.detach().clone() if isinstance(out, torch.Tensor) else None


@dataclass
class ModuleData:
    """What the ranks of the tp world get: every parameter's dense shape and master value, and per tp
    group the inputs and upstream grads of every step (drawn by the reference world)."""

    shapes: dict[str, tuple[int, ...]]
    masters: dict[str, torch.Tensor]
    inputs: list[list[torch.Tensor]]
    grads: list[list[torch.Tensor]]
    #: Per tp group, the ``max_norm`` of the target's clip (the reference's; None: no clipping).
    max_norms: list[float | None] = field(default_factory=list)


def is_divisible(variant: ModuleVariant, case: ModuleCase) -> bool:
    """Whether every size (but the variant's :attr:`~tpsim.module_variant.ModuleVariant.unsharded` ones),
    and a sequence-sharded input's sequence length, divides by the tp size."""
    tp = case.tp_size or case.world_size
    if any(s % tp for n, s in zip(variant.sizes, case.sizes, strict=True) if n not in variant.unsharded):
        return False
    d = variant.sequence_dim_of(len(case.batch_shape) + 1) if variant.input == "sequence-sharded" else None
    return d is None or case.batch_shape[d] % tp == 0
