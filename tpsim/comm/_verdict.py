"""Turn what every rank of a gloo/nccl world reported into values, or into one clear exception.

Shared by the worker pool and torchrun mode. Precedence when several ranks failed: a rank's
own failure (it raised, or its process died) explains the collective errors it caused on the
others, so the lowest such rank is the one raised; only when every failure came out of a
collective (mismatched calls, a timeout) is a :class:`tpsim.CollectiveError` raised. Every
failed rank is listed in ``errors`` and every rank's state is spelled out in the message.
"""

from __future__ import annotations

import pickle
import signal
from dataclasses import dataclass
from typing import Any

from tpsim.comm._worker import Outcome
from tpsim.comm.trace import CollectiveCall, Trace
from tpsim.errors import CollectiveError, RankError

__all__ = ["Unfinished", "describe_exit", "settle"]


@dataclass(frozen=True)
class Unfinished:
    """A rank that neither reported nor exited: what its status slot said when it was stopped."""

    state: str  # "collective", "running", "idle", "unknown"
    op: str | None = None
    call_index: int | None = None
    group: str | None = None

    def where(self) -> str:
        """``all_reduce #3 on group world`` or a phrase saying no collective is known."""
        if self.op is None:
            return "no collective issued yet"
        return f"{self.op} #{self.call_index} on group {self.group}"

    def describe(self) -> str:
        if self.state == "collective":
            return f"blocked in {self.where()}"
        if self.state == "dropped":
            return f"dropped by the fault plan at {self.where()}"
        if self.state == "stalled":
            return f"stalled by the fault plan before {self.where()}"
        if self.state == "unknown":
            return "did not report (its state is unknown)"
        last = f" (last collective: {self.where()})" if self.op else " (no collective issued yet)"
        return f"still running its own code{last}"


def describe_exit(code: int | None) -> str:
    """``exit code 3`` / ``signal SIGSEGV (exit code -11)`` for a process exit status."""
    if code is None:
        return "an unknown exit status"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"signal {name} (exit code {code})"
    return f"exit code {code}"


def _last_call(outcome: Outcome | None) -> CollectiveCall | None:
    if outcome is None or not outcome.calls:
        return None
    return outcome.calls[-1]


def _load_error(outcome: Outcome) -> BaseException | None:
    if outcome.error is None:
        return None
    try:
        exc = pickle.loads(outcome.error)
    except Exception:  # a class this process cannot rebuild: the text traceback still reports it
        return None
    return exc if isinstance(exc, BaseException) else None


def settle(
    *,
    world_size: int,
    backend: str,
    outcomes: dict[int, Outcome],
    exits: dict[int, int | None],
    unfinished: dict[int, Unfinished],
    limit: float | None = None,
    timed_out: bool = False,
    fired: list[Any] | None = None,
) -> tuple[list[Any], Trace]:
    """Return ``(values, trace)`` when every rank succeeded; otherwise raise the right error.

    ``outcomes`` holds the ranks that reported, ``exits`` the ranks whose process ended on its
    own (exit code or negative signal number), ``unfinished`` the ranks tpsim had to stop (with
    what each was doing) and, for ranks in ``exits``, what their status slot said last.
    ``timed_out`` says the whole-run bound ``limit`` (seconds) ran out. ``fired`` lists the
    ``(fault, call)`` pairs of the fault plan that acted: they are named in the message, and the
    ranks they hit are the ``faulty_ranks`` of every survivor's error.
    """
    fired = list(fired or [])
    last_state = {r: unfinished[r] for r in exits if r in unfinished}
    unfinished = {r: st for r, st in unfinished.items() if r not in exits}
    trace = Trace(calls={r: list(o.calls) for r, o in sorted(outcomes.items())})
    if len(outcomes) == world_size and all(o.ok for o in outcomes.values()) and not exits and not unfinished:
        values: list[Any] = []
        for rank in range(world_size):
            try:
                values.append(pickle.loads(outcomes[rank].value or b""))
            except Exception as exc:
                raise RankError(
                    f"rank {rank} returned a value that cannot be unpickled in this process "
                    f"({type(exc).__name__}: {exc}); return plain data (tensors, numbers, lists) "
                    "or instances of importable classes",
                    rank=rank,
                ) from exc
        return values, trace

    def fault_of(rank: int, kind: str) -> Any:
        return next((f for f, c in fired if c.rank == rank and f.kind == kind), None)

    errors: dict[int, BaseException] = {}
    lines: dict[int, str] = {}
    own: list[int] = []  # ranks whose own code raised or whose process died
    collective: list[int] = []  # ranks that failed in, or were stopped in, a collective
    planned: list[int] = []  # ranks a fault plan dropped, crashed or stalled
    crash_at: dict[int, CollectiveCall] = {}

    for rank, outcome in sorted(outcomes.items()):
        if outcome.ok:
            lines[rank] = "finished"
            continue
        headline = f"{outcome.error_type}: {outcome.error_text}".strip()
        if outcome.collective:
            collective.append(rank)
            call = outcome.failed_call or _last_call(outcome)
            where = call.describe() if call else "a collective"
            lines[rank] = f"failed in {where}: {outcome.error_text.strip()}"
            exc = _load_error(outcome)
            if not isinstance(exc, CollectiveError):
                exc = CollectiveError(
                    f"rank {rank} failed in {where}: {headline}",
                    rank=rank,
                    collective=call.op if call else None,
                    call_index=call.call_index if call else None,
                    group=call.group if call else None,
                    remote_traceback=outcome.traceback,
                )
            errors[rank] = exc
        else:
            own.append(rank)
            if outcome.error_type == "InjectedCrash":
                planned.append(rank)
                crashed = next((c for f, c in fired if c.rank == rank and f.kind == "crash"), None)
                if crashed is not None:
                    crash_at[rank] = crashed
            lines[rank] = f"raised {headline}"
            exc = _load_error(outcome) or RankError(
                f"rank {rank} raised {headline}", rank=rank, remote_traceback=outcome.traceback
            )
            add_note = getattr(exc, "add_note", None)
            if add_note is not None and outcome.traceback:
                add_note(f"--- traceback on rank {rank} ---\n{outcome.traceback.rstrip()}")
            errors[rank] = exc

    for rank, code in sorted(exits.items()):
        state = last_state.get(rank)
        if state is not None and state.state == "dropped":
            planned.append(rank)
            fault = fault_of(rank, "drop")
            lines[rank] = f"was dropped by the fault plan at {state.where()}" + (f" ({fault})" if fault else "") + (
                f": its process exited with {describe_exit(code)}")
            errors[rank] = RankError(f"rank {rank} {lines[rank]}", rank=rank)
            continue
        own.append(rank)
        lines[rank] = f"died with {describe_exit(code)}"
        errors[rank] = RankError(f"rank {rank} died with {describe_exit(code)}", rank=rank)

    for rank, state in sorted(unfinished.items()):
        if state.state == "stalled":
            planned.append(rank)
            fault = fault_of(rank, "delay")
            lines[rank] = f"was stalled by the fault plan before {state.where()}" + (f" ({fault})" if fault else "")
            errors[rank] = RankError(f"rank {rank} {lines[rank]}", rank=rank)
            continue
        lines[rank] = state.describe() + (" when tpsim stopped the world" if not timed_out else "")
        if state.state == "collective":
            collective.append(rank)
            errors[rank] = CollectiveError(
                f"rank {rank} was {lines[rank]}",
                rank=rank,
                collective=state.op,
                call_index=state.call_index,
                group=state.group,
            )
        else:
            errors[rank] = RankError(f"rank {rank} was {lines[rank]}", rank=rank)

    # Blame: ranks a fault plan hit, else ranks whose own code failed. Every survivor's collective
    # error names them, so each rank's error says who it was waiting for.
    suspects = sorted(set(planned) or set(own))
    if suspects:
        why = "; ".join(f"rank {s} {lines[s]}" for s in suspects)
        for rank in collective:
            err = errors[rank]
            if isinstance(err, CollectiveError) and not err.faulty_ranks:
                errors[rank] = CollectiveError(
                    f"{err.summary} (waiting for: {why})", rank=rank, collective=err.collective,
                    call_index=err.call_index, group=err.group, faulty_ranks=tuple(suspects),
                    remote_traceback=err.remote_traceback)
    plan = ""
    if fired:
        plan = " [fault plan: " + ", ".join(f"{f} at {c.describe()}" for f, c in fired) + "]"

    def context(exclude: int) -> str:
        others = [f"  rank {r}: {text}" for r, text in sorted(lines.items()) if r != exclude]
        return ("\nother ranks:\n" + "\n".join(others)) if others else ""

    own.sort()
    real_own = [r for r in own if r not in planned]
    if real_own or (own and not collective):
        rank = (real_own or own)[0]
        if rank in outcomes:
            outcome = outcomes[rank]
            summary = f"rank {rank} raised {outcome.error_type}: {outcome.error_text}".rstrip()
            remote = outcome.traceback
        else:
            summary = f"rank {rank} died with {describe_exit(exits.get(rank))} ({_exit_hint(exits.get(rank))})"
            remote = ""
        if rank in crash_at:
            call = crash_at[rank]
            raise CollectiveError(
                f"{summary}{plan} [backend {backend}, world_size={world_size}]{context(rank)}",
                rank=rank, collective=call.op, call_index=call.call_index, group=call.group,
                faulty_ranks=(rank,), remote_traceback=remote, errors=errors)
        raise RankError(
            f"{summary}{plan} [backend {backend}, world_size={world_size}]{context(rank)}",
            rank=rank,
            remote_traceback=remote,
            errors=errors,
        )
    # Collective failures (a dead or stalled peer, a mismatch, a timeout): name the lowest survivor.
    stopped = sorted(unfinished)
    if timed_out and not planned:
        head = (
            f"the world did not finish within {limit:.1f}s (the collective timeout plus a margin): "
            f"rank(s) {', '.join(map(str, stopped))} never reported"
        )
    else:
        head = "no rank could complete its collectives"
    first = sorted(collective)[0] if collective else (stopped[0] if stopped else (planned or [0])[0])
    err = errors.get(first)
    if isinstance(err, CollectiveError) and (not timed_out or planned):
        head = err.summary
    elif planned:
        head = "; ".join(f"rank {s} {lines[s]}" for s in planned)
    text = f"{head}{plan} [backend {backend}, world_size={world_size}]\n" + "\n".join(
        f"  rank {r}: {t}" for r, t in sorted(lines.items())
    )
    if isinstance(err, CollectiveError):
        raise CollectiveError(
            text,
            rank=first,
            collective=err.collective,
            call_index=err.call_index,
            group=err.group,
            faulty_ranks=err.faulty_ranks or tuple(suspects),
            remote_traceback=err.remote_traceback,
            errors=errors,
        )
    if planned:
        st = last_state.get(planned[0]) or unfinished.get(planned[0])
        raise CollectiveError(
            text, rank=planned[0], collective=st.op if st else None, call_index=st.call_index if st else None,
            group=st.group if st else None, faulty_ranks=tuple(planned), errors=errors)
    raise RankError(text, rank=first, errors=errors)


def _exit_hint(code: int | None) -> str:
    if code is not None and code < 0:
        return "the process crashed or was killed before reporting a result"
    return "the process exited without reporting a result, e.g. os._exit() or a crash in native code"
