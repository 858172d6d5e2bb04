"""A tracing wrapper around a real process group (gloo, nccl), shared by the worker pool and torchrun mode.

Every collective a rank issues on a ``torch.distributed`` group reaches one of the forwarding
methods of :class:`TracingProcessGroup`, which

1. records a :class:`~tpsim.comm.trace.CollectiveCall` in the active :class:`RankSession`
   (op name, group, 1-based call index on that group, input shapes/dtypes, reduce op, peer);
2. refuses a call whose own buffers are wrong (:func:`tpsim.comm.ops.buffer_problem`, the rule
   inproc uses) or that passes a tensor a real backend computes wrongly or refuses (a view that is
   not dense, or not contiguous where gloo reads it in storage order: :func:`tpsim.comm.ops.strided_view`,
   :class:`tpsim.CollectiveOnStridedView`), then hands it to :meth:`TracingProcessGroup.intercept`, the
   single per-call hook point where the fault plan acts (drop, crash, delay, corrupt, mismatch) and
   where the members exchange fingerprints of the call before issuing it (mismatches are refused by
   name, not left to hang);
3. issues the real backend op on the caller's tensors exactly as given: the wrapper never changes
   what a collective computes;
4. returns a :class:`TracedWork` whose ``wait`` turns a backend failure (peer gone, timeout)
   into a :class:`tpsim.CollectiveError` naming the collective and its call index.

How it is installed: :func:`register_backends` registers the custom backends ``tpsim_gloo`` and
``tpsim_nccl`` with ``dist.Backend.register_backend``; their creator builds the real
``ProcessGroupGloo``/``ProcessGroupNCCL`` and wraps it. Because the wrapper is itself a
``dist.ProcessGroup``, ``dist.new_group`` groups and the functional collectives (which find
groups by ``group_name`` and call the wrapper's methods from C++) go through it too.
"""

from __future__ import annotations

import contextlib
import datetime
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tpsim.comm import backend_names, ops
from tpsim.comm._inject import RankFaults, checksum, corrupt_, crash, mismatched_call
from tpsim.comm.trace import CollectiveCall
from tpsim.errors import CollectiveError, InvalidArgument
from tpsim.faults import Corrupt, Crash, Delay, Drop, Fault, Mismatch

#: Exit status of a worker process that a Drop fault ended (the parent also reads its status slot).
DROP_EXIT_CODE = 87

#: Bytes of one rank's collective fingerprint (see TracingProcessGroup._verify).
_FINGERPRINT_BYTES = 768

#: Environment variable that turns the fingerprint exchange off (``0``) or on (anything else).
VERIFY_ENV = "TPSIM_VERIFY_COLLECTIVES"

__all__ = [
    "BACKEND_NAMES",
    "RankSession",
    "StatusSlot",
    "TracedWork",
    "TracingProcessGroup",
    "activate",
    "current_session",
    "register_backends",
]

#: tpsim backend name -> the name of the tracing c10d backend registered for it.
BACKEND_NAMES = {"gloo": "tpsim_gloo", "nccl": "tpsim_nccl"}


class StatusSlot:
    """A few bytes of memory shared with the parent, saying what this rank is doing right now.

    The parent reads it when it must decide, without waiting for a timeout, whether a rank
    that has not reported is blocked in a collective (then it can never report on its own)
    and to say in error messages what each rank was doing. Text form:
    ``state|op|call_index|group`` with state ``idle``, ``running`` or ``collective``.
    """

    def __init__(self, buffer: Any | None) -> None:
        self._buffer = buffer  # a multiprocessing RawArray of c_char, or None (torchrun mode)

    def set(self, state: str, call: CollectiveCall | None = None) -> None:
        """Publish ``state`` and the collective ``call`` this rank is in or issued last."""
        if self._buffer is None:
            return
        if call is None:
            text = f"{state}|||"
        else:
            text = f"{state}|{call.op}|{call.call_index}|{call.group}"
        # Truncate so the NUL terminator fits; a reader may see a torn value, which only
        # ever affects the wording of a diagnostic.
        self._buffer.value = text.encode("utf-8", "replace")[: len(self._buffer) - 1]


def parse_status(raw: bytes) -> tuple[str, str | None, int | None, str | None]:
    """Decode a :class:`StatusSlot` value into ``(state, op, call_index, group)``."""
    parts = raw.decode("utf-8", "replace").split("|")
    if len(parts) != 4:
        return ("unknown", None, None, None)
    state, op, index, group = parts
    try:
        call_index: int | None = int(index)
    except ValueError:
        call_index = None
    return (state or "unknown", op or None, call_index, group or None)


class RankSession:
    """What one rank records while it runs one submitted function.

    A fresh session is activated around every ``fn`` run, so call indices start at 1 on every
    group for every run even though the worker's world (and its groups) lives on.
    """

    def __init__(
        self,
        rank: int,
        *,
        timeout: float,
        faults: Sequence[Fault] = (),
        status: StatusSlot | None = None,
        checksum: bool = False,
        verify: bool | None = None,
    ) -> None:
        self.rank = rank
        self.timeout = timeout
        self.faults = tuple(faults)
        self.status = status or StatusSlot(None)
        #: This rank's faults of the plan (every rank knows the whole plan: ties in mismatch votes).
        self.rank_faults = RankFaults(self.faults, rank)
        self.injected_ranks = {f.rank for f in self.faults if isinstance(f, Mismatch)}
        #: Checksum every contribution at the call and as handed to the backend (see tpsim.run).
        self.checksum = checksum
        #: Exchange a fingerprint of every collective first, so mismatches are refused by name
        #: instead of left to the backend (undefined on gloo: a hang, a crash or wrong numbers).
        #: On by default; ``TPSIM_VERIFY_COLLECTIVES=0`` turns it off (a fault plan or checksums
        #: keep it on: they are reported through it).
        if verify is None:
            import os

            verify = bool(self.faults) or checksum or os.environ.get(VERIFY_ENV, "1") not in ("", "0")
        self.verify = verify
        self.calls: list[CollectiveCall] = []
        #: The call whose wait failed first on this rank (None while collectives succeed).
        self.failed_call: CollectiveCall | None = None
        self._counters: dict[str, int] = {}
        self._last: CollectiveCall | None = None
        # Collectives may be issued from several threads of one rank (autograd engine threads).
        self._lock = threading.Lock()

    def record(
        self,
        op: str,
        group: str,
        group_ranks: tuple[int, ...],
        tensors: Sequence[torch.Tensor],
        *,
        reduce_op: str | None = None,
        peer: int | None = None,
    ) -> CollectiveCall:
        """Append and return the :class:`CollectiveCall` for one op issued now on ``group``."""
        with self._lock:
            index = self._counters.get(group, 0) + 1
            self._counters[group] = index
            call = CollectiveCall(
                rank=self.rank,
                op=op,
                group=group,
                group_ranks=group_ranks,
                call_index=index,
                shapes=tuple(tuple(t.shape) for t in tensors),
                dtypes=tuple(ops.dtype_name(t.dtype) for t in tensors),
                reduce_op=reduce_op,
                peer=peer,
            )
            self.calls.append(call)
            self._last = call
        self.status.set("collective", call)
        return call

    def left(self, call: CollectiveCall) -> None:
        """Mark that the rank is back in its own code after waiting on ``call``."""
        self.status.set("running", self._last or call)

    @property
    def last_call(self) -> CollectiveCall | None:
        """The most recent collective this rank issued in this session."""
        return self._last


_SESSION: RankSession | None = None


def current_session() -> RankSession | None:
    """The session of the function running on this rank now, or None outside a run."""
    return _SESSION


@contextlib.contextmanager
def activate(session: RankSession) -> Iterator[RankSession]:
    """Make ``session`` the one every traced collective records into, for the ``with`` body."""
    global _SESSION
    previous = _SESSION
    _SESSION = session
    session.status.set("running")
    for pg in _traced_groups():
        pg.apply_timeout(session.timeout)
    try:
        yield session
    finally:
        _SESSION = previous


def _traced_groups() -> list[TracingProcessGroup]:
    """Every live tracing group of this process (the world and its subgroups)."""
    groups = list(dist.distributed_c10d._world.pg_map) if dist.is_initialized() else []
    return [g for g in groups if isinstance(g, TracingProcessGroup)]


_SOURCE_PREFIX = re.compile(r"^\[[^\]]*\.(?:cc|cpp|h|hpp):\d+\]\s*")


def backend_message(exc: BaseException) -> str:
    """A backend error's text without the C++ source location gloo puts in front of it."""
    return _SOURCE_PREFIX.sub("", str(exc).strip())


def _flat(obj: Any) -> list[torch.Tensor]:
    """Tensors of a tensor / (nested) list of tensors, in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    out: list[torch.Tensor] = []
    for item in obj or ():
        out.extend(_flat(item))
    return out


class _AllWork(dist.Work):
    """One handle over several backend works (used to emulate coalesced ops gloo lacks)."""

    def __init__(self, works: list[Any]) -> None:
        super().__init__()
        self._works = works

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        for work in self._works:
            work.wait(timeout)
        return True

    def is_completed(self) -> bool:
        return all(w.is_completed() for w in self._works)

    def is_success(self) -> bool:
        return all(w.is_success() for w in self._works)

    def get_future(self) -> torch.futures.Future:
        return torch.futures.collect_all([w.get_future() for w in self._works])


class TracedWork(dist.Work):
    """The handle returned for every traced collective.

    ``wait`` waits on the backend work, converts a backend failure into a
    :class:`tpsim.CollectiveError` for this rank, and keeps the rank's status slot honest (in a collective until the wait returns). C++ callers
    (functional collectives, autograd) reach this ``wait`` through torch's Work trampoline.
    """

    def __init__(
        self,
        inner: Any,
        call: CollectiveCall | None,
        session: RankSession | None,
    ) -> None:
        super().__init__()
        self._inner = inner
        self._call = call
        self._session = session
        self._done = False

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        if self._done:  # callers may wait twice (e.g. a work handle and wait_tensor)
            return True
        try:
            result = self._inner.wait(timeout) if self._inner is not None else True
        except Exception as exc:
            raise self._failure(exc) from exc
        finally:
            if self._session is not None and self._call is not None:
                self._session.left(self._call)
        self._done = True
        return bool(result) if result is not None else True

    def _failure(self, exc: Exception) -> Exception:
        call, session = self._call, self._session
        if call is None or session is None:
            return exc  # outside a tpsim run: leave the backend's own error alone
        if session.failed_call is None:
            session.failed_call = call
        if isinstance(exc, CollectiveError):
            return exc
        return CollectiveError(
            f"{call.describe()} failed on rank {call.rank}: {backend_message(exc)}",
            rank=call.rank,
            collective=call.op,
            call_index=call.call_index,
            group=call.group,
        )

    def is_completed(self) -> bool:
        return self._done or (self._inner is None or bool(self._inner.is_completed()))

    def is_success(self) -> bool:
        return self._inner is None or bool(self._inner.is_success())

    def exception(self) -> Any:
        return None if self._inner is None else self._inner.exception()

    def source_rank(self) -> int:
        return int(self._inner.source_rank())

    def _source_rank(self) -> int:
        return int(self._inner._source_rank())

    def result(self) -> list[torch.Tensor]:
        return [] if self._inner is None else list(self._inner.result())

    def synchronize(self) -> None:
        self.wait()

    def get_future(self) -> torch.futures.Future:
        if self._inner is None:
            fut: torch.futures.Future = torch.futures.Future()
            fut.set_result([])
            return fut
        return self._inner.get_future()


class TracingProcessGroup(dist.ProcessGroup):
    """A ``dist.ProcessGroup`` that records and forwards every op to a real backend group.

    ``inner`` is the real ``ProcessGroupGloo``/``ProcessGroupNCCL`` of the same ranks. Every
    public op funnels into :meth:`_collective`, which records the call and passes it to
    :meth:`intercept` — the one method a fault-injection layer overrides.
    """

    def __init__(
        self,
        inner: Any,
        *,
        rank: int,
        size: int,
        group_name: str,
        global_ranks: Sequence[int],
        device_type: str,
        backend_name: str,
    ) -> None:
        super().__init__(rank, size)
        self.inner = inner
        self._group_name = str(group_name)
        # The default group is created with an empty rank list: it spans the whole world.
        self._is_world = len(global_ranks) == 0
        self._global_ranks = tuple(global_ranks) if global_ranks else tuple(range(size))
        self._device_type = device_type
        self._backend_name = backend_name
        #: The tpsim backend this group belongs to (:mod:`tpsim.comm.backend_names` reads it).
        self.tpsim_backend = backend_name
        self._label: str | None = None

    # -- identity: functional collectives resolve groups by name, object collectives by device
    @property
    def group_name(self) -> str:  # type: ignore[override]
        return self._group_name

    @property
    def _device_types(self) -> list[torch.device]:  # type: ignore[override]
        return [torch.device(self._device_type)]

    def getBackendName(self) -> str:
        return self._backend_name

    def name(self) -> str:  # type: ignore[override]
        return self._backend_name

    def _get_backend_name(self) -> str:
        return self._backend_name

    def _get_backend(self, device: Any) -> Any:  # control-plane helpers (timeouts, uid) ask for it
        if torch.device(device).type != self._device_type:
            raise RuntimeError(f"No backend type associated with device type {torch.device(device).type}")
        return self.inner

    @property
    def trace_label(self) -> str:
        """Group name used in traces (:func:`tpsim.comm.ops.group_label`, as on inproc): ``world``, else the
        group's description, else its ranks."""
        if self._label is None:
            desc = ""
            if not self._is_world:
                with contextlib.suppress(Exception):
                    desc = str(self.group_desc)
            self._label = ops.group_label(self._is_world, desc, self._global_ranks)
        return self._label

    @property
    def global_ranks(self) -> tuple[int, ...]:
        """Global ranks of this group's members, in group-rank order."""
        return self._global_ranks

    def apply_timeout(self, seconds: float) -> None:
        """Bound every wait of the real backend by ``seconds`` (set at the start of each run)."""
        with contextlib.suppress(Exception):  # not every backend build exposes set_timeout
            self.inner.set_timeout(datetime.timedelta(seconds=seconds))

    def set_timeout(self, timeout: datetime.timedelta) -> None:  # type: ignore[override]
        self.inner.set_timeout(timeout)

    def shutdown(self) -> None:  # type: ignore[override]
        with contextlib.suppress(Exception):
            self.inner.shutdown()

    def abort(self) -> None:  # type: ignore[override]
        with contextlib.suppress(Exception):
            self.inner.abort()

    # -- the interception point -----------------------------------------------------------
    def intercept(
        self,
        call: CollectiveCall | None,
        tensors: list[torch.Tensor],
        issue: Callable[[], Any],
    ) -> Any:
        """Issue one recorded collective; return the backend's work handle.

        The per-call hook point where the fault plan acts: ``call`` is the record just made (None
        outside a tpsim run), ``tensors`` the rank's contribution as the caller passed it,
        ``issue()`` runs the real op. A Drop ends this process here (``os._exit``: its peers see a
        real dead peer), a Crash raises, a Delay sleeps, a Corrupt perturbs ``tensors`` before they
        are sent, a Mismatch changes what this rank
        claims to issue. With the session's ``verify`` on, the group first exchanges fingerprints
        of the call (op, call index, signature, checksums) and every member refuses a disagreement
        with the same :class:`tpsim.CollectiveError`, naming the deviating rank(s).
        """
        session = current_session()
        if session is None or call is None:
            return issue()
        crc = checksum(tensors) if session.checksum else 0
        note = ""
        signature = ops.signature_of(call)
        fault = session.rank_faults.next_call(call) if session.rank_faults.faults else None
        if fault is not None:
            note = ops.fault_note(fault, call)
            if isinstance(fault, Drop):
                session.status.set("dropped", call)
                _die(DROP_EXIT_CODE)
            elif isinstance(fault, Crash):
                raise crash(fault, call)
            elif isinstance(fault, Delay):
                session.status.set("stalled", call)
                time.sleep(fault.seconds)  # a real stall; the parent bounds the run
                session.status.set("collective", call)
            elif isinstance(fault, Corrupt):
                if call.op != "recv":  # a receive buffer is no contribution
                    corrupt_(fault, tensors)
            elif isinstance(fault, Mismatch):
                mismatched_call(fault, call)
                signature = ops.mismatched_signature(signature, ops.signature_of(call), fault.what)
        if session.verify and call.op not in ops.P2P_OPS and self.size() > 1:
            sent = checksum(tensors) if session.checksum else 0
            self._verify(call, session, ops.describe_signature(call.op, signature), crc, sent, note)
        return issue()

    def _verify(self, call: CollectiveCall, session: RankSession, signature: str, crc: int, sent: int,
                note: str) -> None:
        """Exchange fingerprints of this call with the group; raise the same verdict on every member.

        Like ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: one all_gather of a fixed-size record (op, call
        index, signature, checksums, fault note) on the real group before the call itself, bounded by
        the group's timeout. Every member sees every record, so every member reaches the same verdict.
        """
        fields = [call.op, str(call.call_index), signature, f"{crc:x}", f"{sent:x}", note]
        text = "\x1f".join(fields).encode("utf-8", "replace")
        buf = torch.zeros(_FINGERPRINT_BYTES, dtype=torch.uint8)
        buf[: min(len(text), _FINGERPRINT_BYTES)] = torch.frombuffer(bytearray(text[:_FINGERPRINT_BYTES]),
                                                                     dtype=torch.uint8)
        device = torch.device(self._device_type) if self._device_type == "cpu" else torch.device(
            "cuda", torch.cuda.current_device())
        mine = buf.to(device)
        everyone = [torch.empty_like(mine) for _ in range(self.size())]
        try:
            self.inner.allgather([everyone], [mine], _opts("AllgatherOptions")).wait()
        except Exception as exc:
            raise TracedWork(None, call, session)._failure(exc) from exc
        prints: dict[int, list[str]] = {}
        for i, t in enumerate(everyone):
            raw = t.cpu().numpy().tobytes().rstrip(b"\x00").decode("utf-8", "replace").split("\x1f")
            raw += [""] * (len(fields) - len(raw))
            prints[self._peer(i)] = raw
        members = {}
        for r, (op, index, sig, _, _, rnote) in prints.items():
            members[r] = ops.Member(op, int(index) if index.isdigit() else 0, sig, rnote)
        if len({(m.op, m.signature) for m in members.values()}) > 1:
            where = ops.group_words(call.group, call.group_ranks)
            message, faulty, ref = ops.mismatch_message(where, members, session.injected_ranks)
            self._refuse(call, session, message, faulty, members[ref].op, members[ref].call_index)
        bad = [(r, int(p[3] or "0", 16), int(p[4] or "0", 16), p[5]) for r, p in sorted(prints.items()) if p[3] != p[4]]
        if bad:
            first = members[min(members)]
            where = ops.group_words(call.group, call.group_ranks)
            self._refuse(call, session, ops.checksum_message(first.op, first.call_index, where, bad),
                         tuple(r for r, *_ in bad), first.op, first.call_index)

    def _refuse(self, call: CollectiveCall, session: RankSession, message: str, faulty: Sequence[int],
                op: str, index: int) -> None:
        if session.failed_call is None:
            session.failed_call = call
        # Every member refuses at the same point after a completed exchange: the world stays usable.
        raise CollectiveError(message, rank=call.rank, collective=op, call_index=index, group=call.group,
                              faulty_ranks=tuple(faulty), world_intact=True)

    def _collective(
        self,
        op: str,
        inputs: Any,
        issue: Callable[[], Any],
        *,
        reduce_op: Any = None,
        peer: int | None = None,
        problem: str | None = None,
        strided: tuple[str, torch.Tensor, str] | None = None,
    ) -> TracedWork:
        session = current_session()
        tensors = _flat(inputs)
        call = None
        if session is not None:
            call = session.record(
                op,
                self.trace_label,
                self._global_ranks,
                tensors,
                reduce_op=ops.reduce_op_name(reduce_op) if reduce_op is not None else None,
                peer=peer,
            )
        try:
            if problem is not None:  # this member's own buffers are wrong: refused here, as on inproc
                rank = call.rank if call is not None else self._peer(self.rank())
                where = call.describe() if call is not None else op
                raise InvalidArgument(f"{where}: on rank {rank}, {problem}")
            if strided is not None:  # a view a real backend computes wrongly or refuses: refused, as on inproc
                raise ops.strided_view_error(call if call is not None else self._bare_call(op, tensors), strided)
            inner = self.intercept(call, tensors, issue)
        except BaseException:
            if session is not None and call is not None:
                session.left(call)  # refused at issue time: the rank is not blocked in it
            raise
        return TracedWork(inner, call, session)

    def _bare_call(self, op: str, tensors: Sequence[torch.Tensor]) -> CollectiveCall:
        """A record of ``op`` for messages outside a tpsim run (no session numbers calls)."""
        return CollectiveCall(rank=self._peer(self.rank()), op=op, group=self.trace_label,
                              group_ranks=self._global_ranks, call_index=0,
                              shapes=tuple(tuple(t.shape) for t in tensors),
                              dtypes=tuple(ops.dtype_name(t.dtype) for t in tensors))

    def _problem(self, op: str, inputs: Any, outputs: Any, root: int | None = None,
                 splits: tuple[Sequence[int], Sequence[int]] | None = None) -> str | None:
        return ops.buffer_problem(op, self.size(), self.rank(), root, inputs, outputs, splits)

    def _peer(self, group_rank: int) -> int:
        """Global rank of ``group_rank`` in this group (as traces report peers)."""
        if 0 <= group_rank < len(self._global_ranks):
            return self._global_ranks[group_rank]
        return group_rank

    # -- forwarded ops (the caller's tensors, exactly as given) ---------------------------
    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TracedWork:
        opts = dist.AllreduceOptions() if opts is None else opts
        return self._collective("all_reduce", tensors, lambda: self.inner.allreduce(tensors, opts),
                                reduce_op=opts.reduceOp, strided=ops.strided_view("all_reduce", tensors))

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> TracedWork:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts
        return self._collective("all_reduce", tensors, lambda: self.inner.allreduce_coalesced(tensors, opts),
                                reduce_op=opts.reduceOp, strided=ops.strided_view("all_reduce", tensors))

    def allgather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> TracedWork:
        opts = _opts("AllgatherOptions") if opts is None else opts
        return self._collective("all_gather", input_tensors,
                                lambda: self.inner.allgather(output_tensors, input_tensors, opts),
                                problem=self._problem("all_gather", input_tensors, output_tensors),
                                strided=ops.strided_view("all_gather", input_tensors, output_tensors))

    def allgather_coalesced(
        self, output_lists: list[list[torch.Tensor]], input_list: list[torch.Tensor], opts: Any = None
    ) -> TracedWork:
        opts = _opts("AllgatherOptions") if opts is None else opts
        return self._collective("all_gather", input_list,
                                lambda: self.inner.allgather_coalesced(output_lists, input_list, opts),
                                strided=ops.strided_view("all_gather", input_list, output_lists))

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor, opts: Any = None) -> TracedWork:
        opts = _opts("AllgatherOptions") if opts is None else opts
        return self._collective(
            "all_gather_into_tensor", [input], lambda: self.inner._allgather_base(output, input, opts),
            problem=self._problem("all_gather_into_tensor", input, output),
            strided=ops.strided_view("all_gather_into_tensor", input, output),
        )

    all_gather_single = _allgather_base  # torch >= 2.13 name of the same op

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TracedWork:
        opts = _opts("AllgatherOptions") if opts is None else opts
        return self._coalesced("all_gather_into_tensor", "allgather_into_tensor_coalesced", self.inner._allgather_base,
                               outputs, inputs, opts)

    def _coalesced(self, op: str, native: str, one: Callable[..., Any], outputs: list[torch.Tensor],
                   inputs: list[torch.Tensor], opts: Any, reduce_op: Any = None) -> TracedWork:
        """The coalesced form of ``op``: the backend's own (its method ``native``) where it has one, else
        ``one(output, input, opts)`` per tensor, in the same order on every rank (gloo has no coalesced form)."""
        def issue() -> Any:
            coalesced = getattr(self.inner, native, None)
            if coalesced is not None:
                return coalesced(outputs, inputs, opts)
            return _AllWork([one(o, i, opts) for o, i in zip(outputs, inputs, strict=True)])

        problem = next((q for o, i in zip(outputs, inputs, strict=False)
                        if (q := self._problem(op, i, o)) is not None), None)
        return self._collective(op, inputs, issue, reduce_op=reduce_op, problem=problem,
                                strided=ops.strided_view(op, inputs, outputs))

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> TracedWork:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._collective(
            "reduce_scatter", input_tensors, lambda: self.inner.reduce_scatter(output_tensors, input_tensors, opts),
            reduce_op=opts.reduceOp, problem=self._problem("reduce_scatter", input_tensors, output_tensors),
            strided=ops.strided_view("reduce_scatter", input_tensors, output_tensors),
        )

    def _reduce_scatter_base(self, outputTensor: torch.Tensor, inputTensor: torch.Tensor, opts: Any = None) -> TracedWork:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._collective(
            "reduce_scatter_tensor", [inputTensor],
            lambda: self.inner._reduce_scatter_base(outputTensor, inputTensor, opts),
            reduce_op=opts.reduceOp, problem=self._problem("reduce_scatter_tensor", inputTensor, outputTensor),
            strided=ops.strided_view("reduce_scatter_tensor", inputTensor, outputTensor),
        )

    reduce_scatter_single = _reduce_scatter_base  # torch >= 2.13 name of the same op

    def reduce_scatter_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> TracedWork:
        opts = dist.ReduceScatterOptions() if opts is None else opts
        return self._coalesced("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
                               self.inner._reduce_scatter_base, outputs, inputs, opts, reduce_op=opts.reduceOp)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> TracedWork:
        opts = dist.BroadcastOptions() if opts is None else opts
        return self._collective("broadcast", tensors, lambda: self.inner.broadcast(tensors, opts),
                                peer=self._peer(opts.rootRank), strided=ops.strided_view("broadcast", tensors))

    def scatter(
        self, output_tensors: list[torch.Tensor], input_tensors: list[list[torch.Tensor]], opts: Any = None
    ) -> TracedWork:
        opts = dist.ScatterOptions() if opts is None else opts
        # The root contributes the scatter list; the other ranks only a buffer to receive into.
        shown = input_tensors if _flat(input_tensors) else output_tensors
        return self._collective(
            "scatter", shown, lambda: self.inner.scatter(output_tensors, input_tensors, opts),
            peer=self._peer(opts.rootRank),
            problem=self._problem("scatter", input_tensors, output_tensors, opts.rootRank),
            strided=ops.strided_view("scatter", input_tensors, output_tensors),
        )

    def gather(
        self, output_tensors: list[list[torch.Tensor]], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> TracedWork:
        opts = dist.GatherOptions() if opts is None else opts
        return self._collective(
            "gather", input_tensors, lambda: self.inner.gather(output_tensors, input_tensors, opts),
            peer=self._peer(opts.rootRank),
            problem=self._problem("gather", input_tensors, output_tensors, opts.rootRank),
            strided=ops.strided_view("gather", input_tensors, output_tensors),
        )

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> TracedWork:
        opts = dist.ReduceOptions() if opts is None else opts
        return self._collective(
            "reduce", tensors, lambda: self.inner.reduce(tensors, opts),
            reduce_op=opts.reduceOp, peer=self._peer(opts.rootRank), strided=ops.strided_view("reduce", tensors),
        )

    def alltoall(
        self, output_tensors: list[torch.Tensor], input_tensors: list[torch.Tensor], opts: Any = None
    ) -> TracedWork:
        opts = dist.AllToAllOptions() if opts is None else opts
        return self._collective("all_to_all", input_tensors,
                                lambda: self.inner.alltoall(output_tensors, input_tensors, opts),
                                problem=self._problem("all_to_all", input_tensors, output_tensors),
                                strided=ops.strided_view("all_to_all", input_tensors, output_tensors))

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> TracedWork:
        opts = dist.AllToAllOptions() if opts is None else opts
        out_splits, in_splits = list(output_split_sizes), list(input_split_sizes)
        return self._collective(
            "all_to_all_single", [input],
            lambda: self.inner.alltoall_base(output, input, out_splits, in_splits, opts),
            problem=self._problem("all_to_all_single", input, output, splits=(out_splits, in_splits)),
            strided=ops.strided_view("all_to_all_single", input, output),
        )

    all_to_all_single = alltoall_base  # torch >= 2.13 name of the same op

    def barrier(self, opts: Any = None) -> TracedWork:
        opts = dist.BarrierOptions() if opts is None else opts
        return self._collective("barrier", [], lambda: self.inner.barrier(opts))

    def monitored_barrier(self, timeout: datetime.timedelta | None = None, wait_all_ranks: bool = False) -> None:
        def issue() -> None:
            if timeout is None:
                self.inner.monitored_barrier(wait_all_ranks=wait_all_ranks)
            else:
                self.inner.monitored_barrier(timeout, wait_all_ranks)

        self._collective("barrier", [], issue).wait()

    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> TracedWork:
        return self._collective("send", tensors, lambda: self.inner.send(tensors, dstRank, tag),
                                peer=self._peer(dstRank), strided=ops.strided_view("send", tensors))

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> TracedWork:
        return self._collective("recv", tensors, lambda: self.inner.recv(tensors, srcRank, tag),
                                peer=self._peer(srcRank), strided=ops.strided_view("recv", tensors))

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> TracedWork:
        return self._collective("recv", tensors, lambda: self.inner.recv_anysource(tensors, tag),
                                strided=ops.strided_view("recv", tensors))


def _opts(name: str) -> Any:
    """Options objects that ``torch.distributed`` does not re-export (e.g. AllgatherOptions)."""
    import torch._C._distributed_c10d as c10d

    return getattr(c10d, name)()


# -- backend registration --------------------------------------------------------------------

_REGISTERED: dict[str, bool] = {}
_LOOPBACK = {"value": False}


def register_backends(*, loopback: bool) -> None:
    """Register ``tpsim_gloo`` / ``tpsim_nccl`` with torch.distributed (idempotent per process).

    ``loopback=True`` (the worker pool: every rank on this machine) binds gloo to 127.0.0.1 so
    no hostname lookup or network interface is involved; ``False`` (torchrun, possibly many
    machines) lets gloo pick its interface as usual (``GLOO_SOCKET_IFNAME`` is honoured).
    """
    _LOOPBACK["value"] = loopback
    if _REGISTERED:
        return
    dist.Backend.register_backend(BACKEND_NAMES["gloo"], _create_gloo, extended_api=True, devices=["cpu"])
    gloo, nccl = BACKEND_NAMES["gloo"], BACKEND_NAMES["nccl"]
    # dist.get_backend() names the real backend (code branches on "gloo"; monitored_barrier needs it),
    # and groups asked for by that name inside the world are traced too.
    backend_names.present_as(gloo, "gloo", aliases={"gloo": gloo})
    if dist.is_nccl_available():
        dist.Backend.register_backend(nccl, _create_nccl, extended_api=True, devices=["cuda"])
        backend_names.present_as(nccl, "nccl", aliases={"nccl": nccl, "gloo": gloo})
    _REGISTERED["done"] = True


def _timeout_for(opts: Any) -> datetime.timedelta:
    session = current_session()
    # Groups made inside a run (dist.new_group) get the run's timeout, not the world's.
    if session is not None:
        return datetime.timedelta(seconds=session.timeout)
    return opts.timeout


def _create_gloo(opts: Any, backend_options: Any) -> TracingProcessGroup:
    from torch.distributed import ProcessGroupGloo

    gloo_opts = ProcessGroupGloo._Options()
    gloo_opts._timeout = _timeout_for(opts)
    if _LOOPBACK["value"]:
        gloo_opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    else:
        gloo_opts._devices = [ProcessGroupGloo.create_default_device()]
    inner = ProcessGroupGloo(opts.store, opts.group_rank, opts.group_size, gloo_opts)
    with contextlib.suppress(Exception):
        inner.options.global_ranks_in_group = list(opts.global_ranks_in_group)
        inner.options.group_name = opts.group_id
    return TracingProcessGroup(
        inner,
        rank=opts.group_rank,
        size=opts.group_size,
        group_name=opts.group_id,
        global_ranks=list(opts.global_ranks_in_group),
        device_type="cpu",
        backend_name=BACKEND_NAMES["gloo"],
    )


def _create_nccl(opts: Any, backend_options: Any) -> TracingProcessGroup:
    from torch.distributed import ProcessGroupNCCL

    nccl_opts = backend_options if isinstance(backend_options, ProcessGroupNCCL.Options) else ProcessGroupNCCL.Options()
    nccl_opts._timeout = _timeout_for(opts)
    with contextlib.suppress(Exception):
        nccl_opts.global_ranks_in_group = list(opts.global_ranks_in_group)
        nccl_opts.group_name = opts.group_id
    inner = ProcessGroupNCCL(opts.store, opts.group_rank, opts.group_size, nccl_opts)
    return TracingProcessGroup(
        inner,
        rank=opts.group_rank,
        size=opts.group_size,
        group_name=opts.group_id,
        global_ranks=list(opts.global_ranks_in_group),
        device_type="cuda",
        backend_name=BACKEND_NAMES["nccl"],
    )


def _die(code: int) -> None:
    """End this process now, as a crashed machine would: no cleanup, sockets closed by the OS."""
    import os
    import sys

    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
