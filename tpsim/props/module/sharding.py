"""How each parameter of a module is sharded: declared, or read from its shapes at tp size 1 and N.

The dense module (tp size 1) holds every parameter whole; a rank of the tp group holds its piece.
Compared dim by dim, the two shapes say how the parameter is sharded:

- equal shapes: replicated;
- one dim ``d`` with ``full[d] == local[d] * tp`` and every other dim equal: ``Shard(d)``, rank ``r``
  holding the ``r``-th slice — unless the module that owns the parameter describes a packed layout
  with the attributes of :mod:`tpsim.layers.linear` (``parts``: the full sizes of its packed parts,
  adding up to ``full[d]``; vLLM's ``output_sizes`` and nanotron's ``contiguous_chunks`` say the
  same, :data:`PARTS_ATTRIBUTES`), which makes it ``Shard(d, parts=parts)``, shard ``r`` of every part;
- one dim that does not divide, cut as ``torch.tensor_split`` cuts it (``ceil`` sizes on the first
  ``full[d] % tp`` ranks, ``floor`` on the rest): an *uneven* ``Shard(d)``, loaded and compared
  piece by piece (a module that shards uneven sizes correctly passes);
- anything else: no layout (reported: a truncated or padded piece, or a shape error).

A :class:`~tpsim.variant.ParamSpec` on the variant overrides the inference (its shape is checked).

A shape that no layout explains in a case whose sizes divide is :class:`UnknownLayout`: a usage
error, never a finding, since correct modules store parameters so (key/value heads replicated
because there are fewer than ranks, an undeclared packed layout).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tpsim.errors import InvalidArgument
from tpsim.placement import Placement, Replicate, Shard, shard_shape

__all__ = ["ParamLayout", "UnknownLayout", "infer_layout", "uneven_size"]


@dataclass(frozen=True)
class ParamLayout:
    """How one parameter is laid out over the tp group (``placement`` in its stored coordinates)."""

    placement: Placement
    declared: bool = False
    uneven: bool = False

    def describe(self) -> str:
        """``S(0)``, ``S(0,parts=[4, 4])``, ``R``; ``(uneven)`` and ``(declared)`` when they apply."""
        text = str(self.placement)
        if self.uneven:
            text += " (uneven)"
        return text + (" (declared)" if self.declared else "")


class UnknownLayout(InvalidArgument):
    """A parameter whose shape on a rank is neither the dense shape nor a ``1/tp`` piece of it along one
    dim (see the module docstring): tpsim cannot tell from shapes how its values are laid out, so it
    cannot judge it. Declared fields: ``param``, ``shape`` (on ``rank``), ``full`` (the dense
    module's) and ``tp_size``."""

    def __init__(self, param: str, shape: Sequence[int], full: Sequence[int], rank: int, tp_size: int) -> None:
        master = "bias" if param.rpartition(".")[2] == "bias" else "weight"
        super().__init__(
            f"parameter {param!r} has shape {list(shape)} on rank {rank} (tp size {tp_size}) and {list(full)} in the "
            f"dense module: neither the dense shape (replicated) nor a 1/{tp_size} piece of it along one dim, so tpsim "
            "cannot tell from the shapes how its values are laid out over the ranks (a correct module may store it "
            "so: key/value heads replicated because there are fewer than ranks, parts packed together). Declare its "
            f"layout: ModuleVariant(params=(ParamSpec({param!r}, {master!r}, <placement>),)) with a Shard (parts=... "
            "for packed parts) or Replicate placement; or, for an attention block, describe it as a "
            "tpsim.attention_variant.AttentionVariant and check it with --kind attention, which reads each rank's "
            "heads (replicated key/value heads included)"
        )
        self.param = param
        self.shape = tuple(shape)
        self.full = tuple(full)
        self.rank = rank
        self.tp_size = tp_size

    def __reduce__(self) -> tuple[Any, ...]:  # the fields are the constructor's arguments
        return (type(self), (self.param, self.shape, self.full, self.rank, self.tp_size))


def uneven_size(size: int, tp: int, rank: int) -> int:
    """The size of rank ``rank``'s piece of a dim of ``size`` cut by ``torch.tensor_split``."""
    return size // tp + (1 if rank < size % tp else 0)


#: The attributes a layer describes its packed parts with (the full sizes of its parts, in order):
#: tpsim's and Megatron-style layers' ``parts``, vLLM's ``output_sizes`` (``MergedColumnParallelLinear``,
#: ``QKVParallelLinear``), nanotron's ``contiguous_chunks``.
PARTS_ATTRIBUTES = ("parts", "output_sizes", "contiguous_chunks")


def _parts_hint(owner: Any, size: int, tp: int) -> tuple[int, ...] | None:
    for attribute in PARTS_ATTRIBUTES:
        parts = getattr(owner, attribute, None)
        if not isinstance(parts, (tuple, list)) or len(parts) < 2:
            continue
        if not all(isinstance(p, int) and not isinstance(p, bool) and p > 0 for p in parts) or sum(parts) != size:
            continue
        return tuple(parts) if all(p % tp == 0 for p in parts) else None
    return None


def infer_layout(full: Sequence[int], local: Sequence[int], tp: int, rank: int, owner: Any = None) -> ParamLayout | None:
    """The layout of a parameter of shape ``local`` on tp rank ``rank`` whose dense shape is ``full``
    (see the module docstring); None when no layout explains the shapes."""
    full, local = tuple(int(s) for s in full), tuple(int(s) for s in local)
    if full == local:
        return ParamLayout(Replicate())
    if len(full) != len(local):
        return None
    differ = [d for d in range(len(full)) if full[d] != local[d]]
    if len(differ) != 1:
        return None
    d = differ[0]
    if local[d] * tp == full[d]:
        parts = _parts_hint(owner, full[d], tp)
        return ParamLayout(Shard(d, parts=parts) if parts else Shard(d))
    if full[d] % tp and local[d] == uneven_size(full[d], tp, rank):
        return ParamLayout(Shard(d), uneven=True)
    return None


def declared_layout(placement: Placement, full: Sequence[int], local: Sequence[int], tp: int) -> ParamLayout | None:
    """The declared ``placement`` when ``local`` is the shape it implies for ``full`` (else None)."""
    try:
        expected = shard_shape(tuple(full), placement, tp)
    except Exception:  # noqa: BLE001 - a placement that cannot cut this shape explains nothing
        return None
    return ParamLayout(placement, declared=True) if tuple(expected) == tuple(local) else None
