"""What every backend shares to inject a fault plan (:mod:`tpsim.faults`) beneath a process group.

The backends differ in *where* a fault acts (inproc: in the thread's ``_join``; gloo/nccl: in
:meth:`TracingProcessGroup.intercept`), not in *what* it does; the what lives here:
finding the fault for a call, perturbing a contribution, checksumming one, describing one.
"""

from __future__ import annotations

import dataclasses
import zlib
from collections.abc import Sequence

import torch

from tpsim.comm.trace import CollectiveCall
from tpsim.faults import Corrupt, Fault, InjectedCrash, Mismatch

__all__ = ["RankFaults", "checksum", "corrupt_", "crash", "mismatched_call"]

#: Ops a mismatch of kind "op" turns a call into: a barrier, or an all_reduce in place of a barrier.
_OTHER_OP = {"barrier": "all_reduce"}


class RankFaults:
    """The faults of one rank, looked up per call (cheap when the rank has none)."""

    __slots__ = ("faults", "fired", "n")

    def __init__(self, plan: Sequence[Fault], rank: int) -> None:
        self.faults = tuple(f for f in plan if f.rank == rank)
        self.n = 0  # calls this rank issued so far, any group
        self.fired: list[tuple[Fault, CollectiveCall]] = []

    def next_call(self, call: CollectiveCall) -> Fault | None:
        """Count ``call`` (just issued) and return the fault acting on it, if any."""
        self.n += 1
        for fault in self.faults:
            if fault.matches(call.rank, self.n, call.group, call.call_index):
                # A copy: a Mismatch rewrites the trace record into what the rank really issued.
                self.fired.append((fault, dataclasses.replace(call)))
                return fault
        return None


def crash(fault: Fault, call: CollectiveCall) -> InjectedCrash:
    """The exception a :class:`tpsim.faults.Crash` raises on its rank."""
    return InjectedCrash(f"rank {call.rank} crashed on purpose (fault plan: {fault} at {call.describe()})")


# -- corruption -------------------------------------------------------------------------------------

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _flip(flat: torch.Tensor, index: int, bit: int | None) -> None:
    """Flip ``bit`` of element ``index`` of the contiguous 1-D tensor ``flat``, in place."""
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)  # a bit of the real part
        index *= 2
    bits = 8 * flat.element_size()
    if bit is None:
        # Default: the top exponent bit of a float (a large, visible change), the top bit otherwise.
        bit = bits - 2 if flat.is_floating_point() else bits - 1
    bit %= bits
    ints = flat.view(_INT_VIEW[flat.element_size()])
    value = (int(ints[index].item()) & ((1 << bits) - 1)) ^ (1 << bit)
    if ints.dtype != torch.uint8 and value >= 1 << (bits - 1):
        value -= 1 << bits  # back into the signed range of the view
    ints[index] = value


def corrupt_(fault: Corrupt, tensors: Sequence[torch.Tensor]) -> bool:
    """Perturb ``tensors`` in place as ``fault`` says; return whether any element changed.

    Goes through ``.data`` so that autograd's version counters do not move: a real memory
    fault would not make backward raise either.
    """
    changed = False
    for t in tensors:
        if t.numel() == 0:
            continue
        data = t.data
        if not data.is_contiguous():
            work = data.contiguous()
        else:
            work = data
        flat = work.view(-1)
        i = fault.index % flat.numel()
        if fault.how == "scale":
            if flat.dtype == torch.bool:
                flat.logical_not_()
            elif flat.is_floating_point() or flat.is_complex():
                flat.mul_(fault.factor)
            else:  # integers: scale in floating point, round back
                flat.copy_((flat * fault.factor).to(flat.dtype))
        elif fault.how == "nan" and (flat.is_floating_point() or flat.is_complex()):
            flat[i] = float("nan")
        elif flat.dtype == torch.bool:
            flat[i] = ~flat[i]
        else:  # bitflip, or nan on an integer tensor
            _flip(flat, i, fault.bit if fault.how == "bitflip" else None)
        if work is not data:
            data.copy_(work)
        changed = True
        if fault.how == "bitflip":
            break  # one flipped bit: in the first non-empty tensor only
    return changed


def checksum(tensors: Sequence[torch.Tensor]) -> int:
    """CRC-32 of the raw bytes of ``tensors`` (any dtype, any device), in order."""
    crc = 0
    for t in tensors:
        data = t.detach()
        if data.device.type != "cpu":
            data = data.cpu()
        data = data.contiguous().reshape(-1)
        if data.numel() == 0:
            continue
        raw = data.view(torch.uint8) if data.dtype != torch.bool else data.to(torch.uint8)
        crc = zlib.crc32(raw.numpy().tobytes(), crc)
    return crc


# -- mismatch ------------------------------------------------------------------------------------------


def mismatched_call(fault: Mismatch, call: CollectiveCall) -> None:
    """Rewrite ``call`` (the trace record) into what a :class:`Mismatch` makes the rank issue."""
    if fault.what == "op":
        call.op = _OTHER_OP.get(call.op, "barrier")
        if call.op == "barrier":
            call.shapes, call.dtypes, call.reduce_op = (), (), None
    elif fault.what == "shape":
        if call.shapes:
            first = tuple(call.shapes[0])
            first = (first[0] + 1, *first[1:]) if first else (2,)
            call.shapes = (first, *call.shapes[1:])
        else:
            call.shapes = ((1,),)
    else:
        dtypes = call.dtypes or ("float32",)
        other = "float32" if dtypes[0] == "float64" else "float64"
        call.dtypes = (other, *dtypes[1:])
