"""Diagnoses: stable names for the ways a sharded layer goes wrong, each given only on positive evidence.

A property that fails compares per-rank tensors with the float64 dense reference; a *recogniser*
looks for the evidence of one known mechanism and names it. When no recogniser finds its evidence
the diagnosis is ``mismatch``, with the element that violates the bound most and the best hint.
Names are stable: scripts match on them (``tpsim check --report json``), so a name is never reused
for something else.

The registry
------------

Every diagnosis is one :class:`DiagnosisSpec` in :data:`REGISTRY`, registered once below as a
module constant (``BIAS_DUPLICATION = register(DiagnosisSpec("bias-duplication", ...))``). A spec
says:

- ``properties``: the properties it can explain (``forward-equivalence``, ...);
- ``doc``: one line for the docs tables (:func:`diagnosis_table`);
- ``evidence``: the positive evidence that must be seen to give the name — written here, next to
  the definition, and checked by the recogniser that gives it;
- ``mutant``: a catalogued mutant (:data:`tpsim.mutants.CATALOG`) that shows it, or None for the
  harness's own outcomes (``exception``, ``mismatch``, ``fault-not-surfaced``; the reason is in
  ``evidence``);
- ``consequences``: the other properties that fail on the same case *because of* this cause (one
  cause, one report: :func:`group_causes` lists them under it);
- ``confirmed_by``: how the name is confirmed (:data:`CONFIRMATIONS`). A diagnosis is a claim: a name
  read from numbers (a factor, a bias multiple, summands, a recomputation) is kept on a case narrower
  than float64 only when the same case in float64 shows it (:func:`confirm`, run by every family's
  :meth:`~tpsim.props.family.Family.confirm_in_float64`), and a factor of the tp size only when the same
  case on one rank passes (:func:`confirm_on_one_rank`); otherwise the report says ``mismatch`` with the
  measured facts. Names that are observed rather than measured (a shape, a dtype, an exception) need no
  re-run. A spec that says nothing is a numeric pattern (:data:`FLOAT64`).

Adding a diagnosis is one registry entry here, one recogniser (a function decorated with
``@recogniser(NAME)``, e.g. in :mod:`tpsim.props.linear.checks`) and one mutant in :mod:`tpsim.mutants`;
tests/test_diagnosis_registry.py checks that every entry has all three and that no code reports an
unregistered name. docs/design.md shows the recipe.

:class:`Failure` is what reports list and case files record. The numeric patterns recognisers use
are pure functions in :mod:`tpsim.patterns` (re-exported here for older imports).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from tpsim._json import jsonable
from tpsim.patterns import (
    bias_multiple,
    block_mapping,
    close,
    rank_summands,
    regathered_dim,
    scale_factor,
    worst_violation,
)

__all__ = [
    "CONFIRMATIONS",
    "DIAGNOSES",
    "FALLBACK",
    "FLOAT64",
    "OBSERVED",
    "ONE_RANK",
    "RECOGNISERS",
    "REGISTRY",
    "RERUN",
    "Confirmed",
    "Diagnosis",
    "DiagnosisSpec",
    "Failure",
    "bias_multiple",
    "block_mapping",
    "claims",
    "close",
    "confirm",
    "confirm_on_one_rank",
    "confirmation_table",
    "diagnosis_table",
    "each_failure",
    "follows_from",
    "group_causes",
    "mismatch",
    "not_confirmed",
    "rank_summands",
    "recogniser",
    "regathered_dim",
    "register",
    "scale_factor",
    "spec",
    "tp_factor_claim",
]

# Property names the registry refers to (defined with their checks in tpsim.props; repeated here
# as plain strings because this module sits below the property engine).
_FORWARD = "forward-equivalence"
_INPUT_GRAD = "input-grad-equivalence"
_WEIGHT_GRAD = "weight-grad-equivalence"
_BIAS_GRAD = "bias-grad-equivalence"
_REPLICA = "replica-consistency"
_TRAINING = "training-equivalence"
_DIVISIBILITY = "divisibility"
_FAULTS = "fault-detection"
_PER_CASE = (_FORWARD, _INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _REPLICA, _TRAINING)
_GRADS = (_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD)


# How a name is confirmed (:attr:`DiagnosisSpec.confirmed_by`): a diagnosis is a claim, kept only
# where rounding and a degenerate minimal case cannot fake its evidence (the docs table:
# :func:`confirmation_table`).

class Confirmed(enum.Enum):
    """How a diagnosis name is confirmed (:attr:`DiagnosisSpec.confirmed_by`; the words: :data:`CONFIRMATIONS`)."""

    #: Observed, not measured: a shape, a dtype, a missing grad, an exception or a death, bits that differ
    #: between replicas. Rounding cannot fake it: named in every dtype as seen.
    OBSERVED = "observed"
    #: A numeric pattern (a factor, a bias multiple, summands, a recomputation) within tolerance, in every
    #: element. On a case narrower than float64 it is kept only when the same case in float64 shows it for
    #: the same property and sublayer; otherwise the float64 name, or ``mismatch`` with what was measured.
    FLOAT64 = "float64"
    #: A factor of the tp size (``tp x``, ``(tp-1) x bias``): as :attr:`FLOAT64`, and the same case on one
    #: rank (in float64) must pass that property, where such a factor vanishes (a variant that cannot run on
    #: one rank: the same name at twice the tp size). At tp 2 the factor is 2 (or 1*bias): what a bug that
    #: ignores the tp size (a forward that is simply 2x, a bias added twice) shows too.
    ONE_RANK = "float64 + one rank"
    #: As :attr:`FLOAT64`; in a whole module named only when a changed re-run (the layout or plan entry it
    #: names, every key/value head made one) passes the failing case and a larger one the module fails.
    RERUN = "float64 + re-run"
    #: The fallback: nothing is claimed beyond the measured facts.
    FALLBACK = "fallback"

    def __str__(self) -> str:
        return self.value


OBSERVED = Confirmed.OBSERVED
FLOAT64 = Confirmed.FLOAT64
ONE_RANK = Confirmed.ONE_RANK
RERUN = Confirmed.RERUN
FALLBACK = Confirmed.FALLBACK
#: Every way a name is confirmed, and what it means (the docs table's words).
CONFIRMATIONS: dict[Confirmed, str] = {
    OBSERVED: "observed, not measured (a shape, a dtype, a missing grad, an exception or a death, bits that differ "
              "between replicas): rounding cannot fake it, named in every dtype",
    FLOAT64: "a numeric pattern, in every element: on a bfloat16, float16 or float32 case named only when the same "
             "case in float64 shows it for the same property and sublayer (else the float64 name, or mismatch with "
             "the facts)",
    ONE_RANK: "as float64, and the same case on one rank (float64) passes that property: a factor of the tp size "
              "vanishes there, while at tp 2 its factor (2x, 1*bias) is also what a bug that ignores the tp size "
              "shows; a variant that cannot run on one rank (min_tp_size) must show the same name at twice the tp "
              "size, its sizes doubled (else mismatch with the facts)",
    RERUN: "as float64; in a whole module, named only when a re-run with the change it names passes the failing "
           "case and a larger one that the module as declared fails",
    FALLBACK: "the fallback: no mechanism is claimed, the message gives the measured facts",
}


@dataclass(frozen=True)
class DiagnosisSpec:
    """One diagnosis: its stable ``name``, the ``properties`` it explains, its one-line ``doc``, the
    positive ``evidence`` that must be seen to give it, the catalogued ``mutant`` that shows it
    (None for harness outcomes, the reason in ``evidence``), the properties that fail as its
    ``consequences`` on the same case (see the module docstring) and how the name is
    ``confirmed_by`` (:data:`CONFIRMATIONS`)."""

    name: str
    properties: tuple[str, ...]
    doc: str
    evidence: str
    mutant: str | None
    consequences: tuple[str, ...] = ()
    #: How the name is confirmed (:data:`CONFIRMATIONS`); a numeric pattern (:data:`FLOAT64`) unless said.
    confirmed_by: Confirmed = FLOAT64

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or self.name != self.name.strip().lower() or " " in self.name:
            raise ValueError(f"DiagnosisSpec(name={self.name!r}): expected a lower-case name with dashes")
        for attr in ("properties", "consequences"):
            value = getattr(self, attr)
            if isinstance(value, str) or not all(isinstance(p, str) for p in value):
                raise ValueError(f"DiagnosisSpec({self.name!r}, {attr}={value!r}): expected a tuple of property names")
            object.__setattr__(self, attr, tuple(value))
        if not self.properties:
            raise ValueError(f"DiagnosisSpec({self.name!r}): properties is empty; name the properties it explains")
        if not self.doc.strip() or not self.evidence.strip():
            raise ValueError(f"DiagnosisSpec({self.name!r}): doc and evidence must say something")
        if not isinstance(self.confirmed_by, Confirmed):
            raise ValueError(f"DiagnosisSpec({self.name!r}, confirmed_by={self.confirmed_by!r}): expected one of "
                             f"{', '.join(f'Confirmed.{c.name}' for c in Confirmed)}")


#: Every registered diagnosis, by name, in registration order.
REGISTRY: dict[str, DiagnosisSpec] = {}

#: The recognisers of each diagnosis (functions decorated with :func:`recogniser`), by name: each as
#: ``module:qualname``, never the function itself (a recogniser made inside a check closes over its
#: case's tensors: kept here, the first check's observation stayed alive for the life of the process,
#: 7 GB at the lab note's size).
RECOGNISERS: dict[str, list[str]] = {}

_F = TypeVar("_F", bound=Callable[..., Any])


def register(spec: DiagnosisSpec) -> str:
    """Add ``spec`` to :data:`REGISTRY` and return its name (for a module constant).

    Raises ValueError when the name is taken: names are stable and never reused."""
    if not isinstance(spec, DiagnosisSpec):
        raise TypeError(f"register(spec={spec!r}): expected a DiagnosisSpec")
    if spec.name in REGISTRY:
        raise ValueError(f"diagnosis {spec.name!r} is already registered; pick another name")
    REGISTRY[spec.name] = spec
    return spec.name


def spec(name: str) -> DiagnosisSpec:
    """The registered spec of ``name``; ValueError naming the registered ones otherwise."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"diagnosis {name!r} is not registered; expected one of {sorted(REGISTRY)}") from None


def recogniser(*names: str) -> Callable[[_F], _F]:
    """Mark a function as the recogniser of the diagnoses ``names`` (registered ones only).

    A recogniser looks for its diagnosis's ``evidence`` and returns a :class:`Diagnosis` (or a
    :class:`Failure`) when it sees it, None otherwise."""
    for name in names:
        spec(name)

    def mark(fn: _F) -> _F:
        # A recogniser made inside a check (a closure over its context) is marked each time the check
        # runs: it is one recogniser, listed once.
        where = f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"
        for name in names:
            known = RECOGNISERS.setdefault(name, [])
            if where not in known:
                known.append(where)
        return fn

    return mark


def diagnosis_table() -> list[tuple[str, str]]:
    """``(name, doc)`` of every registered diagnosis, in registration order (for docs tables)."""
    return [(s.name, s.doc) for s in REGISTRY.values()]


class _Docs(Mapping[str, str]):
    """Read-only name -> doc view of :data:`REGISTRY` (the older ``DIAGNOSES`` dict)."""

    def __getitem__(self, name: str) -> str:
        return REGISTRY[name].doc

    def __iter__(self) -> Iterator[str]:
        return iter(REGISTRY)

    def __len__(self) -> int:
        return len(REGISTRY)

    def __repr__(self) -> str:
        return f"DIAGNOSES({dict(self)!r})"


#: Every diagnosis name tpsim reports, with its doc (a read-only view of :data:`REGISTRY`).
DIAGNOSES: Mapping[str, str] = _Docs()


# --- the registry --------------------------------------------------------------------------------
# Each entry: what it means, the evidence that must be seen to name it, the mutant that shows it,
# and what else fails on the same case because of it. Recognisers check exactly this evidence.

BIAS_DUPLICATION = register(DiagnosisSpec(
    "bias-duplication", (_FORWARD,),
    "the output is off by exactly (world_size-1)*bias: every rank added the full bias to its summand "
    "before the reduction (add it once, after the reduction); or by +1*bias from a layer that adds the bias "
    "and also returns it for the caller under skip_bias_add",
    "output - dense output = c * bias (broadcast over the leading dims) in every element: within tolerance, "
    "and leaving at most a quarter of the difference's RMS, with c = world_size - 1, world_size >= 2 and a "
    "bias in the case, and the same case on one rank passes; in a module, a bias added before a reduction "
    "anywhere (a parent module's included: the summands the reduction adds are off by it) is named at the "
    "sublayer that owns it; or c = 1 when the forward returned (output, bias) and tpsim added the returned "
    "bias, as the caller does",
    "row-bias-before-reduce",
    consequences=(_TRAINING,),
    confirmed_by=ONE_RANK,
))
BIAS_MISSING = register(DiagnosisSpec(
    "bias-missing", (_FORWARD,),
    "the output is off by exactly -bias: the bias is never added",
    "output - dense output = -bias (broadcast over the leading dims) in every element: within tolerance, "
    "and leaving at most a quarter of the difference's RMS, with a non-zero bias in the case",
    "column-ignores-bias",
    consequences=(_BIAS_GRAD, _REPLICA, _TRAINING),
))
WRONG_SHARD_DIM = register(DiagnosisSpec(
    "wrong-shard-dim", (_FORWARD,) + _GRADS,
    "a tensor was split or gathered along the wrong dim: a parameter has the shape of the master cut "
    "along its other dim, the output holds the right values concatenated along a batch dim, or a "
    "sequence-sharded output/grad is sliced along the batch dim instead of the sequence dim",
    "a rank's tensor equals the dense one re-cut along another dim (same values within tolerance, in "
    "the shape of that cut), every rank holds its Shard(d) slice for a d other than the declared one, "
    "or a parameter's stored shape is the master's cut along its other dim",
    "column-wrong-split-dim",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _REPLICA, _TRAINING),
))
WRONG_SHARD_ORDER = register(DiagnosisSpec(
    "wrong-shard-order", (_FORWARD,) + _GRADS,
    "a rank holds another rank's shard: blocks of the result are permuted or repeated (a reversed or "
    "node-local rank order)",
    "each of the ws blocks of the result along its sharded dim equals some block of the dense result "
    "within tolerance, not all in place; or rank r's tensor equals rank j's expected slice (j != r)",
    "column-reversed-shards",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _REPLICA, _TRAINING),
))
PACKED_SHARD_LAYOUT = register(DiagnosisSpec(
    "packed-shard-layout", (_FORWARD, _WEIGHT_GRAD, _BIAS_GRAD),
    "a packed weight (gate/up, Q/K/V) was split as one contiguous block: a rank holds a contiguous "
    "slice of the packed dim instead of its shard of every packed part",
    "every rank's piece equals its contiguous 1/ws slice of the packed dim of the dense result within "
    "tolerance (instead of its shard of each part), with ws >= 2; in a whole module, the forward first "
    "diverges at a sublayer whose parameters were sharded by their shapes alone, and the same case passes "
    "with them declared as the shard of each of 2 or 3 equal parts, as does a larger case (more tokens, "
    "another seed) that the module as declared fails",
    "packed-gate-up-contiguous",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _TRAINING),
    confirmed_by=RERUN,
))
ZERO_COPIES_DRIFT = register(DiagnosisSpec(
    "zero-copies-drift", (_TRAINING,),
    "a parameter held by tp rank 0 with zeros on the other ranks (Partial: the copies add up to it) "
    "forwards right, but training moves the zero copies: every rank's optimizer applies the full grad "
    "to its own copy, so the sum moves tp times as far as the dense parameter",
    "a parameter whose layout is Partial() and whose copies on every tp rank other than 0 were exactly "
    "zero after loading is non-zero on some of them after training, with ws >= 2. No catalogued mutant "
    "(single layers hold such a bias on rank 0 only, without zero copies): tests/wild shows it in a module",
    None,
))
MISSING_REDUCTION = register(DiagnosisSpec(
    "missing-reduction", (_FORWARD,),
    "each rank returned only its own summand: the reduction over the tp group is missing",
    "every rank's output equals its own summand x_r W_r^T (with or without the bias) within tolerance, "
    "for a layer whose declared output is the sum of those summands, with ws >= 2, and the ranks' outputs "
    "differ (every rank holding the same values is no summand; nor is one rank holding the whole beside "
    "zeros)",
    "row-no-reduce-without-bias",
    consequences=(_REPLICA, _TRAINING),
))
DOUBLE_REDUCTION = register(DiagnosisSpec(
    "double-reduction", (_FORWARD,),
    "the result is world_size times the expected one: it was reduced twice (e.g. a layer that "
    "reduces, declared or wrapped as partial)",
    "the output equals world_size * the dense x W^T (the bias, if any, added once or world_size "
    "times) in every element (within tolerance, the same exact zeros, leaving at most a quarter of the "
    "difference's RMS), for a result a reduction makes, with ws >= 2; and the same case on one rank passes "
    "(a forward that is simply 2x at tp 2 is not reduced twice)",
    "row-reduce-twice",
    consequences=(_TRAINING,),
    confirmed_by=ONE_RANK,
))
GRAD_NOT_REDUCED = register(DiagnosisSpec(
    "grad-not-reduced", _GRADS,
    "each rank's gradient (of a replicated input or parameter) is only its summand: the ranks' grads "
    "differ and add up to the dense grad; the backward all-reduce is missing (for a parameter whose "
    "trainer reduces it, declare ParamSpec(grad='partial'))",
    "the ranks' grads of a replicated tensor whose grad is declared complete differ from each other "
    "and their rank-order sum equals the dense grad within tolerance (ws >= 2); or, for a column layer's "
    "sequence-sharded input, each rank's grad equals its sequence slice of its own summand g_r W_r (the "
    "backward reduce-scatter is a plain split)",
    "column-no-backward-reduce",
    consequences=(_REPLICA, _TRAINING),
))
GRAD_SCALED = register(DiagnosisSpec(
    "grad-scaled", _GRADS,
    "a gradient is the dense one times a constant (1/world_size: averaged instead of summed, or a "
    "value divided by the world size in forward; world_size: reduced twice)",
    "the grad equals c * the dense grad in every element for one constant c != 1: within tolerance * "
    "max(1, |c|), with the same exact zeros (an element exactly 0 in one and not in the other is no multiple), "
    "and c explains the difference far better than no factor (the RMS left at most a quarter of it: a rounding "
    "that is not uniform, such as an early bfloat16 cast, is no factor); for one-element tensors only c in "
    "{world_size, 1/world_size} counts: one number is a multiple of any other",
    "row-bias-divided",
    consequences=(_TRAINING,),
))
GRAD_MISSING = register(DiagnosisSpec(
    "grad-missing", _GRADS,
    "a tensor that takes part in the forward has no gradient on some rank",
    "after backward, .grad of the rank's input or of a parameter the variant declares is None",
    "row-weight-data",
    consequences=(_REPLICA, _TRAINING),
    confirmed_by=OBSERVED,
))
BIAS_GRAD_RANK0_ONLY = register(DiagnosisSpec(
    "bias-grad-rank0-only", (_BIAS_GRAD,),
    "only rank 0's bias received its gradient, the others got none or zeros: the bias is added on "
    "rank 0 only, so the replicas drift apart",
    "a replicated bias whose grad on rank 0 equals the dense grad within tolerance while every other "
    "rank's is None or all zeros (ws >= 2)",
    "row-bias-rank0-only",
    consequences=(_REPLICA, _TRAINING),
))
REPLICA_DIVERGENCE = register(DiagnosisSpec(
    "replica-divergence", (_REPLICA,),
    "a tensor that must be identical on every rank (a reduced output, a complete input grad, a "
    "replicated parameter or its grad) differs across ranks, or a replicated parameter differs right "
    "after construction (every rank seeded alike: its init is not synchronised)",
    "a tensor the variant declares replicated is not bit-identical across the tp group's ranks (its "
    "grad after the trainer's sum, for a grad declared partial)",
    "row-replica-init-diverges",
    consequences=(_TRAINING,),
    confirmed_by=OBSERVED,
))
WRONG_GROUP = register(DiagnosisSpec(
    "wrong-group", (_FORWARD, _INPUT_GRAD),
    "a result is a reduction (or gather) over another set of ranks than the layer's tp group (e.g. "
    "the whole world): a collective runs on the wrong process group",
    "with tp_size < world_size, every rank's result equals the reduction (or gather) over one "
    "candidate set of ranks (the world, the data-parallel groups, the other layout's tp groups) "
    "within that set's tolerance",
    "row-wrong-group",
    consequences=(_INPUT_GRAD, _REPLICA, _TRAINING),
))
DIVISIBILITY_UNCHECKED = register(DiagnosisSpec(
    "divisibility-unchecked", (_DIVISIBILITY,),
    "a size that does not divide by the tp size was accepted (silently truncated or padded, or "
    "failing in a collective) instead of raising a clear error on every rank",
    "for a case whose sharded sizes do not divide by the tp size: some rank returned an output, not "
    "every rank raised, or a rank's error names neither the offending sizes nor divisibility",
    "column-floor-division",
    confirmed_by=OBSERVED,
))
PRECISION_LOSS = register(DiagnosisSpec(
    "precision-loss", (_FORWARD,) + _GRADS + (_TRAINING,),
    "the result was computed or communicated in a narrower dtype than the case's: recomputing the "
    "reference in that dtype explains it, the declared dtype does not",
    "the declared dtype's tolerance rejects the result, while an emulation of the computation in a "
    "narrower dtype (the result rounded to it, or the ranks' summands reduced in it) is within that "
    "dtype's tolerance and explains it far better: its residual is at most a quarter of the residual "
    "against the dense reference (RMS over the elements)",
    "row-half-precision-reduce",
    # A cast to a narrower dtype on the forward path rounds the gradient flowing back through it too.
    consequences=_GRADS + (_TRAINING,),
))
SHAPE_ERROR = register(DiagnosisSpec(
    "shape-error", (_FORWARD,) + _GRADS + (_TRAINING,),
    "a rank's tensor (output, grad, parameter) has the wrong shape",
    "the shape of a rank's tensor differs from the one its placement implies, and no re-cut of the "
    "dense result along another dim matches it (that would be wrong-shard-dim)",
    "row-flatten-no-restore",
    consequences=_GRADS + (_REPLICA, _TRAINING),
    confirmed_by=OBSERVED,
))
WRONG_DTYPE = register(DiagnosisSpec(
    "wrong-dtype", (_FORWARD,) + _GRADS,
    "a rank's output or gradient has another dtype than the case's: another floating dtype (e.g. float32 returned "
    "for a float16 or float64 case: part of the layer computes or communicates in a dtype it never casts back from), "
    "or a complex or integer one",
    "the dtype of the rank's tensor differs from the case's dtype (checked before any value: a wider "
    "dtype can hide a lower-precision bug, a narrower one looks like rounding; a complex or integer output is "
    "never compared, which would drop its imaginary part or fraction, in any family)",
    "row-reduce-float32",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _REPLICA, _TRAINING),
    confirmed_by=OBSERVED,
))
OUTPUT_DETACHED = register(DiagnosisSpec(
    "output-detached", (_FORWARD,),
    "the forward output is detached from the autograd graph although the input requires grad: a "
    "collective (or a copy) runs outside autograd, so nothing flows back through the layer",
    "on some rank the returned tensor has grad_fn None and requires_grad False while the rank's input "
    "requires grad (recorded by the rank before backward, which would raise)",
    "column-gather-no-autograd",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _REPLICA, _TRAINING),
    confirmed_by=OBSERVED,
))
EXCEPTION = register(DiagnosisSpec(
    "exception", _PER_CASE,
    "the variant raised an exception on some rank: the report names the first rank that raised, the "
    "phase (build, forward, backward, SGD step) and carries its traceback",
    "a harness outcome, no pattern: a rank's build, forward or backward raised (the exception, its "
    "rank and phase are the evidence). No single mutant defines it: any raising code shows it "
    "(column-bias-default-dtype and column-view-flatten in the catalog do)",
    None,
    consequences=_PER_CASE,
    confirmed_by=OBSERVED,
))
COLLECTIVE_ON_STRIDED_VIEW = register(DiagnosisSpec(
    "collective-on-strided-view", _PER_CASE,
    "a collective was given a view that a real backend computes wrongly or refuses: a slice that is "
    "not dense (big[..., :n], x[..., ::2]), an expanded tensor, or a transposed one where the backend "
    "reads storage order. Plain gloo computes on the first numel elements of the storage instead; NCCL "
    "refuses it. The report names the rank, the collective and the view's shape and strides",
    "a rank raised tpsim.CollectiveOnStridedView at the call, on inproc and gloo alike: the tensor is not "
    "contiguous and the layout table of tpsim.comm.ops (gloo's column measured against plain torch gloo, "
    "NCCL's from its checks) says one of the two computes it wrongly or refuses it for that op and place",
    "row-reduce-strided-view",
    consequences=_PER_CASE,
    confirmed_by=OBSERVED,
))
MISMATCH = register(DiagnosisSpec(
    "mismatch", _PER_CASE,
    "the values differ from the dense reference in no recognised pattern: the message quotes the "
    "element that violates the tolerance most (got vs expected, its bound) and the best hint",
    "the fallback, a harness outcome: the tolerance rejects the result and no recogniser found its "
    "evidence. No mutant defines it (a mutant with a mechanism gets that mechanism's name)",
    None,
    confirmed_by=FALLBACK,
))
FAULT_NOT_SURFACED = register(DiagnosisSpec(
    "fault-not-surfaced", (_FAULTS,),
    "under a fault plan, the fault was neither reported (an error naming the injected rank, the "
    "collective and its call) nor harmless nor caught by an equivalence property",
    "a harness outcome of the fault-detection property (tpsim/props/faults.py): the run with the "
    "plan returned a result that differs from the clean run while every equivalence property passes "
    "on it, raised without naming the injected rank and call, overran its time bound or left a rank "
    "behind. It tests the backends' fault reporting, so no layer mutant defines it "
    "(tests/test_faults_property.py shows it)",
    None,
    confirmed_by=OBSERVED,
))

RANK_EXITED = register(DiagnosisSpec(
    "rank-exited", _PER_CASE + (_DIVISIBILITY,),
    "a rank ended its process instead of returning or raising (os._exit, sys.exit, exit() from native "
    "code): the report names the rank, its phase (build, forward, backward, SGD step) and the exit status",
    "a harness outcome: the rank raised SystemExit, or (on an isolated inproc world, or gloo) the process "
    "running it ended with an exit status while that rank held the baton. No catalogued mutant: the "
    "catalog runs in-process, where such a mutant would end the test run (tests/test_isolation.py "
    "writes them as hostile rank functions)",
    None,
    consequences=_PER_CASE,
    confirmed_by=OBSERVED,
))
RANK_CRASHED = register(DiagnosisSpec(
    "rank-crashed", _PER_CASE + (_DIVISIBILITY,),
    "a rank crashed: its process was killed by a signal (segfault, abort(), the out-of-memory killer) "
    "or it ran out of memory; the report names the rank, its phase and the signal or allocation",
    "a harness outcome: the rank raised MemoryError or torch's \"can't allocate memory\", or (on an "
    "isolated inproc world, or gloo) the process running it was killed by a signal while that rank held "
    "the baton. No catalogued mutant, for the reason given for rank-exited",
    None,
    consequences=_PER_CASE,
    confirmed_by=OBSERVED,
))

# Vocab-parallel embeddings and cross-entropies (recognisers: tpsim/props/vocab/checks.py).
VOCAB_MASK_MISSING = register(DiagnosisSpec(
    "vocab-mask-missing", (_FORWARD,),
    "an embedding's output for an id also holds a row of every rank that does not own the id: the "
    "ranks look up ids outside their vocabulary range (shifted and clamped into it) without zeroing "
    "those rows before the all-reduce",
    "embedding output - dense lookup = sum, over the ranks r that do not own the id, of rank r's stored "
    "row at local index 0 or at the id clamped into r's range, within tolerance, with tp >= 2",
    "embedding-unmasked-ids",
    consequences=(_WEIGHT_GRAD,),
))
LABEL_SMOOTHING_PER_SHARD = register(DiagnosisSpec(
    "label-smoothing-per-shard", (_FORWARD, _INPUT_GRAD),
    "with label smoothing, each rank's loss averages the smoothing term over its own vocabulary shard "
    "instead of the whole vocabulary, so the ranks' losses differ (Megatron-LM #737)",
    "label_smoothing > 0, tp >= 2, and every rank's loss equals the smoothed loss recomputed with the "
    "mean log-probability taken over that rank's shard only (as F.cross_entropy smooths, or as Megatron "
    "does with the shard's size as the vocabulary size), within tolerance; or every rank's logits grad "
    "equals the autograd grad of that rank's per-shard loss, within the grad's bound; or, with one id "
    "per rank, every rank's own code raised ZeroDivisionError in the forward (the factor n/(n-1))",
    "cross-entropy-smoothing-per-shard",
    consequences=(_INPUT_GRAD, _REPLICA),
))
MAX_NOT_REDUCED = register(DiagnosisSpec(
    "max-not-reduced", (_FORWARD,),
    "the softmax over a sharded vocabulary shifted each rank's logits by that rank's own maximum: the "
    "all-reduce MAX of the logits' maximum is missing, so the shards' exponentials are summed with "
    "different shifts",
    "tp >= 2 and the loss equals the cross-entropy recomputed with every logit shifted by the maximum of "
    "its own rank's shard (log sum_j exp(x_j - m_rank(j)) - (x_t - m_rank(t)), smoothed the same way), "
    "within tolerance",
    "cross-entropy-local-max",
    consequences=(_INPUT_GRAD,),
))
LOSS_OFF_BY_LOG_TP = register(DiagnosisSpec(
    "loss-off-by-log-tp", (_FORWARD,),
    "the loss is the dense one plus exactly log(tp): a vocab-parallel cross-entropy was given the "
    "gathered logits as if they were a shard, so it saw every logit tp times (Megatron-LM #7452)",
    "tp >= 2 and every non-ignored token's loss equals the dense loss + log(tp) within tolerance "
    "(a reduced loss: the same offset summed or averaged)",
    "cross-entropy-gathered-logits",
    consequences=(_INPUT_GRAD,),
))
VOCAB_PADDING_IN_SOFTMAX = register(DiagnosisSpec(
    "vocab-padding-in-softmax", (_FORWARD,),
    "the padding columns of a vocabulary padded to a multiple of the tp size took part in the softmax: "
    "the loss is a cross-entropy over the padded vocabulary (Megatron-LM #1754)",
    "the vocabulary does not divide by the tp size and the loss equals the cross-entropy recomputed over "
    "the padded logits as the ranks held them (padding columns included), within tolerance",
    "cross-entropy-padding-in-softmax",
    consequences=(_INPUT_GRAD,),
))

# Head-sharded attention (recognisers: tpsim/props/attention/checks.py).
QKV_HEAD_MISMATCH = register(DiagnosisSpec(
    "qkv-head-mismatch", (_FORWARD,),
    "a rank's query heads attend with key/value heads of another group: Q, K and V were not split "
    "along the same heads",
    "at least as many key/value heads as ranks; every rank holds its own query heads, but some rank's "
    "K/V rows are master heads other than the ones its query heads use (read from the rows it stores), "
    "and the output equals the attention recomputed with that pairing of query and key/value heads, "
    "within tolerance; in a whole module (a block), the forward first diverges inside an attention "
    "sublayer whose Q/K/V projections match, and the same case passes once every key row and every "
    "value row of its masters is made one row (every key/value head the same head), as does a larger "
    "case (more tokens, another seed) that the module as declared fails",
    "attention-kv-heads-round-robin",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD),
    confirmed_by=RERUN,
))
KV_HEADS_NOT_REPLICATED = register(DiagnosisSpec(
    "kv-heads-not-replicated", (_FORWARD,),
    "with fewer key/value heads than ranks (grouped-query attention), a rank holds a key/value head its "
    "query heads do not use instead of the replica of their own",
    "fewer key/value heads than ranks; every rank holds its own query heads, but some rank's K/V rows are "
    "another head than the one its query heads use (read from the rows it stores), and the output equals "
    "the attention recomputed with that pairing, within tolerance; for a head-packed Q/K/V column layer "
    "(Variant.head_size), every rank's query columns are its own and its K and V columns both equal those "
    "of one master key/value head, not head r // (tp / num_kv_heads) on some rank",
    "attention-kv-not-replicated",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _TRAINING),
))
ATTENTION_SCALE = register(DiagnosisSpec(
    "attention-scale", (_FORWARD,),
    "the attention scores are scaled by a tp-dependent factor times 1/sqrt(head_dim): the softmax scale "
    "was computed from a local (per-rank) size instead of the head dim",
    "tp >= 2 and every rank's output equals the attention recomputed with its softmax scale multiplied by "
    "c in {sqrt(tp), 1/sqrt(tp), tp, 1/tp}, within that recomputation's tolerance",
    "attention-local-head-dim-scale",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD),
))
PLAN_INPUT_LAYOUT = register(DiagnosisSpec(
    "plan-input-layout", (_FORWARD,) + _GRADS,
    "a module of a tensor-parallel plan gets its input in another layout than its style expects: each rank "
    "hands a planned layer its own piece (a sequence shard) where the layer needs the whole input; the "
    "plan's PrepareModuleInput on that module (or the output layout of the entry before it) is missing",
    "the same failing case passes with one change to the plan: a PrepareModuleInput turning the module's "
    "sharded input into the layout its planned sublayers expect, or one entry's style with its gather or "
    "split (colwise_gather_output for colwise, rowwise_split_input for rowwise); plans are not layers, so no "
    "catalogued layer mutant shows it (the buggy plans of tests/test_plans.py and tests/hf_subclasses.py do)",
    None,
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD),
    confirmed_by=RERUN,
))

NONDETERMINISTIC = register(DiagnosisSpec(
    "nondeterministic", (_FORWARD,),
    "the forward is not deterministic: run twice on one rank, on the same input from the same "
    "parameters, it gives different outputs (dropout in train mode, unseeded noise); put the module in "
    "eval mode or seed it",
    "the dense reference (the module on a tp group of one rank) run twice on the same input, with the same "
    "parameters and buffers, gives outputs that are not bit-identical",
    "module-dropout-in-train-mode",
    consequences=(_INPUT_GRAD, _WEIGHT_GRAD, _BIAS_GRAD, _REPLICA, _TRAINING),
    confirmed_by=OBSERVED,
))

# Training as people train: gradient accumulation and clipping (recognisers: tpsim/props/training.py).
GRAD_REDUCED_AFTER_ACCUMULATION = register(DiagnosisSpec(
    "grad-reduced-after-accumulation", (_TRAINING,),
    "a grad accumulated over several micro-batches counts an earlier micro-batch again: it is reduced over "
    "the tp group after every backward (a register_post_accumulate_grad_hook that all-reduces param.grad), so "
    "what earlier micro-batches accumulated is reduced again; after two micro-batches the grad is off by "
    "exactly (tp-1) times the first micro-batch's grad. Reduce once per optimizer step, after the "
    "accumulation, or reduce only the fresh micro-batch's grad (a Tensor.register_hook on the parameter)",
    "the first micro-batch's grad matches the dense one, while the grad accumulated over the first optimizer "
    "step's micro-batches equals the dense accumulated grad plus c times the dense first micro-batch's grad "
    "(c != 0 fitted by least squares, within the bound of each), in a tensor of at least two elements whose "
    "first micro-batch's grad is not proportional to the later micro-batches' (so no constant scaling of "
    "every micro-batch explains it); the factor c is reported (tp - 1 for an all-reduce after each of two "
    "micro-batches)",
    "sequence-bias-grad-hook-reduce",
))
NORM_COUNTS_REPLICAS = register(DiagnosisSpec(
    "norm-counts-replicas", (_TRAINING,),
    "the total grad norm a distributed clip computes counts every replicated parameter once per rank: "
    "norm^2 = dense norm^2 + (tp-1) * sum of the replicated parameters' grad^2, so the grads are clipped "
    "too hard; count a replicated parameter on one rank only (Megatron's "
    "param_is_not_tensor_parallel_duplicate), or sum the squares of sharded parameters only across ranks",
    "the target supplies a clip function, tp >= 2, some replicated parameter has a non-zero grad, and the "
    "total norm it returned on a rank differs from the dense total norm of the same grads beyond its bound "
    "while it equals sqrt(dense norm^2 + (tp-1) * sum over the replicated parameters of their dense grad's "
    "squared norm) within that bound",
    "module-clip-counts-replicas",
))

NORM_NOT_REDUCED = register(DiagnosisSpec(
    "norm-not-reduced", (_TRAINING,),
    "the total grad norm a clip computes is each rank's own: the squares of its local pieces are never "
    "summed over the tp group (a norm of plain local tensors: torch.nn.utils.clip_grad_norm_ reduces only "
    "DTensor grads), so every rank clips by its own coefficient and replicated parameters drift apart; "
    "all-reduce the sum of squares of the sharded parameters' grads before the square root",
    "the target supplies a clip function, tp >= 2, and the total norm it returned on a rank differs from the "
    "dense total norm of the same grads beyond its bound while it equals, within that bound, the 2-norm of "
    "that rank's own accumulated grads (its local pieces, replicated parameters counted once)",
    "module-clip-local-norm",
    consequences=(_REPLICA,),
))

# --- diagnoses and failures ----------------------------------------------------------------------


@dataclass(frozen=True)
class Diagnosis:
    """A named explanation: ``name`` (a registered diagnosis), a one-paragraph ``message``,
    and ``details`` (numbers such as ``max_abs``, ``max_rel``, ``where``, ``factor``)."""

    name: str
    message: str
    details: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.name not in REGISTRY:
            raise ValueError(f"Diagnosis(name={self.name!r}) is not one of {sorted(REGISTRY)}")


@dataclass
class Failure:
    """One failed property on one case: what a report lists and a case file records.

    - ``property``: the property's name (``forward-equivalence``, ...);
    - ``diagnosis``: a registered diagnosis name (stable: scripts match on it);
    - ``message``: one paragraph saying what was wrong, with the numbers (no traceback);
    - ``case``: the (minimal, when it comes from a search) :class:`tpsim.props.case.Case`;
    - ``case_file``: the path the case was saved to (None until saved);
    - ``rank``: the rank the evidence comes from, when one rank stands out (always set for
      ``exception``: the first rank that raised);
    - ``traceback``: that rank's traceback text, for ``exception`` (else None);
    - ``details``: numbers behind the message (``max_abs``, ``max_rel``, ``where``, ``factor``...);
    - ``variant``: the variant's name;
    - ``found_after``: how many examples a search had run when this property first failed with
      this diagnosis (None outside a search);
    - ``sublayer``: which sublayer of a module the failure comes from (None for a single layer);
      rendered ``fc2: bias-duplication``;
    - ``consequences``: failures of other properties on the same case that follow from this one's
      cause (see :func:`group_causes`); a report counts this failure once, as one cause.
    """

    property: str
    diagnosis: str
    message: str
    case: Any = None
    case_file: str | None = None
    rank: int | None = None
    details: dict[str, Any] = field(default_factory=dict)
    variant: str | None = None
    traceback: str | None = None
    found_after: int | None = None
    sublayer: str | None = None
    consequences: list[Failure] = field(default_factory=list)

    @property
    def label(self) -> str:
        """``diagnosis``, prefixed by the sublayer when there is one (``fc2: bias-duplication``)."""
        return f"{self.sublayer}: {self.diagnosis}" if self.sublayer else self.diagnosis

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: every field above, the case as its dict (:meth:`Case.to_dict`); each
        consequence as its own dict (its case left out when it is this failure's case)."""
        case = self.case.to_dict() if hasattr(self.case, "to_dict") else self.case
        consequences = []
        for c in self.consequences:
            data = c.to_json()
            if c.case is self.case or c.case == self.case:
                data.pop("case")
            consequences.append(data)
        return {
            "variant": self.variant,
            "property": self.property,
            "diagnosis": self.diagnosis,
            "sublayer": self.sublayer,
            "message": self.message,
            "rank": self.rank,
            "traceback": self.traceback,
            "case": case,
            "case_file": self.case_file,
            "found_after": self.found_after,
            "details": jsonable(self.details),
            "consequences": consequences,
        }

    #: Older name of :meth:`to_json`.
    to_dict = to_json

    def describe(self) -> str:
        """Human-readable block: ``property: diagnosis``, the message, the case, the traceback and
        the consequences of the same cause."""
        lines = [f"{self.property}: {self.label}", f"  {self.message}"]
        if self.case is not None:
            lines.append(f"  case: {self.case.describe() if hasattr(self.case, 'describe') else self.case}")
        if self.case_file:
            lines.append(f"  case file: {self.case_file}")
        if self.traceback:
            lines.append(f"  traceback on rank {self.rank}:")
            lines.extend("    " + line for line in self.traceback.rstrip().splitlines())
        if self.consequences:
            lines.append("  consequences of the same cause:")
            lines.extend(f"    {c.property}: {c.label} — {c.message}" for c in self.consequences)
        return "\n".join(lines)



# --- one cause, one report -----------------------------------------------------------------------


def follows_from(cause: Failure, other: Failure) -> bool:
    """Whether ``other`` (a failure on the same case) follows from ``cause``: its property is one
    of the consequences the registry lists for ``cause``'s diagnosis, it comes from the same
    sublayer (or a later one: ``cause.sublayer`` None covers them all), and it is not ``cause``'s
    own property."""
    if other is cause or other.property == cause.property:
        return False
    if cause.sublayer is not None and other.sublayer not in (None, cause.sublayer):
        return False
    return other.property in spec(cause.diagnosis).consequences


def each_failure(causes: Sequence[Failure]) -> Iterator[Failure]:
    """Every failure of ``causes``: each cause, then the consequences listed under it."""
    for cause in causes:
        yield cause
        yield from cause.consequences


def group_causes(failures: Sequence[Failure]) -> list[Failure]:
    """Fold the failures of one case into causes: each failure that :func:`follows_from` an earlier
    cause is moved into that cause's ``consequences`` (listed there, never dropped); the rest are
    the causes, in their original order. Idempotent."""
    causes: list[Failure] = []
    for f in failures:
        owner = next((c for c in causes if follows_from(c, f)), None)
        if owner is None:
            causes.append(f)
        else:
            owner.consequences.append(f)
            owner.consequences.extend(f.consequences)
            f.consequences = []
    order = {p: i for i, p in enumerate((*_PER_CASE, _DIVISIBILITY))}
    for c in causes:  # in the order properties are evaluated, however they were attached
        c.consequences.sort(key=lambda f: order.get(f.property, len(order)))
    return causes


def confirm(failures: Sequence[Failure], float64: Sequence[Failure], patterns: frozenset[str] | set[str],
            dtype: str) -> None:
    """Hold the diagnoses ``patterns`` (read from numeric patterns: a factor, a bias multiple, an
    offset of log tp) found on a ``dtype`` case narrower than float64 to what the *same case in
    float64* shows (``float64``: its failures), where rounding cannot fake a pattern. For each such
    failure (or consequence): kept where float64 shows the same diagnosis for the same property and
    sublayer; renamed to the diagnosis float64 shows for that property and sublayer, if it names
    one; otherwise ``mismatch``, with what was measured and what float64 showed. In place."""
    seen: dict[tuple[str, str | None], Failure] = {}
    for f in each_failure(float64):
        seen.setdefault((f.property, f.sublayer), f)
    names = {(f.property, f.sublayer, f.diagnosis) for f in each_failure(float64)}
    for f in each_failure(failures):
        if f.diagnosis not in patterns and f.diagnosis != MISMATCH or (f.property, f.sublayer, f.diagnosis) in names:
            continue
        twin = seen.get((f.property, f.sublayer))
        if f.diagnosis == MISMATCH and (twin is None or twin.diagnosis not in patterns):
            continue  # nothing named here, nothing better named in float64
        f.details = {**f.details, "unconfirmed": f.diagnosis}
        if twin is not None and twin.diagnosis != MISMATCH:
            f.message = (f"{twin.message} (named from the same case in float64; in {dtype} the pattern looked "
                         f"like {f.diagnosis}, which rounding can fake)")
            f.details = {**f.details, **twin.details, "unconfirmed": f.diagnosis}
            f.diagnosis = twin.diagnosis
            continue
        shown = ", ".join(sorted({x.label for x in float64})) or "no failure"
        f.message = (f"{f.message} — not named {f.diagnosis}: the same case in float64 shows {shown}, so the "
                     "pattern is not confirmed where rounding cannot fake it")
        f.diagnosis = MISMATCH


def not_confirmed(failures: Sequence[Failure], patterns: frozenset[str] | set[str], why: str) -> None:
    """Every failure (or consequence) of ``failures`` named one of ``patterns`` becomes ``mismatch``:
    its confirming run could not be made (``why``). In place."""
    for f in each_failure(failures):
        if f.diagnosis in patterns:
            f.details = {**f.details, "unconfirmed": f.diagnosis}
            f.message = f"{f.message} — not named {f.diagnosis}: {why}"
            f.diagnosis = MISMATCH


def claims(*rules: Confirmed) -> frozenset[str]:
    """The registered names confirmed by one of ``rules`` (:data:`CONFIRMATIONS`); none given: every name a
    float64 re-run confirms (:data:`FLOAT64`, :data:`ONE_RANK`, :data:`RERUN`)."""
    wanted = set(rules or (FLOAT64, ONE_RANK, RERUN))
    return frozenset(s.name for s in REGISTRY.values() if s.confirmed_by in wanted)


def tp_factor_claim(failure: Failure) -> bool:
    """Whether ``failure`` names a factor of the tp size (:data:`ONE_RANK`): not a returned bias added
    again (``bias-duplication`` with ``returned``: +1*bias at any tp, the layer's own evidence)."""
    return REGISTRY[failure.diagnosis].confirmed_by == ONE_RANK and not failure.details.get("returned")


def confirm_on_one_rank(failures: Sequence[Failure], one_rank: Sequence[Failure] | None, why_not: str = "",
                        more_ranks: tuple[int, Sequence[Failure]] | None = None) -> None:
    """Hold the tp-factor claims among ``failures`` (:func:`tp_factor_claim`) to the same case on one rank
    (``one_rank``: its failures, float64): a factor of the tp size vanishes there, so a claim whose property
    fails on one rank too is renamed ``mismatch``, with the facts and what one rank showed. ``one_rank``
    None: the case could not run on one rank (``why_not`` says why); the claim then stands only where
    ``more_ranks`` — ``(tp, failures)`` of the same case grown to a larger tp size, float64 — shows the same
    name for the same property, its factor grown with the tp size (the recognisers check the factor of the
    case's own tp size). In place."""
    seen = {} if one_rank is None else {f.property: f for f in each_failure(one_rank)}
    grown = set() if more_ranks is None else {(f.property, f.diagnosis) for f in each_failure(more_ranks[1])}
    for f in each_failure(failures):
        if not tp_factor_claim(f):
            continue
        if one_rank is not None and f.property not in seen:
            continue  # vanished on one rank: a factor of the tp size
        if one_rank is None and (f.property, f.diagnosis) in grown:
            continue  # grew with the tp size
        if one_rank is not None:
            other = seen[f.property]
            why = (f"the same case on one rank (float64) fails {f.property} too ({other.label}: "
                   f"{other.message}), so the difference does not come from the tp size")
        elif more_ranks is not None:
            why = (f"it could not run on one rank ({why_not}), and the same case at tp size {more_ranks[0]} "
                   f"(float64, sizes grown with it) does not show it: the factor does not grow with the tp size")
        else:
            why = f"it could not be confirmed on one rank, where a factor of the tp size vanishes ({why_not})"
        f.details = {**f.details, "unconfirmed": f.diagnosis}
        f.message = f"{f.message} — not named {f.diagnosis}: {why}"
        f.diagnosis = MISMATCH


def confirmation_table() -> list[tuple[str, str, str]]:
    """``(name, how it is confirmed, what that means)`` of every registered diagnosis, in registration
    order (for the docs table)."""
    return [(s.name, s.confirmed_by.value, CONFIRMATIONS[s.confirmed_by]) for s in REGISTRY.values()]


# --- the fallback --------------------------------------------------------------------------------


@recogniser(MISMATCH)
def mismatch(actual: torch.Tensor, expected: torch.Tensor, *, what: str, tol: torch.Tensor | None = None,
             hint: str = "") -> Diagnosis:
    """The fallback diagnosis: no recogniser saw its evidence.

    With ``tol`` (the per-element bound) the message quotes the element that violates the bound by
    the largest factor — got, expected, its error and its bound — then the max absolute and
    relative errors; without it, the element of the max absolute error. ``hint`` (e.g. "within
    bfloat16 rounding") is appended as a hint, never as a name."""
    a = actual.to(torch.float64)
    e = expected.to(torch.float64)
    if a.shape != e.shape:
        return Diagnosis(MISMATCH, f"{what} has shape {list(a.shape)}, expected {list(e.shape)}", {})
    diff = (a - e).abs()
    if diff.numel() == 0:
        return Diagnosis(MISMATCH, f"{what} differs from the dense reference", {})
    diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
    flat = int(torch.argmax(diff))
    where_abs = [int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape)] if diff.dim() else []
    max_abs = float(diff.reshape(-1)[flat])
    max_rel = float((diff / e.abs().clamp_min(torch.finfo(torch.float64).tiny)).max())
    details: dict[str, Any] = {"max_abs": max_abs, "max_rel": max_rel, "where_max_abs": where_abs}
    worst = worst_violation(a, e, tol) if tol is not None else None
    if worst is not None and tol is not None:
        got, want = float(a[worst]), float(e[worst])
        err = float(diff[worst])
        bound = float(tol.to(torch.float64).expand_as(diff)[worst])
        details.update(where=list(worst), got=got, expected=want, error=err, bound=bound)
        text = (f"{what} differs from the dense reference beyond its tolerance: at index {list(worst)} got {got:.6g}, "
                f"expected {want:.6g} (error {err:.3g} > bound {bound:.3g}, the worst violation relative to its "
                f"bound); max abs error {max_abs:.3g} at index {where_abs}; max rel error {max_rel:.3g}")
    else:
        got, want = float(a.reshape(-1)[flat]), float(e.reshape(-1)[flat])
        details["where"] = where_abs
        text = (f"{what} differs from the dense reference: max abs error {max_abs:.3g} at index {where_abs} "
                f"(got {got:.6g}, expected {want:.6g}); max rel error {max_rel:.3g}")
    if hint:
        text += f" ({hint})"
        details["hint"] = hint
    return Diagnosis(MISMATCH, text, details)
