"""A rank's exception, from the rank that raises it to the one failure that names it.

**On the rank.** Every family's rank function runs the variant's code (build, forward, backward)
inside ``try``/``except`` and raises :func:`variant_raised`'s :class:`VariantRaised` instead: phase,
SGD step, a one-line summary and the traceback text, as declared fields (plain data: it travels back
from gloo workers and from the isolated worker). Its ``collective`` field holds the
:class:`~tpsim.CollectiveError` when what stopped the variant was a collective that could not
complete (found anywhere in the exception's chain: a layer may wrap it in its own error). Such a
rank did not fail on its own: a peer raised, died or is stuck, or the calls did not match.

**In the parent.** :func:`blame` sorts a failed run's rank errors into a :class:`Blame`, and
:func:`run_failure` turns it into the one failure every family reports, in this order:

1. a rank that died (:class:`~tpsim.RankExited`, :class:`~tpsim.RankCrashed`): ``rank-exited`` /
   ``rank-crashed`` with its rank, phase and cause (:func:`death_failure`);
2. the lowest rank whose own code raised: ``exception``, with its phase, step and traceback, and
   the other ranks that raised on their own (``collective-on-strided-view`` when what it raised is
   tpsim's refusal of a view a real backend computes wrongly, :class:`~tpsim.CollectiveOnStridedView`);
3. a rank that was still running its own code when the world timed out (a rank the timeout's
   ``CollectiveError.faulty_ranks`` names that has no error of its own): ``exception``, named stuck;
4. otherwise a collective that could not complete (mismatched calls, a checksum): ``exception`` on
   the rank its verdict blames (``faulty_ranks``), else on the first rank stopped in it.

A rank stopped in a collective is never the one named while a rank of an earlier kind exists.
Every fact comes from declared fields (``RankError.errors``, ``CollectiveError.faulty_ranks``,
``RankDied.phase``, ``VariantRaised.collective``); tpsim's own messages are quoted, never read.

The ``divisibility`` property reads the same sorting (:func:`refusal_failure`): a case the variant
cannot shard must be refused by every rank's own code, with an error that names the sizes or
divisibility (:func:`names_the_size`: the only text read here is the variant's own error).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpsim.comm.scheduler import format_exception, text_of
from tpsim.diagnosis import (
    COLLECTIVE_ON_STRIDED_VIEW,
    DIVISIBILITY_UNCHECKED,
    EXCEPTION,
    RANK_CRASHED,
    RANK_EXITED,
    Failure,
    recogniser,
)
from tpsim.errors import CollectiveError, CollectiveOnStridedView, RankCrashed, RankDied, RankError
from tpsim.props.property_names import DIVISIBILITY, INPUT_GRAD, property_of_phase

__all__ = [
    "Blame",
    "VariantRaised",
    "blame",
    "death_failure",
    "failed_after_acceptance",
    "names_the_size",
    "rank_errors",
    "refusal_failure",
    "run_failure",
    "variant_raised",
]


class VariantRaised(RuntimeError):
    """The variant raised inside a rank. Declared fields: ``phase`` (``build``, ``forward``,
    ``backward``), ``step`` (0-based SGD step), ``summary`` (``Type: message``, one line),
    ``traceback_text`` (the rank's traceback), ``collective``: the :class:`~tpsim.CollectiveError`
    that stopped the variant when it was a collective that could not complete (None when the
    variant's own code failed), ``error_type``: the class of the variant's exception (``ValueError``,
    ``package.module.Error``) and ``raised_in``: the module whose code raised it (the innermost frame),
    so that a recogniser can tell an error of the variant's own code without reading any message."""

    phase: str
    step: int
    summary: str
    traceback_text: str
    collective: CollectiveError | None
    error_type: str
    raised_in: str

    def __init__(self, phase: str, step: int, summary: str, traceback_text: str,
                 collective: CollectiveError | None = None, error_type: str = "", raised_in: str = "") -> None:
        super().__init__(phase, step, summary, traceback_text)
        self.phase = phase
        self.step = step
        self.summary = summary
        self.traceback_text = traceback_text
        self.collective = collective
        self.error_type = error_type
        self.raised_in = raised_in

    def __reduce__(self) -> tuple[Any, ...]:  # every field survives pickling (gloo, the isolated worker)
        return (type(self), (self.phase, self.step, self.summary, self.traceback_text, self.collective,
                             self.error_type, self.raised_in))

    def __str__(self) -> str:
        where = self.phase if self.phase == "build" else f"{self.phase} (step {self.step})"
        return f"the variant raised during {where}: {self.summary}"


def variant_raised(phase: str, step: int, err: BaseException) -> VariantRaised:
    """The :class:`VariantRaised` a rank raises for ``err``, which the variant's code raised during
    ``phase`` of SGD step ``step`` (``raise variant_raised("forward", step, err) from err``)."""
    summary = f"{type(err).__name__}: {text_of(err)}".splitlines()[0][:500]
    cls = type(err)
    error_type = cls.__qualname__ if cls.__module__ == "builtins" else f"{cls.__module__}.{cls.__qualname__}"
    tb = err.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    raised_in = "" if tb is None else str(tb.tb_frame.f_globals.get("__name__", ""))
    return VariantRaised(phase, step, summary, format_exception(err), _collective_in(err),
                         error_type, raised_in)


def _collective_in(err: BaseException) -> CollectiveError | None:
    """The collective error in ``err``'s chain (itself, its cause or context), as a small copy
    without the nested errors and trace, which the parent has from the run's own error."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, CollectiveError):
            return CollectiveError(e.summary, rank=e.rank, collective=e.collective, call_index=e.call_index,
                                   group=e.group, faulty_ranks=e.faulty_ranks, world_intact=e.world_intact)
        e = e.__cause__ or e.__context__
    return None


def _waited_in(err: BaseException) -> CollectiveError | None:
    """The collective a rank was stopped in (its error is that collective's), None when it failed on its own."""
    if isinstance(err, CollectiveError):
        return err
    if isinstance(err, VariantRaised):
        return err.collective
    return None


def rank_errors(error: RankError | None) -> dict[int, BaseException]:
    """Every failed rank's own error (``error.errors``); a run that collected none: the failing rank's,
    except for a collective timeout, whose ranks have none of their own (see :func:`blame`)."""
    if error is None:
        return {}
    if error.errors or isinstance(error, CollectiveError):
        return {r: _unwrap_variant_error(e) for r, e in error.errors.items()}
    return {error.rank: _unwrap_variant_error(error)}


def _unwrap_variant_error(err: BaseException) -> BaseException:
    """A rank's own :class:`VariantRaised`, where a process backend wrapped it in the
    :class:`~tpsim.CollectiveError` of the call it failed in (its ``__cause__``): the phase and the
    collective's verdict are the variant's, as on inproc."""
    cause = err.__cause__
    return cause if isinstance(err, CollectiveError) and isinstance(cause, VariantRaised) else err


@dataclass(frozen=True)
class Blame:
    """A failed run's ranks, sorted by what happened to them (see the module docstring).

    - ``death``: a rank that died (exited, crashed), None when none did;
    - ``raised``: the ranks whose own code raised, with their errors;
    - ``waiting``: the ranks stopped in a collective that could not complete, with their errors;
    - ``stuck``: the ranks still running their own code when the world timed out;
    - ``culprits``: the ranks the collectives' verdicts blame (mismatched or missing members).
    """

    death: RankDied | None
    raised: dict[int, BaseException]
    waiting: dict[int, BaseException]
    stuck: tuple[int, ...]
    culprits: tuple[int, ...]


def blame(error: RankError) -> Blame:
    """Sort the ranks of the run that failed with ``error`` (see :class:`Blame`)."""
    errors = rank_errors(error)
    death = error if isinstance(error, RankDied) else next(
        (e for _, e in sorted(errors.items()) if isinstance(e, RankDied)), None)
    # The ranks a timeout names: tpsim stopped them while they ran their own code, and describes them
    # with a plain RankError (or nothing): they raised nothing themselves.
    timed_out = set(error.faulty_ranks) if isinstance(error, CollectiveError) else set()
    raised: dict[int, BaseException] = {}
    waiting: dict[int, BaseException] = {}
    for r, e in sorted(errors.items()):
        if isinstance(e, RankDied) or (r in timed_out and type(e) is RankError):
            continue
        if _waited_in(e) is not None:
            waiting[r] = e
        else:
            raised[r] = e
    stuck = tuple(sorted(r for r in timed_out if r not in raised and r not in waiting))
    verdicts = [c for c in (_waited_in(e) for e in waiting.values()) if c is not None]
    culprits = tuple(sorted({r for c in verdicts for r in c.faulty_ranks} | timed_out))
    return Blame(death, raised, waiting, stuck, culprits)


def _facts(err: BaseException) -> tuple[str | None, int | None, str, str]:
    """``(phase, step, summary, traceback)`` of one rank's error (phase None: not known)."""
    if isinstance(err, VariantRaised):
        return err.phase, err.step, err.summary, err.traceback_text
    if isinstance(err, RankError):
        return None, None, _first_line(err.summary) or type(err).__name__, err.remote_traceback
    return None, None, _first_line(f"{type(err).__name__}: {text_of(err)}"), ""


def _first_line(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0] if lines else ""


def _collective_summary(b: Blame, error: RankError) -> str:
    """One line on the collective the ranks were stopped in: the lowest waiting rank's, with its phase
    (tpsim's wrapper around it left out), or the run's own summary."""
    if b.waiting:
        r = min(b.waiting)
        err = b.waiting[r]
        phase, step, summary, _ = _facts(err)
        collective = err.collective if isinstance(err, VariantRaised) else None
        text = _first_line(collective.summary) if collective is not None else summary
        return f"rank {r} during {_where(phase, step)}: {text}"
    return _first_line(error.summary)


def _where(phase: str | None, step: int | None) -> str:
    if phase is None:
        return "the run"
    return phase if phase == "build" or step is None else f"{phase} (step {step})"


@recogniser(RANK_EXITED, RANK_CRASHED)
def death_failure(variant: str, case: Any, death: RankDied, *, divisible: bool = True,
                  backward: str = INPUT_GRAD, context: str = "") -> Failure:
    """``rank-exited`` / ``rank-crashed``: the rank that died, its phase and cause (``divisible``
    False: it counts under the ``divisibility`` property, the only one such a case checks;
    ``context`` is put before the message, e.g. which of a family's worlds it was)."""
    prop = property_of_phase(death.phase, death.step, backward) if divisible else DIVISIBILITY
    diag = RANK_CRASHED if isinstance(death, RankCrashed) else RANK_EXITED
    return Failure(prop, diag, context + _first_line(death.summary), case=case, rank=death.rank,
                   traceback=death.remote_traceback.rstrip() or None, variant=variant,
                   details={"phase": death.phase, "step": death.step, "cause": death.cause,
                            "exitcode": death.exitcode, "signal": death.signal})


#: Errors tpsim raises on a rank for a call a real backend computes wrongly or refuses, by type: their
#: diagnosis names the raise instead of ``exception``.
_BACKEND_RULES = {f"{c.__module__}.{c.__qualname__}": COLLECTIVE_ON_STRIDED_VIEW for c in (CollectiveOnStridedView,)}


def _named(err: BaseException) -> str:
    kind = err.error_type if isinstance(err, VariantRaised) else f"{type(err).__module__}.{type(err).__qualname__}"
    return _BACKEND_RULES.get(kind, EXCEPTION)


@recogniser(EXCEPTION, COLLECTIVE_ON_STRIDED_VIEW)
def run_failure(variant: str, case: Any, error: RankError, *, divisible: bool = True,
                backward: str = INPUT_GRAD) -> Failure:
    """The one failure of a run that failed with ``error`` (see the module docstring for the order);
    ``backward``: the property a failure in the backward counts under."""
    b = blame(error)
    if b.death is not None:
        return death_failure(variant, case, b.death, divisible=divisible, backward=backward)
    involved = sorted(b.raised)
    diag = EXCEPTION
    if b.raised:
        rank = min(b.raised)
        phase, step, summary, tb = _facts(b.raised[rank])
        others = [r for r in involved if r != rank]
        message = f"rank {rank} raised during {_where(phase, step)}: {summary}" + (
            f" (ranks {others} raised too)" if others else "")
        diag = _named(b.raised[rank])
    elif b.stuck:
        rank, phase, step, tb = b.stuck[0], None, None, ""
        waiting = f", while ranks {sorted(b.waiting)} waited for it in a collective" if b.waiting else ""
        message = (f"rank {rank} is stuck: it was still running its own code when the world timed out{waiting}: "
                   f"{_first_line(error.summary)}")
        involved = list(b.stuck)
    else:
        # Told from a rank that waited for the culprits (their own errors only echo the verdict).
        witnesses = [r for r in b.waiting if r not in b.culprits] or sorted(b.waiting)
        witness = witnesses[0] if witnesses else error.rank
        stopped = b.waiting.get(witness, error)
        phase, step, _, tb = _facts(stopped)
        call = _waited_in(stopped)
        what = f"{call.collective} #{call.call_index}" if call is not None and call.collective else "a collective"
        summary = _first_line(call.summary if call is not None else error.summary)
        rank = b.culprits[0] if b.culprits else witness
        because = f" because of rank(s) {list(b.culprits)}" if b.culprits and list(b.culprits) != [witness] else ""
        message = f"rank {witness} could not complete {what} during {_where(phase, step)}{because}: {summary}"
    prop = property_of_phase(phase, step, backward)
    return Failure(prop, diag, message, case=case, rank=rank, traceback=tb.rstrip() or None, variant=variant,
                   details={"phase": phase, "step": step, "ranks": involved, "stuck": list(b.stuck),
                            "waiting": sorted(b.waiting)})


def names_the_size(err: BaseException, sizes: Sequence[int]) -> bool:
    """A clear refusal: the variant's error mentions divisibility (or a multiple) or one of ``sizes``
    as a whole number."""
    text = err.summary if isinstance(err, VariantRaised) else str(err)
    if "divisib" in text.lower() or "multiple" in text.lower():
        return True
    return any(re.search(rf"(?<![\d.]){n}(?![\d.])", text) for n in sizes)


def failed_after_acceptance(error: RankError) -> tuple[int, str] | None:
    """``(rank, what happened)`` when a run of a case that does not divide failed only after the layer
    accepted it: no rank's own code raised while it was built or in its first forward (a refusal), and
    some rank raised or stopped in a later phase (a backward, a training step). None otherwise."""
    b = blame(error)
    if b.death is not None:
        return None
    facts = {r: _facts(e) for r, e in {**b.waiting, **b.raised}.items()}
    early = [r for r in b.raised if facts[r][0] == "build" or (facts[r][0] == "forward" and facts[r][1] == 0)]
    late = sorted(r for r, (phase, step, _, _) in facts.items()
                  if phase is not None and phase != "build" and not (phase == "forward" and step == 0))
    if early or not late:
        return None
    r = next((r for r in late if r in b.raised), late[0])
    phase, step, summary, _ = facts[r]
    return r, f"rank {r} {'raised' if r in b.raised else 'stopped in a collective'} during {_where(phase, step)}: {summary}"


@recogniser(DIVISIBILITY_UNCHECKED)
def refusal_failure(variant: str, case: Any, error: RankError, what: str, sizes: Sequence[int], *,
                    subject: str = "layer", assert_refuses: bool = False) -> Failure | None:
    """The ``divisibility`` property of a case that cannot be sharded, whose run failed with
    ``error``: None when every rank's own code refused it with an error naming one of ``sizes`` or
    divisibility (``assert_refuses``: or with an ``AssertionError``, a forward-only variant's refusal in
    vLLM's style; the report notes that ``python -O`` strips it); else ``divisibility-unchecked`` (``what`` says which sizes do not divide; ``subject``
    names the variant: layer, module, block), or the death of a rank."""
    b = blame(error)
    if b.death is not None:
        return death_failure(variant, case, b.death, divisible=False)
    raised = sorted(b.raised)
    if len(raised) == case.world_size:
        unclear = [r for r in raised if not names_the_size(b.raised[r], sizes)
                   and not (assert_refuses and getattr(b.raised[r], "error_type", None) == "AssertionError")]
        if not unclear:
            return None
        r = unclear[0]
        _, _, summary, tb = _facts(b.raised[r])
        return Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                       f"{what}; every rank raised, but rank {r}'s error does not say why (it names neither the sizes "
                       f"nor divisibility): {summary}; check the sizes at construction and raise a ValueError naming "
                       "them", case=case, rank=r, variant=variant, traceback=tb.rstrip() or None,
                       details={"raised": raised, "unclear": unclear})
    waiting = sorted(b.waiting)
    if raised:
        others = waiting or sorted(set(range(case.world_size)) - set(raised))
        # The raising rank's own error first: it is the cause the waiting ranks only echo.
        phase, step, summary, _ = _facts(b.raised[raised[0]])
        detail = f"ranks {raised} raised but ranks {others} did not" + (
            " (they failed waiting in a collective instead)" if waiting else "") + (
            f"; rank {raised[0]} raised during {_where(phase, step)}: {summary}")
    else:
        detail = f"no rank raised a clear error; the ranks failed in a collective: {_collective_summary(b, error)}"
    return Failure(DIVISIBILITY, DIVISIBILITY_UNCHECKED, f"{what}, and the {subject} did not refuse it on every rank: "
                   f"{detail}", case=case, variant=variant, details={"raised": raised, "collective": waiting})
