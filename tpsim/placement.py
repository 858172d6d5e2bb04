"""Placements: how one logical tensor is laid out across the ranks of a tensor-parallel group.

The same three ideas as DTensor:

- :class:`Shard` ``S(d)``: rank ``r`` holds the ``r``-th of ``world_size`` equal slices along
  dim ``d``. ``Shard(d, parts=(a, b, ...))`` is a packed dim made of several parts (gate/up,
  Q/K/V) that are each sharded on their own: rank ``r`` holds the ``r``-th slice of *every* part,
  concatenated (Megatron's partition stride). The parts are sizes, or proportions scaled to the
  dim (``parts=(1, 1)``: gate/up halves; ``parts=(8, 2, 2)``: grouped-query Q/K/V at any head size).
  ``Shard(d, parts=(q, k, v), head_size=h)`` splits each part into heads of ``h`` rows, the layout of
  vLLM's ``QKVParallelLinear``: the first part (query heads) is sharded by whole heads, its heads
  divisible by ``world_size``; a later part (key/value heads) likewise when it has a multiple of
  ``world_size`` heads, and when it has fewer heads ``g`` than ranks (``world_size % g == 0``) each
  head is *replicated* on ``world_size // g`` ranks: rank ``r`` holds head ``r * g // world_size``
  (the attention family's key/value rule, :mod:`tpsim.props.attention.checks`). :func:`assemble`
  reads a replicated head from the first rank holding it; :func:`replica_expanded` lays every rank's
  piece side by side (each replica its own copy: how tpsim checks such a layer, see
  :func:`tpsim.props.linear.world.expanded_out_features`); :func:`replicated_parts` says which parts replicate.
- :class:`Replicate` ``R``: every rank holds the whole tensor.
- :class:`Partial` ``P``: every rank holds a summand; the logical tensor is the sum over ranks.

Placements describe tensors in their *logical* (master) coordinates, e.g. a linear weight as
``[out_features, in_features]`` like ``nn.Linear``; a variant that stores a weight transposed says
so separately (see :mod:`tpsim.variant`).

:func:`shard_tensor` cuts a master tensor for one rank and :func:`assemble` puts per-rank pieces
back together; both refuse sizes that do not divide, naming the numbers, except inside
:func:`uneven_pieces`: there an unpacked dim that does not divide is cut into ``torch.tensor_split``'s
pieces (the first ``size % world_size`` ranks hold one more), the layout libraries that shard
uneven sizes by design use (DeepSpeed AutoTP, DTensor), or, with ``uneven_pieces("chunk")``, into
``torch.chunk``'s (pieces of ``ceil(size / world_size)``, the last non-empty one smaller and the
ranks after it empty: 5 over 4 ranks is 2, 2, 1, 0). tpsim enters it to check such a layer's
result, never to build one.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from tpsim.errors import InvalidArgument

__all__ = [
    "Partial",
    "Placement",
    "Replicate",
    "Shard",
    "assemble",
    "assemble_pieces",
    "part_sizes",
    "piece",
    "replica_expanded",
    "replicated_parts",
    "shard_shape",
    "shard_tensor",
    "split_sizes",
    "uneven_pieces",
    "UNEVEN_STYLES",
]

#: How a dim that does not divide is cut inside :func:`uneven_pieces`: ``torch.tensor_split``'s pieces
#: (sizes differ by at most one) or ``torch.chunk``'s (equal pieces of the ceiling, then the rest).
UNEVEN_STYLES = ("tensor_split", "chunk")
#: How an unpacked dim that does not divide is cut (None: it is refused; see the module docstring).
_UNEVEN: contextvars.ContextVar[str | None] = contextvars.ContextVar("tpsim_uneven_pieces", default=None)


@contextlib.contextmanager
def uneven_pieces(style: str = "tensor_split") -> Iterator[None]:
    """Within this block (of this thread), :func:`shard_shape` and :func:`shard_tensor` cut an unpacked
    dim that does not divide by the world size into ``torch.tensor_split``'s pieces (``style="chunk"``:
    ``torch.chunk``'s, see :func:`split_sizes`) instead of refusing."""
    if style not in UNEVEN_STYLES:
        raise InvalidArgument(f"uneven_pieces(style={style!r}): expected one of {', '.join(UNEVEN_STYLES)}")
    token = _UNEVEN.set(style)
    try:
        yield
    finally:
        _UNEVEN.reset(token)


def split_sizes(size: int, world_size: int, style: str = "tensor_split") -> tuple[int, ...]:
    """The sizes of ``world_size`` pieces of a dim of ``size``: ``torch.tensor_split``'s (the first
    ``size % world_size`` are one larger) or, ``style="chunk"``, ``torch.chunk``'s (``ceil(size /
    world_size)`` each while the dim lasts: the last non-empty piece holds the rest, and the ranks after
    it hold empty pieces, which ``torch.chunk`` itself leaves out: 5 over 4 ranks is 2, 2, 1, 0)."""
    if style == "chunk":
        step = -(-size // world_size)
        return tuple(max(0, min(step, size - r * step)) for r in range(world_size))
    base, extra = divmod(size, world_size)
    return tuple(base + (1 if r < extra else 0) for r in range(world_size))


def _uneven_piece(tensor: torch.Tensor, dim: int, rank: int, world_size: int, style: str) -> torch.Tensor:
    sizes = split_sizes(tensor.shape[dim], world_size, style)
    return tensor.narrow(dim, sum(sizes[:rank]), sizes[rank])


class Placement:
    """Base of the three placements; use :class:`Shard`, :class:`Replicate`, :class:`Partial`."""

    def is_shard(self, dim: int | None = None) -> bool:
        """True for a :class:`Shard` (along ``dim`` when given)."""
        return False

    def is_replicate(self) -> bool:
        """True for :class:`Replicate`."""
        return False

    def is_partial(self) -> bool:
        """True for :class:`Partial`."""
        return False


@dataclass(frozen=True)
class Shard(Placement):
    """Sharded along ``dim``; ``parts`` (sizes of packed parts) shards each part on its own."""

    dim: int
    parts: tuple[int, ...] | None = None
    #: Rows (elements along ``dim``) per attention head of every packed part: a packed Q/K/V whose
    #: key/value parts are replicated in groups when they have fewer heads than ranks (module docstring).
    head_size: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int):
            raise InvalidArgument(f"Shard(dim={self.dim!r}): dim must be an int")
        if self.head_size is not None:
            if isinstance(self.head_size, bool) or not isinstance(self.head_size, int) or self.head_size < 1:
                raise InvalidArgument(f"Shard(head_size={self.head_size!r}): head_size must be an int >= 1")
            if self.parts is None or len(tuple(self.parts)) < 2:
                raise InvalidArgument(
                    f"Shard(head_size={self.head_size!r}, parts={self.parts!r}): head_size needs packed parts "
                    "(query heads first, then key and value heads), e.g. parts=(8, 2, 2)"
                )
        if self.parts is not None:
            parts = tuple(self.parts)
            if not parts or any(isinstance(p, bool) or not isinstance(p, int) or p < 1 for p in parts):
                raise InvalidArgument(
                    f"Shard(parts={self.parts!r}): parts must be a non-empty sequence of positive ints"
                )
            # Frozen dataclass: normalise a list to a tuple so the placement stays hashable.
            object.__setattr__(self, "parts", parts)

    def is_shard(self, dim: int | None = None) -> bool:
        return dim is None or dim == self.dim

    def __str__(self) -> str:
        if self.parts is None:
            return f"S({self.dim})"
        if self.head_size is not None:
            return f"S({self.dim},parts={list(self.parts)},head_size={self.head_size})"
        return f"S({self.dim},parts={list(self.parts)})"


@dataclass(frozen=True)
class Replicate(Placement):
    """Every rank holds the whole tensor (and must hold the same values)."""

    def is_replicate(self) -> bool:
        return True

    def __str__(self) -> str:
        return "R"


@dataclass(frozen=True)
class Partial(Placement):
    """Each rank holds a summand; the logical tensor is the sum over ranks."""

    def is_partial(self) -> bool:
        return True

    def __str__(self) -> str:
        return "P"


def _check_world(rank: int, world_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidArgument(f"world_size={world_size!r} must be an int >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidArgument(f"rank={rank!r} must be an int in [0, {world_size})")


def _part_sizes(size: int, placement: Shard) -> tuple[int, ...]:
    parts = placement.parts or (size,)
    total = sum(parts)
    # Parts are sizes, or proportions scaled to the dim: ``Shard(0, parts=(8, 2, 2))`` on a dim of
    # 24 is parts (16, 4, 4), so one placement describes a packed QKV weight at every head size.
    if total == 0 or size % total:
        raise InvalidArgument(
            f"{placement}: the parts add up to {total} but the sharded dim has size {size} (parts are sizes, "
            "or proportions whose sum divides the dim)"
        )
    scale = size // total
    return tuple(p * scale for p in parts)


def part_sizes(size: int, placement: Placement) -> tuple[int, ...]:
    """The sizes of the packed parts of a dim of ``size`` under ``placement`` (one part when unpacked).

    ``Shard(d, parts=...)``'s parts are sizes when they add up to ``size``, else proportions scaled
    to it (``parts=(8, 2, 2)`` on 24 gives ``(16, 4, 4)``; ``parts=(1, 1)``: two equal halves).
    """
    if not isinstance(placement, Shard) or placement.parts is None:
        return (size,)
    return _part_sizes(size, placement)


def _check_divisible(placement: Shard, dim_size: int, world_size: int, what: str) -> tuple[int, ...]:
    parts = _part_sizes(dim_size, placement)
    if placement.head_size is not None:
        _head_layout(placement, parts, world_size, what)
        return parts
    for i, p in enumerate(parts):
        if p % world_size:
            part = f"part {i} (size {p})" if placement.parts else f"size {p}"
            raise InvalidArgument(
                f"cannot shard {what} along dim {placement.dim}: {part} is not divisible by "
                f"world_size={world_size}"
            )
    return parts


def _head_layout(placement: Shard, parts: Sequence[int], world_size: int, what: str) -> list[bool]:
    """Per part of a head-packed ``placement``: whether its heads are replicated (fewer than ranks).
    Raises naming the part when its heads do not fit the rules of the module docstring."""
    d = placement.head_size or 1
    out = []
    for i, p in enumerate(parts):
        heads, rest = divmod(p, d)
        where = f"cannot shard {what} along dim {placement.dim}: part {i} (size {p})"
        if rest:
            raise InvalidArgument(f"{where} is not a whole number of heads of head_size={d}")
        if heads % world_size == 0:
            out.append(False)
        elif i > 0 and world_size % heads == 0:
            out.append(True)  # fewer key/value heads than ranks: each on world_size // heads ranks
        elif i == 0:
            raise InvalidArgument(
                f"{where}: its {heads} query heads are not divisible by world_size={world_size}"
            )
        else:
            raise InvalidArgument(
                f"{where}: its {heads} key/value heads and world_size={world_size} do not divide one another "
                "(a key/value part needs a multiple of world_size heads, or a divisor of it: each head then "
                "replicated on world_size // heads ranks)"
            )
    return out


def _local_rows(placement: Shard, parts: Sequence[int], world_size: int, rank: int,
                replicated: Sequence[bool]) -> list[tuple[int, int]]:
    """(start, length) along the dim of each part's rows that ``rank`` holds, in part order."""
    out = []
    start = 0
    for p, rep in zip(parts, replicated, strict=True):
        if rep:
            d = placement.head_size or 1
            head = rank * (p // d) // world_size  # rank r holds head r // (world_size // heads)
            out.append((start + head * d, d))
        else:
            step = p // world_size
            out.append((start + rank * step, step))
        start += p
    return out


def replicated_parts(size: int, placement: Placement, world_size: int) -> tuple[bool, ...]:
    """Per packed part of a dim of ``size`` under ``placement`` over ``world_size`` ranks: whether it
    is replicated in groups (a head-packed key/value part with fewer heads than ranks; see the module
    docstring). All False for any other placement. Raises where the heads do not fit."""
    if not isinstance(placement, Shard) or placement.head_size is None:
        return tuple(False for _ in part_sizes(size, placement))
    parts = _part_sizes(size, placement)
    return tuple(_head_layout(placement, parts, world_size, f"a dim of size {size}"))


def replica_expanded(tensor: torch.Tensor, placement: Placement, world_size: int) -> torch.Tensor:
    """Every rank's piece of ``tensor`` under ``placement``, concatenated in rank order along the
    sharded dim: the logical tensor in which each replica of a replicated key/value head is its own
    copy (see the module docstring), so that ``Shard(dim)`` of it is rank ``r``'s piece."""
    if not isinstance(placement, Shard):
        raise InvalidArgument(f"placement={placement!r}: replica_expanded takes a Shard")
    pieces = [shard_tensor(tensor, placement, r, world_size) for r in range(world_size)]
    return torch.cat(pieces, dim=placement.dim % tensor.dim())


def shard_shape(shape: Sequence[int], placement: Placement, world_size: int, rank: int | None = None) -> tuple[int, ...]:
    """Shape of one rank's piece of a tensor of ``shape`` under ``placement`` (within
    :func:`uneven_pieces`, the piece of ``rank`` when the dim does not divide)."""
    shape = tuple(int(s) for s in shape)
    if not isinstance(placement, Shard):
        return shape
    dim = placement.dim % len(shape) if shape else placement.dim
    out = list(shape)
    style = _UNEVEN.get()
    if style is not None and placement.parts is None and shape[dim] % world_size and rank is not None:
        out[dim] = split_sizes(shape[dim], world_size, style)[rank]
        return tuple(out)
    if style is not None and placement.parts is None and shape[dim] % world_size:
        raise InvalidArgument(
            f"the pieces of a tensor of shape {list(shape)} along dim {placement.dim} over world_size={world_size} "
            f"differ by rank ({list(split_sizes(shape[dim], world_size, style))}); ask shard_tensor for one rank's piece"
        )
    what = f"a tensor of shape {list(shape)}"
    parts = _check_divisible(placement, shape[dim], world_size, what)
    if placement.head_size is not None:
        replicated = _head_layout(placement, parts, world_size, what)
        out[dim] = sum(length for _, length in _local_rows(placement, parts, world_size, 0, replicated))
        return tuple(out)
    out[dim] = shape[dim] // world_size
    return tuple(out)


def shard_tensor(tensor: torch.Tensor, placement: Placement, rank: int, world_size: int) -> torch.Tensor:
    """Rank ``rank``'s piece of the master ``tensor`` (a view where possible; clone to own it).

    ``Replicate``: the tensor itself. ``Partial``: rank 0 holds the tensor and the others zeros
    (one valid decomposition of the sum). ``Shard``: the ``rank``-th equal slice along the dim,
    taken from each packed part and concatenated. Raises :class:`tpsim.InvalidArgument` when a
    part does not divide by ``world_size``.
    """
    _check_world(rank, world_size)
    if isinstance(placement, Replicate):
        return tensor
    if isinstance(placement, Partial):
        return tensor if rank == 0 else torch.zeros_like(tensor)
    if not isinstance(placement, Shard):
        raise InvalidArgument(f"placement={placement!r} is not a Shard, Replicate or Partial")
    dim = placement.dim % tensor.dim()
    style = _UNEVEN.get()
    if style is not None and placement.parts is None and tensor.shape[dim] % world_size:
        return _uneven_piece(tensor, dim, rank, world_size, style)
    what = f"a tensor of shape {list(tensor.shape)}"
    parts = _check_divisible(placement, tensor.shape[dim], world_size, what)
    replicated = _head_layout(placement, parts, world_size, what) if placement.head_size else [False] * len(parts)
    pieces = [tensor.narrow(dim, start, length)
              for start, length in _local_rows(placement, parts, world_size, rank, replicated)]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=dim)


def assemble(pieces: Sequence[torch.Tensor], placement: Placement) -> torch.Tensor:
    """Put per-rank pieces (index = rank) back into the logical tensor; inverse of :func:`shard_tensor`.

    ``Replicate`` returns rank 0's piece (whether the replicas agree is a separate check);
    ``Partial`` sums; ``Shard`` concatenates, interleaving packed parts back into place.
    """
    if not pieces:
        raise InvalidArgument("pieces is empty; expected one tensor per rank")
    if isinstance(placement, Replicate):
        return pieces[0]
    if isinstance(placement, Partial):
        total = pieces[0].clone()
        for p in pieces[1:]:
            total = total + p
        return total
    if not isinstance(placement, Shard):
        raise InvalidArgument(f"placement={placement!r} is not a Shard, Replicate or Partial")
    world_size = len(pieces)
    dim = placement.dim % pieces[0].dim()
    if placement.parts is None:
        return torch.cat(list(pieces), dim=dim)
    if placement.head_size is not None:
        return _assemble_heads(pieces, placement, dim)
    total = sum(pieces[0].shape[dim] for _ in pieces)
    local = [p // world_size for p in _part_sizes(total, placement)]
    for rank, piece in enumerate(pieces):
        if piece.shape[dim] != sum(local):
            raise InvalidArgument(
                f"piece of rank {rank} has size {piece.shape[dim]} along dim {placement.dim}; "
                f"expected {sum(local)} for {placement} over {world_size} ranks"
            )
    out = []
    for i, size in enumerate(local):
        offset = sum(local[:i])
        out.extend(piece.narrow(dim, offset, size) for piece in pieces)
    return torch.cat(out, dim=dim)


def _assemble_heads(pieces: Sequence[torch.Tensor], placement: Shard, dim: int) -> torch.Tensor:
    """:func:`assemble` for a head-packed placement: a replicated head is read from the first rank
    holding it (whether its replicas agree is a separate check). The logical size is found from the
    pieces: the one whose layout gives pieces of their size."""
    world_size, local = len(pieces), pieces[0].shape[dim]
    d, total_p = placement.head_size or 1, sum(placement.parts or ())
    for size in range(total_p, total_p * world_size * local + 1, total_p):
        try:
            parts = _part_sizes(size, placement)
            replicated = _head_layout(placement, parts, world_size, "")
        except InvalidArgument:
            continue
        if sum(d if rep else p // world_size for p, rep in zip(parts, replicated, strict=True)) != local:
            continue
        out = [torch.empty(0)] * len(parts)
        for i, (p, rep) in enumerate(zip(parts, replicated, strict=True)):
            offset = sum(d if rp else pp // world_size for pp, rp in zip(parts[:i], replicated[:i], strict=True))
            n = d if rep else p // world_size
            if rep:
                heads = p // d
                out[i] = torch.cat([pieces[j * world_size // heads].narrow(dim, offset, n) for j in range(heads)], dim=dim)
            else:
                out[i] = torch.cat([piece.narrow(dim, offset, n) for piece in pieces], dim=dim)
        for rank, piece in enumerate(pieces):
            if piece.shape[dim] != local:
                raise InvalidArgument(
                    f"piece of rank {rank} has size {piece.shape[dim]} along dim {placement.dim}; "
                    f"expected {local} for {placement} over {world_size} ranks"
                )
        return torch.cat(out, dim=dim)
    raise InvalidArgument(
        f"pieces of size {local} along dim {placement.dim} over {world_size} ranks fit no layout of {placement}"
    )


def piece(t: torch.Tensor, placement: Placement, rank: int, tp: int, uneven: bool = False) -> torch.Tensor:
    """Rank ``rank``'s piece of the full ``t`` (``uneven``: as ``torch.tensor_split`` cuts a dim that does
    not divide; ``Partial``: rank 0 holds it, the others zeros)."""
    if uneven and isinstance(placement, Shard):
        return torch.tensor_split(t, tp, dim=placement.dim % max(t.dim(), 1))[rank]
    if isinstance(placement, Partial):
        return t if rank == 0 else torch.zeros_like(t)
    return shard_tensor(t, placement, rank, tp)


def assemble_pieces(pieces: Sequence[torch.Tensor], placement: Placement, uneven: bool = False) -> torch.Tensor:
    """The full tensor from every rank's piece (inverse of :func:`piece`)."""
    if uneven and isinstance(placement, Shard):
        return torch.cat(list(pieces), dim=placement.dim % max(pieces[0].dim(), 1))
    return assemble(list(pieces), placement)
