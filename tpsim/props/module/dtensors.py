"""DTensor parameters and outputs of a module target, read and written in their own placement.

A module parallelised by a plan (``parallelize_module``, Hugging Face's ``apply_tensor_parallelism``)
holds its parameters as DTensors: each reports its *global* shape and its placement on the mesh, and
stores one local piece. The tp world (:mod:`tpsim.props.module.world`) treats such a parameter as
the module says it is laid out, never as its global shape suggests:

- its layout is the DTensor's placement (``Shard(d)`` / ``Replicate()``), not a shape inference;
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
from tpsim.placement import Replicate, Shard
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
    """The layout of the DTensor parameter ``p`` (dense shape ``full``) as its placement says;
    None when the placement is neither a shard nor a replica, or its global shape is not ``full``."""
    placement = _one_placement(p, name)
    if tuple(p.shape) != tuple(full):
        return None
    if placement.is_replicate():
        return ParamLayout(Replicate(), declared=True)
    if placement.is_shard():
        d = placement.dim % len(full)
        return ParamLayout(Shard(d), declared=True, uneven=full[d] % tp != 0)
    return None


def load_piece(p: Any, master: torch.Tensor) -> None:
    """Write this rank's piece of the full ``master`` into the DTensor parameter ``p``'s local tensor
    (the piece DTensor computes for this rank; under ``no_grad``)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = p.to_local()
    shape, offset = compute_local_shape_and_global_offset(tuple(master.shape), p.device_mesh, p.placements)
    index = tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))
    local.copy_(master[index])


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
