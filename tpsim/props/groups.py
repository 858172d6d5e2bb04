"""Tensor-parallel subgroups: a world of ``W`` ranks split into ``W/T`` tp groups of ``T`` ranks.

Real jobs run tensor parallelism inside a larger world (a tp × dp mesh), and a layer must only
ever talk to its own tp group. A case with ``tp_size < world_size`` runs ``W/T`` copies of the layer
side by side, one per tp group, in one of two layouts (``Case.tp_layout``):

- ``consecutive``: groups of neighbouring ranks, ``[0..T-1], [T..2T-1], ...`` (tp innermost, as
  Megatron-LM orders its mesh);
- ``strided``: every ``W/T``-th rank, ``[0, D, 2D, ...], [1, D+1, ...]`` with ``D = W/T`` (tp
  outermost, as a ``(tp, dp)`` device mesh).

Every group gets the **same master weight and bias** (data-parallel replicas start from the same
parameters) and **its own inputs and upstream gradients** (each replica sees its own batch), so a
collective over the wrong set of ranks mixes data of several groups and shows in the numbers. Group
0's data is exactly the data of the case with ``tp_size == world_size`` (same seed), drawn first.

:func:`wrong_group` recognises a result that is a reduction (or a gather) over another set of
ranks than the rank's tp group — the whole world, the rank's data-parallel group, or its group
in the other layout — and names that set (diagnosis ``wrong-group``).

:func:`tp_group` is the rank side: every family's rank function calls it first, for its own group.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from tpsim.diagnosis import WRONG_GROUP, recogniser
from tpsim.errors import InvalidArgument
from tpsim.placement import Shard, shard_tensor

__all__ = ["TP_LAYOUTS", "candidate_sets", "group_index", "tp_group", "tp_groups", "wrong_group"]

#: How tp groups are laid out over the world (see the module docstring).
TP_LAYOUTS = ("consecutive", "strided")


def tp_groups(world_size: int, tp_size: int, layout: str = "consecutive") -> list[list[int]]:
    """The ``world_size // tp_size`` tp groups (global ranks, tp rank order) of ``layout``."""
    if tp_size < 1 or world_size % tp_size:
        raise InvalidArgument(f"tp_size={tp_size} must be >= 1 and divide world_size={world_size}")
    if layout not in TP_LAYOUTS:
        raise InvalidArgument(f"tp_layout={layout!r}; expected one of {', '.join(TP_LAYOUTS)}")
    n = world_size // tp_size
    if layout == "consecutive":
        return [[g * tp_size + i for i in range(tp_size)] for g in range(n)]
    return [[g + n * i for i in range(tp_size)] for g in range(n)]


def tp_group(case: Any, global_rank: int) -> tuple[Any, int, int, int]:
    """``(group, group index, tp rank, tp size)`` of this rank of the world running ``case`` (any
    family's case: ``world_size``, ``tp_size``, ``tp_layout``). Creates every tp group: all ranks must
    call ``new_group`` for every group, in the same order, so every rank calls this."""
    tp = case.tp_size or case.world_size
    if tp == case.world_size:
        return dist.group.WORLD, 0, global_rank, tp
    mine = None
    for index, ranks in enumerate(tp_groups(case.world_size, tp, case.tp_layout)):
        pg = dist.new_group(ranks)
        if global_rank in ranks:
            mine = (pg, index, ranks.index(global_rank), tp)
    if mine is None:  # unreachable: the groups partition the world
        raise InvalidArgument(f"rank {global_rank} is in no tp group of {case.describe()}")
    return mine


def group_index(rank: int, groups: Sequence[Sequence[int]]) -> tuple[int, int]:
    """``(group, tp_rank)`` of global ``rank``."""
    for index, ranks in enumerate(groups):
        if rank in ranks:
            return index, list(ranks).index(rank)
    raise InvalidArgument(f"rank={rank} is in none of the tp groups {groups}")


def candidate_sets(world_size: int, tp_size: int, layout: str) -> list[tuple[str, list[list[int]]]]:
    """Sets of ranks a buggy layer may talk to instead of its tp group, each as a partition of the
    world: the whole world, the data-parallel groups (same tp rank), the tp groups of the other layout."""
    groups = tp_groups(world_size, tp_size, layout)
    out: list[tuple[str, list[list[int]]]] = [("the whole world (the default group)", [list(range(world_size))])]
    if len(groups) > 1 and tp_size > 1:
        dp = [[grp[i] for grp in groups] for i in range(tp_size)]
        out.append(("the data-parallel group (ranks with the same tp rank)", dp))
        other = "strided" if layout == "consecutive" else "consecutive"
        alt = tp_groups(world_size, tp_size, other)
        if sorted(map(sorted, alt)) != sorted(map(sorted, groups)):
            out.append((f"the tp group of the {other} layout", alt))
    return out


def _set_of(rank: int, partition: list[list[int]]) -> list[int]:
    return next(s for s in partition if rank in s)


@recogniser(WRONG_GROUP)
def wrong_group(
    what: str,
    actual: Sequence[torch.Tensor | None],
    summands: Sequence[torch.Tensor],
    *,
    world_size: int,
    tp_size: int,
    layout: str,
    tol_for: Any,
    offset: torch.Tensor | None = None,
    gather_dim: int | None = None,
) -> dict[str, Any] | None:
    """Whether every rank's ``actual`` is the reduction (sum; ``gather_dim``: concatenation) of
    ``summands`` over one of :func:`candidate_sets` instead of its own tp group.

    ``summands[s]`` is what global rank ``s`` contributes (its partial sum, or its output shard);
    ``offset`` is added once after a reduction (a row bias); ``tol_for(n)`` gives the per-element
    tolerance of a reduction over ``n`` ranks. Returns ``{"used": name, "ranks": set of rank 0's
    peers, "message": ...}`` or None.
    """
    if tp_size == world_size or any(a is None for a in actual):
        return None
    groups = tp_groups(world_size, tp_size, layout)
    for name, partition in candidate_sets(world_size, tp_size, layout):
        ok = True
        for r in range(world_size):
            peers = _set_of(r, partition)
            if sorted(peers) == sorted(_set_of(r, groups)):
                ok = False  # this candidate is the right group for r: no evidence
                break
            if gather_dim is not None:
                expected = torch.cat([summands[s] for s in peers], dim=gather_dim)
            else:
                expected = torch.stack([summands[s] for s in peers]).sum(0)
                if offset is not None:
                    expected = expected + offset
            a = actual[r]
            if a is None or a.shape != expected.shape:
                ok = False
                break
            tol = tol_for(len(peers))
            tol = tol if tol.shape == expected.shape or tol.numel() == 1 else tol.max()
            if not bool(((a.to(torch.float64) - expected).abs() <= tol).all()):
                ok = False
                break
        if ok:
            mine = _set_of(0, groups)
            used = _set_of(0, partition)
            return {
                "used": name,
                "ranks": used,
                "message": (
                    f"{what} is the {'concatenation' if gather_dim is not None else 'sum'} over {name} "
                    f"(rank 0 with ranks {used}) instead of over its own tp group (rank 0's: {mine}): a collective "
                    "runs on the wrong process group; pass the layer's tp group to every collective"
                ),
            }
    return None


def _per_rank(groups: Sequence[Sequence[int]], world_size: int,
              piece: Callable[[int, int, int], torch.Tensor]) -> list[torch.Tensor]:
    """``piece(group index, tp rank, tp size)`` of every global rank, in global rank order."""
    tp = len(groups[0])
    out: list[torch.Tensor] = [torch.empty(0)] * world_size
    for index, ranks in enumerate(groups):
        for t, r in enumerate(ranks):
            out[r] = piece(index, t, tp)
    return out


def row_summands(x_by_group: Sequence[torch.Tensor], weight: torch.Tensor, groups: Sequence[Sequence[int]],
                 world_size: int) -> list[torch.Tensor]:
    """Each global rank's row-layer summand ``x_r W_rᵀ`` (its group's input, its tp shard)."""
    return _per_rank(groups, world_size, lambda index, t, tp: (
        shard_tensor(x_by_group[index], Shard(-1), t, tp) @ shard_tensor(weight, Shard(1), t, tp).t()))


def column_grad_summands(grad_by_group: Sequence[torch.Tensor], weight: torch.Tensor,
                         groups: Sequence[Sequence[int]], world_size: int) -> list[torch.Tensor]:
    """Each global rank's column-layer input-grad summand ``g_r W_r`` (its group's upstream grad,
    its tp shard of the output features)."""
    return _per_rank(groups, world_size, lambda index, t, tp: (
        shard_tensor(grad_by_group[index], Shard(-1), t, tp) @ shard_tensor(weight, Shard(0), t, tp)))


def column_output_shards(y_by_group: Sequence[torch.Tensor], groups: Sequence[Sequence[int]],
                         world_size: int) -> list[torch.Tensor]:
    """Each global rank's column-layer output shard (its group's dense output, its tp slice)."""
    return _per_rank(groups, world_size, lambda index, t, tp: shard_tensor(y_by_group[index], Shard(-1), t, tp))
