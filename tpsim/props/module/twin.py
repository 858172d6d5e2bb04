"""The twin oracle: tolerances for a whole module without a rounding rule per operation.

The magnitude run (:mod:`tpsim.props.module.magnitude`) derives a per-element bound through every
operation it has a rule for; a module with an operation it has none for (a complex rotary
embedding, a softmax written out, an ``exp``, a mask), or a case in bfloat16/float16 (where that
bound, carried through several sublayers, is as large as the bugs it looks for), is judged by the
**dense twin** instead: the same dense module (the module on a tp group of one rank), run on the
same master values, inputs and upstream grads in a lower precision ``L``. How far the twin strays
from the float64 reference measures how much rounding this very computation amplifies, whatever
its operations are; the tensor-parallel run does the same operations in another reduction order,
so its error must be of the same size.

For every compared tensor ``T`` (the output, the input grad, every parameter grad of the first
micro-batch and accumulated over the first optimizer step, every parameter after training, every
recorded sublayer boundary) with float64 reference ``T64`` and twin
``TL``, in a case of dtype ``d`` on a tp group of ``tp`` ranks:

    s = max |T64|,   e = max(rho * s, max |TL - T64|),   r = eps(d) / eps(L)
    bound = TWIN_FACTOR * sqrt(tp + 1) * (r * e + eps(d) * s)         (every element of T)

where ``rho`` is the twin's worst relative error ``max |TL - T64| / max |T64|`` over the compared
tensors it *resolves* (below): a tensor is allowed the relative error the computation showed
anywhere, and never less than the twin's own absolute error on it (a tensor whose reference is
exactly zero, the input grad of a one-element RMSNorm, has ``s = 0``: its bound is the twin's
rounding of it).

**Tensors the twin does not resolve.** A tensor whose twin errs by at least its own scale
(``max |TL - T64| >= s > 0``: the twin has no correct digit of it) is the result of cancellation far
below the terms it sums — the query and key grads of attention over a one-token sequence, zero in
exact arithmetic (one key: the softmax's grad cancels), where each computation leaves its own
rounding of the terms. Its relative error measures that cancellation, not how much rounding the
computation amplifies: it is left out of ``rho`` (the query grad's 8.6e9 would allow every other
tensor an error larger than itself: a false pass). And its reference is rounding too: where the
twin happens to round it exactly (zero, as some CPUs' kernels do) the twin's "error" is the float64
reference's own, which ``r`` would shrink 2**29-fold below what the reference itself shows. So such a
tensor is allowed at least its own scale, ``e' = max(r e, s)`` in place of ``r e``: a run may differ
from a reference that is all rounding by as much as that rounding (a tensor-parallel bug moves it
by the terms, orders of magnitude more).

**A reference that is all rounding, or zero.** Such a tensor (not resolved, or exactly zero in
float64 and in the twin) has no scale of its own: ``s`` is rounding, or 0, and a bound built on it
is below what any run of the case's dtype can meet on the same terms (the query grad of a bfloat16
decoder layer over one token: 6e-20 in float64, exactly 0 in the twin, 2e-10 on a tp rank, once
judged against 9e-19; exactly zero in both, against the subnormal floor, 1e-39). Its terms are the
size of the other tensors of its kind: such a tensor is bounded at the scale ``S`` of the largest
tensor of its kind (forward values, grads, trained parameters) that the twin resolves, ``max(s, S)``
in place of ``s`` (``terms`` of :func:`twin_bound`). A tensor-parallel bug moves it by the terms;
in a float64 case that bound is still ~1e-15 of them.

- ``L`` is the case's dtype for float32, bfloat16 and float16 (``r = 1``): the twin makes exactly the
  roundings of a correct one-rank run. A float64 case has no lower-precision error to measure, so
  its twin runs in float32 and its error is scaled by ``r = eps(float64)/eps(float32) = 2**-29``:
  rounding errors are first-order in the unit roundoff (Higham, *Accuracy and Stability of
  Numerical Algorithms*, §3), so the same computation in float64 errs ``r`` times less. Any
  tensor-parallel bug (a summand missing, a bias twice, a wrong shard) is orders of magnitude
  above that bound.
- ``sqrt(tp + 1)``: the tp run splits each sharded reduction into ``tp`` partial sums and adds them
  in the all-reduce: up to ``tp`` more roundings of partial sums than the twin, growing like the
  square root of their number for rounding errors of random sign (the same model as
  :mod:`tpsim.props.tolerance`).
- ``eps(d) * s``: the floor. A twin that happens to be exact (a tensor of exactly representable
  sums, an upstream grad passed through) says nothing about the tp run's own roundings, each at
  most ``eps(d)/2`` of the tensor's scale.
- ``TWIN_FACTOR = 8`` leaves room for the tails, as :data:`tpsim.props.tolerance.FACTOR` does;
  tests/test_blocks.py and tests/test_modules.py check correct blocks in every dtype and that the
  seeded bugs are still caught.
- The bound is per tensor (its largest error and scale), not per element: an element where the
  twin happens to round exactly is no evidence that the tp run must too.
- Where the twin does not stay finite but the reference does (it overflows in ``L``): in a float64
  case the bound becomes ``sqrt(eps(float64)) * s`` (half the digits: still far below any bug); in a
  narrower dtype nothing about that tensor can be judged in that dtype (``inf``).

The checks use the same code for both oracles: the twin's bound is returned as the *equivalent
magnitude* ``M`` for which :func:`tpsim.props.tolerance.tolerance` gives it (the tolerance is linear
in ``M``), with the reduction length of the rows only.

A module that casts down inside (Llama's RMSNorm computes in float32 whatever its input) rounds to
that dtype in every case: a float64 case of it is judged as a case of the narrower dtype ``n``
(``d = n`` in the bound, its twin in ``twin_dtype(n)``). The float64 reference records the cast
(:class:`~tpsim.props.module.magnitude.ValueTape`); the rounding-error bound of the magnitude run
assumes the case's dtype throughout and is not used for such a case.

Gradients through an activation with a kink (ReLU) are compared in float64 cases only, as with
the derived bound (the float64 reference records which activations the module went through).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any

import torch
import torch.distributed as dist

from tpsim.module_variant import ModuleVariant
from tpsim.props.module.boundary import Capture
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.steps import StepTensors, assign, dense_step, step_plan
from tpsim.props.rank import optimizer_of, zero_grad_of
from tpsim.props.tolerance import FACTOR
from tpsim.props.tolerance import eps as eps_of
from tpsim.seeding import manual_seed

__all__ = ["TWIN_FACTOR", "relative_error", "resolved", "twin_bound", "twin_dtype", "twin_magnitudes", "twin_run"]

_F64 = torch.float64

#: The safety factor of the twin's bound (see the module docstring).
TWIN_FACTOR = 8.0


def twin_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the twin runs in for a case of ``dtype``: float32 for float64, else ``dtype`` itself."""
    return torch.float32 if dtype == _F64 else dtype


def _scale(t: torch.Tensor) -> float:
    finite = t[torch.isfinite(t)]
    return float(finite.abs().max()) if finite.numel() else 0.0


def relative_error(ref: torch.Tensor | None, twin: torch.Tensor | None) -> float:
    """``max |TL - T64| / max |T64|`` of one tensor (``inf`` where the twin is missing or not finite
    and the reference is; 0 for a zero tensor)."""
    if ref is None:
        return 0.0
    ref64 = ref.detach().to(_F64)
    s = _scale(ref64)
    if twin is None or tuple(twin.shape) != tuple(ref64.shape):
        return math.inf
    finite = torch.isfinite(ref64)
    diff = (twin.detach().to(_F64) - ref64).abs()[finite]
    e = float(diff.max()) if diff.numel() else 0.0
    if not math.isfinite(e):
        return math.inf
    return e / s if s > 0 else 0.0


def resolved(ref: torch.Tensor | None, twin: torch.Tensor | None) -> bool:
    """Whether the twin has a correct digit of the tensor (its relative error is below 1; see the
    module docstring): a zero, missing or not finite one counts as resolved (its own rules apply)."""
    rel = relative_error(ref, twin)
    return rel < 1.0 or math.isinf(rel)


def twin_bound(ref: torch.Tensor, rho: float, dtype: torch.dtype, tp: int, own: float = 0.0,
               terms: float = 0.0) -> float:
    """The bound of every element of a tensor whose float64 reference is ``ref``, when the twin's
    worst relative error over the tensors it resolves is ``rho`` and its absolute error on this
    tensor is ``own`` (see the module docstring; ``own >= max |ref|``: a tensor it does not resolve, or
    one that is zero in both). ``terms``: the scale of the terms such a tensor is computed from (the
    largest tensor of its kind the twin resolves), which stands for its own scale there: a reference that
    is all rounding, or exactly zero, says nothing of what the case's dtype can meet."""
    s = _scale(ref.detach().to(_F64))
    d_eps = eps_of(dtype)
    if not math.isfinite(rho):
        return math.sqrt(d_eps) * s if dtype == _F64 else math.inf
    r = d_eps / eps_of(twin_dtype(dtype))
    rounding = own >= s  # not resolved (or zero in both): the reference may be all rounding
    scale = max(s, terms) if rounding else s
    err = r * max(rho * scale, own)
    if rounding and s > 0:
        err = max(err, s)
    return TWIN_FACTOR * math.sqrt(tp + 1) * (err + d_eps * scale)


def _absolute_error(ref: torch.Tensor, twin: torch.Tensor | None) -> float:
    """``max |TL - T64|`` over the finite elements of the reference (0 where it cannot be measured:
    a missing or misshapen twin makes ``rho`` infinite instead)."""
    if twin is None or tuple(twin.shape) != tuple(ref.shape):
        return 0.0
    ref64 = ref.detach().to(_F64)
    diff = (twin.detach().to(_F64) - ref64).abs()[torch.isfinite(ref64)]
    e = float(diff.max()) if diff.numel() else 0.0
    return e if math.isfinite(e) else 0.0


def _equivalent(ref: torch.Tensor | None, low: torch.Tensor | None, rho: float, at: torch.dtype,
                dtype: torch.dtype, tp: int, rows: int, terms: float = 0.0) -> torch.Tensor | None:
    """The magnitude tensor whose :func:`~tpsim.props.tolerance.tolerance` in the case's ``dtype`` is
    :func:`twin_bound` at the precision ``at`` (``low``: the twin's tensor; ``terms``: the scale of the
    largest tensor of its kind the twin resolves)."""
    if ref is None:
        return None
    unit = FACTOR * eps_of(dtype) * math.sqrt(max(rows, 1) + max(tp, 1))
    bound = twin_bound(ref, rho, at, tp, _absolute_error(ref, low), terms)
    return torch.full(tuple(ref.shape), bound / unit, dtype=_F64)


def twin_run(variant: ModuleVariant, case: ModuleCase, masters: dict[str, torch.Tensor],
             inputs: list[torch.Tensor], grads: list[torch.Tensor], capture_on: bool,
             precision: torch.dtype | None = None, max_norm: float | None = None) -> Any:
    """One tp group's training on the dense twin in :func:`twin_dtype` of ``precision`` (the case's
    dtype unless the module narrows it; returned as :class:`~tpsim.props.module.steps.StepTensors`,
    in the twin's dtype): the same micro-batches, accumulation, ``zero_grad`` mode and clipping
    (``max_norm``: the reference's) as the reference world (:mod:`tpsim.props.module.world`)."""
    low = twin_dtype(precision or case.torch_dtype)
    manual_seed(case.seed)
    dense = variant.reference(case.sizes, group=dist.group.WORLD, dtype=low)
    assign(dense, {n: t.to(low, copy=True) for n, t in masters.items()})
    first: tuple[Any, ...] = ()
    accumulated: dict[str, torch.Tensor | None] = {}
    # A forward-only variant: the one forward the reference ran (``inputs`` holds one), under
    # torch.no_grad(), with no backward and no optimizer step (tpsim.props.module.world).
    forward_only = variant.forward_only
    optimizer = None if forward_only else optimizer_of(dense)
    set_to_none = zero_grad_of(case)
    micro = 0
    for step, count in enumerate(step_plan(variant, case, traced=capture_on)):
        for _ in range(count):
            x = inputs[micro].to(low, copy=True).requires_grad_(not forward_only)
            capture = Capture().install(dense) if capture_on and micro == 0 else None
            with torch.no_grad() if forward_only else contextlib.nullcontext():
                y = variant.call(dense, x)
            if not forward_only:
                y.backward(grads[micro].to(y.dtype))
            if capture is not None:
                capture.remove()
            if micro == 0:
                first = (y.detach(), None if x.grad is None else x.grad.detach(),
                         {} if forward_only else {n: None if p.grad is None else p.grad.detach().clone()
                                                  for n, p in dense.named_parameters()},
                         None if capture is None else capture.as_payload())
            micro += 1
        if forward_only or capture_on:
            break
        if step == 0:
            accumulated = {n: None if p.grad is None else p.grad.detach().clone() for n, p in dense.named_parameters()}
        dense_step(dense, optimizer, set_to_none=set_to_none, max_norm=max_norm)
    return StepTensors(*first, final={} if forward_only or capture_on else {n: p.detach() for n, p in dense.named_parameters()},
                       accumulated=accumulated)


def twin_magnitudes(value: Any, twin: Any, case: ModuleCase, precision: torch.dtype | None = None) -> Any:
    """The equivalent magnitudes (:class:`~tpsim.props.module.steps.StepTensors`) of one tp group's
    reference ``value`` and its ``twin`` (see the module docstring); ``precision``: the dtype the
    bound is made at (default: the case's; a narrower one where the module casts down to it)."""

    dtype, tp, rows = case.torch_dtype, case.tp_size or case.world_size, case.rows
    at = precision or dtype
    pairs = [(value.y, twin.y), (value.dx, twin.dx), *((g, twin.grads.get(n)) for n, g in value.grads.items()),
             *((t, twin.final.get(n)) for n, t in value.final.items())]
    accumulated = [(g, twin.accumulated.get(n)) for n, g in value.accumulated.items()]
    ref_c = low_c = None
    if value.capture is not None:
        ref_c = Capture.from_payload(value.capture)
        low_c = Capture.from_payload(twin.capture or {})
        pairs += [(t, low_c.tensors.get(k)) for k, t in ref_c.tensors.items()]
    # Over the tensors the twin resolves: the relative error of a cancellation is no measure of the rest.
    rho = max((relative_error(a, b) for a, b in pairs if resolved(a, b)), default=0.0)
    # Grads summed over micro-batches in the case's dtype round once more per micro-batch: their own worst
    # error bounds them, and never loosens the single-step tensors' bounds.
    rho_accumulated = max((relative_error(a, b) for a, b in accumulated if resolved(a, b)), default=rho)
    # The scale of the terms of each kind (values of the forward, grads, trained parameters): what a tensor
    # that is all rounding, or zero, in float64 is computed from (the query grad of one-token attention: its
    # terms are the other grads' size), the scale the case's dtype rounds at.
    kinds: dict[str, list[tuple[torch.Tensor | None, torch.Tensor | None]]] = {
        "value": [(value.y, twin.y)],
        "grad": [(value.dx, twin.dx), *((g, twin.grads.get(n)) for n, g in value.grads.items()),
                 *((g, twin.accumulated.get(n)) for n, g in value.accumulated.items())],
        "final": [(t, twin.final.get(n)) for n, t in value.final.items()],
    }
    if ref_c is not None and low_c is not None:
        for k, t in ref_c.tensors.items():
            kinds["grad" if k[1] in ("gin", "gout") else "value"].append((t, low_c.tensors.get(k)))
    terms = {kind: max((_scale(a.detach().to(_F64)) for a, b in items if a is not None and _scale(
        a.detach().to(_F64)) > 0 and relative_error(a, b) < 1.0), default=0.0) for kind, items in kinds.items()}

    def eq(ref: torch.Tensor | None, low: torch.Tensor | None, kind: str, worst: float = rho) -> torch.Tensor | None:
        return _equivalent(ref, low, worst, at, dtype, tp, rows, terms[kind])

    capture = None
    if ref_c is not None and low_c is not None:
        capture = Capture(active=False)
        capture.events = list(ref_c.events)
        capture.tensors = {k: eq(t, low_c.tensors.get(k), "grad" if k[1] in ("gin", "gout") else "value")  # type: ignore[misc]
                           for k, t in ref_c.tensors.items()}
        capture = capture.as_payload()
    return StepTensors(eq(value.y, twin.y, "value"), eq(value.dx, twin.dx, "grad"),
                       {n: eq(g, twin.grads.get(n), "grad") for n, g in value.grads.items()}, capture,
                       final={n: eq(t, twin.final.get(n), "final") for n, t in value.final.items()},  # type: ignore[misc]
                       accumulated={n: eq(g, twin.accumulated.get(n), "grad", max(rho, rho_accumulated))
                                    for n, g in value.accumulated.items()})
