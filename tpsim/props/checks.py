"""The properties: claims checked on one case, each a named function usable from pytest.

Per-case properties (all fed by one world run, :func:`tpsim.props.world.observe`):

- :func:`forward_equivalence` — the output, assembled by the variant's output placement (sharded:
  concatenated; gathered/reduced: every rank's; partial: summed over ranks, as the caller's
  all-reduce would), equals the float64 dense ``x Wᵀ + b``;
- :func:`input_grad_equivalence` — the input gradient: for a replicated input with ``complete``
  semantics (Megatron's rule) every rank holds the full dense gradient, with ``partial`` the sum over
  ranks does; for a sharded input every rank holds its slice;
- :func:`weight_grad_equivalence`, :func:`bias_grad_equivalence` — each rank's parameter grad (read
  back into master layout, so a transposed weight is handled) equals its slice of the dense grad
  (a replicated parameter: the whole dense grad, on every rank);
- :func:`replica_consistency` — every replicated tensor (gathered/reduced output, complete input
  grad, grads and values of replicated parameters) is bit-identical across ranks;
- :func:`training_equivalence` — after ``TRAIN_STEPS`` SGD steps the re-assembled parameters equal
  dense training (evaluated when the single-step properties hold: it catches state bugs such as a
  cached weight copy that stops following the parameter);
- :func:`divisibility` — for a case whose sharded sizes do not divide by the tp size: every rank
  raises an exception (while building the layer or in its forward); no rank returns a result (a
  silent truncation) and no rank is left failing in a collective.

Each function raises :class:`PropertyFailed` (an ``AssertionError``, so pytest reports it as a
test failure) carrying the :class:`~tpsim.diagnosis.Failure`. :func:`check_case` evaluates them
all from one run and returns the failures.
"""

from __future__ import annotations

import collections
import re
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpsim.diagnosis import (
    Diagnosis,
    Failure,
    bias_multiple,
    block_mapping,
    close,
    lower_precision,
    mismatch,
    rank_summands,
    regathered_dim,
    scale_factor,
)
from tpsim.errors import CollectiveError, InvalidArgument
from tpsim.placement import Replicate, Shard, assemble, shard_tensor
from tpsim.props.case import Case
from tpsim.props.groups import column_grad_summands, column_output_shards, tp_groups, wrong_group
from tpsim.props.groups import row_summands as group_row_summands
from tpsim.props.tolerance import tolerance
from tpsim.props.world import (
    LR,
    TRAIN_STEPS,
    Observation,
    Reference,
    VariantRaised,
    non_divisible_sizes,
    observe,
    reference,
)
from tpsim.variant import LayoutError, Variant

__all__ = [
    "PROPERTIES",
    "PropertyFailed",
    "bias_grad_equivalence",
    "check_case",
    "divisibility",
    "evaluate",
    "forward_equivalence",
    "input_grad_equivalence",
    "replica_consistency",
    "training_equivalence",
    "weight_grad_equivalence",
]

FORWARD = "forward-equivalence"
INPUT_GRAD = "input-grad-equivalence"
WEIGHT_GRAD = "weight-grad-equivalence"
BIAS_GRAD = "bias-grad-equivalence"
REPLICA = "replica-consistency"
TRAINING = "training-equivalence"
DIVISIBILITY = "divisibility"

#: Every property name, in the order they are evaluated and reported.
PROPERTIES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BIAS_GRAD, REPLICA, TRAINING, DIVISIBILITY)


class PropertyFailed(AssertionError):
    """A property does not hold on a case; ``failure`` has the diagnosis and the case."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.property} failed ({failure.diagnosis}): {failure.message}")
        self.failure = failure


# --- helpers -------------------------------------------------------------------------------------

_F64 = torch.float64


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(_F64)


class _Ctx:
    """What every evaluator needs about the case."""

    def __init__(self, variant: Variant, case: Case, values: list[dict[str, Any]], ref: Reference | None):
        self.variant = variant
        self.case = case
        self.values = values
        self.ref = ref
        self.ws = case.tp_size or case.world_size  # the tp group's size (the world's when tp_size == world_size)
        self.dtype = case.torch_dtype

    def tol(self, magnitude: torch.Tensor, k: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        return tolerance(dtype or self.dtype, magnitude, reduction_length=k, world_size=self.ws)

    def fail(self, prop: str, diag: Diagnosis, rank: int | None = None, prefix: str = "") -> Failure:
        message = f"{prefix}{diag.message}" if prefix else diag.message
        return Failure(prop, diag.name, message, case=self.case, rank=rank, details=dict(diag.details), variant=self.variant.name)


def _precision_or_mismatch(
    ctx: _Ctx, actual: torch.Tensor, expected: torch.Tensor, mag: torch.Tensor, k: int, what: str
) -> Diagnosis:
    narrower = lower_precision(actual, expected, ctx.dtype, lambda dt: ctx.tol(mag, k, dt))
    base = mismatch(actual, expected, what=what)
    if narrower is not None:
        name = str(narrower).replace("torch.", "")
        return Diagnosis(
            "precision-loss",
            f"{what} is within {name} rounding of the dense reference but not within {ctx.case.dtype} rounding: "
            f"part of the computation or communication runs in {name} or narrower ({base.message.split(': ', 1)[1]})",
            dict(base.details, narrower=name),
        )
    return base


def _shape_diagnosis(ctx: _Ctx, actual: torch.Tensor, expected: torch.Tensor, full: torch.Tensor,
                     placement: Any, rank: int, what: str, tol_scalar: float) -> Diagnosis:
    """A wrong shape: the expected values re-cut along another dim (wrong-shard-dim), else shape-error."""
    if ctx.ws > 1 and full.dim() > 0:
        if isinstance(placement, Shard):
            shard_dim = placement.dim % full.dim()
            for d in range(full.dim()):
                if d == shard_dim:
                    continue
                # An uneven dim is cut as torch.tensor_split cuts it (a split that never checks sizes).
                cand = (shard_tensor(full, Shard(d), rank, ctx.ws) if full.shape[d] % ctx.ws == 0
                        else torch.tensor_split(full, ctx.ws, dim=d)[rank])
                if cand.shape == actual.shape and bool(((actual - cand).abs() <= tol_scalar).all()):
                    return Diagnosis(
                        "wrong-shard-dim",
                        f"{what} on rank {rank} has shape {list(actual.shape)} (expected {list(expected.shape)}): "
                        f"it is the dense result sharded along dim {d} instead of dim {shard_dim}",
                        {"shape": list(actual.shape), "expected_shape": list(expected.shape), "dim": d},
                    )
        else:
            d = regathered_dim(actual, full, dim=-1, parts=ctx.ws, tol_scalar=tol_scalar)
            if d is not None:
                return Diagnosis(
                    "wrong-shard-dim",
                    f"{what} on rank {rank} has shape {list(actual.shape)} (expected {list(expected.shape)}): its values "
                    f"are the {ctx.ws} shards concatenated along dim {d} instead of the last (feature) dim",
                    {"shape": list(actual.shape), "expected_shape": list(expected.shape), "dim": d},
                )
    return Diagnosis(
        "shape-error",
        f"{what} on rank {rank} has shape {list(actual.shape)}, expected {list(expected.shape)}",
        {"shape": list(actual.shape), "expected_shape": list(expected.shape)},
    )


def _blocks_msg(mapping: list[int]) -> str:
    wrong = [f"block {i} holds shard {j}" for i, j in enumerate(mapping) if i != j]
    return ", ".join(wrong[:6]) + (" ..." if len(wrong) > 6 else "")


# --- forward -------------------------------------------------------------------------------------


def _row_summands(ctx: _Ctx) -> list[torch.Tensor]:
    """Each rank's expected summand ``x_r W_rᵀ`` of a row layer (input features sharded)."""
    ref = ctx.ref
    return [
        shard_tensor(ref.x, Shard(-1), r, ctx.ws) @ shard_tensor(ref.weight, Shard(1), r, ctx.ws).t()
        for r in range(ctx.ws)
    ]


def _diagnose_output(ctx: _Ctx, actual: torch.Tensor, tol: torch.Tensor, outs: list[torch.Tensor], what: str) -> Diagnosis:
    ref = ctx.ref
    y, ws, mode = ref.y, ctx.ws, ctx.variant.output
    off_by_bias = None
    if ref.bias is not None:
        c = bias_multiple(actual - y, ref.bias, tol)
        if c is not None and ws > 1 and abs(c - (ws - 1)) < 1e-2:
            return Diagnosis(
                "bias-duplication",
                f"{what} is off by exactly (world_size-1)*bias = {ws - 1}*bias (world_size={ws}): every rank adds "
                "the full bias to its summand before the reduction; add it once, after the reduction",
                {"factor": c},
            )
        if c is not None and abs(c + 1) < 1e-2:
            return Diagnosis("bias-missing", f"{what} is off by exactly -bias: the bias is never added", {"factor": c})
        # Any other multiple is only worth naming when the bias has several entries (one number is
        # a multiple of any other) and rounding in a narrower dtype does not explain it better.
        off_by_bias = c if c is not None and ref.bias.numel() > 1 else None
    if mode == "reduced" and ctx.variant.kind == "row" and ws > 1:
        summands = _row_summands(ctx)
        bias = ref.bias if ref.bias is not None else torch.zeros(())
        for r, out in enumerate(outs):
            if out.shape == y.shape and (close(out, summands[r], tol) or close(out, summands[r] + bias, tol)):
                return Diagnosis(
                    "missing-reduction",
                    f"{what}: rank {r} returned only its own summand x_r W_r^T (the ranks' outputs differ and add up to "
                    "the dense output): the all-reduce over the tp group is missing",
                    {"rank": r},
                )
    found_layout = _packed_or_sequence_layout(ctx, outs, y, tol, ref.bias, what)
    if found_layout is not None:
        return found_layout
    c = scale_factor(actual, y, tol, known=(ws,))
    if c is not None and ws > 1 and abs(c - ws) < 1e-2:
        hint = " (the layer already reduces: declare output='reduced')" if mode == "partial" else ""
        return Diagnosis("double-reduction", f"{what} is {ws} x the dense output: it was reduced twice{hint}", {"factor": c})
    if mode in ("sharded", "gathered") and ws > 1 and actual.dim() > 0:
        mapping = block_mapping(actual, y, tol, dim=-1, parts=ws)
        if mapping is None and ref.bias is not None:
            # The harness loads the bias shards itself (in the right order): compare x Wᵀ alone.
            mapping = block_mapping(actual - ref.bias, y - ref.bias, tol, dim=-1, parts=ws)
        if mapping is not None and mapping != list(range(ws)):
            return Diagnosis(
                "wrong-shard-order",
                f"{what} has its {ws} feature blocks out of place ({_blocks_msg(mapping)}): a rank holds another "
                "rank's shard of the weight",
                {"mapping": mapping},
            )
    found = _precision_or_mismatch(ctx, actual, y, ref.mag["y"], ctx.case.in_features, what)
    if ref.bias is not None and off_by_bias is not None and found.name == "mismatch":
        return Diagnosis("mismatch", f"{what} is off by {off_by_bias:.4g}*bias (world_size={ws}); {found.message}",
                         dict(found.details, factor=off_by_bias))
    return found


def _contiguous_packed(ctx: _Ctx, pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, dim: int) -> bool:
    """Each rank's piece is the rank-th *contiguous* slice of ``full`` along ``dim`` (the packed
    weight split as one block) instead of its shard of every packed part."""
    ws = ctx.ws
    if ws < 2 or full.dim() == 0 or full.shape[dim] % ws:
        return False
    return all(
        p.shape == shard_tensor(full, Shard(dim), r, ws).shape
        and close(p, shard_tensor(full, Shard(dim), r, ws), shard_tensor(tol, Shard(dim), r, ws))
        for r, p in enumerate(pieces)
    )


def _packed_message(ctx: _Ctx, what: str) -> str:
    parts = ctx.variant.packed
    return (
        f"{what}: every rank holds a contiguous 1/{ctx.ws} slice of the packed dim instead of its shard of each of "
        f"the {len(parts or ())} packed parts (proportions {list(parts or ())}): the packed weight was split as one "
        "block, so a rank's 'gate' and 'up' (or Q, K, V) come from the wrong parts; shard each part on its own "
        "(Megatron's partition stride; vllm #3775)"
    )


def _other_dim_slices(ctx: _Ctx, pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, skip: int) -> int | None:
    """The dim ``d`` (not ``skip``, not the feature dim) such that every rank's piece is its
    ``Shard(d)`` slice of ``full``: a scatter/gather along the wrong dim (same shapes included)."""
    if ctx.ws < 2 or full.dim() < 2:
        return None
    for d in range(full.dim() - 1):
        if d == skip or full.shape[d] % ctx.ws:
            continue
        if all(
            p.shape == shard_tensor(full, Shard(d), r, ctx.ws).shape
            and close(p, shard_tensor(full, Shard(d), r, ctx.ws), shard_tensor(tol, Shard(d), r, ctx.ws))
            for r, p in enumerate(pieces)
        ):
            return d
    return None


def _packed_or_sequence_layout(ctx: _Ctx, outs: list[torch.Tensor], y: torch.Tensor, tol: torch.Tensor,
                               bias: torch.Tensor | None, what: str) -> Diagnosis | None:
    """``packed-shard-layout`` (a packed column split contiguously) or ``wrong-shard-dim`` (a
    sequence-sharded output cut along another dim), recognised from every rank's piece."""
    v, ws = ctx.variant, ctx.ws
    if ws < 2 or y.dim() == 0:
        return None
    if v.packed and v.output == "sharded":
        # The layer may take its bias shards by the packed layout (the harness loads them so) while
        # its weight is split contiguously: compare x W^T alone too.
        candidates = [(outs, y)]
        if bias is not None:
            place = v.output_placement
            candidates.append(([o - shard_tensor(bias, place, r, ws) for r, o in enumerate(outs)], y - bias))
        for pieces, full in candidates:
            if _contiguous_packed(ctx, pieces, full, tol, y.dim() - 1):
                return Diagnosis("packed-shard-layout", _packed_message(ctx, what), {"parts": list(v.packed)})
    if v.output == "sequence-sharded":
        seq = v.sequence_dim_of(y.dim())
        d = _other_dim_slices(ctx, outs, y, tol, -1 if seq is None else seq)
        if d is not None:
            return Diagnosis(
                "wrong-shard-dim",
                f"{what}: every rank holds its 1/{ws} slice of dim {d} of the reduced output instead of dim {seq} "
                f"(the sequence dim, sequence_dim={v.sequence_dim}): the reduce-scatter runs along the wrong dim "
                "(e.g. the batch dim; vllm #30610, ROCm/aiter #3395)",
                {"dim": d, "expected_dim": seq},
            )
    return None


def _forward(ctx: _Ctx) -> Failure | None:
    ref = ctx.ref
    outs_raw = [v.get("output") for v in ctx.values]
    for r, o in enumerate(outs_raw):
        if o is None:
            kind = ctx.values[r].get("output_type", "None")
            return ctx.fail(FORWARD, Diagnosis("shape-error", f"rank {r}'s forward returned {kind}, not a tensor"), r)
    outs = [o.to(_F64) for o in outs_raw]
    y, ws, mode = ref.y, ctx.ws, ctx.variant.output
    tol = ctx.tol(ref.mag["y"], ctx.case.in_features)
    tol_scalar = float(tol.max()) if tol.numel() else 0.0
    if mode in ("sharded", "sequence-sharded"):
        # Shard(-1) (per packed part for a packed column) or the sequence dim: each rank's piece.
        placement = ctx.variant.output_placement
        for r, o in enumerate(outs):
            exp = shard_tensor(y, placement, r, ws)
            if o.shape != exp.shape:
                return ctx.fail(FORWARD, _shape_diagnosis(ctx, o, exp, y, placement, r, "the output", tol_scalar), r)
        actual = assemble(outs, placement)
        if close(actual, y, tol):
            return None
        return ctx.fail(FORWARD, _diagnose_output(ctx, actual, tol, outs, "the output (rank shards assembled)"))
    if mode == "partial":
        for r, o in enumerate(outs):
            if o.shape != y.shape:
                return ctx.fail(FORWARD, _shape_diagnosis(ctx, o, y, y, Replicate(), r, "the output", tol_scalar), r)
        actual = torch.stack(outs).sum(0)
        if close(actual, y, tol):
            return None
        return ctx.fail(FORWARD, _diagnose_output(ctx, actual, tol, outs, "the output (summed over ranks)"))
    for r, o in enumerate(outs):
        if o.shape != y.shape:
            return ctx.fail(FORWARD, _shape_diagnosis(ctx, o, y, y, Replicate(), r, "the output", tol_scalar), r)
    for r, o in enumerate(outs):
        if not close(o, y, tol):
            return ctx.fail(FORWARD, _diagnose_output(ctx, o, tol, outs, f"the output on rank {r}"), r)
    return None


# --- gradients -----------------------------------------------------------------------------------


def _input_grad(ctx: _Ctx) -> Failure | None:
    ref = ctx.ref
    ws, dx = ctx.ws, ref.dx
    grads = [_f64(v.get("input_grad")) for v in ctx.values]
    tol = ctx.tol(ref.mag["dx"], ctx.case.out_features)
    tol_scalar = float(tol.max()) if tol.numel() else 0.0
    for r, g in enumerate(grads):
        if g is None:
            return ctx.fail(INPUT_GRAD, Diagnosis("grad-missing", f"the input received no gradient on rank {r} (x.grad is None)"), r)
    sharded = ctx.variant.input in ("sharded", "sequence-sharded")
    in_place = ctx.variant.input_placement  # in_place, or Shard(sequence_dim) under sequence parallelism
    for r, g in enumerate(grads):
        exp = shard_tensor(dx, in_place, r, ws) if sharded else dx
        if g.shape != exp.shape:
            placement = in_place if sharded else Replicate()
            return ctx.fail(INPUT_GRAD, _shape_diagnosis(ctx, g, exp, dx, placement, r, "the input grad", tol_scalar), r)  # type: ignore[arg-type]
    k = ctx.case.out_features
    if not sharded and ctx.variant.input_grad == "partial":
        total = torch.stack(grads).sum(0)  # type: ignore[arg-type]
        if close(total, dx, tol):
            return None
        if ws > 1 and all(close(g, dx, tol) for g in grads):  # type: ignore[arg-type]
            return ctx.fail(INPUT_GRAD, Diagnosis(
                "grad-scaled",
                f"the input grad summed over ranks is {ws} x the dense grad: every rank already holds the complete "
                "gradient; declare input_grad='complete'",
                {"factor": float(ws)},
            ))
        c = scale_factor(total, dx, tol, known=(ws, 1 / ws))
        if c is not None:
            return ctx.fail(INPUT_GRAD, Diagnosis("grad-scaled", f"the input grad summed over ranks is {c:.4g} x the dense grad", {"factor": c}))
        return ctx.fail(INPUT_GRAD, _precision_or_mismatch(ctx, total, dx, ref.mag["dx"], k, "the input grad summed over ranks"))
    for r, g in enumerate(grads):
        exp = shard_tensor(dx, in_place, r, ws) if sharded else dx
        t = shard_tensor(tol, in_place, r, ws) if sharded else tol
        if close(g, exp, t):
            continue
        what = f"the input grad on rank {r}"
        if not sharded and rank_summands(grads, dx, tol):  # type: ignore[arg-type]
            return ctx.fail(INPUT_GRAD, Diagnosis(
                "grad-not-reduced",
                f"{what} is only its own summand (the ranks' input grads add up to the dense grad): the backward "
                "all-reduce of the replicated input's grad is missing (Megatron's copy_to_tensor_parallel_region); "
                "if the caller reduces it, declare input_grad='partial'",
            ), r)
        c = scale_factor(g, exp, t, known=(ws, 1 / ws))
        if c is not None:
            hint = " (averaged instead of summed?)" if abs(c * ws - 1) < 1e-2 else ""
            return ctx.fail(INPUT_GRAD, Diagnosis("grad-scaled", f"{what} is {c:.4g} x the dense grad{hint}", {"factor": c}), r)
        if ctx.variant.input == "sequence-sharded" and ws > 1:
            seq = ctx.variant.sequence_dim_of(dx.dim())
            d = _other_dim_slices(ctx, grads, dx, tol, -1 if seq is None else seq)  # type: ignore[arg-type]
            if d is not None:
                return ctx.fail(INPUT_GRAD, Diagnosis(
                    "wrong-shard-dim",
                    f"the input grad: every rank holds its 1/{ws} slice of dim {d} of the dense grad instead of dim "
                    f"{seq} (the sequence dim): the backward reduce-scatter runs along the wrong dim",
                    {"dim": d, "expected_dim": seq},
                ), r)
        if sharded and ws > 1:
            for j in range(ws):
                if j != r and close(g, shard_tensor(dx, in_place, j, ws), t):
                    return ctx.fail(INPUT_GRAD, Diagnosis(
                        "wrong-shard-order", f"{what} is the slice of rank {j}: a rank holds another rank's shard", {"holds": j}), r)
        mag = shard_tensor(ref.mag["dx"], in_place, r, ws) if sharded else ref.mag["dx"]
        return ctx.fail(INPUT_GRAD, _precision_or_mismatch(ctx, g, exp, mag, k, what), r)
    return None


def _param_grad(ctx: _Ctx, master: str, prop: str) -> Failure | None:
    ref = ctx.ref
    spec = ctx.variant.param(master)
    if spec is None or (master == "bias" and not ctx.case.bias):
        return None
    ws = ctx.ws
    full = ref.dweight if master == "weight" else ref.dbias
    mag_full = ref.mag["d" + master]
    k = max(ref.rows, 1)
    tol_full = ctx.tol(mag_full, k)
    tol_scalar = float(tol_full.max()) if tol_full.numel() else 0.0
    placement = spec.placement
    sharded = isinstance(placement, Shard)
    grads = [_f64(v["grads"].get(master)) for v in ctx.values]
    expected = [shard_tensor(full, placement, r, ws) if sharded else full for r in range(ws)]
    tols = [shard_tensor(tol_full, placement, r, ws) if sharded else tol_full for r in range(ws)]
    mags = [shard_tensor(mag_full, placement, r, ws) if sharded else mag_full for r in range(ws)]
    name = f"the {spec.name} grad"

    ok = [g is not None and g.shape == e.shape and close(g, e, t) for g, e, t in zip(grads, expected, tols, strict=True)]
    if all(ok):
        return None
    if master == "bias" and not sharded and ws > 1 and ok[0] and all(
        g is None or (g.shape == full.shape and not bool(g.abs().gt(0).any())) for g in grads[1:]
    ):
        return ctx.fail(prop, Diagnosis(
            "bias-grad-rank0-only",
            f"only rank 0's bias received its gradient (ranks 1..{ws - 1} have "
            f"{'None' if grads[1] is None else 'zeros'}): the bias is added on rank 0 only, so the other replicas "
            "never learn; add it on every rank after the reduction",
        ), 1)
    for r, (g, e, t) in enumerate(zip(grads, expected, tols, strict=True)):
        if ok[r]:
            continue
        what = f"{name} on rank {r}"
        if g is None:
            return ctx.fail(prop, Diagnosis("grad-missing", f"{spec.name} received no gradient on rank {r} (.grad is None)"), r)
        if g.shape != e.shape:
            return ctx.fail(prop, _shape_diagnosis(ctx, g, e, full, placement, r, name, tol_scalar), r)
        if sharded and getattr(placement, "parts", None) and ctx.ws > 1 and all(x is not None for x in grads) and \
                _contiguous_packed(ctx, grads, full, tol_full, placement.dim % full.dim()):  # type: ignore[arg-type]
            return ctx.fail(prop, Diagnosis("packed-shard-layout", _packed_message(ctx, name), {"parts": list(placement.parts)}), r)
        if not sharded and rank_summands([x for x in grads if x is not None], full, tol_full):
            return ctx.fail(prop, Diagnosis(
                "grad-not-reduced",
                f"{what} is only its own summand (the ranks' grads add up to the dense grad): the grad of the "
                f"replicated parameter {spec.name!r} is never all-reduced"
                + (" (under sequence parallelism each rank uses it on its own slice of the sequence only; "
                   "NeMo #7184, gpt-neox #1257)" if "sequence-sharded" in (ctx.variant.input, ctx.variant.output) else ""),
                {"param": spec.name},
            ), r)
        c = scale_factor(g, e, t, known=(ws, 1 / ws))
        if c is not None:
            hint = " (averaged instead of summed, or the value divided by world_size?)" if abs(c * ws - 1) < 1e-2 else ""
            hint = " (reduced twice?)" if abs(c - ws) < 1e-2 and ws > 1 else hint
            return ctx.fail(prop, Diagnosis("grad-scaled", f"{what} is {c:.4g} x the dense grad{hint}", {"factor": c}), r)
        if sharded and ws > 1:
            for j in range(ws):
                if j != r and close(g, expected[j], torch.maximum(t, tols[j])):
                    return ctx.fail(prop, Diagnosis(
                        "wrong-shard-order",
                        f"{what} is the grad of rank {j}'s shard: rank {r} holds rank {j}'s shard of {spec.name}",
                        {"holds": j},
                    ), r)
        return ctx.fail(prop, _precision_or_mismatch(ctx, g, e, mags[r], k, what), r)
    return None


# --- replicas, training --------------------------------------------------------------------------


def _replica_at_construction(ctx: _Ctx) -> Failure | None:
    """Replicated parameters the layer initialised itself must agree bit for bit right after
    construction (every rank was seeded alike), before the harness loads the master values."""
    for spec in ctx.variant.params or ():
        tensors = [(x.get("init") or {}).get(spec.name) for x in ctx.values]
        if any(t is None for t in tensors) or len({tuple(t.shape) for t in tensors}) > 1:
            continue
        bad = [r for r in range(1, len(tensors)) if not torch.equal(tensors[r], tensors[0])]
        if bad:
            diff = max(float((tensors[r].to(_F64) - tensors[0].to(_F64)).abs().max()) for r in bad)
            return ctx.fail(REPLICA, Diagnosis(
                "replica-divergence",
                f"parameter {spec.name!r} is replicated ({spec.placement}) but right after construction ranks {bad} "
                f"hold other values than rank 0 (max abs difference {diff:.3g}), although every rank was seeded "
                f"alike (torch.manual_seed({ctx.case.seed})) before the build: its initialisation depends on the rank "
                "(a rank-dependent seed or RNG state); draw it from the same RNG state on every rank or broadcast it "
                "from one rank after construction",
                {"ranks": bad, "max_abs": diff, "param": spec.name, "tensor": f"{spec.name} at construction"},
            ), bad[0])
    return None


def _replica(ctx: _Ctx) -> Failure | None:
    at_construction = _replica_at_construction(ctx)
    if at_construction is not None:
        return at_construction
    v = ctx.variant
    items: list[tuple[str, list[Any]]] = []
    if v.output in ("gathered", "reduced"):
        items.append(("the output", [x.get("output") for x in ctx.values]))
    if v.input == "replicated" and v.input_grad == "complete":
        items.append(("the input grad", [x.get("input_grad") for x in ctx.values]))
    for spec in v.params or ():
        if isinstance(spec.placement, Replicate) and (spec.master == "weight" or ctx.case.bias):
            items.append((f"the {spec.name} grad", [x["grads"].get(spec.master) for x in ctx.values]))
            items.append((f"{spec.name} after {TRAIN_STEPS} SGD steps", [x["final"].get(spec.master) for x in ctx.values]))
    for what, tensors in items:
        if any(t is None for t in tensors) or len({tuple(t.shape) for t in tensors}) > 1:
            continue  # missing or mis-shaped tensors are the equivalence properties' findings
        bad = [r for r in range(1, len(tensors)) if not torch.equal(tensors[r], tensors[0])]
        if bad:
            diff = max(float((tensors[r].to(_F64) - tensors[0].to(_F64)).abs().max()) for r in bad)
            return ctx.fail(REPLICA, Diagnosis(
                "replica-divergence",
                f"{what} must be identical on every rank, but ranks {bad} differ from rank 0 (max abs difference {diff:.3g})",
                {"ranks": bad, "max_abs": diff, "tensor": what},
            ), bad[0])
    return None


def _training(ctx: _Ctx) -> Failure | None:
    ref = ctx.ref
    k = ref.rows + ctx.case.in_features + ctx.case.out_features
    for spec in ctx.variant.params or ():
        if spec.master == "bias" and not ctx.case.bias:
            continue
        finals = [_f64(v["final"].get(spec.master)) for v in ctx.values]
        want = ref.final[spec.master]
        tol = ctx.tol(ref.mag["final_" + spec.master], k)
        what = f"{spec.name} after {TRAIN_STEPS} SGD steps (lr {LR})"
        if any(f is None for f in finals):
            return ctx.fail(TRAINING, Diagnosis("shape-error", f"{what}: the parameter disappeared on some rank"))
        if isinstance(spec.placement, Shard):
            try:
                from tpsim.placement import assemble

                got = assemble(finals, spec.placement)  # type: ignore[arg-type]
            except (RuntimeError, InvalidArgument) as err:
                return ctx.fail(TRAINING, Diagnosis("shape-error", f"{what}: cannot re-assemble the shards: {err}"))
            if not close(got, want, tol):
                d = _precision_or_mismatch(ctx, got, want, ref.mag["final_" + spec.master], k, f"{what} (re-assembled)")
                return ctx.fail(TRAINING, d)
        else:
            for r, got in enumerate(finals):
                if not close(got, want, tol):
                    d = _precision_or_mismatch(ctx, got, want, ref.mag["final_" + spec.master], k, f"{what} on rank {r}")
                    return ctx.fail(TRAINING, d, r)
    return None


# --- whole-run outcomes --------------------------------------------------------------------------

_PHASE_RE = re.compile(r"the variant raised during (\w+)(?: \(step (\d+)\))?: (.*)")


def _exception_failure(variant: Variant, obs: Observation) -> Failure:
    errors = obs.rank_errors()
    primary = {r: e for r, e in errors.items() if not isinstance(e, CollectiveError)}
    pool = primary or errors
    rank = min(pool)
    err = pool[rank]
    phase, step, summary, tb = "forward", 0, str(err).splitlines()[0] if str(err) else type(err).__name__, ""
    if isinstance(err, VariantRaised):
        phase, step, summary, tb = err.phase, err.step, err.summary, err.traceback_text
    else:
        text = str(err)
        m = _PHASE_RE.search(text)
        if m:
            phase, step, summary = m.group(1), int(m.group(2) or 0), m.group(3)
        tb = getattr(err, "remote_traceback", "") or text
    if isinstance(err, CollectiveError) and not primary:
        summary = f"{err.collective or 'a collective'} #{err.call_index} could not complete: {str(err).splitlines()[0]}"
    prop = {"build": FORWARD, "forward": FORWARD, "backward": INPUT_GRAD}.get(phase, FORWARD)
    if step > 0:
        prop = TRAINING
    where = phase if phase == "build" else f"{phase} (step {step})"
    others = sorted(r for r in primary if r != rank)
    also = f" (ranks {others} raised too)" if others else ""
    message = f"rank {rank} raised during {where}: {summary}{also}"
    return Failure(prop, "exception", message, case=obs.case, rank=rank, traceback=tb.rstrip() or None,
                   details={"phase": phase, "step": step, "ranks": sorted(primary)}, variant=variant.name)


def _layout_failure(variant: Variant, obs: Observation) -> Failure | None:
    """A parameter with the wrong stored shape (raised by the loader as :class:`LayoutError`)."""
    layout = {r: e for r, e in obs.rank_errors().items() if isinstance(e, LayoutError)}
    if not layout:
        return None
    r = min(layout)
    err = layout[r]
    shape, expected = err.shape, tuple(err.expected)
    diag = "shape-error"
    if shape is not None:
        spec = next((s for s in variant.params or () if s.name == err.param), None)
        if spec is not None and _is_other_dim_shard(spec, tuple(shape), obs.case):
            diag = "wrong-shard-dim"
    msg = str(err)
    if diag == "wrong-shard-dim":
        msg += " — that is the shape of the master sharded along the other dim: the weight was split along the wrong dim"
    return Failure(FORWARD, diag, msg, case=obs.case, rank=r, variant=variant.name,
                   details={"param": err.param, "shape": None if shape is None else list(shape),
                            "expected_shape": list(expected), "ranks": sorted(layout)})


def _is_other_dim_shard(spec: Any, shape: tuple[int, ...], case: Case) -> bool:
    """``shape`` is a piece of the master cut along the *other* dim (as stored, either orientation).

    Pieces of ``torch.chunk``/``tensor_split`` count too (ceil or floor of ``size / ws``), as long
    as the other dim really was cut (a piece smaller than the master).
    """
    master = (case.out_features, case.in_features) if spec.master == "weight" else (case.out_features,)
    ws = case.tp_size or case.world_size
    if not isinstance(spec.placement, Shard) or len(master) != 2 or ws == 1:
        return False
    dim = spec.placement.dim % 2
    other = 1 - dim
    forms = set()
    for piece in {master[other] // ws, -(-master[other] // ws)}:
        if 0 < piece < master[other]:
            cand = list(master)
            cand[other] = piece
            forms |= {tuple(cand), tuple(reversed(cand))}
    return tuple(shape) in forms


def _names_the_size(err: BaseException, sizes: Sequence[int]) -> bool:
    """A clear refusal mentions divisibility or one of the offending sizes (as a whole number)."""
    text = str(err)
    if isinstance(err, VariantRaised):
        text = err.summary
    if "divisib" in text.lower() or "multiple" in text.lower():
        return True
    return any(re.search(rf"(?<![\d.]){n}(?![\d.])", text) for n in sizes)


def _divisibility(variant: Variant, obs: Observation) -> Failure | None:
    case, ws = obs.case, obs.case.world_size
    tp = case.tp_size or ws
    # Sharded feature dims, packed parts and the sequence length (see tpsim.props.world).
    offending = non_divisible_sizes(variant, case)
    size_name = "world_size" if tp == ws else "tp_size"
    what = ", ".join(f"{n}={v}" for n, v in offending.items()) + f" is not divisible by {size_name}={tp}"
    if obs.error is not None:
        errors = obs.rank_errors()
        raised = sorted(r for r, e in errors.items() if not isinstance(e, CollectiveError))
        stuck = sorted(r for r, e in errors.items() if isinstance(e, CollectiveError))
        if len(raised) == ws:
            unclear = [r for r in raised if not _names_the_size(errors[r], list(offending.values()))]
            if not unclear:
                return None
            r = unclear[0]
            err = errors[r]
            summary = err.summary if isinstance(err, VariantRaised) else f"{type(err).__name__}: {err}"
            return Failure(
                DIVISIBILITY, "divisibility-unchecked",
                f"{what}; every rank raised, but rank {r}'s error does not say why (it names neither the sizes "
                f"nor divisibility): {summary.splitlines()[0] if summary else type(err).__name__}; check the sizes "
                "at construction and raise a ValueError naming them",
                case=case, rank=r, variant=variant.name,
                traceback=getattr(err, "traceback_text", None), details={"raised": raised, "unclear": unclear},
            )
        if raised:
            detail = f"ranks {raised} raised but ranks {stuck or sorted(set(range(ws)) - set(raised))} did not"
            if stuck:
                detail += " (they failed waiting in a collective instead)"
        else:
            detail = f"no rank raised a clear error; the ranks failed in a collective: {str(obs.error).splitlines()[0]}"
        return Failure(DIVISIBILITY, "divisibility-unchecked",
                       f"{what}, and the layer did not refuse it on every rank: {detail}",
                       case=case, variant=variant.name, details={"raised": raised, "collective": stuck})
    values = obs.values or []
    accepted = [r for r, v in enumerate(values) if v["status"] == "accepted"]
    r0 = accepted[0]
    shape = values[r0].get("output_shape")
    return Failure(
        DIVISIBILITY,
        "divisibility-unchecked",
        f"{what}, yet every rank built the layer and its forward returned an output (rank {r0}: shape "
        f"{list(shape) if shape is not None else shape}) without an error: the sizes were silently truncated or "
        "padded; raise a ValueError naming the sizes at construction",
        case=case,
        rank=r0,
        variant=variant.name,
        details={"accepted": accepted},
    )


def evaluate(variant: Variant, obs: Observation, properties: Sequence[str] | None = None) -> list[Failure]:
    """Evaluate ``properties`` (default: all) on one observation; return the failures, in order."""
    wanted = tuple(properties or PROPERTIES)
    unknown = [p for p in wanted if p not in PROPERTIES]
    if unknown:
        raise InvalidArgument(f"unknown properties {unknown}; expected some of {list(PROPERTIES)}")
    if not obs.divisible:
        if DIVISIBILITY not in wanted:
            return []
        f = _divisibility(variant, obs)
        return [f] if f else []
    if obs.error is not None:
        return [_layout_failure(variant, obs) or _exception_failure(variant, obs)]
    if (obs.case.tp_size or obs.case.world_size) != obs.case.world_size:
        return _evaluate_groups(variant, obs, wanted)
    return _evaluate_values(variant, obs.case, obs.values or [], obs.masters, wanted)


def _evaluate_values(variant: Variant, case: Case, values: list[dict[str, Any]], masters: Any,
                     wanted: Sequence[str]) -> list[Failure]:
    """The per-case properties on the values of one tp group (its ranks in tp-rank order)."""
    obs = Observation(case, True, values=values, masters=masters)
    ctx = _Ctx(variant, obs.case, values, reference(obs.case, obs.masters))
    if any(v["status"] == "output-shape" for v in values):
        f = _forward(ctx)
        return [f] if f else [Failure(FORWARD, "shape-error", "the output shape does not match the upstream grad", case=obs.case, variant=variant.name)]
    evaluators: list[tuple[str, Callable[[], Failure | None]]] = [
        (FORWARD, lambda: _forward(ctx)),
        (INPUT_GRAD, lambda: _input_grad(ctx)),
        (WEIGHT_GRAD, lambda: _param_grad(ctx, "weight", WEIGHT_GRAD)),
        (BIAS_GRAD, lambda: _param_grad(ctx, "bias", BIAS_GRAD)),
        (REPLICA, lambda: _replica(ctx)),
    ]
    failures = [f for name, fn in evaluators if name in wanted and (f := fn()) is not None]
    if TRAINING in wanted and not failures:
        f = _training(ctx)
        if f is not None:
            failures.append(f)
    return failures


# --- tp subgroups ----------------------------------------------------------------------------------


def _evaluate_groups(variant: Variant, obs: Observation, wanted: Sequence[str]) -> list[Failure]:
    """Every tp group's result checked on its own data; the first group that fails is reported
    (ranks and group named), with ``wrong-group`` when the numbers show a collective over another set
    of ranks."""
    case, values = obs.case, obs.values or []
    groups = tp_groups(case.world_size, case.tp_size, case.tp_layout)
    for g, ranks in enumerate(groups):
        failures = _evaluate_values(variant, case, [values[r] for r in ranks], obs.masters.for_group(g), wanted)
        if not failures:
            continue
        wrong = _wrong_group(variant, obs, groups)
        out = []
        for f in failures:
            if f.property in wrong:
                prop_diag = wrong.pop(f.property)
                f = Failure(f.property, "wrong-group", prop_diag["message"], case=case, rank=0, variant=variant.name,
                            details={"used": prop_diag["used"], "used_ranks": prop_diag["ranks"], "groups": groups})
                out.append(f)
                continue
            if f.rank is not None:
                f.details = dict(f.details, tp_rank=f.rank)
                f.rank = ranks[f.rank]
            f.details = dict(f.details, group=g, group_ranks=list(ranks))
            f.message = f"in tp group {g} (global ranks {list(ranks)}; rank numbers below are tp ranks): {f.message}"
            out.append(f)
        return out
    return []


def _wrong_group(variant: Variant, obs: Observation, groups: list[list[int]]) -> dict[str, dict[str, Any]]:
    """Per property, a recognised collective over the wrong set of ranks (see :mod:`tpsim.props.groups`)."""
    case, values, m = obs.case, obs.values or [], obs.masters
    ws, tp = case.world_size, case.tp_size
    f64 = torch.float64
    w = m.weight.to(f64)
    b = None if m.bias is None else m.bias.to(f64)
    per = [m.for_group(g) for g in range(len(groups))]
    xs = [p.inputs[0].to(f64) for p in per]
    gs = [p.grads[0].to(f64) for p in per]

    def tol_for(mag: torch.Tensor, k: int) -> Callable[[int], torch.Tensor]:
        return lambda n: tolerance(case.torch_dtype, mag, reduction_length=k, world_size=n)

    found: dict[str, dict[str, Any]] = {}
    outs = [_f64(v.get("output")) for v in values]
    common = dict(world_size=ws, tp_size=tp, layout=case.tp_layout)
    if variant.kind == "row" and variant.output == "reduced":
        mag = torch.stack([x.abs() @ w.abs().t() for x in xs]).sum(0) + (0.0 if b is None else b.abs())
        hit = wrong_group("the output", outs, group_row_summands(xs, w, groups, ws), offset=b,
                          tol_for=tol_for(mag, case.in_features), **common)
        if hit:
            found[FORWARD] = hit
    if variant.kind == "column" and variant.output == "gathered":
        ys = [x @ w.t() + (0.0 if b is None else b) for x in xs]
        mag = torch.stack([x.abs() @ w.abs().t() for x in xs]).sum(0) + (0.0 if b is None else b.abs())
        hit = wrong_group("the output", outs, column_output_shards(ys, groups, ws), gather_dim=-1,
                          tol_for=lambda n: tolerance(case.torch_dtype, mag, reduction_length=case.in_features,
                                                      world_size=n).max(), **common)
        if hit:
            found[FORWARD] = hit
    if variant.kind == "column" and variant.input == "replicated" and variant.input_grad == "complete":
        grads = [_f64(v.get("input_grad")) for v in values]
        mag = torch.stack([g.abs() @ w.abs() for g in gs]).sum(0)
        hit = wrong_group("the input grad", grads, column_grad_summands(gs, w, groups, ws),
                          tol_for=tol_for(mag, case.out_features), **common)
        if hit:
            found[INPUT_GRAD] = hit
    return found


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
    obs = observe(variant, case, backend=backend, timeout=timeout)
    _CACHE[key] = (variant, obs)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return obs


def check_case(
    variant: Variant,
    case: Case,
    *,
    backend: str = "inproc",
    timeout: float = 10.0,
    properties: Sequence[str] | None = None,
) -> list[Failure]:
    """Run ``case`` once and evaluate every property (or ``properties``); return the failures.

    A failing case with a non-contiguous ``input_layout`` is run again as its contiguous twin (same
    values, contiguous tensors); a failure the twin does not show says that it appears only for
    non-contiguous layouts."""
    obs = observe(variant, case, backend=backend, timeout=timeout)
    failures = evaluate(variant, obs, properties)
    if failures and case.input_layout != "contiguous":
        twin = evaluate(variant, observe(variant, case, backend=backend, timeout=timeout, layout="contiguous"), properties)
        seen = {f.property for f in twin}
        for f in failures:
            if f.property not in seen:
                f.message += (
                    f" — the bug appears only for non-contiguous layouts: the contiguous twin of this case (same "
                    f"values, input_layout=contiguous instead of {case.input_layout}) passes"
                )
                f.details = dict(f.details, contiguous_twin="passes")
    return failures


def _one(prop: str) -> Callable[..., None]:
    def check(variant: Variant, case: Case, *, backend: str = "inproc", timeout: float = 10.0) -> None:
        obs = _observation(variant, case, backend, timeout)
        if prop == DIVISIBILITY and obs.divisible:
            raise InvalidArgument(
                f"divisibility needs a case whose sharded sizes do not divide by world_size={case.world_size}; "
                f"got {case.describe()}"
            )
        for failure in evaluate(variant, obs, (prop,)):
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
training_equivalence.__doc__ = f"After {TRAIN_STEPS} SGD steps the re-assembled parameters match dense training."
divisibility = _one(DIVISIBILITY)
divisibility.__doc__ = "A non-divisible case raises on every rank (no hang, no silent truncation)."
