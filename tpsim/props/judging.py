"""Judging one observation: the engine's one path from a world run to its failures.

Every family is judged the same way (:func:`judge`, called by :meth:`tpsim.props.family.Family.judge`):

1. **what applies**: the properties asked for, among those the variant is checked for
   (:meth:`Family.applicable`);
2. **shared first**: an output that is no real floating tensor is ``wrong-dtype`` in every family;
3. **triage** of the run: the dense reference failed (a family whose reference is a run:
   :func:`reference_failure`); a rank died; the sizes do not divide (:meth:`Family.refused`: a clear
   refusal on every rank holds, anything else is ``divisibility-unchecked``; a variant that shards
   such sizes by design is judged like any other case); the run failed
   (:meth:`Family.failed_run`: :func:`tpsim.props.blame.run_failure` unless the family knows more);
   the parameters are not laid out as any rank could hold them (:meth:`Family.layout_failure`);
4. **each tp group on its own**: the family's :class:`GroupContext` of the group, and every check of
   the family's registry (:attr:`Family.checks`: property -> ``check(ctx) -> Failure | None``) that
   applies, in registry order — only the forward when some rank's output could not be
   back-propagated; a training failure beside a single-step one is listed under it (training runs on
   every grad, the wrong ones included). The first group that fails is reported, its ranks relabelled as tp ranks and the
   group named (:func:`relabel`), and a collective over another set of ranks named ``wrong-group``
   where the family recognises one (:meth:`Family.wrong_group`).

The shared checks live here too: ``replica-consistency`` (:func:`replica_consistency`: everything a
group context says is replicated must be the same bits on every rank of the group) and the
reference failure of a family whose dense reference is itself a run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tpsim.diagnosis import (
    EXCEPTION,
    NONDETERMINISTIC,
    REGISTRY,
    REPLICA_DIVERGENCE,
    SHAPE_ERROR,
    WRONG_GROUP,
    Diagnosis,
    Failure,
    follows_from,
    recogniser,
)
from tpsim.errors import RankDied
from tpsim.props.blame import death_failure
from tpsim.props.groups import tp_groups
from tpsim.props.observation import (
    DETACHED,
    OUTPUT_SHAPE,
    DenseReferenceFailed,
    NotDeterministic,
    Observation,
    output_dtype_failure,
)
from tpsim.props.property_names import DIVISIBILITY, FORWARD, REPLICA, TRAINING
from tpsim.props.tolerance import Tolerance

if TYPE_CHECKING:
    from tpsim.props.family import Family

__all__ = ["Check", "GroupContext", "Replicated", "failure", "judge", "reference_failure", "relabel",
           "replica_consistency"]

_F64 = torch.float64


@dataclass
class Replicated:
    """A tensor every rank of a tp group must hold bit for bit: ``what`` it is, each rank's copy (tp
    rank order; None: missing, which the equivalence properties report), the parameter it belongs to
    and ``why`` a divergence matters (said after the facts)."""

    what: str
    tensors: list[Any]
    param: str | None = None
    why: str = ""


class GroupContext:
    """One tp group of one observation, as every check of the registry sees it: the variant, the
    case, the observation, the group's index ``g`` (``group_index``) and global ``ranks``, every rank's result in tp
    rank order (``values``), and the one tolerance model of the case (:meth:`tol`). A family's
    context adds its dense reference and says what is replicated (:meth:`replicated`)."""

    def __init__(self, variant: Any, obs: Observation, group_index: int, ranks: Sequence[int],
                 values: list[Any]) -> None:
        self.variant, self.obs, self.case, self.group_index = variant, obs, obs.case, group_index
        self.ranks = list(ranks)
        self.values = values
        self.tp = len(values)
        self.dtype: torch.dtype = obs.case.torch_dtype
        self.tolerance = Tolerance(self.dtype, self.tp)

    def tol(self, magnitude: torch.Tensor, reduction_length: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The bound of each element of a result of ``magnitude`` (:class:`tpsim.props.tolerance.Tolerance`)."""
        return self.tolerance.bound(magnitude, reduction_length, dtype)

    def fail(self, prop: str, diag: Diagnosis, rank: int | None = None, sublayer: str | None = None,
             **details: Any) -> Failure:
        """The failure of ``prop`` named by ``diag`` on tp rank ``rank`` of this group."""
        return Failure(prop, diag.name, diag.message, case=self.case, rank=rank, variant=self.variant.name,
                       details={**diag.details, **details}, sublayer=sublayer)

    def compared(self, prop: str, what: str, rank: int, got: torch.Tensor | None, expected: torch.Tensor,
                 tol: torch.Tensor, recognisers: Sequence[Callable[[], Failure | None]] = ()) -> Failure | None:
        """Tp rank ``rank``'s tensor ``got`` against ``expected`` (its whole piece of the dense result) within
        ``tol`` (:func:`tpsim.props.placed.verdict`); a difference is named by the first of the family's
        ``recognisers`` (each a call that returns its failure or None) that sees its evidence, else by the
        shared ones."""
        from tpsim.props.placed import Placed, verdict

        def named(*_: Any) -> Diagnosis | None:
            for recognise in recognisers:
                found = recognise()
                if found is not None:
                    named.failure = found  # type: ignore[attr-defined]
                    return Diagnosis(found.diagnosis, found.message, found.details)
            return None

        found = verdict(Placed(what, [got], expected, tol, grad=prop != FORWARD, ranks=(rank,)), self.dtype, [named])
        if found is None:
            return None
        return getattr(named, "failure", None) or self.fail(prop, found[0], found[1])

    @property
    def unusable(self) -> bool:
        """Whether some rank's output could not be back-propagated (only the forward can be judged)."""
        return any(getattr(v, "status", None) in (OUTPUT_SHAPE, DETACHED) for v in self.values)

    def replicated(self) -> list[Replicated]:
        """Everything the ranks of the group must hold bit for bit (default: nothing)."""
        return []


def failure(variant: Any, case: Any, prop: str, diagnosis: str, message: str, *, rank: int | None = None,
            details: dict[str, Any] | None = None) -> Failure:
    """A :class:`~tpsim.diagnosis.Failure` of ``variant`` on ``case`` (a recogniser's finding)."""
    return Failure(prop, diagnosis, message, case=case, rank=rank, details=details or {}, variant=variant.name)


#: A check of the registry: the failure of its property on one tp group, or None.
Check = Callable[[GroupContext], "Failure | None"]


@recogniser(REPLICA_DIVERGENCE)
def replica_consistency(ctx: GroupContext) -> Failure | None:
    """``replica-divergence`` for the first of the context's replicated tensors that some rank holds
    other bits of than tp rank 0; missing or mis-shaped copies are the equivalence properties' findings."""
    for item in ctx.replicated():
        tensors = item.tensors
        if any(t is None for t in tensors) or len({tuple(t.shape) for t in tensors}) > 1:
            continue
        bad = [r for r in range(1, len(tensors)) if not _same_bits(tensors[r], tensors[0])]
        if bad:
            diff = max(float((tensors[r].to(_F64) - tensors[0].to(_F64)).abs().max()) for r in bad)
            details: dict[str, Any] = {"ranks": bad, "max_abs": diff, "tensor": item.what}
            if item.param:
                details["param"] = item.param
            return ctx.fail(REPLICA, Diagnosis(
                REPLICA_DIVERGENCE,
                f"{item.what} must be identical on every rank of the tp group, but ranks {bad} differ from rank 0 "
                f"(max abs difference {diff:.3g}){item.why}", details),
                bad[0], None if item.param is None else item.param.rpartition(".")[0] or None)
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other is NaN (a mean over no target is NaN on every rank)."""
    if torch.equal(a, b):
        return True
    if a.dtype != b.dtype or not a.is_floating_point():
        return False
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


@recogniser(EXCEPTION, NONDETERMINISTIC)
def reference_failure(variant: Any, obs: Observation, failed: DenseReferenceFailed) -> Failure:
    """The variant failed where it is its own dense reference (``failed``: one rank, float64, the
    module family's reference world): not deterministic, its rank died, or it raised."""
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


def relabel(failures: list[Failure], group_index: int, ranks: Sequence[int]) -> list[Failure]:
    """``failures`` of tp group ``group_index`` (global ``ranks``) with their ranks made global and the group named."""
    for f in failures:
        if f.rank is not None:
            f.details = dict(f.details, tp_rank=f.rank)
            f.rank = ranks[f.rank]
        f.details = dict(f.details, group=group_index, group_ranks=list(ranks))
        f.message = f"in tp group {group_index} (global ranks {list(ranks)}; rank numbers below are tp ranks): {f.message}"
    return failures


def judge(family: Family, variant: Any, obs: Observation, properties: Sequence[str] | None = None) -> list[Failure]:
    """The failures of one observation (see the module docstring), in registry order."""
    wanted = family.wanted(variant, properties)
    wrong = output_dtype_failure(variant, obs)
    if wrong is not None:
        return [wrong] if FORWARD in wanted else []
    if obs.reference_error is not None:
        return [reference_failure(variant, obs, obs.reference_error)]
    # A variant that declares it shards sizes that do not divide (by design) is held to every property
    # on them: a rank that raises there fails it, a refusal does not count.
    divisible = obs.divisible or bool(getattr(variant, "uneven_sizes_are_cases", False))
    if not divisible and obs.error is None:  # accepted: held pieces the family can judge, or truncated
        return [f for f in family.accepted(variant, obs, wanted) if f.property in wanted]
    if not divisible:
        return family.refused(variant, obs) if DIVISIBILITY in wanted else []
    if isinstance(obs.error, RankDied):
        return [death_failure(variant.name, obs.case, obs.error)]
    if obs.error is not None:
        return [family.failed_run(variant, obs)]
    laid_out = family.layout_failure(variant, obs)
    if laid_out is not None:
        return [laid_out]
    return judge_groups(family, variant, obs, wanted)


def judge_groups(family: Family, variant: Any, obs: Observation, wanted: Sequence[str]) -> list[Failure]:
    """Each tp group of a run every rank finished, judged on its own; the first that fails is reported."""
    case, values = obs.case, obs.values or []
    groups = tp_groups(case.world_size, case.tp_size or case.world_size, case.tp_layout)
    for group_index, ranks in enumerate(groups):
        ctx = family.context(variant, obs, group_index, ranks, [values[r] for r in ranks])
        if ctx.unusable:  # no backward ran: only the forward can be judged
            found = family.checks[FORWARD](ctx)
            failures = [found or ctx.fail(FORWARD, Diagnosis(SHAPE_ERROR, "the output shape does not match the "
                                                                          "upstream grad"))]
        else:
            failures = [f for prop, check in family.checks.items() if prop in wanted and (f := check(ctx)) is not None]
            # Training runs on every grad, the wrong ones included: where a single-step property fails,
            # the trained parameters differ by consequence, whichever sublayer owns them.
            trained = [f for f in failures if f.property == TRAINING]
            others = [f for f in failures if f.property != TRAINING]
            if trained and others and REGISTRY[trained[0].diagnosis].properties == (TRAINING,) and all(
                    follows_from(trained[0], f) for f in others):
                # ... unless the training step itself explains them (a clip whose norm each rank computes
                # alone makes the replicas diverge): then it is the cause.
                trained[0].consequences.extend(others)
                failures = trained
            elif trained and others:
                failures = others
                failures[0].consequences.extend(trained)
        if not failures:
            continue
        if len(ranks) == case.world_size:
            return failures
        wrong = family.wrong_group(variant, obs, groups)
        return [Failure(f.property, WRONG_GROUP, wrong[f.property]["message"], case=case, rank=0,
                        variant=variant.name, details={"used": wrong[f.property]["used"],
                                                       "used_ranks": wrong[f.property]["ranks"], "groups": groups})
                if f.property in wrong else relabel([f], group_index, ranks)[0] for f in failures]
    return []
