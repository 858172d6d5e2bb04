"""Pickling tensors for tpsim's own pipes: plain CPU tensors travel as their raw storage bytes.

torch pickles a tensor by ``torch.save``-ing its storage into a byte string (~0.3 ms per small
tensor, measured), which made shipping a check's per-rank results to and from a worker process
cost a third of the check. :func:`reduce_tensor` sends the storage bytes directly (a protocol 5
buffer read straight from the storage; ~10 µs per tensor there and back, on an idle machine) with
dtype, shape, strides, offset and ``requires_grad``, so the copy is exact, views and strides
included; the rebuilt tensor shares the unpickled buffer instead of copying it again. Anything else (subclasses such as ``Parameter`` or DTensor,
sparse, quantized, conjugated, non-CPU, non-leaf tensors that require grad, tensors carrying
Python attributes) goes through torch's own pickling unchanged. Trace records
(:class:`~tpsim.comm.trace.CollectiveCall`) travel as plain tuples of their fields.
"""

from __future__ import annotations

import ctypes
import dataclasses
import io
import pickle
from typing import Any

import torch

from tpsim.comm.trace import CollectiveCall

__all__ = ["Pickler", "dumps", "reduce_tensor"]

_PROTOCOL = 5
_CALL_FIELDS = tuple(f.name for f in dataclasses.fields(CollectiveCall))
_Tensor = torch.Tensor
_STRIDED = torch.strided
_CHAR = ctypes.c_char


try:
    import numpy as _np

    #: dtypes numpy can view a buffer as: ``torch.from_numpy(numpy.ndarray(...))`` builds the tensor in
    #: ~1 µs, a third of ``frombuffer(...).as_strided(...)`` (bfloat16 and the rest take that path).
    _NUMPY = {t: (_np.dtype(n), _np.dtype(n).itemsize) for t, n in (
        (torch.float64, _np.float64), (torch.float32, _np.float32), (torch.float16, _np.float16),
        (torch.int64, _np.int64), (torch.int32, _np.int32), (torch.int16, _np.int16), (torch.int8, _np.int8),
        (torch.uint8, _np.uint8), (torch.bool, _np.bool_), (torch.complex64, _np.complex64),
        (torch.complex128, _np.complex128))}
except ImportError:  # numpy is optional for torch: the torch path serves every dtype
    _NUMPY: dict[torch.dtype, tuple[Any, int]] = {}


def _rebuild(dtype: torch.dtype, shape: tuple[int, ...], stride: tuple[int, ...], offset: int, data: Any,
             requires_grad: bool) -> torch.Tensor:
    # ``data`` is a bytearray (a writable buffer unpickles as one): the tensor shares it, no copy.
    if not len(data):  # an empty storage (a tensor with no elements)
        t = torch.empty_strided(shape, stride, dtype=dtype)
    elif dtype in _NUMPY and min(stride, default=0) >= 0:
        np_dtype, size = _NUMPY[dtype]
        t = torch.from_numpy(_np.ndarray(shape, np_dtype, data, offset * size, tuple(s * size for s in stride)))
    else:
        t = torch.frombuffer(data, dtype=dtype).as_strided(shape, stride, offset)
    return t.requires_grad_(True) if requires_grad else t


def reduce_tensor(obj: Any) -> Any:
    """A ``reducer_override`` result for a plain CPU tensor, or NotImplemented for anything else."""
    if (type(obj) is not _Tensor or not obj.is_cpu or obj.layout is not _STRIDED or obj.is_conj() or obj.is_neg()
            or obj.is_quantized or (obj.requires_grad and not obj.is_leaf) or obj.__dict__):
        return NotImplemented
    storage = obj.untyped_storage()
    size = storage.nbytes()
    if size % obj.element_size():
        return NotImplemented  # a storage another dtype made, of a size this dtype cannot tile
    # The storage's bytes as a writable buffer (read while pickling, when ``obj`` keeps it alive).
    raw = pickle.PickleBuffer((_CHAR * size).from_address(storage.data_ptr())) if size else b""
    return _rebuild, (obj.dtype, tuple(obj.shape), obj.stride(), obj.storage_offset(), raw, obj.requires_grad)


class Pickler(pickle.Pickler):
    """``pickle.Pickler`` (protocol 5) with the fast tensor path."""

    def __init__(self, file: Any) -> None:
        super().__init__(file, protocol=_PROTOCOL)

    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is CollectiveCall:  # positional: ~5x quicker than a slotted dataclass's own way
            return CollectiveCall, tuple(getattr(obj, name) for name in _CALL_FIELDS)
        return reduce_tensor(obj)


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` with the fast tensor path (load with plain ``pickle.loads``)."""
    buf = io.BytesIO()
    Pickler(buf).dump(obj)
    return buf.getvalue()
