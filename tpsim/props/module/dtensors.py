"""DTensor parameters and outputs of a module target, read and written in their own placement.

A module parallelised by a plan (``parallelize_module``, Hugging Face's ``apply_tensor_parallelism``)
holds its parameters as DTensors: each reports its *global* shape and its placement on the mesh, and
stores one local piece. The tp world (:mod:`tpsim.props.module.world`) treats such a parameter as
the module says it is laid out, never as its global shape suggests:

- its layout is the DTensor's placement (``Shard(d)``, ``_StridedShard``, ``Partial()``, ``Replicate()``),
  not a shape inference;
- its master piece is written into the local tensor (the piece DTensor itself computes for this
  rank: ``torch.chunk`` sizes when a dim does not divide), never copied as a plain tensor into the
  DTensor (torch refuses mixed ``Tensor``/``DTensor`` copies);
- its grad is read in the parameter's placement: a grad DTensor left ``Partial`` (a sequence-parallel
  norm's replicated weight: each rank's grad is a summand until the optimizer reads it) is
  redistributed to the parameter's placement first, exactly what a DTensor optimizer step applies;
- a DTensor output is read as its ``full_tensor()``: its value is what DTensor says it is, whatever
  its placement (a plain local output is judged by the variant's declared ``output`` as before).

Reading a DTensor's pieces back through *any* of torch's placements (``_StridedShard`` and ``Partial``
included, on meshes of several dims) in a process that never imports user code is
:mod:`tpsim.props.module.dtensor_pieces`.

No harness code imports ``torch.distributed.tensor`` for a module without DTensors (it costs seconds
per process): every helper looks for the class in ``sys.modules`` first.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from tpsim.errors import InvalidArgument
from tpsim.placement import Partial, Replicate, Shard
from tpsim.props.module.sharding import ParamLayout

__all__ = ["is_dtensor", "dtensor_layout", "load_piece", "local_grad", "local_shape", "local_value", "plain_output"]


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (without importing ``torch.distributed.tensor``)."""
    module = sys.modules.get("torch.distributed.tensor")
    cls = getattr(module, "DTensor", None)
    return cls is not None and isinstance(t, cls)


def local_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The shape this rank stores of ``p`` (a DTensor's local piece; else ``p``'s shape)."""
    return tuple(p.to_local().shape) if is_dtensor(p) else tuple(p.shape)


def _one_placement(p: Any, name: str) -> Any:
    if p.device_mesh.ndim != 1:
        raise InvalidArgument(f"parameter {name!r} is a DTensor on a {p.device_mesh.ndim}-D mesh; tpsim checks a "
                              "module parallelised over one tp group (a 1-D mesh)")
    return p.placements[0]


def dtensor_layout(p: Any, name: str, full: tuple[int, ...], tp: int) -> ParamLayout | None:
    """The layout of the DTensor parameter ``p`` (dense shape ``full``) as its placement says, in
    tpsim's placements: ``Shard(d)``; ``_StridedShard(d, split_factor=k)`` (transformers' packed
    gate/up) as ``Shard(d, parts=...)`` of ``k`` equal parts, shard ``r`` of each; ``Partial()`` (a sum's
    terms); ``Replicate()``. None when its global shape is not ``full`` or the pieces are not ones
    tpsim's placements cut alike (an uneven ``torch.chunk`` piece that ``torch.tensor_split`` cuts
    otherwise, an uneven strided piece): reported as a layout tpsim cannot read."""
    from tpsim.props.module.dtensor_pieces import piece_shape, placement_of

    _one_placement(p, name)
    if tuple(p.shape) != tuple(full):
        return None
    (placement,) = placement_of(p).placements
    if placement.kind == "replicate":
        return ParamLayout(Replicate(), declared=True)
    if placement.kind == "partial":
        return ParamLayout(Partial(), declared=True) if placement.reduce_op == "sum" else None
    d = placement.dim
    size = full[d]
    if placement.kind == "strided_shard":
        k = placement.split_factor
        return ParamLayout(Shard(d, parts=(size // k,) * k), declared=True) if size % (k * tp) == 0 else None
    if size % tp == 0:
        return ParamLayout(Shard(d), declared=True)
    # torch.chunk's pieces (DTensor's) where they are torch.tensor_split's (tpsim's uneven pieces) too.
    layout = placement_of(p)
    chunked = [piece_shape(layout, r)[d] for r in layout.ranks]
    split = [size // tp + (1 if r < size % tp else 0) for r in range(tp)]
    return ParamLayout(Shard(d), declared=True, uneven=True) if chunked == split else None


def load_piece(p: Any, master: torch.Tensor) -> None:
    """Write this rank's piece of the full ``master`` into the DTensor parameter ``p``'s local tensor
    (the piece DTensor itself gives this rank, whatever its placement; under ``no_grad``)."""
    from tpsim.props.module.dtensor_pieces import expected_piece, placement_of

    p.to_local().copy_(expected_piece(master, placement_of(p), p.device_mesh.get_rank()))


def local_grad(p: Any) -> torch.Tensor | None:
    """``p``'s grad as this rank stores it, in ``p``'s placement (a DTensor grad left ``Partial`` is
    redistributed first, as a DTensor optimizer step does)."""
    g = p.grad
    if g is None or not is_dtensor(g):
        return g
    if tuple(g.placements) != tuple(p.placements):
        g = g.redistribute(p.device_mesh, p.placements)
    return g.to_local()


def local_value(p: torch.Tensor) -> torch.Tensor:
    """``p``'s local piece (a DTensor's) or ``p`` itself, detached."""
    return (p.to_local() if is_dtensor(p) else p).detach()


def plain_output(out: Any) -> Any:
    """A module output as the checks read it: a DTensor as its ``full_tensor()`` (differentiable:
    its backward hands each rank the grad of its own piece), anything else unchanged."""
    return out.full_tensor() if is_dtensor(out) else out
