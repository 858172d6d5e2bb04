"""Turn what every rank of a gloo/nccl world reported into values, or into one clear exception.

Shared by the worker pool and torchrun mode. Each rank's report (or, for a rank that never
reported, its exit status and what its status slot said) becomes a
:class:`tpsim.comm.ops.RankEnd`; :func:`tpsim.comm.ops.explain` then picks the rank whose failure
explains the others and words the error exactly as the in-process backend words the same failure.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from typing import Any

from tpsim.comm import ops, plain
from tpsim.comm._worker import Outcome
from tpsim.comm.ops import describe_exit
from tpsim.comm.trace import CollectiveCall, Trace
from tpsim.errors import CollectiveError, RankError

__all__ = ["Unfinished", "describe_exit", "margin", "values_or_raise"]


def margin(timeout: float) -> float:
    """Seconds allowed on top of ``timeout`` for a whole run (reporting, pickling, scheduling)."""
    return 1.0 + 0.1 * timeout


@dataclass(frozen=True)
class Unfinished:
    """A rank that neither reported nor exited: what its status slot said when it was stopped."""

    state: str  # "collective", "running", "idle", "dropped", "stalled", "unknown"
    op: str | None = None
    call_index: int | None = None
    group: str | None = None

    def call(self, rank: int) -> CollectiveCall | None:
        """The call the status slot names, as a record (None when it names none)."""
        if self.op is None:
            return None
        return CollectiveCall(rank=rank, op=self.op, group=self.group or "?", group_ranks=(),
                              call_index=self.call_index or 0)

    def where(self) -> str:
        """``all_reduce #3 on group world`` or a phrase saying no collective is known."""
        if self.op is None:
            return "no collective issued yet"
        return ops.call_name(self.op, self.call_index, self.group)


def _last_call(outcome: Outcome | None) -> CollectiveCall | None:
    if outcome is None or not outcome.calls:
        return None
    return outcome.calls[-1]


def _load_error(outcome: Outcome) -> BaseException | None:
    if outcome.error is None:
        return None
    try:
        exc = (plain.loads if outcome.plain else pickle.loads)(outcome.error)
    except Exception:  # a class this process cannot rebuild: the text traceback still reports it
        return None
    return exc if isinstance(exc, BaseException) else None


def values_or_raise(
    *,
    world_size: int,
    backend: str,
    outcomes: dict[int, Outcome],
    exits: dict[int, int | None],
    unfinished: dict[int, Unfinished],
    limit: float | None = None,
    timed_out: bool = False,
    fired: list[Any] | None = None,
    timeout: float | None = None,
) -> tuple[list[Any], Trace]:
    """Return ``(values, trace)`` when every rank succeeded; otherwise raise the right error.

    ``outcomes`` holds the ranks that reported, ``exits`` the ranks whose process ended on its
    own (exit code or negative signal number), ``unfinished`` the ranks tpsim had to stop (with
    what each was doing) and, for ranks in ``exits``, what their status slot said last.
    ``timed_out`` says the whole-run bound ``limit`` (seconds) ran out; ``timeout`` is the
    collective timeout (named in a straggler's message). ``fired`` lists the ``(fault, call)``
    pairs of the fault plan that acted. The error carries the trace of the ranks that reported.
    """
    fired = sorted(fired or [], key=lambda item: item[1].rank)
    last_state = {r: unfinished[r] for r in exits if r in unfinished}
    unfinished = {r: st for r, st in unfinished.items() if r not in exits}
    trace = Trace(calls={r: list(o.calls) for r, o in sorted(outcomes.items())})
    if len(outcomes) == world_size and all(o.ok for o in outcomes.values()) and not exits and not unfinished:
        values: list[Any] = []
        for rank in range(world_size):
            try:
                outcome = outcomes[rank]
                values.append((plain.loads if outcome.plain else pickle.loads)(outcome.value or b""))
            except Exception as exc:
                raise RankError(
                    f"rank {rank} returned a value that cannot be unpickled in this process "
                    f"({type(exc).__name__}: {exc}); return plain data (tensors, numbers, lists) "
                    "or instances of importable classes",
                    rank=rank, trace=trace, faults_fired=fired,
                ) from exc
        return values, trace

    def fault_of(rank: int, kind: str) -> Any:
        return next((f for f, c in fired if c.rank == rank and f.kind == kind), None)

    ends: dict[int, ops.RankEnd] = {}
    for rank, outcome in sorted(outcomes.items()):
        last = _last_call(outcome)
        if outcome.ok:
            ends[rank] = ops.RankEnd(rank, ops.FINISHED, last)
            continue
        exc = _load_error(outcome)
        if outcome.collective:
            call = outcome.failed_call or last
            if not isinstance(exc, CollectiveError):
                own = exc
                exc = CollectiveError(
                    f"rank {rank} failed in {call.describe() if call else 'a collective'}: "
                    f"{outcome.error_type}: {outcome.error_text}".strip(),
                    rank=rank, collective=call.op if call else None, call_index=call.call_index if call else None,
                    group=call.group if call else None, remote_traceback=outcome.traceback)
                # The rank's own exception (a layer's, or a harness's wrapper that records the phase and
                # the collective it was stopped in) stays reachable, as inproc keeps it.
                exc.__cause__ = own
            ends[rank] = ops.RankEnd(rank, ops.COLLECTIVE, call, error=exc, error_type=outcome.error_type,
                                     error_text=outcome.error_text)
            continue
        if exc is None:
            exc = RankError(f"rank {rank} raised {outcome.error_type}: {outcome.error_text}".strip(), rank=rank,
                            remote_traceback=outcome.traceback)
        elif outcome.traceback and hasattr(exc, "add_note") and not isinstance(exc, RankError):
            exc.add_note(f"--- traceback on rank {rank} ---\n{outcome.traceback.rstrip()}")
        crashed = next((c for f, c in fired if c.rank == rank and f.kind == "crash"), None)
        if outcome.error_type == "InjectedCrash" and crashed is not None:
            ends[rank] = ops.RankEnd(rank, ops.CRASHED, crashed, error=exc, error_type=outcome.error_type,
                                     error_text=outcome.error_text, traceback=outcome.traceback,
                                     fault=fault_of(rank, "crash"))
        else:
            ends[rank] = ops.RankEnd(rank, ops.RAISED, last, error=exc, error_type=outcome.error_type,
                                     error_text=outcome.error_text, traceback=outcome.traceback)

    for rank, code in sorted(exits.items()):
        state = last_state.get(rank)
        call = state.call(rank) if state is not None else None
        if state is not None and state.state == "dropped":
            # A process backend's own words: the dropped rank's process really exited.
            end = ops.RankEnd(rank, ops.DROPPED, call, exit_code=code, fault=fault_of(rank, "drop"),
                              note=f": its process exited with {describe_exit(code)}")
        else:
            end = ops.RankEnd(rank, ops.DIED, call, exit_code=code)
        end.error = RankError(f"rank {rank} {end.line()}", rank=rank)
        ends[rank] = end

    for rank, state in sorted(unfinished.items()):
        call = state.call(rank)
        if state.state == "stalled":
            end = ops.RankEnd(rank, ops.STALLED, call, fault=fault_of(rank, "delay"))
        elif state.state == "unknown":
            end = ops.RankEnd(rank, ops.UNKNOWN)
        else:
            end = ops.RankEnd(rank, ops.STOPPED, call, blocked=state.state == "collective")
        if end.kind == ops.STOPPED and end.blocked and call is not None:
            end.error = CollectiveError(f"rank {rank} {end.line()}", rank=rank, collective=call.op,
                                        call_index=call.call_index, group=call.group)
        else:
            end.error = RankError(f"rank {rank} {end.line()}", rank=rank)
        ends[rank] = end

    err = ops.explain(ends, world_size=world_size, backend=backend, fired=fired,
                      timeout=timeout if timeout is not None else (limit or 0.0), timed_out=timed_out)
    err.trace = trace
    raise err
