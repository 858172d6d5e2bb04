"""Fault plans as a Hypothesis strategy, and the fault-detection property.

**fault-detection**: for any fault plan, the run of a case terminates within its bound and

- a dropped, crashed or mismatching rank, or one stalled past the timeout, makes the run raise an
  error whose message names the injected rank, the collective it hit and that call's index, and
  every other member of that collective's group ends with an error too (never a hang);
- a rank stalled well within the timeout changes nothing: the result equals the clean run's;
- a corrupted contribution is never silently passed: with ``checksum=True`` the run raises naming
  the corrupting rank; without it, either the result is bit-identical to the clean run (the
  collective ignored that contribution) or it differs and the family's properties fail on it — a
  difference they pass is reported;
- no worker process or rank thread outlives the run.

:func:`check_faults` runs a variant of any family under generated plans (``tpsim check TARGET
--faults ...``) and returns one :class:`FaultReport` per example; the ones with ``ok=False`` are what
the harness or the layer failed to surface. The case, its world run and its judging are the
family's (:meth:`~tpsim.props.family.Family.fault_case`, :meth:`~tpsim.props.family.Family.world`,
:meth:`~tpsim.props.family.Family.judge`): the same run a check makes, with a fault plan beneath.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hypothesis import Phase, given, settings
from hypothesis import seed as hyp_seed
from hypothesis import strategies as st

import tpsim
from tpsim.diagnosis import FAULT_NOT_SURFACED, recogniser
from tpsim.errors import InvalidArgument, RankError
from tpsim.faults import FAULT_KINDS, Corrupt, Crash, Delay, Drop, Fault, Mismatch, parse_plan
from tpsim.props.family import World, family_of
from tpsim.props.launch import WARM_TIMEOUT, for_ranks, resolve_only, run_options
from tpsim.props.observation import Observation
from tpsim.props.search import HEALTH_CHECKS_SUPPRESSED

__all__ = [
    "FAULT_DETECTION",
    "FaultNotSurfaced",
    "FaultReport",
    "check_faults",
    "fault_detection",
    "fault_plans",
    "faults",
]

#: The property's name, as reports and case files spell it.
FAULT_DETECTION = "fault-detection"

#: Seconds allowed beyond ``timeout`` (plus planned delays) before a run counts as hung.
SLACK_S = {"inproc": 5.0, "gloo": 10.0, "nccl": 20.0}


class FaultNotSurfaced(AssertionError):
    """The fault-detection property failed; ``report`` says how."""

    def __init__(self, report: FaultReport) -> None:
        super().__init__(report.message)
        self.report = report


@dataclass
class FaultReport:
    """What one fault-plan run showed.

    ``outcome``: ``"error"`` (the run raised), ``"result"`` (it returned) or ``"not-fired"`` (no
    fault's call came). ``ok`` says whether the guarantee held; ``message`` explains either way;
    ``caught_by`` names the property that caught a corrupted result; ``elapsed``/``bound`` in s.
    """

    case: Any
    plan: tuple[Fault, ...]
    backend: str
    ok: bool
    outcome: str
    message: str
    elapsed: float
    bound: float
    fired: list[str] = field(default_factory=list)
    caught_by: str | None = None
    variant: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict (the case as its dict, the plan as fault dicts)."""
        return {
            "property": FAULT_DETECTION,
            "variant": self.variant,
            "backend": self.backend,
            "ok": self.ok,
            "outcome": self.outcome,
            "message": self.message,
            "elapsed_s": round(self.elapsed, 3),
            "bound_s": round(self.bound, 3),
            "fired": list(self.fired),
            "caught_by": self.caught_by,
            "plan": [f.to_json() for f in self.plan],
            "case": self.case.to_dict(),
        }


# --- the strategy --------------------------------------------------------------------------------


def faults(
    world_size: int,
    *,
    max_calls: int | Sequence[int] = 8,
    kinds: Sequence[str] = FAULT_KINDS,
    delays: Sequence[float] = (0.05, 2.0),
) -> st.SearchStrategy[Fault]:
    """One fault for a world of ``world_size`` ranks.

    ``max_calls`` bounds ``at_call`` (1-based); a sequence gives the bound per rank (e.g. the
    number of calls each rank made in a clean run, so every fault fires). ``delays`` are the
    stall lengths a Delay may get (give one below and one above the run's timeout).
    Shrinks toward a drop on rank 0 at its first call. Mismatch needs two ranks.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"world_size={world_size!r} must be an int >= 1")
    unknown = [k for k in kinds if k not in FAULT_KINDS]
    if unknown or not kinds:
        raise InvalidArgument(f"kinds={list(kinds)!r}: expected a non-empty subset of {', '.join(FAULT_KINDS)}")
    limits = [max_calls] * world_size if isinstance(max_calls, int) else list(max_calls)
    if len(limits) != world_size or any(isinstance(n, bool) or not isinstance(n, int) or n < 0 for n in limits):
        raise InvalidArgument(f"max_calls={max_calls!r} must be an int >= 1 or one int >= 0 per rank "
                              f"({world_size} ranks)")
    ranks = [r for r in range(world_size) if limits[r] >= 1]
    if not ranks:
        raise InvalidArgument(f"max_calls={max_calls!r}: no rank makes a call, so no fault can act")
    usable = [k for k in FAULT_KINDS if k in kinds and not (k == "mismatch" and world_size < 2)]
    if not usable:
        raise InvalidArgument(f"kinds={list(kinds)!r}: a mismatch needs world_size >= 2 (got {world_size})")
    if not delays or any(not isinstance(d, (int, float)) or d < 0 for d in delays):
        raise InvalidArgument(f"delays={list(delays)!r} must be a non-empty list of seconds >= 0")

    @st.composite
    def one(draw: st.DrawFn) -> Fault:
        kind = draw(st.sampled_from(usable))
        rank = draw(st.sampled_from(ranks))
        at_call = draw(st.integers(1, limits[rank]))
        if kind == "drop":
            return Drop(rank, at_call)
        if kind == "crash":
            return Crash(rank, at_call)
        if kind == "delay":
            return Delay(rank, at_call, seconds=float(draw(st.sampled_from(list(delays)))))
        if kind == "corrupt":
            how = draw(st.sampled_from(["nan", "bitflip", "scale"]))
            index = draw(st.integers(0, 7))
            factor = draw(st.sampled_from([2.0, -1.0, 1e3])) if how == "scale" else 2.0
            return Corrupt(rank, at_call, how=how, index=index, factor=factor)
        return Mismatch(rank, at_call, what=draw(st.sampled_from(["op", "shape", "dtype"])))

    return one()


def fault_plans(
    world_size: int,
    *,
    max_calls: int | Sequence[int] = 8,
    kinds: Sequence[str] = FAULT_KINDS,
    max_faults: int = 1,
    delays: Sequence[float] = (0.05, 2.0),
) -> st.SearchStrategy[tuple[Fault, ...]]:
    """Fault plans of 1 to ``max_faults`` faults, each on a distinct (rank, call). See :func:`faults`."""
    if isinstance(max_faults, bool) or not isinstance(max_faults, int) or max_faults < 1:
        raise InvalidArgument(f"max_faults={max_faults!r} must be an int >= 1")
    one = faults(world_size, max_calls=max_calls, kinds=kinds, delays=delays)
    return st.lists(one, min_size=1, max_size=max_faults,
                    unique_by=lambda f: (f.rank, f.at_call)).map(tuple)


# --- running a case under a plan -----------------------------------------------------------------


def _world(variant: Any, case: Any, backend: str, isolate: bool, timeout: float) -> World:
    """The family's world run of ``case``, its payload ready for the ranks (the same run a check
    makes, so that a fault plan acts beneath exactly what is checked)."""
    world = family_of(variant).world(variant, case, timeout=max(timeout, 30.0), isolate=isolate)
    for_ranks(variant, world.payload, case.world_size, backend=backend, isolate=isolate)
    return world


_warm_worker: list[int | None] = [None]


def _ensure_isolated_worker(ref: tuple[Any, ...], world_size: int) -> None:
    """A worker replaced after an earlier fault (a hang abandons it) is started, and the target
    imported in it, before the run is timed: its start-up is not the run's."""
    from tpsim.comm.isolate import live_worker_pid

    pid = live_worker_pid()
    if pid is None or pid != _warm_worker[0]:
        tpsim.run_world(resolve_only, world_size, args=(ref,), timeout=WARM_TIMEOUT, isolate=True, plain=True)
        _warm_worker[0] = live_worker_pid()


def _leftovers() -> list[str]:
    from tpsim.comm import isolate, procs

    pooled = {p for pids in procs.live_worker_pids().values() for p in pids} | isolate.helper_pids()
    this_pid, left = os.getpid(), []
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not entry.isdigit() or int(entry) in pooled:
            continue
        try:
            with open(f"/proc/{entry}/stat") as fh:
                parts = fh.read().rsplit(")", 1)[-1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as fh:
                cmd = fh.read()
        except OSError:
            continue
        # A live child that is neither a pooled worker nor multiprocessing's own resource tracker.
        if len(parts) > 1 and int(parts[1]) == this_pid and parts[0] != "Z" and b"resource_tracker" not in cmd:
            left.append(f"process {entry}")
    left += [t.name for t in threading.enumerate() if t.name.startswith("tpsim-rank-") and t.is_alive()]
    return left


def _names(err: BaseException, rank: int, op: str, index: int) -> bool:
    text = str(err)
    return f"rank {rank}" in text and f"{op} #{index}" in text


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b) or (
            a.is_floating_point() and torch.equal(torch.nan_to_num(a, 7.0), torch.nan_to_num(b, 7.0))
            and torch.equal(a.isnan(), b.isnan())))
    if dataclasses.is_dataclass(a) and not isinstance(a, type) and type(a) is type(b):
        return _same(vars(a), vars(b))  # a rank's typed result (tpsim.props.linear.world.RankResult)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return a == b


def fault_detection(
    variant: Any,
    case: Any,
    plan: Sequence[Any] | None = None,
    *,
    backend: str = "inproc",
    timeout: float = 5.0,
    checksum: bool = False,
    clean: tpsim.WorldResult | None = None,
    isolate: bool = False,
) -> FaultReport:
    """Check the fault-detection property for ``case`` under ``plan`` (default: ``case.faults``).

    Returns the :class:`FaultReport` when the guarantee holds; raises :class:`FaultNotSurfaced`
    (an AssertionError) carrying it when not. ``clean`` is the case's run without faults, when
    the caller has it (otherwise it is run here).
    """
    plan_t = parse_plan(case.faults if plan is None else plan)
    report = _detect(variant, case, plan_t, backend=backend, timeout=timeout, checksum=checksum, clean=clean,
                     isolate=isolate)
    if not report.ok:
        raise FaultNotSurfaced(report)
    return report


@recogniser(FAULT_NOT_SURFACED)
def _detect(variant: Any, case: Any, plan: tuple[Fault, ...], *, backend: str, timeout: float,
            checksum: bool, clean: tpsim.WorldResult | None, isolate: bool = False) -> FaultReport:
    ws = case.world_size
    world = _world(variant, case, backend, isolate, timeout)
    options = dict(run_options(variant), plain="ref" in world.payload)
    if clean is None:
        clean = tpsim.run_world(world.fn, ws, backend=backend, args=(world.payload,), timeout=max(timeout, 30.0),
                                isolate=isolate, **options)
    bound = timeout + sum(f.seconds for f in plan if isinstance(f, Delay)) + SLACK_S.get(backend, 10.0)
    if backend != "inproc":
        from tpsim.comm.procs import ensure_pool

        ensure_pool(backend, ws)  # a pool replaced after an earlier fault: its start-up is not the run's
    elif isolate:
        _ensure_isolated_worker(world.payload["ref"], ws)
    t0 = time.monotonic()
    error: RankError | None = None
    result = None
    try:
        result = tpsim.run_world(world.fn, ws, backend=backend, args=(world.payload,), faults=plan, timeout=timeout,
                                 checksum=checksum, isolate=isolate, **options)
        fired_pairs = result.faults_fired
    except RankError as err:
        error = err
        fired_pairs = list(getattr(err, "faults_fired", []) or [])
    elapsed = time.monotonic() - t0
    fired = [f"{f} at {c.describe()}" for f, c in fired_pairs]

    def report(ok: bool, outcome: str, message: str, caught_by: str | None = None) -> FaultReport:
        left = _leftovers()
        if left:
            ok, message = False, f"{message}; left behind after the run: {', '.join(left)}"
        if elapsed > bound:
            ok, message = False, f"the run took {elapsed:.1f}s, over its bound of {bound:.1f}s; {message}"
        return FaultReport(case=case, plan=plan, backend=backend, ok=ok, outcome=outcome, message=message,
                           elapsed=elapsed, bound=bound, fired=fired, caught_by=caught_by, variant=variant.name)

    if not fired_pairs:
        if error is None and _same(result.values if result else None, clean.values):
            return report(True, "not-fired", "no fault's call came; the result equals the clean run")
        if error is not None and not plan:
            return report(False, "error", f"the run failed without any fault: {str(error).splitlines()[0]}")
        if error is None:
            return report(False, "result", "no fault fired, yet the result differs from the clean run")
    fault, call = (fired_pairs[0] if fired_pairs else (plan[0], None))
    where = f"{call.op} #{call.call_index}" if call is not None else "its call"
    must_fail = isinstance(fault, (Drop, Crash, Mismatch)) or (isinstance(fault, Corrupt) and checksum) or (
        isinstance(fault, Delay) and fault.seconds > timeout)
    may_fail = must_fail or (isinstance(fault, Delay) and fault.seconds > timeout / 2)
    if error is not None:
        if not may_fail and not isinstance(fault, Corrupt):
            return report(False, "error", f"{fault} should not have failed the run, but: {str(error).splitlines()[0]}")
        if isinstance(fault, Corrupt) and not checksum:
            # A NaN or huge value may make the variant raise: loud, so surfaced.
            return report(True, "error", f"the corrupted run raised: {str(error).splitlines()[0]}")
        if call is None or not _names(error, fault.rank, call.op, call.call_index):
            return report(False, "error", f"the error does not name rank {fault.rank} and {where}: "
                                          f"{str(error).splitlines()[0]}")
        members = call.group_ranks or tuple(range(ws))
        dead = {f.rank for f, _ in fired_pairs}
        silent = [r for r in members if r not in dead and r not in error.errors]
        if error.errors and silent:
            return report(False, "error", f"rank(s) {silent} of the group ended without an error although "
                                          f"{fault} hit {where}")
        return report(True, "error", str(error).splitlines()[0])
    if must_fail:
        return report(False, "result", f"{fault} fired at {where} but the run returned normally")
    if _same(result.values, clean.values):
        return report(True, "result", f"{fault} at {where}: the result equals the clean run")
    if isinstance(fault, Delay):
        return report(False, "result", f"{fault} (within the timeout) changed the result")
    # A corrupted result: the family's properties must catch it.
    family = family_of(variant)
    obs = Observation(case, world.data, values=result.values, divisible=family.divisible(variant, case))
    failures = family.judge(variant, obs)
    if failures:
        names = ", ".join(sorted({f.property for f in failures}))
        return report(True, "result", f"{fault} at {where} corrupted the result; caught by {names}",
                      caught_by=failures[0].property)
    return report(False, "result", f"{fault} at {where} changed the result, yet every property passed "
                                   "(run with checksum=True to pinpoint such corruption)")


def check_faults(
    variant: Any,
    *,
    kinds: Sequence[str] = FAULT_KINDS,
    world_sizes: Sequence[int] = (2, 3, 4),
    max_examples: int = 20,
    seed: int = 0,
    backend: str = "inproc",
    timeout: float = 5.0,
    checksum: bool = False,
    isolate: bool = False,
) -> list[FaultReport]:
    """Run ``variant`` (of any family, or a target string naming one) under generated fault plans.

    One small divisible case per world size (its family's :meth:`~tpsim.props.family.Family.fault_case`:
    linear layers get features a multiple of it, a batch of 2, float64, bias); plans drawn by :func:`fault_plans` with ``at_call`` within the calls each rank makes in
    the clean run and delays of ``timeout / 10`` and ``timeout * 2``. Returns a report per example,
    ``ok=False`` for every fault the harness or the layer failed to surface. ``isolate``: run the
    inproc worlds in the supervised worker process (what ``tpsim check --faults`` does), so a rank
    that dies or hangs in native code is reported instead of taking the caller with it; the variant
    then needs a target string.
    """
    if isinstance(variant, str):
        from tpsim.target import resolve_target

        found = resolve_target(variant)
        if len(found) != 1:
            raise InvalidArgument(f"target {variant!r} names {len(found)} variants; pass one variant")
        variant = found[0]
    family = family_of(variant)
    sizes = sorted(set(world_sizes))
    if not sizes or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in sizes):
        raise InvalidArgument(f"world_sizes={list(world_sizes)!r} must be a non-empty list of ints >= 1")
    clean: dict[int, tuple[Any, tpsim.WorldResult]] = {}
    for ws in sizes:
        case = family.fault_case(variant, ws, seed).replace(target=variant.target, variant=variant.name,
                                                            options=variant.options, property=FAULT_DETECTION)
        world = _world(variant, case, backend, isolate, timeout)
        clean[ws] = (case, tpsim.run_world(world.fn, ws, backend=backend, args=(world.payload,),
                                           timeout=max(timeout, 30), isolate=isolate, plain="ref" in world.payload,
                                           **run_options(variant)))
    # A world where no rank issues a collective (e.g. one rank: layers skip their collectives)
    # gives a fault nothing to act on.
    sizes = [ws for ws in sizes if any(clean[ws][1].trace.of(r) for r in range(ws))]
    if not sizes:
        raise InvalidArgument(f"variant {variant.name!r} issues no collective at world_sizes={list(world_sizes)}: "
                              "no fault could act; use world sizes >= 2")
    reports: list[FaultReport] = []
    delays = (timeout / 10, timeout * 2)

    @st.composite
    def examples(draw: st.DrawFn) -> tuple[Any, tuple[Fault, ...]]:
        ws = draw(st.sampled_from(sizes))
        case, result = clean[ws]
        calls = [len(result.trace.of(r)) for r in range(ws)]
        usable = [k for k in kinds if not (k == "mismatch" and ws < 2)] or list(kinds)
        plan = draw(fault_plans(ws, max_calls=calls, kinds=usable, delays=delays))
        return case, plan

    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=False,
              suppress_health_check=HEALTH_CHECKS_SUPPRESSED, phases=(Phase.generate,))
    @hyp_seed(seed)
    @given(examples())
    def run_one(example: tuple[Any, tuple[Fault, ...]]) -> None:
        case, plan = example
        reports.append(_detect(variant, case.replace(faults=tuple(f.to_json() for f in plan)), plan,
                               backend=backend, timeout=timeout, checksum=checksum, clean=clean[case.world_size][1],
                               isolate=isolate))

    run_one()
    return reports
