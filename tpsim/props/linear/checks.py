"""The properties of a linear layer: claims checked on one case (each a named function usable from
pytest, in :mod:`tpsim.props.linear`, exported by :mod:`tpsim.props`), and their recognisers.

Per-case properties (all fed by one world run, :meth:`tpsim.props.linear.family.LinearFamily.observe`):

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
- :func:`training_equivalence` — trained as people train (:func:`tpsim.props.rank.schedule`: two
  SGD steps, the first accumulating the case's ``micro_batches``, ``zero_grad`` in the
  case's mode after each; a partial grad summed over the tp group once per step, as the trainer
  does), the grads accumulated over the first step equal the dense ones and the re-assembled
  parameters equal dense training: it catches state bugs such as a cached weight copy that stops
  following the parameter, and a grad reduced again after accumulation
  (``grad-reduced-after-accumulation``);
- :func:`divisibility` — for a case whose sharded sizes do not divide by the tp size: every rank
  raises an exception (while building the layer or in its first forward), or the layer shards the
  sizes unevenly by design (every parameter holds its ``torch.tensor_split`` piece, or every one its
  ``torch.chunk`` piece) and every other
  property holds on those pieces. A truncated or padded shard, a wrong result, a failure after the
  first forward and a rank left failing in a collective are findings (``divisibility-unchecked``).
  A forward-only variant's refusal by ``assert`` on every rank counts too (``python -O`` strips it).

Each function raises :class:`PropertyFailed` (an ``AssertionError``, so pytest reports it as a
test failure) carrying the :class:`~tpsim.diagnosis.Failure`. :func:`~tpsim.props.linear.family.check_case` evaluates them
all from one run and returns the causes: a failure that follows from another (the registry's
consequence rules) is listed in that one's ``consequences``.

Every tensor is compared as a :class:`~tpsim.props.placed.Placed` tensor — each rank's piece, the float64
reference, its bound, its placement — and named by the shared recognisers of :mod:`tpsim.props.placed`
after the linear family's own (marked ``@recogniser(NAME)``, each on the evidence its registry entry
states, :mod:`tpsim.diagnosis`): a returned bias the caller adds again, a row layer's rank that
returned only its own summand ``x_r W_rᵀ``, a head-packed layer's key/value heads on the wrong ranks,
a sequence-sharded input's grad split instead of reduce-scattered. The fallback is ``mismatch``,
quoting the element that violates its bound most, with hints (never names) for what it resembles. A replicated parameter's grad declared ``partial`` (or
marked ``sequence_parallel``) is checked as the trainer sees it: the rank-order sum of the ranks'
grads equals the dense grad, and the replicas agree after that sum.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from tpsim.diagnosis import (
    BIAS_DUPLICATION,
    DIVISIBILITY_UNCHECKED,
    GRAD_NOT_REDUCED,
    KV_HEADS_NOT_REPLICATED,
    MISSING_REDUCTION,
    OUTPUT_DETACHED,
    SHAPE_ERROR,
    WRONG_SHARD_DIM,
    Diagnosis,
    Failure,
    recogniser,
)
from tpsim.patterns import close
from tpsim.placement import Replicate, Shard, part_sizes, replicated_parts, shard_tensor, uneven_pieces
from tpsim.props.groups import column_grad_summands, column_output_shards
from tpsim.props.groups import row_summands as group_row_summands
from tpsim.props.groups import wrong_group as recognise_wrong_group
from tpsim.props.judging import Check, GroupContext, Replicated, replica_consistency
from tpsim.props.linear.case import Case
from tpsim.props.linear.world import (
    ACCEPTED,
    LR,
    RankResult,
    Reference,
    expanded_out_features,
    expanded_view,
    non_divisible_sizes,
    reference,
    replica_trained,
)
from tpsim.props.observation import DETACHED, Observation
from tpsim.props.placed import Placed, Recogniser, verdict
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
from tpsim.props.rank import schedule, zero_grad_of
from tpsim.props.tolerance import tolerance
from tpsim.props.training import accumulated_what, reduced_after_accumulation
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

_F64 = torch.float64


def _f64(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().to(_F64)


class PropertyFailed(AssertionError):
    """A property does not hold on a case; ``failure`` has the diagnosis and the case."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(f"{failure.property} failed ({failure.diagnosis}): {failure.message}")
        self.failure = failure


class LinearContext(GroupContext):
    """One tp group of a linear case: the float64 dense reference of its data (``ref``), and with
    replicated key/value heads the declared (head-packed) variant and the case as drawn (``heads``),
    while ``variant``/``case`` are the replica-expanded view the checks compare with
    (:func:`tpsim.props.linear.world.expanded_view`)."""

    def __init__(self, variant: Variant, obs: Observation, group_index: int, ranks: Sequence[int],
                 values: list[RankResult]):
        super().__init__(variant, obs, group_index, ranks, values)
        declared = (variant, obs.case)
        drawn = obs.data.for_group(group_index)
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
                for name in ("d" + spec.master, "acc_d" + spec.master):
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
                items.append(Replicated(f"{spec.name} after training",
                                        [x.final.get(spec.master) for x in self.values]))
        return items


    def judged(self, prop: str, placed: Placed, recognisers: Sequence[Recogniser] = ()) -> Failure | None:
        """The failure of ``prop`` on ``placed`` (:func:`tpsim.props.placed.verdict`), or None."""
        found = verdict(placed, self.dtype, recognisers)
        return None if found is None else self.fail(prop, found[0], found[1])


# --- forward -------------------------------------------------------------------------------------


def _row_summands(ctx: LinearContext) -> list[torch.Tensor]:
    """Each rank's expected summand ``x_r W_rᵀ`` of a row layer (input features sharded)."""
    ref = ctx.ref
    return [shard_tensor(ref.x, Shard(-1), r, ctx.ws) @ shard_tensor(ref.weight, Shard(1), r, ctx.ws).t()
            for r in range(ctx.ws)]


def _returned_bias(ctx: LinearContext) -> Recogniser:
    """``bias-duplication`` of a forward that returned its bias for the caller to add (``skip_bias_add``,
    which tpsim added as the caller does) while adding it itself: off by exactly +1*bias."""

    @recogniser(BIAS_DUPLICATION)
    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
        bias = ctx.ref.bias
        if bias is None or not any(getattr(v, "returned_bias", False) for v in ctx.values) or \
                actual.shape[-1:] != bias.shape or not close(actual, placed.full + bias, ctx.tol(
                    ctx.ref.mag["y"] + bias.abs(), ctx.case.in_features)):
            return None
        return Diagnosis(BIAS_DUPLICATION,
                         f"{placed.what} is off by exactly +1*bias: the layer adds the bias itself and also returns it "
                         "for the caller to add (skip_bias_add), so the caller adds it a second time; under "
                         "skip_bias_add leave it out of the output", {"factor": 1.0, "returned": True})

    return recognise


def _missing_reduction(ctx: LinearContext) -> Recogniser:
    """``missing-reduction``: every rank of a row layer returned only its own summand ``x_r W_rᵀ`` (with or
    without the bias), and the ranks' outputs differ. One rank's output that happens to equal its summand
    says nothing of the others (every rank holding the same garbage, rank 0's summand, is no missing
    reduction)."""

    @recogniser(MISSING_REDUCTION)
    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
        v = ctx.variant
        if not (v.output == "reduced" and v.kind == "row" and ctx.ws > 1 and len(pieces) == ctx.ws):
            return None
        summands = _row_summands(ctx)
        bias = ctx.ref.bias if ctx.ref.bias is not None else torch.zeros((), dtype=_F64)
        for r, out in enumerate(pieces):
            if out.shape != placed.full.shape or not (close(out, summands[r], placed.tol)
                                                      or close(out, summands[r] + bias, placed.tol)):
                return None
        if all(close(out, pieces[0], placed.tol) for out in pieces[1:]):
            return None  # every rank holds the same values: no rank's own summand shows
        return Diagnosis(MISSING_REDUCTION,
                         f"{placed.what}: every rank returned only its own summand x_r W_r^T (the ranks' outputs "
                         "differ and add up to the dense output): the all-reduce over the tp group is missing",
                         {"ranks": list(range(len(pieces)))})

    return recognise


def _kv_heads_held(ctx: LinearContext) -> Recogniser:
    """``kv-heads-not-replicated`` of a head-packed Q/K/V column with fewer key/value heads than ranks:
    every rank's query columns are its own, its key and value columns are both those of one master
    key/value head (read off its output), and some rank's head is not ``r // replicas``."""

    @recogniser(KV_HEADS_NOT_REPLICATED)
    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
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
        full, tol = placed.full, placed.tol

        def cols(t: torch.Tensor, rank: int, lo: int, n: int) -> torch.Tensor:
            return t[..., rank * width + lo: rank * width + lo + n]

        held = []
        for r, o in enumerate(pieces):
            if o.shape[-1] != width or o.shape[:-1] != full.shape[:-1]:
                return None
            if not close(o[..., :qn], cols(full, r, 0, qn), cols(tol, r, 0, qn)):
                return None  # its query heads are not its own: another mechanism
            match = [j for j in range(nkv) if close(o[..., qn:], cols(full, j * replicas, qn, 2 * d),
                                                    cols(tol, j * replicas, qn, 2 * d))]
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
            f"{placed.what}: with {nkv} key/value heads on {ws} ranks, {pairs}{how}: each head must be replicated on "
            f"the {replicas} ranks whose query heads use it (rank r holds head r // {replicas}, i.e. r * {nkv} // "
            f"{ws}); every rank's query columns are its own, its K and V columns those of another head",
            {"held": held, "expected": own})

    return recognise


@recogniser(OUTPUT_DETACHED)
def _forward(ctx: LinearContext) -> Failure | None:
    v, ref, ws = ctx.variant, ctx.ref, ctx.ws
    for r, x in enumerate(ctx.values):
        if x.output is None:
            return ctx.fail(FORWARD, Diagnosis(SHAPE_ERROR, f"rank {r}'s forward returned {x.output_type or 'None'}, "
                                               "not a tensor"), r)
    detached = [r for r, x in enumerate(ctx.values) if x.status == DETACHED]
    if detached and all(x.output.dtype == ctx.dtype for x in ctx.values):
        return ctx.fail(FORWARD, Diagnosis(
            OUTPUT_DETACHED,
            f"the output on rank {detached[0]} is detached from the autograd graph (grad_fn is None) although the "
            f"input requires grad{' (also on ranks ' + str(detached[1:]) + ')' if len(detached) > 1 else ''}: a "
            "collective or copy runs outside autograd (e.g. dist.all_gather into fresh buffers, or a result built "
            "under torch.no_grad()), so no gradient flows back through the layer; use an autograd-aware collective "
            "(torch.distributed.nn.functional, or a torch.autograd.Function with the conjugate backward)",
            {"ranks": detached}), detached[0])
    sharded = v.output in ("sharded", "sequence-sharded")
    what = ("the output (rank shards assembled)" if sharded else
            "the output (summed over ranks)" if v.output == "partial" else "the output")
    placed = Placed(what, [x.output for x in ctx.values], ref.y, ctx.tol(ref.mag["y"], ctx.case.in_features),
                    v.output_placement if sharded else Replicate(), summed=v.output == "partial",
                    biases=() if ref.bias is None else (("bias", ref.bias),),
                    reduced=v.kind == "row" or v.output == "reduced",
                    sequence_dim=v.sequence_dim_of(ref.y.dim()) if v.output == "sequence-sharded" else None,
                    mag=ref.mag["y"], k=ctx.case.in_features, offset=ref.bias,
                    # A row layer's output is the sum of the ranks' summands plus the bias: precision-loss
                    # can recompute that sum in a narrower dtype.
                    summands=_row_summands(ctx) if v.kind == "row" and ws > 1 else None)
    return ctx.judged(FORWARD, placed, [_returned_bias(ctx), _missing_reduction(ctx), _kv_heads_held(ctx)])


# --- gradients -----------------------------------------------------------------------------------


def _sequence_grad_split(ctx: LinearContext) -> Recogniser:
    """``grad-not-reduced`` of a column layer's sequence-sharded input: every rank's input grad is its
    sequence slice of its own summand ``g_r W_r`` (rank r's output features), not of their sum: the
    backward of the forward all-gather splits the grad instead of reduce-scattering it."""

    @recogniser(GRAD_NOT_REDUCED)
    def recognise(placed: Placed, actual: torch.Tensor, pieces: list[torch.Tensor]) -> Diagnosis | None:
        v, ws, ref = ctx.variant, ctx.ws, ctx.ref
        weight = v.param("weight")
        if v.kind != "column" or v.input != "sequence-sharded" or ws < 2 or weight is None or ref.upstream is None:
            return None
        in_place = v.input_placement
        if not isinstance(in_place, Shard):
            return None
        features = Shard(-1, parts=v.packed) if v.packed else Shard(-1)  # rank r's output features, however returned
        for r, piece in enumerate(pieces):
            own = shard_tensor(ref.upstream, features, r, ws) @ shard_tensor(ref.weight, weight.placement, r, ws)
            own_mag = shard_tensor(ref.upstream.abs(), features, r, ws) @ shard_tensor(ref.weight.abs(), weight.placement, r, ws)
            expected = shard_tensor(own, in_place, r, ws)
            bound = ctx.tol(shard_tensor(own_mag, in_place, r, ws), ctx.case.out_features)
            if piece.shape != expected.shape or not close(piece, expected, bound):
                return None
        return Diagnosis(
            GRAD_NOT_REDUCED,
            "the input grad on every rank is its sequence slice of its own summand (rank r's output features only): "
            "the backward of the input's all-gather along the sequence dim keeps this rank's slice of the grad "
            "instead of reduce-scattering it (Megatron's gather_from_sequence_parallel_region, nanotron's "
            "differentiable_all_gather)")

    return recognise


def _input_grad(ctx: LinearContext) -> Failure | None:
    v, ref, ws = ctx.variant, ctx.ref, ctx.ws
    sharded = v.input in ("sharded", "sequence-sharded")
    summed = not sharded and v.input_grad == "partial"
    # A replicated input of a column layer: its grad is the sum over ranks of g_r W_r (each rank's
    # output features), which precision-loss can recompute in a narrower dtype.
    summands = None
    if not sharded and v.kind == "column" and ws > 1:
        summands = [shard_tensor(ref.upstream, Shard(-1), r, ws) @ shard_tensor(ref.weight, Shard(0), r, ws) for r in range(ws)]
    placed = Placed("the input grad" + (" summed over ranks" if summed else ""), [x.input_grad for x in ctx.values],
                    ref.dx, ctx.tol(ref.mag["dx"], ctx.case.out_features),
                    v.input_placement if sharded else Replicate(), summed=summed, grad=True,
                    sequence_dim=v.sequence_dim_of(ref.dx.dim()) if v.input == "sequence-sharded" else None,
                    mag=ref.mag["dx"], k=ctx.case.out_features, summands=summands)
    found = ctx.judged(INPUT_GRAD, placed, [_sequence_grad_split(ctx)])
    if found is not None and found.diagnosis == GRAD_NOT_REDUCED and not sharded and found.rank is None:
        found.message += ("; the backward all-reduce of the replicated input's grad is missing (Megatron's "
                          "copy_to_tensor_parallel_region); if the caller reduces it, declare input_grad='partial'")
    return found


def _param_grad(ctx: LinearContext, master: str, prop: str) -> Failure | None:
    ref = ctx.ref
    spec = ctx.variant.param(master)
    if spec is None or (master == "bias" and not ctx.case.bias):
        return None
    holders = ctx.holders_failure(spec, prop)
    if holders is not None:
        return holders
    full = ref.dweight if master == "weight" else ref.dbias
    mag, k = ref.mag["d" + master], max(ref.rows, 1)
    grads = [x.grads.get(master) for x in ctx.values]
    summed = any(master in x.partial for x in ctx.values)
    if ctx.rank0_only(spec):
        grads = grads[:1]  # held by tp rank 0 only: its grad is the whole dense grad
    tol = ctx.tol(mag, k)
    if summed:  # the trainer's sum adds ws summands, each rounded: up to ws more roundings than one grad
        tol, k = tol * ctx.ws, k + ctx.ws
        why = ("declared grad='partial'" if spec.grad == "partial"
               else f"marked {spec.name}.sequence_parallel = True, so the trainer sums it")
        what = f"the {spec.name} grad summed over the tp group (the trainer's sum; it is {why})"
    else:
        what = f"the {spec.name} grad"
    found = ctx.judged(prop, Placed(what, grads, full, tol, spec.placement, summed=summed, grad=True,
                                    param=spec.name, mag=mag, k=k, sequence_parallel="sequence-sharded" in (
                                        ctx.variant.input, ctx.variant.output)))
    if found is not None and found.diagnosis == GRAD_NOT_REDUCED:
        found.message += (f"; if the trainer sums it (Megatron's finalize_model_grads), declare ParamSpec("
                          f"{spec.name!r}, ..., grad='partial') or mark it {spec.name}.sequence_parallel = True")
    return found


# --- training ------------------------------------------------------------------------------------


def _accumulated(ctx: LinearContext, spec: Any) -> Failure | None:
    """The grad of ``spec``'s parameter accumulated over the first optimizer step's micro-batches, as the
    trainer sees it (a partial grad: the ranks' sum), against the dense accumulated grad; an earlier
    micro-batch counted again is named (:func:`tpsim.props.training.reduced_after_accumulation`)."""
    ref, master = ctx.ref, spec.master
    full = ref.acc_dweight if master == "weight" else ref.acc_dbias
    first = ref.dweight if master == "weight" else ref.dbias
    if full is None:
        return None
    grads = [x.accumulated.get(master) for x in ctx.values]
    if ctx.rank0_only(spec):
        grads = grads[:1]
    summed = any(master in x.partial for x in ctx.values)
    # Each micro-batch's grad errs within the tolerance of its own magnitude, and the tolerance is linear
    # in the magnitude: the accumulated grad's bound is that of the sum of their magnitudes, at one
    # micro-batch's reduction length (as each step's bound was when every step had one micro-batch).
    mag, k = ref.mag["acc_d" + master], max(ref.rows, 1)
    earlier = ref.earlier.get("d" + master, [first])
    tol = ctx.tol(mag, k)
    earlier_tol = [ctx.tol(m, k) for m in ref.earlier.get("mag_d" + master, [ref.mag["d" + master]])]
    if summed:  # the trainer's sum adds ws summands, each rounded (as for one micro-batch's grad)
        tol, earlier_tol, k = tol * ctx.ws, [t * ctx.ws for t in earlier_tol], k + ctx.ws
    what = accumulated_what(spec.name, ref.micro_batches) + (" summed over the tp group (the trainer's sum)"
                                                             if summed else "")
    return ctx.judged(TRAINING, Placed(what, grads, full, tol, spec.placement, summed=summed, grad=True,
                                       param=spec.name, mag=mag, k=k),
                      [reduced_after_accumulation(earlier, earlier_tol, ctx.ws, ref.micro_batches)])


def _training(ctx: LinearContext) -> Failure | None:
    ref = ctx.ref
    k = ref.rows + ctx.case.in_features + ctx.case.out_features
    specs = [s for s in ctx.variant.params or () if s.master == "weight" or ctx.case.bias]
    for spec in specs:
        holders = ctx.holders_failure(spec, TRAINING)
        if holders is not None:
            return holders
        found = _accumulated(ctx, spec)
        if found is not None:
            return found
    for spec in specs:
        finals = [x.final.get(spec.master) for x in ctx.values]
        if ctx.rank0_only(spec):
            finals = finals[:1]  # held by tp rank 0 only
        mag = ref.mag["final_" + spec.master]
        found = ctx.judged(TRAINING, Placed(f"{spec.name} after training ({_trained(ctx.case)}, lr {LR})", finals,
                                            ref.final[spec.master], ctx.tol(mag, k), spec.placement, param=spec.name,
                                            mag=mag, k=k))
        if found is not None:
            return found
    return None


def _trained(case: Any) -> str:
    """How the training of ``case`` is described in messages."""
    plan = schedule(case)
    zero = "set_to_none" if zero_grad_of(case) else "zeroed in place"
    return f"{len(plan)} SGD steps of {'+'.join(str(n) for n in plan)} micro-batches, grads {zero} after each"


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
    """What does not divide: sharded feature dims, packed parts, the sequence length (:mod:`tpsim.props.linear.world`)."""
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


def _construction(ctx: LinearContext) -> Failure | None:
    """What the layer loaded itself (``load=False``), against the masters right after construction: a
    mis-slice is named where the library made it, before any forward."""
    if ctx.heads is not None:
        return None  # replicated key/value heads: the pieces are read through the expanded view only
    for spec in ctx.variant.params or ():
        pieces = [x.loaded.get(spec.master) for x in ctx.values]
        full = ctx.ref.weight if spec.master == "weight" else ctx.ref.bias
        if full is None or any(p is None for p in pieces):  # not loaded by the layer, or held by rank 0 only
            continue
        found = ctx.judged(FORWARD, Placed(
            f"the {spec.master} right after construction (as the layer loaded it, read through {spec.placement})",
            pieces, full, ctx.tol(full.abs(), 1), spec.placement, param=spec.master))
        if found is not None:
            found.details = {**found.details, "construction": True}
            return found
    return None


def _forward_from_construction(ctx: LinearContext) -> Failure | None:
    return _construction(ctx) or _forward(ctx)


#: The registry: the linear family's check of each property on one tp group, in report order.
LINEAR_CHECKS: dict[str, Check] = {
    FORWARD: _forward_from_construction,
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
