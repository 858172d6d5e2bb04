"""The properties of a linear layer: claims checked on one case (each a named function usable from
pytest, in :mod:`tpsim.props.linear`, exported by :mod:`tpsim.props`), and their recognisers.

Per-case properties (all fed by one world run, :meth:`tpsim.props.linear.LinearFamily.observe`):

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
- :func:`training_equivalence` — after ``TRAIN_STEPS`` SGD steps (a partial grad summed over the
  tp group first, as the trainer does) the re-assembled parameters equal dense training: it catches
  state bugs such as a cached weight copy that stops following the parameter;
- :func:`divisibility` — for a case whose sharded sizes do not divide by the tp size: every rank
  raises an exception (while building the layer or in its first forward), or the layer shards the
  sizes unevenly by design (every parameter holds its ``torch.tensor_split`` piece, or every one its
  ``torch.chunk`` piece) and every other
  property holds on those pieces. A truncated or padded shard, a wrong result, a failure after the
  first forward and a rank left failing in a collective are findings (``divisibility-unchecked``).
  A forward-only variant's refusal by ``assert`` on every rank counts too (``python -O`` strips it).

Each function raises :class:`PropertyFailed` (an ``AssertionError``, so pytest reports it as a
test failure) carrying the :class:`~tpsim.diagnosis.Failure`. :func:`~tpsim.props.linear.check_case` evaluates them
all from one run and returns the causes: a failure that follows from another (the registry's
consequence rules) is listed in that one's ``consequences``.

Diagnoses are given by recognisers (functions marked ``@recogniser(NAME)``), each on the evidence
its registry entry states (:mod:`tpsim.diagnosis`), with the tolerance of the computation it
describes; the fallback is ``mismatch``, quoting the element that violates its bound most, with
hints (never names) for what it resembles. A replicated parameter's grad declared ``partial`` (or
marked ``sequence_parallel``) is checked as the trainer sees it: the rank-order sum of the ranks'
grads equals the dense grad, and the replicas agree after that sum.
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
    GRAD_MISSING,
    GRAD_NOT_REDUCED,
    GRAD_SCALED,
    KV_HEADS_NOT_REPLICATED,
    MISSING_REDUCTION,
    OUTPUT_DETACHED,
    PACKED_SHARD_LAYOUT,
    PRECISION_LOSS,
    SHAPE_ERROR,
    WRONG_DTYPE,
    WRONG_SHARD_DIM,
    WRONG_SHARD_ORDER,
    Diagnosis,
    Failure,
    mismatch,
    recogniser,
)
from tpsim.errors import InvalidArgument
from tpsim.patterns import bias_multiple, block_mapping, close, rank_summands, regathered_dim, scale_factor
from tpsim.placement import (
    Replicate,
    Shard,
    assemble,
    part_sizes,
    replicated_parts,
    shard_tensor,
    uneven_pieces,
)
from tpsim.props.case import Case
from tpsim.props.groups import column_grad_summands, column_output_shards
from tpsim.props.groups import row_summands as group_row_summands
from tpsim.props.groups import wrong_group as recognise_wrong_group
from tpsim.props.judging import Check, GroupContext, Replicated, replica_consistency
from tpsim.props.observation import DETACHED, Observation
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
from tpsim.props.tolerance import tolerance
from tpsim.props.world import (
    ACCEPTED,
    LR,
    TRAIN_STEPS,
    RankResult,
    Reference,
    expanded_out_features,
    expanded_view,
    non_divisible_sizes,
    reference,
    replica_trained,
)
from tpsim.variant import LayoutError, Variant

__all__ = [
    "LINEAR_CHECKS",
    "PROPERTIES",
    "LinearContext",
    "PropertyFailed",
    "accepted",
    "layout_failure",
    "offending",
    "wrong_group",
]



class PropertyFailed(AssertionError):
    """A property does not hold on a case; ``failure`` has the diagnosis and the case."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.property} failed ({failure.diagnosis}): {failure.message}")
        self.failure = failure


# --- helpers -------------------------------------------------------------------------------------

_F64 = torch.float64


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(_F64)


class LinearContext(GroupContext):
    """One tp group of a linear case: the float64 dense reference of its data (``ref``), and with
    replicated key/value heads the declared (head-packed) variant and the case as drawn (``heads``),
    while ``variant``/``case`` are the replica-expanded view the checks compare with
    (:func:`tpsim.props.world.expanded_view`)."""

    def __init__(self, variant: Variant, obs: Observation, g: int, ranks: Sequence[int], values: list[RankResult]):
        super().__init__(variant, obs, g, ranks, values)
        declared = (variant, obs.case)
        drawn = obs.data.for_group(g)
        self.variant, self.case, masters = expanded_view(variant, obs.case, drawn)
        self.ref: Reference = reference(self.case, masters)
        self.ws = self.tp
        self.heads: tuple[Variant, Case] | None = None
        if self.variant is not variant:
            self.heads = declared
            # The grad rule of the replicated heads (ParamSpec.grad): "partial", each replica's own share (the
            # expanded twin's); "complete", the head's whole grad on every replica. Either way every replica
            # trains like the master's head (the trainer sums partial shares: sum_kv_replicas).
            complete, mag = replica_trained(variant, obs.case, drawn, masters)
            for spec in variant.params or ():
                name = "d" + spec.master
                if spec.grad == "complete" and name in complete:
                    setattr(self.ref, name, complete[name])
                    self.ref.mag[name] = mag[name]
            self.ref.final.update({k: complete[f"final_{k}"] for k in self.ref.final})
            self.ref.mag.update({k: v for k, v in mag.items() if k.startswith("final_")})

    def rank0_only(self, spec: Any) -> bool:
        """Whether ``spec``'s parameter is held by tp rank 0 only in this run (declared or detected:
        the other ranks' layers have no tensor there; see :attr:`tpsim.variant.ParamSpec.held_by`)."""
        return self.ws > 1 and any(spec.master in getattr(v, "absent", ()) for v in self.values)

    def holders_failure(self, spec: Any, prop: str) -> Failure | None:
        """A ``shape-error`` when some but not all of the ranks after rank 0 hold ``spec``'s parameter."""
        absent = [r for r, v in enumerate(self.values) if spec.master in getattr(v, "absent", ())]
        if not absent or len(absent) == self.ws - 1:
            return None
        held = [r for r in range(self.ws) if r not in absent]
        return self.fail(prop, Diagnosis(
            SHAPE_ERROR,
            f"parameter {spec.name!r} is held by tp ranks {held} but not by {absent}: a replicated parameter lives "
            "on every rank, or on tp rank 0 only (nanotron's row bias)",
            {"param": spec.name},
        ), absent[0])

    def fail(self, prop: str, diag: Diagnosis, rank: int | None = None, sublayer: str | None = None,
             **details: Any) -> Failure:
        failure = super().fail(prop, diag, rank, sublayer, **details)
        failure.case = self.heads[1] if self.heads is not None else self.case  # as drawn, never its expanded view
        return failure

    def replicated(self) -> list[Replicated]:
        v = self.variant
        items = [Replicated(f"parameter {spec.name!r} ({spec.placement}) right after construction",
                            [x.init.get(spec.name) for x in self.values], spec.name,
                            f", although every rank was seeded alike (torch.manual_seed({self.case.seed})) before the "
                            "build: its initialisation depends on the rank (a rank-dependent seed or RNG state); draw "
                            "it from the same RNG state on every rank or broadcast it from one rank after construction")
                 for spec in v.params or ()]
        if v.output in ("gathered", "reduced"):
            items.append(Replicated("the output", [x.output for x in self.values]))
        if v.input == "replicated" and v.input_grad == "complete":
            items.append(Replicated("the input grad", [x.input_grad for x in self.values]))
        for spec in v.params or ():
            if self.rank0_only(spec):
                continue  # one holder: no replicas to agree
            if isinstance(spec.placement, Replicate) and (spec.master == "weight" or self.case.bias):
                if any(spec.master in x.partial for x in self.values):
                    # Partial by design: the replicas must agree after the trainer's sum.
                    items.append(Replicated(f"the {spec.name} grad after the trainer's sum",
                                            [x.summed_grads.get(spec.master) for x in self.values]))
                else:
                    items.append(Replicated(f"the {spec.name} grad", [x.grads.get(spec.master) for x in self.values]))
                items.append(Replicated(f"{spec.name} after {TRAIN_STEPS} SGD steps",
                                        [x.final.get(spec.master) for x in self.values]))
        return items


@dataclass
class _Compared:
    """One failing comparison, as the recognisers see it: the actual and expected float64 tensors
    (same shape), the bound, the magnitudes it came from and the reduction length, and — where the
    expected tensor is a sum over the tp group's ranks — each rank's expected summand and what is
    added after the sum (a bias), so precision-loss can recompute the sum in a narrower dtype."""

    what: str
    actual: torch.Tensor
    expected: torch.Tensor
    tol: torch.Tensor
    mag: torch.Tensor
    k: int
    summands: list[torch.Tensor] | None = None
    offset: torch.Tensor | None = None


#: Dtypes with fewer mantissa bits than each case dtype, widest first: what a narrower computation
#: can have used (bfloat16 keeps float32's range, so it also counts below float16).
_NARROWER = {
    torch.float64: (torch.float32, torch.float16, torch.bfloat16),
    torch.float32: (torch.float16, torch.bfloat16),
    torch.float16: (torch.bfloat16,),
    torch.bfloat16: (),
}

#: How much better the narrower recomputation must explain a result than the dense reference does
#: (ratio of the RMS residuals): a missing bias or any other structural error is as far from the
#: narrower recomputation as from the dense result, rounding in the narrower dtype is not.
_EXPLAINS_FAR_BETTER = 0.25


def _rounded(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype).to(_F64)


def _reduced_in(summands: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """The rank-order sum of ``summands`` with every summand and partial sum rounded to ``dtype``,
    as a reduction communicated in ``dtype`` computes it."""
    total = _rounded(summands[0], dtype)
    for s in summands[1:]:
        total = _rounded(total + _rounded(s, dtype), dtype)
    return total


def _rms(t: torch.Tensor) -> float:
    return float(t.pow(2).mean().sqrt()) if t.numel() else 0.0


@recogniser(PRECISION_LOSS)
def _precision_loss(ctx: LinearContext, c: _Compared) -> Diagnosis | None:
    """``precision-loss`` on its evidence (see the registry): an emulation of the computation in a
    narrower dtype — the result rounded to it, or the ranks' summands reduced in it — is within that
    dtype's tolerance and leaves at most a quarter of the residual the dense reference leaves."""
    residual = _rms(c.actual - c.expected)
    if residual == 0.0 or not torch.isfinite(c.actual).all():
        return None
    best: tuple[float, str, torch.dtype] | None = None
    for narrow in _NARROWER.get(ctx.dtype, ()):
        emulations = [("the result rounded to {}", _rounded(c.expected, narrow))]
        if c.summands is not None and len(c.summands) > 1:
            offset = c.offset if c.offset is not None else 0.0
            emulations.append(("the ranks' summands reduced in {}", _reduced_in(c.summands, narrow) + offset))
        tol = ctx.tol(c.mag, c.k, narrow)
        for how, emulated in emulations:
            left = _rms(c.actual - emulated)
            if left <= _EXPLAINS_FAR_BETTER * residual and close(c.actual, emulated, tol):
                if best is None or left < best[0]:
                    best = (left, how, narrow)
    if best is None:
        return None
    left, how, narrow = best
    name = str(narrow).replace("torch.", "")
    base = mismatch(c.actual, c.expected, what=c.what, tol=c.tol)
    return Diagnosis(
        PRECISION_LOSS,
        f"{c.what} is not within {ctx.case.dtype} rounding of the dense reference, but recomputing it in {name} "
        f"({how.format(name)}) explains it: RMS residual {left:.3g} against {residual:.3g} for the dense "
        f"reference; part of the computation or communication runs in {name} "
        f"({base.message.split(': ', 1)[1]})",
        dict(base.details, narrower=name, emulation=how.format(name), residual=residual, emulated_residual=left),
    )


def _unexplained(ctx: LinearContext, c: _Compared, hint: str = "") -> Diagnosis:
    """``precision-loss`` when its evidence is there, else ``mismatch`` quoting the worst violation,
    with ``hint`` and, when the error is within a narrower dtype's rounding but recomputing in it does
    not explain it, that fact as a hint (never as a name)."""
    found = _precision_loss(ctx, c)
    if found is not None:
        return found
    hints = [hint] if hint else []
    for narrow in _NARROWER.get(ctx.dtype, ()):
        if close(c.actual, c.expected, ctx.tol(c.mag, c.k, narrow)):
            name = str(narrow).replace("torch.", "")
            hints.append(f"the error is within {name} rounding, but recomputing in {name} does not explain it: "
                         "not a precision loss")
            break
    return mismatch(c.actual, c.expected, what=c.what, tol=c.tol, hint="; ".join(hints))


@recogniser(WRONG_DTYPE)
def _wrong_dtype(ctx: LinearContext, tensors: Sequence[torch.Tensor | None], what: str) -> tuple[int, Diagnosis] | None:
    """``wrong-dtype``: the first rank whose tensor has another floating dtype than the case's."""
    for r, t in enumerate(tensors):
        if t is not None and t.is_floating_point() and t.dtype != ctx.dtype:
            got = str(t.dtype).replace("torch.", "")
            return r, Diagnosis(
                WRONG_DTYPE,
                f"{what} on rank {r} is {got}, but the case is {ctx.case.dtype}: part of the layer computes or "
                f"communicates in {got} and never casts back to the input's dtype",
                {"dtype": got, "expected_dtype": ctx.case.dtype},
            )
    return None


@recogniser(SHAPE_ERROR, WRONG_SHARD_DIM)
def _shape_diagnosis(ctx: LinearContext, actual: torch.Tensor, expected: torch.Tensor, full: torch.Tensor,
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
                        WRONG_SHARD_DIM,
                        f"{what} on rank {rank} has shape {list(actual.shape)} (expected {list(expected.shape)}): "
                        f"it is the dense result sharded along dim {d} instead of dim {shard_dim}",
                        {"shape": list(actual.shape), "expected_shape": list(expected.shape), "dim": d},
                    )
        else:
            d = regathered_dim(actual, full, dim=-1, parts=ctx.ws, tol_scalar=tol_scalar)
            if d is not None:
                return Diagnosis(
                    WRONG_SHARD_DIM,
                    f"{what} on rank {rank} has shape {list(actual.shape)} (expected {list(expected.shape)}): its values "
                    f"are the {ctx.ws} shards concatenated along dim {d} instead of the last (feature) dim",
                    {"shape": list(actual.shape), "expected_shape": list(expected.shape), "dim": d},
                )
    return Diagnosis(
        SHAPE_ERROR,
        f"{what} on rank {rank} has shape {list(actual.shape)}, expected {list(expected.shape)}",
        {"shape": list(actual.shape), "expected_shape": list(expected.shape)},
    )


def _blocks_msg(mapping: list[int]) -> str:
    wrong = [f"block {i} holds shard {j}" for i, j in enumerate(mapping) if i != j]
    return ", ".join(wrong[:6]) + (" ..." if len(wrong) > 6 else "")


# --- forward -------------------------------------------------------------------------------------


def _row_summands(ctx: LinearContext) -> list[torch.Tensor]:
    """Each rank's expected summand ``x_r W_rᵀ`` of a row layer (input features sharded)."""
    ref = ctx.ref
    return [
        shard_tensor(ref.x, Shard(-1), r, ctx.ws) @ shard_tensor(ref.weight, Shard(1), r, ctx.ws).t()
        for r in range(ctx.ws)
    ]


@recogniser(BIAS_DUPLICATION, BIAS_MISSING)
def _bias_multiple(ctx: LinearContext, c: _Compared) -> Diagnosis | None:
    """``bias-duplication`` (the result is the dense one plus (ws-1)*bias, ws >= 2) or ``bias-missing``
    (minus the bias, a non-zero one) — the registry's evidence for each, each checked with the
    tolerance of the computation it describes: its magnitudes include the extra ``|c| * |bias|`` terms
    that computation summed (a duplicated bias is rounded ws times)."""
    bias = ctx.ref.bias
    if bias is None or not bool(bias.ne(0).any()) or c.actual.shape[-1:] != bias.shape:
        return None
    ws = ctx.ws
    if any(getattr(v, "returned_bias", False) for v in ctx.values):
        # The forward returned a bias for the caller (skip_bias_add), and tpsim added it, as the caller does.
        tol = ctx.tol(c.mag + bias.abs(), c.k)
        if close(c.actual, c.expected + bias, tol):
            return Diagnosis(
                BIAS_DUPLICATION,
                f"{c.what} is off by exactly +1*bias: the layer adds the bias itself and also returns it for the "
                "caller to add (skip_bias_add), so the caller adds it a second time; under skip_bias_add leave it "
                "out of the output",
                {"factor": 1.0, "returned": True},
            )
    for factor, name in (((ws - 1), BIAS_DUPLICATION), (-1, BIAS_MISSING)):
        if factor == 0:
            continue
        tol = ctx.tol(c.mag + abs(factor) * bias.abs(), c.k)
        if close(c.actual, c.expected + factor * bias, tol):
            if name == BIAS_DUPLICATION:
                return Diagnosis(
                    BIAS_DUPLICATION,
                    f"{c.what} is off by exactly (world_size-1)*bias = {ws - 1}*bias (world_size={ws}): every rank "
                    "adds the full bias to its summand before the reduction; add it once, after the reduction",
                    {"factor": float(factor)},
                )
            return Diagnosis(BIAS_MISSING, f"{c.what} is off by exactly -bias: the bias is never added",
                             {"factor": -1.0})
    return None


def _other_bias_multiple(ctx: LinearContext, c: _Compared) -> str:
    """A hint (not a name): the error is another multiple of a bias of several entries (one number
    is a multiple of any other, so a one-entry bias says nothing)."""
    bias = ctx.ref.bias
    if bias is None or bias.numel() < 2:
        return ""
    m = bias_multiple(c.actual - c.expected, bias, c.tol)
    return "" if m is None else f"the error is {m:.4g}*bias (world_size={ctx.ws})"


@recogniser(MISSING_REDUCTION)
def _missing_reduction(ctx: LinearContext, c: _Compared, outs: list[torch.Tensor]) -> Diagnosis | None:
    """``missing-reduction``: a row layer's rank returned only its own summand (with or without the bias)."""
    v, ws = ctx.variant, ctx.ws
    if not (v.output == "reduced" and v.kind == "row" and ws > 1):
        return None
    summands = _row_summands(ctx)
    bias = ctx.ref.bias if ctx.ref.bias is not None else torch.zeros((), dtype=_F64)
    for r, out in enumerate(outs):
        if out.shape == c.expected.shape and (close(out, summands[r], c.tol) or close(out, summands[r] + bias, c.tol)):
            return Diagnosis(
                MISSING_REDUCTION,
                f"{c.what}: rank {r} returned only its own summand x_r W_r^T (the ranks' outputs differ and add up to "
                "the dense output): the all-reduce over the tp group is missing",
                {"rank": r},
            )
    return None


@recogniser(DOUBLE_REDUCTION)
def _double_reduction(ctx: LinearContext, c: _Compared) -> Diagnosis | None:
    """``double-reduction``: the output is ws x the dense ``x Wᵀ``, the bias added once or ws times."""
    ws = ctx.ws
    if ws < 2:
        return None
    bias = ctx.ref.bias
    forms = [(c.actual, c.expected)]
    if bias is not None:
        forms.append((c.actual - bias, c.expected - bias))
    for actual, expected in forms:
        f = scale_factor(actual, expected, c.tol, known=(ws,))
        if f is not None and abs(f - ws) < 1e-2:
            hint = " (the layer already reduces: declare output='reduced')" if ctx.variant.output == "partial" else ""
            return Diagnosis(DOUBLE_REDUCTION, f"{c.what} is {ws} x the dense output: it was reduced twice{hint}",
                             {"factor": f})
    return None


@recogniser(WRONG_SHARD_ORDER)
def _output_blocks(ctx: LinearContext, c: _Compared) -> Diagnosis | None:
    """``wrong-shard-order`` of a sharded or gathered output: its feature blocks permuted or repeated."""
    ws, mode, ref = ctx.ws, ctx.variant.output, ctx.ref
    if mode not in ("sharded", "gathered") or ws < 2 or c.actual.dim() == 0:
        return None
    mapping = block_mapping(c.actual, c.expected, c.tol, dim=-1, parts=ws)
    if mapping is None and ref.bias is not None:
        # The harness loads the bias shards itself (in the right order): compare x Wᵀ alone.
        mapping = block_mapping(c.actual - ref.bias, c.expected - ref.bias, c.tol, dim=-1, parts=ws)
    if mapping is None or mapping == list(range(ws)):
        return None
    return Diagnosis(
        WRONG_SHARD_ORDER,
        f"{c.what} has its {ws} feature blocks out of place ({_blocks_msg(mapping)}): a rank holds another "
        "rank's shard of the weight",
        {"mapping": mapping},
    )


@recogniser(KV_HEADS_NOT_REPLICATED)
def _kv_heads_held(ctx: LinearContext, c: _Compared, outs: list[torch.Tensor]) -> Diagnosis | None:
    """``kv-heads-not-replicated`` of a head-packed Q/K/V column with fewer key/value heads than ranks:
    every rank's query columns are its own, its key and value columns are both those of one master
    key/value head (read off its output), and some rank's head is not ``r // replicas``."""
    if ctx.heads is None or ctx.ws < 2:
        return None
    declared, case = ctx.heads
    d, ws = declared.head_size or 1, ctx.ws
    placement = Shard(0, parts=declared.packed, head_size=d)
    parts = part_sizes(case.out_features, placement)
    if len(parts) != 3 or not replicated_parts(case.out_features, placement, ws)[1]:
        return None
    nkv, qn = parts[1] // d, parts[0] // ws
    replicas, width = ws // nkv, qn + 2 * d

    def cols(t: torch.Tensor, rank: int, lo: int, n: int) -> torch.Tensor:
        return t[..., rank * width + lo: rank * width + lo + n]

    held = []
    for r, o in enumerate(outs):
        if o is None or o.shape[-1] != width or o.shape[:-1] != c.expected.shape[:-1]:
            return None
        if not close(o[..., :qn], cols(c.expected, r, 0, qn), cols(c.tol, r, 0, qn)):
            return None  # its query heads are not its own: another mechanism
        match = [j for j in range(nkv) if close(o[..., qn:], cols(c.expected, j * replicas, qn, 2 * d),
                                                cols(c.tol, j * replicas, qn, 2 * d))]
        if not match:
            return None
        held.append(match[0])
    own = [r // replicas for r in range(ws)]
    wrong = [r for r in range(ws) if held[r] != own[r]]
    if not wrong:
        return None
    how = " (round robin: rank % num_kv_heads)" if held == [r % nkv for r in range(ws)] else ""
    pairs = ", ".join(f"rank {r} holds kv{held[r]} (not kv{own[r]})" for r in wrong)
    return Diagnosis(
        KV_HEADS_NOT_REPLICATED,
        f"{c.what}: with {nkv} key/value heads on {ws} ranks, {pairs}{how}: each head must be replicated on the "
        f"{replicas} ranks whose query heads use it (rank r holds head r // {replicas}, i.e. r * {nkv} // {ws}); "
        "every rank's query columns are its own, its K and V columns those of another head",
        {"held": held, "expected": own},
    )


def _diagnose_output(ctx: LinearContext, c: _Compared, outs: list[torch.Tensor]) -> Diagnosis:
    """The forward's recognisers in order (each on its own evidence), else the fallback."""
    found = (_bias_multiple(ctx, c) or _missing_reduction(ctx, c, outs) or _kv_heads_held(ctx, c, outs)
             or _packed_or_sequence_layout(ctx, outs, c.expected, c.tol, ctx.ref.bias, c.what)
             or _double_reduction(ctx, c) or _output_blocks(ctx, c))
    return found or _unexplained(ctx, c, hint=_other_bias_multiple(ctx, c))


def _contiguous_packed(ctx: LinearContext, pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, dim: int) -> bool:
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


def _packed_message(ctx: LinearContext, what: str) -> str:
    parts = ctx.variant.packed
    return (
        f"{what}: every rank holds a contiguous 1/{ctx.ws} slice of the packed dim instead of its shard of each of "
        f"the {len(parts or ())} packed parts (proportions {list(parts or ())}): the packed weight was split as one "
        "block, so a rank's 'gate' and 'up' (or Q, K, V) come from the wrong parts; shard each part on its own "
        "(Megatron's partition stride; vllm #3775)"
    )


def _other_dim_slices(ctx: LinearContext, pieces: list[torch.Tensor], full: torch.Tensor, tol: torch.Tensor, skip: int) -> int | None:
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


@recogniser(PACKED_SHARD_LAYOUT, WRONG_SHARD_DIM)
def _packed_or_sequence_layout(ctx: LinearContext, outs: list[torch.Tensor], y: torch.Tensor, tol: torch.Tensor,
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
                return Diagnosis(PACKED_SHARD_LAYOUT, _packed_message(ctx, what), {"parts": list(v.packed)})
    if v.output == "sequence-sharded":
        seq = v.sequence_dim_of(y.dim())
        d = _other_dim_slices(ctx, outs, y, tol, -1 if seq is None else seq)
        if d is not None:
            return Diagnosis(
                WRONG_SHARD_DIM,
                f"{what}: every rank holds its 1/{ws} slice of dim {d} of the reduced output instead of dim {seq} "
                f"(the sequence dim, sequence_dim={v.sequence_dim}): the reduce-scatter runs along the wrong dim "
                "(e.g. the batch dim; vllm #30610, ROCm/aiter #3395)",
                {"dim": d, "expected_dim": seq},
            )
    return None


@recogniser(OUTPUT_DETACHED)
def _output_detached(ctx: LinearContext) -> Failure | None:
    """``output-detached``: a rank's output has no autograd graph although its input requires grad."""
    detached = [r for r, v in enumerate(ctx.values) if v.status == DETACHED]
    if not detached:
        return None
    return ctx.fail(FORWARD, Diagnosis(
        OUTPUT_DETACHED,
        f"the output on rank {detached[0]} is detached from the autograd graph (grad_fn is None) although the "
        f"input requires grad{' (also on ranks ' + str(detached[1:]) + ')' if len(detached) > 1 else ''}: a "
        "collective or copy runs outside autograd (e.g. dist.all_gather into fresh buffers, or a result built "
        "under torch.no_grad()), so no gradient flows back through the layer; use an autograd-aware collective "
        "(torch.distributed.nn.functional, or a torch.autograd.Function with the conjugate backward)",
        {"ranks": detached},
    ), detached[0])


def _forward(ctx: LinearContext) -> Failure | None:
    ref = ctx.ref
    outs_raw = [v.output for v in ctx.values]
    for r, o in enumerate(outs_raw):
        if o is None:
            kind = ctx.values[r].output_type or "None"
            return ctx.fail(FORWARD, Diagnosis(SHAPE_ERROR, f"rank {r}'s forward returned {kind}, not a tensor"), r)
    dtype = _wrong_dtype(ctx, outs_raw, "the output")
    if dtype is not None:
        return ctx.fail(FORWARD, dtype[1], dtype[0])
    detached = _output_detached(ctx)
    if detached is not None:
        return detached
    outs = [o.to(_F64) for o in outs_raw]  # type: ignore[union-attr]
    y, ws, mode = ref.y, ctx.ws, ctx.variant.output
    mag = ref.mag["y"]
    k = ctx.case.in_features
    tol = ctx.tol(mag, k)
    tol_scalar = float(tol.max()) if tol.numel() else 0.0
    # A row layer's output is the sum of the ranks' summands plus the bias: precision-loss can
    # recompute that sum in a narrower dtype.
    summands = _row_summands(ctx) if ctx.variant.kind == "row" and ws > 1 else None

    def compared(actual: torch.Tensor, what: str) -> _Compared:
        return _Compared(what, actual, y, tol, mag, k, summands, ref.bias)

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
        return ctx.fail(FORWARD, _diagnose_output(ctx, compared(actual, "the output (rank shards assembled)"), outs))
    if mode == "partial":
        for r, o in enumerate(outs):
            if o.shape != y.shape:
                return ctx.fail(FORWARD, _shape_diagnosis(ctx, o, y, y, Replicate(), r, "the output", tol_scalar), r)
        actual = torch.stack(outs).sum(0)
        if close(actual, y, tol):
            return None
        return ctx.fail(FORWARD, _diagnose_output(ctx, compared(actual, "the output (summed over ranks)"), outs))
    for r, o in enumerate(outs):
        if o.shape != y.shape:
            return ctx.fail(FORWARD, _shape_diagnosis(ctx, o, y, y, Replicate(), r, "the output", tol_scalar), r)
    for r, o in enumerate(outs):
        if not close(o, y, tol):
            return ctx.fail(FORWARD, _diagnose_output(ctx, compared(o, f"the output on rank {r}"), outs), r)
    return None


# --- gradients -----------------------------------------------------------------------------------


@recogniser(GRAD_NOT_REDUCED)
def _grad_not_reduced(ctx: LinearContext, grads: Sequence[torch.Tensor], full: torch.Tensor, tol: torch.Tensor) -> bool:
    """``grad-not-reduced``'s evidence: the ranks' grads of a replicated tensor differ and their
    rank-order sum is the dense grad."""
    return ctx.ws > 1 and rank_summands(grads, full, tol)


@recogniser(GRAD_SCALED)
def _grad_scaled(ctx: LinearContext, actual: torch.Tensor, expected: torch.Tensor, tol: torch.Tensor, what: str) -> Diagnosis | None:
    """``grad-scaled``: a constant multiple of the dense grad (for one element only ws or 1/ws counts)."""
    ws = ctx.ws
    c = scale_factor(actual, expected, tol, known=(ws, 1 / ws))
    if c is None:
        return None
    hint = " (averaged instead of summed, or the value divided by world_size?)" if abs(c * ws - 1) < 1e-2 else ""
    hint = " (reduced twice?)" if abs(c - ws) < 1e-2 and ws > 1 else hint
    return Diagnosis(GRAD_SCALED, f"{what} is {c:.4g} x the dense grad{hint}", {"factor": c})


@recogniser(GRAD_MISSING)
def _grad_missing(grads: Sequence[torch.Tensor | None], what: str, attr: str) -> tuple[int, Diagnosis] | None:
    """``grad-missing``: the first rank where the tensor's ``.grad`` is None."""
    for r, g in enumerate(grads):
        if g is None:
            return r, Diagnosis(GRAD_MISSING, f"{what} received no gradient on rank {r} ({attr} is None)")
    return None


def _input_grad(ctx: LinearContext) -> Failure | None:
    ref = ctx.ref
    ws, dx = ctx.ws, ref.dx
    raw = [v.input_grad for v in ctx.values]
    missing = _grad_missing(raw, "the input", "x.grad")
    if missing is not None:
        return ctx.fail(INPUT_GRAD, missing[1], missing[0])
    dtype = _wrong_dtype(ctx, raw, "the input grad")
    if dtype is not None:
        return ctx.fail(INPUT_GRAD, dtype[1], dtype[0])
    grads: list[torch.Tensor] = [g.to(_F64) for g in raw]  # type: ignore[union-attr]
    mag = ref.mag["dx"]
    k = ctx.case.out_features
    tol = ctx.tol(mag, k)
    tol_scalar = float(tol.max()) if tol.numel() else 0.0
    sharded = ctx.variant.input in ("sharded", "sequence-sharded")
    in_place = ctx.variant.input_placement  # in_place, or Shard(sequence_dim) under sequence parallelism
    for r, g in enumerate(grads):
        exp = shard_tensor(dx, in_place, r, ws) if sharded else dx
        if g.shape != exp.shape:
            placement = in_place if sharded else Replicate()
            return ctx.fail(INPUT_GRAD, _shape_diagnosis(ctx, g, exp, dx, placement, r, "the input grad", tol_scalar), r)
    # A replicated input of a column layer: its grad is the sum over ranks of g_r W_r (each rank's
    # output features), which precision-loss can recompute in a narrower dtype.
    summands = None
    if not sharded and ctx.variant.kind == "column" and ws > 1:
        g0 = ref.g
        summands = [shard_tensor(g0, Shard(-1), r, ws) @ shard_tensor(ref.weight, Shard(0), r, ws) for r in range(ws)]
    if not sharded and ctx.variant.input_grad == "partial":
        total = torch.stack(grads).sum(0)
        if close(total, dx, tol):
            return None
        if ws > 1 and all(close(g, dx, tol) for g in grads):
            return ctx.fail(INPUT_GRAD, Diagnosis(
                GRAD_SCALED,
                f"the input grad summed over ranks is {ws} x the dense grad: every rank already holds the complete "
                "gradient; declare input_grad='complete'",
                {"factor": float(ws)},
            ))
        found = _grad_scaled(ctx, total, dx, tol, "the input grad summed over ranks")
        if found is not None:
            return ctx.fail(INPUT_GRAD, found)
        return ctx.fail(INPUT_GRAD, _unexplained(ctx, _Compared("the input grad summed over ranks", total, dx, tol, mag, k,
                                                                summands)))
    for r, g in enumerate(grads):
        exp = shard_tensor(dx, in_place, r, ws) if sharded else dx
        t = shard_tensor(tol, in_place, r, ws) if sharded else tol
        if close(g, exp, t):
            continue
        what = f"the input grad on rank {r}"
        if not sharded and _grad_not_reduced(ctx, grads, dx, tol):
            return ctx.fail(INPUT_GRAD, Diagnosis(
                GRAD_NOT_REDUCED,
                f"{what} is only its own summand (the ranks' input grads add up to the dense grad): the backward "
                "all-reduce of the replicated input's grad is missing (Megatron's copy_to_tensor_parallel_region); "
                "if the caller reduces it, declare input_grad='partial'",
            ), r)
        split = _sequence_grad_split(ctx, grads, in_place, mag, k)
        if split is not None:
            return ctx.fail(INPUT_GRAD, split, r)
        found = _grad_scaled(ctx, g, exp, t, what)
        if found is not None:
            return ctx.fail(INPUT_GRAD, found, r)
        if ctx.variant.input == "sequence-sharded" and ws > 1:
            seq = ctx.variant.sequence_dim_of(dx.dim())
            d = _other_dim_slices(ctx, grads, dx, tol, -1 if seq is None else seq)
            if d is not None:
                return ctx.fail(INPUT_GRAD, Diagnosis(
                    WRONG_SHARD_DIM,
                    f"the input grad: every rank holds its 1/{ws} slice of dim {d} of the dense grad instead of dim "
                    f"{seq} (the sequence dim): the backward reduce-scatter runs along the wrong dim",
                    {"dim": d, "expected_dim": seq},
                ), r)
        if sharded and ws > 1:
            for j in range(ws):
                if j != r and close(g, shard_tensor(dx, in_place, j, ws), t):
                    return ctx.fail(INPUT_GRAD, Diagnosis(
                        WRONG_SHARD_ORDER, f"{what} is the slice of rank {j}: a rank holds another rank's shard",
                        {"holds": j}), r)
        m = shard_tensor(mag, in_place, r, ws) if sharded else mag
        return ctx.fail(INPUT_GRAD, _unexplained(ctx, _Compared(what, g, exp, t, m, k, None if sharded else summands)), r)
    return None


@recogniser(GRAD_NOT_REDUCED)
def _sequence_grad_split(ctx: LinearContext, grads: Sequence[torch.Tensor], in_place: Any, mag: torch.Tensor,
                         k: int) -> Diagnosis | None:
    """``grad-not-reduced`` of a column layer's sequence-sharded input: every rank's input grad is its
    sequence slice of its own summand ``g_r W_r`` (rank r's output features), not of their sum: the
    backward of the forward all-gather splits the grad instead of reduce-scattering it."""
    v, ws, ref = ctx.variant, ctx.ws, ctx.ref
    weight = v.param("weight")
    if v.kind != "column" or v.input != "sequence-sharded" or ws < 2 or weight is None or ref.g is None:
        return None
    if not isinstance(in_place, Shard):
        return None
    features = Shard(-1, parts=v.packed) if v.packed else Shard(-1)  # rank r's output features, however returned
    for r, g in enumerate(grads):
        own = shard_tensor(ref.g, features, r, ws) @ shard_tensor(ref.weight, weight.placement, r, ws)
        own_mag = shard_tensor(ref.g.abs(), features, r, ws) @ shard_tensor(ref.weight.abs(), weight.placement, r, ws)
        expected, t = shard_tensor(own, in_place, r, ws), ctx.tol(shard_tensor(own_mag, in_place, r, ws), k)
        if g.shape != expected.shape or not close(g, expected, t):
            return None
    return Diagnosis(
        GRAD_NOT_REDUCED,
        "the input grad on every rank is its sequence slice of its own summand (rank r's output features only): "
        "the backward of the input's all-gather along the sequence dim keeps this rank's slice of the grad instead "
        "of reduce-scattering it (Megatron's gather_from_sequence_parallel_region, nanotron's differentiable_all_gather)",
    )


@recogniser(BIAS_GRAD_RANK0_ONLY)
def _bias_grad_rank0_only(ctx: LinearContext, grads: Sequence[torch.Tensor | None], full: torch.Tensor, ok: Sequence[bool]) -> bool:
    """``bias-grad-rank0-only``'s evidence: rank 0's grad right, every other rank's None or zeros."""
    return ctx.ws > 1 and ok[0] and all(
        g is None or (g.shape == full.shape and not bool(g.abs().gt(0).any())) for g in grads[1:]
    )


def _param_grad(ctx: LinearContext, master: str, prop: str) -> Failure | None:
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
    name = f"the {spec.name} grad"
    raw = [v.grads.get(master) for v in ctx.values]
    dtype = _wrong_dtype(ctx, raw, name)
    if dtype is not None:
        return ctx.fail(prop, dtype[1], dtype[0])
    grads = [_f64(g) for g in raw]
    holders = ctx.holders_failure(spec, prop)
    if holders is not None:
        return holders
    if any(master in v.partial for v in ctx.values):
        return _partial_param_grad(ctx, spec, prop, grads, full, tol_full, mag_full, k)
    expected = [shard_tensor(full, placement, r, ws) if sharded else full for r in range(ws)]
    tols = [shard_tensor(tol_full, placement, r, ws) if sharded else tol_full for r in range(ws)]
    mags = [shard_tensor(mag_full, placement, r, ws) if sharded else mag_full for r in range(ws)]

    # A parameter held by tp rank 0 only: rank 0's grad is the whole dense grad; the others hold none.
    rank0_only = ctx.rank0_only(spec)
    ok = [(rank0_only and r > 0) or (g is not None and g.shape == e.shape and close(g, e, t))
          for r, (g, e, t) in enumerate(zip(grads, expected, tols, strict=True))]
    if all(ok):
        return None
    if master == "bias" and not sharded and not rank0_only and _bias_grad_rank0_only(ctx, grads, full, ok):
        return ctx.fail(prop, Diagnosis(
            BIAS_GRAD_RANK0_ONLY,
            f"only rank 0's bias received its gradient (ranks 1..{ws - 1} have "
            f"{'None' if grads[1] is None else 'zeros'}): the bias is added on rank 0 only, so the other replicas "
            "never learn; add it on every rank after the reduction",
        ), 1)
    for r, (g, e, t) in enumerate(zip(grads, expected, tols, strict=True)):
        if ok[r]:
            continue
        what = f"{name} on rank {r}"
        if g is None:
            return ctx.fail(prop, Diagnosis(GRAD_MISSING, f"{spec.name} received no gradient on rank {r} (.grad is None)"), r)
        if g.shape != e.shape:
            return ctx.fail(prop, _shape_diagnosis(ctx, g, e, full, placement, r, name, tol_scalar), r)
        if sharded and getattr(placement, "parts", None) and ctx.ws > 1 and all(x is not None for x in grads) and \
                _contiguous_packed(ctx, grads, full, tol_full, placement.dim % full.dim()):  # type: ignore[arg-type]
            return ctx.fail(prop, Diagnosis(PACKED_SHARD_LAYOUT, _packed_message(ctx, name), {"parts": list(placement.parts)}), r)
        if not sharded and not rank0_only and _grad_not_reduced(ctx, [x for x in grads if x is not None], full, tol_full):
            return ctx.fail(prop, Diagnosis(
                GRAD_NOT_REDUCED,
                f"{what} is only its own summand (the ranks' grads add up to the dense grad): the grad of the "
                f"replicated parameter {spec.name!r} is never all-reduced"
                + (" (under sequence parallelism each rank uses it on its own slice of the sequence only; "
                   "NeMo #7184, gpt-neox #1257)" if "sequence-sharded" in (ctx.variant.input, ctx.variant.output) else "")
                + f"; if the trainer sums it (Megatron's finalize_model_grads), declare ParamSpec({spec.name!r}, ..., "
                  f"grad='partial') or mark it {spec.name}.sequence_parallel = True",
                {"param": spec.name},
            ), r)
        found = _grad_scaled(ctx, g, e, t, what)
        if found is not None:
            return ctx.fail(prop, found, r)
        if sharded and ws > 1:
            for j in range(ws):
                if j != r and close(g, expected[j], torch.maximum(t, tols[j])):
                    return ctx.fail(prop, Diagnosis(
                        WRONG_SHARD_ORDER,
                        f"{what} is the grad of rank {j}'s shard: rank {r} holds rank {j}'s shard of {spec.name}",
                        {"holds": j},
                    ), r)
        return ctx.fail(prop, _unexplained(ctx, _Compared(what, g, e, t, mags[r], k)), r)
    return None


def _partial_param_grad(ctx: LinearContext, spec: Any, prop: str, grads: list[torch.Tensor | None], full: torch.Tensor,
                        tol: torch.Tensor, mag: torch.Tensor, k: int) -> Failure | None:
    """A replicated parameter whose grad the trainer sums (declared ``grad='partial'`` or marked
    ``sequence_parallel``): the rank-order sum of the ranks' grads must equal the dense grad."""
    ws = ctx.ws
    name = f"the {spec.name} grad"
    missing = _grad_missing(grads, spec.name, ".grad")
    if missing is not None:
        return ctx.fail(prop, missing[1], missing[0])
    present: list[torch.Tensor] = [g for g in grads if g is not None]
    for r, g in enumerate(present):
        if g.shape != full.shape:
            return ctx.fail(prop, _shape_diagnosis(ctx, g, full, full, Replicate(), r, name,
                                                   float(tol.max()) if tol.numel() else 0.0), r)
    total = present[0]
    for g in present[1:]:
        total = total + g
    # The trainer's sum adds ws summands, each rounded: up to ws more roundings than one grad.
    tol_sum = tol * ws
    if close(total, full, tol_sum):
        return None
    why = ("declared grad='partial'" if spec.grad == "partial"
           else f"marked {spec.name}.sequence_parallel = True, so the trainer sums it")
    what = f"{name} summed over the tp group (the trainer's sum; it is {why})"
    if ws > 1 and all(close(g, full, tol) for g in present):
        return ctx.fail(prop, Diagnosis(
            GRAD_SCALED,
            f"{what} is {ws} x the dense grad: every rank already holds the complete gradient, so the trainer's sum "
            f"counts it {ws} times; the layer reduces it already: declare grad='complete' (and drop the "
            "sequence_parallel marker)",
            {"factor": float(ws), "param": spec.name},
        ))
    found = _grad_scaled(ctx, total, full, tol_sum, what)
    if found is not None:
        return ctx.fail(prop, found)
    return ctx.fail(prop, _unexplained(ctx, _Compared(what, total, full, tol_sum, mag, k + ws)))


# --- replicas, training --------------------------------------------------------------------------


def _training(ctx: LinearContext) -> Failure | None:
    ref = ctx.ref
    k = ref.rows + ctx.case.in_features + ctx.case.out_features
    for spec in ctx.variant.params or ():
        if spec.master == "bias" and not ctx.case.bias:
            continue
        holders = ctx.holders_failure(spec, TRAINING)
        if holders is not None:
            return holders
        finals = [_f64(v.final.get(spec.master)) for v in ctx.values]
        if ctx.rank0_only(spec):
            finals = finals[:1]  # held by tp rank 0 only
        want = ref.final[spec.master]
        mag = ref.mag["final_" + spec.master]
        tol = ctx.tol(mag, k)
        what = f"{spec.name} after {TRAIN_STEPS} SGD steps (lr {LR})"
        if any(f is None for f in finals):
            return ctx.fail(TRAINING, Diagnosis(SHAPE_ERROR, f"{what}: the parameter disappeared on some rank"))
        if isinstance(spec.placement, Shard):
            try:
                got = assemble(finals, spec.placement)  # type: ignore[arg-type]
            except (RuntimeError, InvalidArgument) as err:
                return ctx.fail(TRAINING, Diagnosis(SHAPE_ERROR, f"{what}: cannot re-assemble the shards: {err}"))
            if not close(got, want, tol):
                return ctx.fail(TRAINING, _unexplained(ctx, _Compared(f"{what} (re-assembled)", got, want, tol, mag, k)))
        else:
            for r, got in enumerate(finals):
                if got.shape != want.shape:  # type: ignore[union-attr]
                    return ctx.fail(TRAINING, _shape_diagnosis(ctx, got, want, want, Replicate(), r, what,  # type: ignore[arg-type]
                                                               float(tol.max()) if tol.numel() else 0.0), r)
                if not close(got, want, tol):  # type: ignore[arg-type]
                    return ctx.fail(TRAINING, _unexplained(ctx, _Compared(f"{what} on rank {r}", got, want, tol, mag, k)), r)  # type: ignore[arg-type]
    return None


# --- whole-run outcomes --------------------------------------------------------------------------

@recogniser(SHAPE_ERROR, WRONG_SHARD_DIM)
def layout_failure(variant: Variant, obs: Observation) -> Failure | None:
    """A parameter with the wrong stored shape (raised by the loader as :class:`LayoutError`)."""
    layout = {r: e for r, e in obs.rank_errors().items() if isinstance(e, LayoutError)}
    if not layout:
        return None
    r = min(layout)
    err = layout[r]
    shape, expected = err.shape, tuple(err.expected)
    diag = SHAPE_ERROR
    if shape is not None:
        spec = next((s for s in variant.params or () if s.name == err.param), None)
        if spec is not None and _is_other_dim_shard(spec, tuple(shape), obs.case):
            diag = WRONG_SHARD_DIM
    msg = str(err)
    if diag == WRONG_SHARD_DIM:
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


def offending(variant: Variant, case: Case) -> tuple[str, list[int]]:
    """What does not divide: sharded feature dims, packed parts, the sequence length (:mod:`tpsim.props.world`)."""
    tp = case.tp_size or case.world_size
    sizes = non_divisible_sizes(variant, case)
    size_name = "world_size" if tp == case.world_size else "tp_size"
    return ", ".join(f"{n}={v}" for n, v in sizes.items()) + f" is not divisible by {size_name}={tp}", list(sizes.values())


@recogniser(DIVISIBILITY_UNCHECKED)
def accepted(family: Any, variant: Variant, obs: Observation, wanted: Sequence[str]) -> list[Failure]:
    """A case whose sizes do not divide that every rank accepted: every rank holds torch.tensor_split's
    (or every rank torch.chunk's) piece of each sharded parameter, uneven by design, and the case is
    judged like a divisible one on those pieces (the first failure is the ``divisibility-unchecked``
    one, the others follow from it); anything else was silently truncated or padded."""
    from tpsim.props.judging import judge_groups

    what, _ = offending(variant, obs.case)
    values = obs.values or []
    styles = {getattr(v, "pieces", None) or "tensor_split" for v in values}
    if values and all(getattr(v, "uneven", False) for v in values) and len(styles) == 1:
        (style,) = styles
        with uneven_pieces(style):
            failures = judge_groups(family, variant, obs, [p for p in wanted if p != DIVISIBILITY])
        if not failures:
            return []
        first = failures[0]
        return [Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                        f"{what}; every rank accepted it and holds torch.{style}'s piece of each sharded parameter "
                        f"(uneven by design), but the result is wrong: {first.property}: {first.diagnosis} — "
                        f"{first.message}", case=obs.case, rank=first.rank, variant=variant.name,
                        details={"uneven": True, "property": first.property, "diagnosis": first.diagnosis},
                        consequences=failures[1:])]
    held = [r for r, v in enumerate(values) if v.status == ACCEPTED] or list(range(len(values)))
    shape = values[held[0]].output_shape
    return [Failure(
        DIVISIBILITY,
        DIVISIBILITY_UNCHECKED,
        f"{what}, yet every rank built the layer and its forward returned an output (rank {held[0]}: shape "
        f"{list(shape) if shape is not None else shape}) without an error: the sizes were silently truncated or "
        "padded (the shards are neither torch.tensor_split's nor torch.chunk's pieces of the sharded sizes); raise a "
        "ValueError naming the sizes at construction, or shard them unevenly and compute the right result",
        case=obs.case, rank=held[0], variant=variant.name, details={"accepted": held},
    )]


#: The registry: the linear family's check of each property on one tp group, in report order.
LINEAR_CHECKS: dict[str, Check] = {
    FORWARD: _forward,
    INPUT_GRAD: _input_grad,
    WEIGHT_GRAD: lambda ctx: _param_grad(ctx, "weight", WEIGHT_GRAD),
    BIAS_GRAD: lambda ctx: _param_grad(ctx, "bias", BIAS_GRAD),
    REPLICA: replica_consistency,
    TRAINING: _training,
}


def wrong_group(variant: Variant, obs: Observation, groups: list[list[int]]) -> dict[str, dict[str, Any]]:
    """Per property, a recognised collective over the wrong set of ranks (see :mod:`tpsim.props.groups`)."""
    case, values, m = obs.case, obs.values or [], obs.data
    if expanded_out_features(variant, case) is not None:
        return {}  # replicated key/value heads: the group recognisers take unexpanded tensors
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
    outs = [_f64(v.output) for v in values]
    common = dict(world_size=ws, tp_size=tp, layout=case.tp_layout)
    if variant.kind == "row" and variant.output == "reduced":
        mag = torch.stack([x.abs() @ w.abs().t() for x in xs]).sum(0) + (0.0 if b is None else b.abs())
        hit = recognise_wrong_group("the output", outs, group_row_summands(xs, w, groups, ws), offset=b,
                          tol_for=tol_for(mag, case.in_features), **common)
        if hit:
            found[FORWARD] = hit
    if variant.kind == "column" and variant.output == "gathered":
        ys = [x @ w.t() + (0.0 if b is None else b) for x in xs]
        mag = torch.stack([x.abs() @ w.abs().t() for x in xs]).sum(0) + (0.0 if b is None else b.abs())
        hit = recognise_wrong_group("the output", outs, column_output_shards(ys, groups, ws), gather_dim=-1,
                          tol_for=lambda n: tolerance(case.torch_dtype, mag, reduction_length=case.in_features,
                                                      world_size=n).max(), **common)
        if hit:
            found[FORWARD] = hit
    if variant.kind == "column" and variant.input == "replicated" and variant.input_grad == "complete":
        grads = [_f64(v.input_grad) for v in values]
        mag = torch.stack([g.abs() @ w.abs() for g in gs]).sum(0)
        hit = recognise_wrong_group("the input grad", grads, column_grad_summands(gs, w, groups, ws),
                          tol_for=tol_for(mag, case.out_features), **common)
        if hit:
            found[INPUT_GRAD] = hit
    return found
