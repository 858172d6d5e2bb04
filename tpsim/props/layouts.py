"""Memory layouts of the generated inputs and upstream gradients (``Case.input_layout``).

Tensors in real training are often views: a sequence-first ``[S, B, H]`` activation read
batch-first, a strided slice, a batch broadcast with ``expand``. A layer that reads storage in
memory order (``.view`` on a non-contiguous tensor, a collective on a ``.contiguous()`` copy whose
result is dropped, a collective given the view itself: ``collective-on-strided-view``) works on
contiguous tensors only. Each layout below
keeps the *values* of the case and changes only how they sit in memory; the harness applies it to
every rank's input (after sharding) and to every upstream gradient:

=============  ===============================================================================
layout         how the tensor ``t`` of shape ``[*batch, H]`` is laid out
=============  ===============================================================================
contiguous     row-major, as generated
transposed     the leading two dims swapped in memory: a sequence-first ``[S, B, ...]`` buffer
               viewed batch-first (``buf.transpose(0, 1)``); with one batch dim the whole
               ``[B, H]`` matrix is column-major. Needs a batch dim.
strided        every other element of a buffer twice as large in every dim (``buf[::2, ::2]``);
               the gaps hold NaN, so a layer that reads storage in memory order gets NaN
expanded       the first batch dim broadcast from size 1 (stride 0): its rows are identical (the
               case's values are drawn that way, see :func:`expand_values`). Needs a batch dim.
=============  ===============================================================================

A layout whose tensor happens to be contiguous anyway (e.g. ``transposed`` with a size-1 dim)
stays valid; :func:`layout_info` reports the strides that were really used.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from tpsim.errors import InvalidArgument

__all__ = ["INPUT_LAYOUTS", "NON_CONTIGUOUS", "apply_layout", "cover_bucket", "expand_values", "layout_info",
           "needs_batch", "shows"]

#: Every layout, contiguous first (the strategies shrink toward it).
INPUT_LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
#: The layouts that make non-contiguous views.
NON_CONTIGUOUS = INPUT_LAYOUTS[1:]
_NEEDS_BATCH = ("transposed", "expanded")


def needs_batch(layout: str) -> bool:
    """Whether ``layout`` needs at least one leading batch dim."""
    return layout in _NEEDS_BATCH


def shows(layout: str, shape: tuple[int, ...]) -> bool:
    """Whether a tensor of ``shape`` in ``layout`` is really laid out so (:func:`apply_layout` gives a
    non-contiguous view; contiguous: always): ``transposed`` swaps two dims of more than one element,
    ``expanded`` broadcasts more than one row, ``strided`` spaces more than one element. Elsewhere the
    layout's tensor is contiguous memory, which a layer that mishandles the layout reads right."""
    if layout == "contiguous":
        return True
    if layout == "transposed":
        return len(shape) >= 2 and shape[0] > 1 and shape[1] > 1
    if layout == "expanded":
        return len(shape) >= 2 and shape[0] > 1
    return math.prod(shape) > 1


def cover_bucket(layout: str, batch_shape: tuple[int, ...]) -> str:
    """The coverage bucket (:meth:`tpsim.props.family.Family.cover_keys`) of an input in ``layout``
    with leading dims ``batch_shape``. ``transposed`` is two buckets, because the two are different
    memory orders a layer meets differently: with one batch dim the whole ``[B, H]`` matrix is
    column-major (``transposed matrix``: a flattened ``[B*S, H]`` activation, the gradient of a
    ``x.t()``), with two or more only the leading dims swap (``transposed``: a sequence-first buffer
    read batch-first). A layer that copies ``.contiguous()`` and reduces the copy may go wrong on one
    and not the other, and a search must check both at every seed."""
    if layout == "transposed" and len(batch_shape) == 1:
        return "transposed matrix"
    return layout


def apply_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A tensor with the values of ``t`` laid out as ``layout`` (a view of a fresh buffer; no grad)."""
    t = t.detach()
    if layout == "contiguous":
        return t.contiguous().clone()
    if layout == "transposed":
        if t.dim() < 2:
            raise InvalidArgument(f"input_layout='transposed' needs a batch dim; got a tensor of shape {list(t.shape)}")
        # Storage sequence-first: dims 0 and 1 swapped in memory, viewed back in the original order.
        return t.transpose(0, 1).contiguous().transpose(0, 1)
    if layout == "strided":
        big = torch.full([2 * s for s in t.shape], float("nan"), dtype=t.dtype)
        view = big[tuple(slice(None, None, 2) for _ in t.shape)]
        view.copy_(t)
        return view
    if layout == "expanded":
        if t.dim() < 2:
            raise InvalidArgument(f"input_layout='expanded' needs a batch dim; got a tensor of shape {list(t.shape)}")
        row = t[:1].clone()
        if not torch.equal(row.expand_as(t), t):
            raise InvalidArgument("input_layout='expanded' needs values that are identical along the first batch dim")
        return row.expand_as(t)
    raise InvalidArgument(f"input_layout={layout!r}; expected one of {', '.join(INPUT_LAYOUTS)}")


def expand_values(t: torch.Tensor, layout: str) -> torch.Tensor:
    """The values a case of ``layout`` uses for a drawn tensor: for ``expanded``, the first row
    repeated along the first batch dim (so the tensor can be an expanded view); else ``t``."""
    if layout == "expanded" and t.dim() >= 2:
        return t[:1].expand_as(t).clone()
    return t


def layout_info(shape: tuple[int, ...], layout: str, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
    """Shape, strides and contiguity of a tensor of ``shape`` in ``layout`` (for case files and reports)."""
    t = torch.zeros(shape, dtype=dtype)
    if layout == "expanded" and len(shape) < 2 or layout == "transposed" and len(shape) < 2:
        return {"shape": list(shape), "strides": list(t.stride()), "contiguous": True}
    v = apply_layout(t, layout)
    return {"shape": list(v.shape), "strides": list(v.stride()), "contiguous": v.is_contiguous()}
