"""A DTensor's layout as plain data, and the map between its full value and each rank's piece.

"The library shards, tpsim observes": a worker process lets the library shard a module, then
reads each parameter's layout (:func:`placement_of`) and local piece (``p.to_local()``) and ships
both to the judging process, which never imports user code (nor ``torch.distributed.tensor``:
it costs seconds per process). There, :func:`assemble` puts the pieces back together into the
full tensor, and :func:`expected_piece` says what rank ``r`` must hold of a given full tensor,
both read *through the placement*, whichever it is:

- ``Shard(d)``: ``torch.chunk`` pieces of dim ``d`` (pieces of ``ceil(size / n)``, the last
  non-empty one smaller, the ranks after it empty: 5 over 4 ranks is 2, 2, 1, 0);
- ``_StridedShard(d, split_factor=k)`` (torch's private placement; Hugging Face's ``packed_colwise``
  / ``packed_rowwise`` store a packed gate/up weight so, with ``k = 2``, and FSDP over TP stores
  ``[_StridedShard(d, k=tp), Shard(d)]``): dim ``d`` is cut into ``k`` chunks, each chunk into ``n``
  chunks, and rank ``c`` holds the ``c``-th chunk of every one of the ``k``, concatenated — the
  ``chunk`` sizes at both levels, exactly as ``_StridedShard._split_tensor`` cuts;
- ``Replicate()``: the whole tensor (:func:`assemble` reads it from coordinate 0 of that mesh dim;
  :func:`diverging_replicas` names copies that differ);
- ``Partial(op)``: a term of the reduction ``op`` (:func:`assemble` reduces the pieces: a sum for
  ``Partial()``). A Partial piece is not determined by the full value — any terms that reduce to it
  are right — so :func:`expected_piece` gives the piece ``distribute_tensor`` would make (``full / n``
  for a sum, ``full`` for ``avg``/``min``/``max``); judge a Partial tensor by :func:`assemble`.

On a mesh of several dims the placements apply left to right (``distribute_tensor``'s order): mesh
dim 0 cuts the full tensor, mesh dim 1 cuts rank's piece of that, and so on; two placements on
different tensor dims commute. A DTensor whose spec carries another shard order (torch's internal
``shard_order``, no public API makes one) is refused by :func:`placement_of` rather than misread.

Ranks are the mesh's global ranks (``layout.ranks``, row-major over ``layout.mesh_shape``): the
pieces handed to :func:`assemble` are keyed by them. The functions here move data only (slices,
concatenation, the reduction a Partial needs), so a piece read through them is bit-equal to the one
torch would produce; only a Partial's reduction may round differently from a collective's order.
"""

from __future__ import annotations

import itertools
import math
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from tpsim.errors import InvalidArgument

__all__ = [
    "DTensorLayout",
    "MeshPlacement",
    "PieceShapeMismatch",
    "UnsupportedLayout",
    "assemble",
    "diverging_replicas",
    "expected_piece",
    "piece_runs",
    "piece_shape",
    "placement_of",
]

#: The placement kinds a :class:`MeshPlacement` may have.
KINDS = ("shard", "strided_shard", "replicate", "partial")
#: Partial reductions :func:`assemble` applies (torch's ``Partial.ALL_REDUCE_OPS`` and the bitwise ones).
REDUCE_OPS = ("sum", "avg", "min", "max", "product", "band", "bor", "bxor")
#: Partial reductions whose piece :func:`expected_piece` can say (those ``distribute_tensor`` makes).
_PARTITIONABLE = ("sum", "avg", "min", "max")


class UnsupportedLayout(InvalidArgument):
    """A DTensor laid out in a way :mod:`tpsim.props.module.dtensor_pieces` does not read (a placement
    other than ``Shard``, ``_StridedShard``, ``Replicate`` and ``Partial``, such as ``_MaskPartial``, or a
    non-default shard order): refused by name rather than read wrongly."""


class PieceShapeMismatch(InvalidArgument):
    """A rank's piece whose shape is not the one its DTensor's layout gives that rank. Declared fields:
    ``rank``, ``shape`` (what it holds), ``expected`` (what the layout says) and ``layout`` (its text)."""

    def __init__(self, message: str, *, rank: int, shape: tuple[int, ...], expected: tuple[int, ...],
                 layout: str) -> None:
        super().__init__(message)
        self.rank = rank
        self.shape = shape
        self.expected = expected
        self.layout = layout

    def __reduce__(self) -> Any:  # the fields survive pickling (a worker's error reaches the judge)
        return (_rebuild_mismatch, (self.args[0], self.rank, self.shape, self.expected, self.layout))


def _rebuild_mismatch(message: str, rank: int, shape: tuple[int, ...], expected: tuple[int, ...],
                      layout: str) -> PieceShapeMismatch:
    return PieceShapeMismatch(message, rank=rank, shape=shape, expected=expected, layout=layout)


@dataclass(frozen=True)
class MeshPlacement:
    """One mesh dim's placement as plain data: ``kind`` is one of :data:`KINDS`; ``dim`` the tensor dim
    a shard cuts (non-negative), ``split_factor`` a strided shard's ``k``, ``reduce_op`` a partial's."""

    kind: str
    dim: int | None = None
    split_factor: int = 1
    reduce_op: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"MeshPlacement(kind={self.kind!r}): expected one of {', '.join(KINDS)}")
        sharded = self.kind in ("shard", "strided_shard")
        if sharded != (self.dim is not None):
            raise InvalidArgument(f"MeshPlacement(kind={self.kind!r}, dim={self.dim!r}): a shard names the "
                                  "tensor dim it cuts (an int >= 0), any other placement none")
        if sharded and (isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 0):
            raise InvalidArgument(f"MeshPlacement(dim={self.dim!r}): expected an int >= 0 (normalised)")
        if isinstance(self.split_factor, bool) or not isinstance(self.split_factor, int) or self.split_factor < 1 or (
                self.kind != "strided_shard" and self.split_factor != 1):
            raise InvalidArgument(f"MeshPlacement(kind={self.kind!r}, split_factor={self.split_factor!r}): expected "
                                  "an int >= 1, and 1 unless the placement is a strided shard")
        if (self.kind == "partial") != (self.reduce_op is not None) or (
                self.reduce_op is not None and self.reduce_op not in REDUCE_OPS):
            raise InvalidArgument(f"MeshPlacement(kind={self.kind!r}, reduce_op={self.reduce_op!r}): a partial "
                                  f"names its reduction (one of {', '.join(REDUCE_OPS)}), any other placement none")

    def __str__(self) -> str:
        """torch's short form: ``S(0)``, ``_S(0, 2)``, ``R``, ``P(sum)``."""
        if self.kind == "shard":
            return f"S({self.dim})"
        if self.kind == "strided_shard":
            return f"_S({self.dim}, {self.split_factor})"
        return "R" if self.kind == "replicate" else f"P({self.reduce_op})"


@dataclass(frozen=True)
class DTensorLayout:
    """How a DTensor is laid out, as plain picklable data (no torch placement objects).

    ``shape`` is its global shape; ``mesh_shape`` its mesh's; ``ranks`` the mesh's global ranks in
    row-major order (rank ``ranks[i]`` sits at the ``i``-th coordinate); ``placements`` one
    :class:`MeshPlacement` per mesh dim; ``mesh_dim_names`` the mesh's names, if any."""

    shape: tuple[int, ...]
    mesh_shape: tuple[int, ...]
    ranks: tuple[int, ...]
    placements: tuple[MeshPlacement, ...]
    mesh_dim_names: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in self.shape):
            raise InvalidArgument(f"DTensorLayout(shape={self.shape!r}): expected ints >= 0")
        if not self.mesh_shape or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in self.mesh_shape):
            raise InvalidArgument(f"DTensorLayout(mesh_shape={self.mesh_shape!r}): expected one int >= 1 per mesh dim")
        if len(self.ranks) != math.prod(self.mesh_shape) or len(set(self.ranks)) != len(self.ranks):
            raise InvalidArgument(f"DTensorLayout(ranks={self.ranks!r}): expected {math.prod(self.mesh_shape)} "
                                  f"distinct ranks for mesh_shape={self.mesh_shape}")
        if len(self.placements) != len(self.mesh_shape):
            raise InvalidArgument(f"DTensorLayout(placements={self.placements!r}): expected one placement per mesh "
                                  f"dim ({len(self.mesh_shape)} for mesh_shape={self.mesh_shape})")
        for p in self.placements:
            if not isinstance(p, MeshPlacement):
                raise InvalidArgument(f"DTensorLayout(placements=...): {p!r} is not a MeshPlacement")
            if p.dim is not None and p.dim >= len(self.shape):
                raise InvalidArgument(f"DTensorLayout: placement {p} cuts dim {p.dim} of a tensor of shape {self.shape}")
        ops = {p.reduce_op for p in self.placements if p.kind == "partial"}
        if len(ops) > 1:  # torch refuses them too (assert_no_mixed_partial_types)
            raise InvalidArgument(f"DTensorLayout: partial placements with different reductions {sorted(ops)}")
        if self.mesh_dim_names is not None and len(self.mesh_dim_names) != len(self.mesh_shape):
            raise InvalidArgument(f"DTensorLayout(mesh_dim_names={self.mesh_dim_names!r}): expected one name per "
                                  f"mesh dim ({len(self.mesh_shape)})")

    @property
    def partial(self) -> bool:
        """Whether some mesh dim holds terms of a reduction (pieces not determined by the full value)."""
        return any(p.kind == "partial" for p in self.placements)

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate on the mesh (InvalidArgument when it is not on it)."""
        try:
            flat = self.ranks.index(rank)
        except ValueError:
            raise InvalidArgument(f"rank={rank!r} is not on this DTensor's mesh (ranks {list(self.ranks)})") from None
        coord = []
        for size in reversed(self.mesh_shape):
            flat, c = divmod(flat, size)
            coord.append(c)
        return tuple(reversed(coord))

    def __str__(self) -> str:
        """``(S(0), _S(1, 2)) on mesh (2, 2) ('dp', 'tp'), shape (8, 6)``."""
        names = f" {self.mesh_dim_names}" if self.mesh_dim_names else ""
        text = ", ".join(str(p) for p in self.placements)
        return f"({text}) on mesh {self.mesh_shape}{names}, shape {self.shape}"


# --- reading a DTensor's layout (in the worker that holds it) ---------------------------------------


def placement_of(p: Any) -> DTensorLayout:
    """The layout of the DTensor ``p`` (a parameter, a grad, an output) as plain data, to ship to a
    process that never imports user code; refuses a placement it cannot read (:class:`UnsupportedLayout`)."""
    module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(module, "DTensor", None)
    if dtensor is None or not isinstance(p, dtensor):
        raise InvalidArgument(f"placement_of(p): expected a DTensor, got {type(p).__name__}")
    from torch.distributed.tensor.placement_types import Partial, Replicate, Shard, _StridedShard

    ndim = p.ndim
    placements = []
    for mesh_dim, pl in enumerate(p.placements):
        kind = type(pl)
        # Exact classes: a subclass (``_MaskPartial``: a masked sum) means something these kinds do not say.
        if kind is _StridedShard:
            placements.append(MeshPlacement("strided_shard", dim=pl.dim % ndim, split_factor=int(pl.split_factor)))
        elif kind is Shard:
            placements.append(MeshPlacement("shard", dim=pl.dim % ndim))
        elif kind is Replicate:
            placements.append(MeshPlacement("replicate"))
        elif kind is Partial and pl.reduce_op in REDUCE_OPS:
            placements.append(MeshPlacement("partial", reduce_op=pl.reduce_op))
        else:
            raise UnsupportedLayout(f"a DTensor of shape {tuple(p.shape)} has placement {pl!r} on mesh dim "
                                    f"{mesh_dim} (placements {tuple(p.placements)}): tpsim reads Shard, _StridedShard, "
                                    "Replicate and Partial only")
    _check_shard_order(p, placements)
    mesh = p.device_mesh
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    return DTensorLayout(shape=tuple(int(s) for s in p.shape), mesh_shape=tuple(int(s) for s in mesh.shape),
                         ranks=tuple(int(r) for r in mesh.mesh.flatten().tolist()), placements=tuple(placements),
                         mesh_dim_names=names)


def _check_shard_order(p: Any, placements: list[MeshPlacement]) -> None:
    """Refuse a spec whose ``shard_order`` is not left to right (see the module docstring)."""
    order = getattr(p._spec, "shard_order", None)
    if order is None:  # torch derives it from the _StridedShard placements: the left-to-right cut
        return
    default: dict[int, list[int]] = {}
    for mesh_dim, pl in enumerate(placements):
        if pl.dim is not None:
            default.setdefault(pl.dim, []).append(mesh_dim)
    got = {int(e.tensor_dim) % max(p.ndim, 1): list(e.mesh_dims) for e in order}
    if got != default:
        raise UnsupportedLayout(f"a DTensor of shape {tuple(p.shape)} with placements {tuple(p.placements)} has "
                                f"shard order {got} (tensor dim: mesh dims in order), not the left-to-right {default}: "
                                "tpsim reads the left-to-right order only")


# --- the map between the full tensor and the pieces (anywhere: plain torch only) ---------------------


def _chunk(length: int, n: int, i: int) -> tuple[int, int]:
    """``[start, stop)`` of ``torch.chunk``'s ``i``-th of ``n`` pieces of ``length`` (empty past the last)."""
    size = -(-length // n)
    start = min(i * size, length)
    return start, min(start + size, length)


def _select(runs: list[tuple[int, int]], start: int, stop: int) -> list[tuple[int, int]]:
    """Positions ``[start, stop)`` of the concatenation of ``runs``, as runs of global indices."""
    out: list[tuple[int, int]] = []
    pos = 0
    for a, b in runs:
        lo, hi = max(start, pos), min(stop, pos + b - a)
        if lo < hi:
            out.append((a + lo - pos, a + hi - pos))
        pos += b - a
    return out


def _merged(runs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for a, b in runs:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def piece_runs(layout: DTensorLayout, rank: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """Which indices of the full tensor ``rank``'s piece holds: per tensor dim, the ``[start, stop)``
    runs whose concatenation, in order, is the piece along that dim (one run for a ``Shard``, up to
    ``split_factor`` for a ``_StridedShard``; none for an empty piece)."""
    coord = layout.coordinate(rank)
    runs = [[(0, size)] if size else [] for size in layout.shape]
    for mesh_dim, pl in enumerate(layout.placements):  # left to right, as distribute_tensor cuts
        if pl.dim is None:
            continue
        n, c, current = layout.mesh_shape[mesh_dim], coord[mesh_dim], runs[pl.dim]
        length = sum(b - a for a, b in current)
        if pl.kind == "shard":
            runs[pl.dim] = _select(current, *_chunk(length, n, c))
        else:  # _StridedShard: chunk into split_factor, chunk each into n, take the c-th of each
            picked: list[tuple[int, int]] = []
            for j in range(pl.split_factor):
                first, first_stop = _chunk(length, pl.split_factor, j)
                a, b = _chunk(first_stop - first, n, c)
                picked.extend(_select(current, first + a, first + b))
            runs[pl.dim] = picked
    return tuple(tuple(_merged(r)) for r in runs)


def piece_shape(layout: DTensorLayout, rank: int) -> tuple[int, ...]:
    """The shape of ``rank``'s piece (what ``to_local()`` gives on that rank)."""
    return tuple(sum(b - a for a, b in r) for r in piece_runs(layout, rank))


def _check_full(full: Any, layout: DTensorLayout) -> torch.Tensor:
    if not isinstance(full, torch.Tensor):
        raise InvalidArgument(f"full: expected a tensor of shape {layout.shape}, got {type(full).__name__}")
    if tuple(full.shape) != layout.shape:
        raise InvalidArgument(f"full has shape {tuple(full.shape)}; the layout {layout} expects {layout.shape}")
    return full.detach()


def expected_piece(full: torch.Tensor, layout: DTensorLayout, rank: int) -> torch.Tensor:
    """What ``rank`` holds of ``full`` under ``layout`` (a new tensor): ``distribute_tensor``'s piece.

    For a Partial layout this is the piece ``distribute_tensor`` makes (``full / n`` per ``Partial()``
    mesh dim, ``full`` itself for ``avg``/``min``/``max``), one of many valid ones: compare a Partial
    tensor's :func:`assemble`, not its pieces."""
    t = _check_full(full, layout)
    for d, runs in enumerate(piece_runs(layout, rank)):
        parts = [t.narrow(d, a, b - a) for a, b in runs]
        t = parts[0] if len(parts) == 1 else torch.cat(parts, dim=d) if parts else t.narrow(d, 0, 0)
    t = t.clone()
    for mesh_dim, pl in enumerate(layout.placements):  # mesh order, as distribute_tensor divides
        if pl.kind != "partial":
            continue
        if pl.reduce_op not in _PARTITIONABLE:
            raise InvalidArgument(f"expected_piece: no piece of a Partial({pl.reduce_op}) layout follows from the "
                                  "full value (torch cannot distribute one either); compare its assemble()")
        if pl.reduce_op == "sum":
            t = t / layout.mesh_shape[mesh_dim]
    return t


def _pieces(pieces_by_rank: Any, layout: DTensorLayout) -> dict[int, torch.Tensor]:
    """The pieces keyed by rank (a mapping, or a sequence indexed by rank), every rank of the mesh once,
    each of its layout's shape."""
    if isinstance(pieces_by_rank, Mapping):
        pieces = dict(pieces_by_rank)
    elif isinstance(pieces_by_rank, Sequence) and not isinstance(pieces_by_rank, (str, bytes)):
        pieces = dict(enumerate(pieces_by_rank))
    else:
        raise InvalidArgument(f"pieces_by_rank: expected a mapping rank -> tensor or a sequence indexed by rank, "
                              f"got {type(pieces_by_rank).__name__}")
    if set(pieces) != set(layout.ranks):
        raise InvalidArgument(f"pieces_by_rank has ranks {sorted(pieces)}; the layout {layout} needs exactly the "
                              f"mesh's ranks {sorted(layout.ranks)}")
    dtypes = set()
    for rank, piece in pieces.items():
        if not isinstance(piece, torch.Tensor) or type(piece).__name__ == "DTensor":
            raise InvalidArgument(f"pieces_by_rank[{rank}]: expected a plain local tensor (to_local()), "
                                  f"got {type(piece).__name__}")
        expected = piece_shape(layout, rank)
        if tuple(piece.shape) != expected:
            raise PieceShapeMismatch(f"rank {rank} holds a piece of shape {tuple(piece.shape)}; the layout {layout} "
                                     f"gives rank {rank} shape {expected}", rank=rank, shape=tuple(piece.shape),
                                     expected=expected, layout=str(layout))
        dtypes.add(piece.dtype)
    if len(dtypes) > 1:
        raise InvalidArgument(f"pieces_by_rank: pieces of different dtypes {sorted(map(str, dtypes))}")
    return {r: p.detach() for r, p in pieces.items()}


def _reduce(op: str, terms: list[torch.Tensor]) -> torch.Tensor:
    """Fold the terms in rank order (a collective may associate differently: equal up to rounding)."""
    out = terms[0].clone()
    for t in terms[1:]:
        if op in ("sum", "avg"):
            out = out + t
        elif op == "min":
            out = torch.minimum(out, t)
        elif op == "max":
            out = torch.maximum(out, t)
        elif op == "product":
            out = out * t
        else:
            out = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}[op](out, t)
    return out / len(terms) if op == "avg" else out


def _groups(layout: DTensorLayout) -> dict[tuple[int, ...], list[int]]:
    """The ranks that make up each region of the full tensor, keyed by their coordinates on the shard
    dims: on a Replicate dim the copy at coordinate 0 (the others are replicas of it), on a Partial dim
    every term, in mesh (rank) order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for rank in layout.ranks:
        coord = layout.coordinate(rank)
        if any(c and pl.kind == "replicate" for c, pl in zip(coord, layout.placements, strict=True)):
            continue
        key = tuple(c for c, pl in zip(coord, layout.placements, strict=True) if pl.dim is not None)
        groups.setdefault(key, []).append(rank)
    return groups


def assemble(pieces_by_rank: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
             layout: DTensorLayout) -> torch.Tensor:
    """The full tensor from every rank's piece (``to_local()``), keyed by global rank: the inverse of
    :func:`expected_piece` (what ``full_tensor()`` gives). A Partial mesh dim's terms are reduced; a
    Replicate mesh dim's copy is read at coordinate 0 (:func:`diverging_replicas` names copies that
    differ). Raises :class:`PieceShapeMismatch` when a piece's shape is not the one the layout gives
    its rank, InvalidArgument for missing or extra ranks."""
    pieces = _pieces(pieces_by_rank, layout)
    op = next((pl.reduce_op for pl in layout.placements if pl.kind == "partial"), None)
    regions = [(piece_runs(layout, ranks[0]), pieces[ranks[0]] if op is None else _reduce(op, [pieces[r] for r in ranks]))
               for ranks in _groups(layout).values()]
    first = regions[0][1]  # its dtype: the pieces', or an int Partial(avg)'s mean's
    out = torch.empty(layout.shape, dtype=first.dtype, device=first.device)
    for runs, piece in regions:
        # Each combination of one run per dim is a block of the full tensor held contiguously in the piece.
        starts = [[sum(b - a for a, b in r[:i]) for i in range(len(r))] for r in runs]
        for block in itertools.product(*(range(len(r)) for r in runs)):
            dst = tuple(slice(*runs[d][i]) for d, i in enumerate(block))
            src = tuple(slice(starts[d][i], starts[d][i] + runs[d][i][1] - runs[d][i][0]) for d, i in enumerate(block))
            out[dst] = piece[src]
    return out


def diverging_replicas(pieces_by_rank: Mapping[int, torch.Tensor] | Sequence[torch.Tensor],
                       layout: DTensorLayout) -> list[tuple[int, int]]:
    """``(rank, reference)`` for each rank whose piece is not bit-equal to the replica :func:`assemble`
    read in its place (the rank at coordinate 0 on every Replicate mesh dim, all else the same). Empty
    when every copy agrees, or when the layout has no Replicate mesh dim."""
    pieces = _pieces(pieces_by_rank, layout)
    out = []
    for rank in layout.ranks:
        coord = layout.coordinate(rank)
        ref_coord = tuple(0 if pl.kind == "replicate" else c for c, pl in zip(coord, layout.placements, strict=True))
        if ref_coord == coord:
            continue
        ref = layout.ranks[_flat_index(layout.mesh_shape, ref_coord)]
        if not _bit_equal(pieces[rank], pieces[ref]):
            out.append((rank, ref))
    return out


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bits (two NaNs with the same payload are equal copies; ``torch.equal`` says they differ)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def _flat_index(mesh_shape: tuple[int, ...], coord: tuple[int, ...]) -> int:
    flat = 0
    for size, c in zip(mesh_shape, coord, strict=True):
        flat = flat * size + c
    return flat
