"""Hypothesis strategies every family's cases are drawn with: world sizes, tp groups, dtypes, batch
shapes and sizes per rank.

Draw order and value order are chosen so that shrinking moves toward the smallest, most readable
failing example: the world size is drawn first from the sorted sizes (shrinks toward 1, then 2),
the dtype from ``float64`` first, sizes toward a few per rank, the batch toward a 1-D input.

Sizes per rank (:func:`per_rank`) are tiny (1 to 3) half the time and otherwise reach past the tiny,
up to ``max_per_rank`` (:data:`DEFAULT_MAX_SIZE`, 64; ``tpsim check --max-size``): any size, or on
purpose a power of two or a tile multiple ± 1 (15, 16, 17, 31, ...), where kernels, chunked losses
and fused layers switch code paths. Shrinking still goes to the smallest size that fails (tiny first).

World sizes: ``DEFAULT_WORLD_SIZES`` (1, 2, 3, 4, 8), or ``THOROUGH_WORLD_SIZES`` (1-8, 12, 16) when the
environment sets ``TPSIM_THOROUGH=1`` (tpsim's ``thorough`` Hypothesis profile does).
Dtypes: float64, float32, bfloat16, float16; tolerances per dtype in :mod:`tpsim.props.tolerance`.
Training (:func:`training`, drawn last by the families that train): the micro-batches the first
optimizer step accumulates (2, or 3 one case in four; never fewer) and ``zero_grad``'s mode.

Tensor-parallel subgroups (:func:`draw_tp`): the tp size is drawn after the world size — with
``subgroups`` the whole world half the time (shrinking prefers it) and a proper divisor otherwise,
with ``tp_sizes`` one of those that divide the world (worlds none divides are not drawn) — and the
groups' layout (consecutive or strided, see :mod:`tpsim.props.groups`) when there are several groups
of several ranks. A family's own strategy (the linear family's: :mod:`tpsim.props.linear.strategies`)
draws its sizes over the tp size.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

from hypothesis import strategies as st

from tpsim.errors import InvalidArgument
from tpsim.props.case import DTYPES
from tpsim.props.sizes import DEFAULT_MAX_SIZE

__all__ = [
    "DEFAULT_MAX_SIZE",
    "DEFAULT_WORLD_SIZES",
    "THOROUGH_WORLD_SIZES",
    "batch_shapes",
    "default_world_sizes",
    "draw_tp",
    "dtypes",
    "per_rank",
    "sizes_past_tiny",
    "training",
    "world_and_tp",
    "world_sizes",
]


#: Default world sizes, the one source of them (``search`` and ``tpsim check`` use these): a single
#: rank, a non-power of two, and a size above 4 (node-local rank bugs show only there).
DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)


#: World sizes of the thorough profile: every size up to 8, then 12 and 16.
THOROUGH_WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16)


#: Sizes per rank up to this are "tiny": drawn half the time, and where shrinking goes first.
TINY = 3


#: Tile sizes whose multiples (and their neighbours, ± 1) are drawn on purpose: kernels, chunked
#: losses and fused layers switch code paths exactly there.
TILES = (4, 8, 16, 32, 64)


def world_sizes(sizes: Sequence[int] = DEFAULT_WORLD_SIZES) -> st.SearchStrategy[int]:
    """World sizes from ``sizes``, shrinking toward the smallest."""
    sizes = sorted(set(int(s) for s in sizes))
    if not sizes or sizes[0] < 1:
        raise InvalidArgument(f"world sizes {list(sizes)!r} must be a non-empty list of ints >= 1")
    return st.sampled_from(sizes)


def dtypes(names: Sequence[str] = tuple(DTYPES)) -> st.SearchStrategy[str]:
    """dtype names, shrinking toward the widest (float64)."""
    bad = [n for n in names if n not in DTYPES]
    if bad or not names:
        raise InvalidArgument(f"dtypes {list(names)!r}: expected a non-empty subset of {', '.join(DTYPES)}")
    ordered = [n for n in DTYPES if n in names]
    return st.sampled_from(ordered)


@functools.cache
def batch_shapes(max_dims: int = 3, max_size: int = 3, min_dims: int = 0) -> st.SearchStrategy[tuple[int, ...]]:
    """Leading batch shapes of ``min_dims`` (default 0) to ``max_dims`` dims, sizes 1 to ``max_size``
    (size 1 included)."""
    return st.lists(st.integers(1, max_size), min_size=min_dims, max_size=max(max_dims, min_dims)).map(tuple)


@functools.cache
def sizes_past_tiny(low: int, high: int) -> tuple[int, ...]:
    """The sizes in ``[low, high]`` past :data:`TINY` drawn on purpose: powers of two, multiples of
    :data:`TILES` and their neighbours (± 1), and ``high`` itself, in increasing order."""
    picked = {high}
    for tile in TILES:
        for m in range(tile, high + 2, tile):
            picked.update((m - 1, m, m + 1))
    power = 1
    while power <= high:
        picked.add(power)
        power *= 2
    return tuple(sorted(n for n in picked if max(low, TINY + 1) <= n <= high))


@functools.cache  # strategies are immutable: built (and validated) once per bounds
def per_rank(low: int, high: int) -> st.SearchStrategy[int]:
    """A size per rank in ``[low, high]``: half the time tiny (``low`` to :data:`TINY`), otherwise any
    size up to ``high``, or one of :func:`sizes_past_tiny` (tile multiples ± 1, powers of two).
    Shrinking goes to the tiny branch first, then to the smallest size that still fails, so a bug that
    needs 5 features per rank shrinks to 5 (the "any size" branch comes before the special sizes)."""
    tiny = st.integers(low, max(low, min(TINY, high)))
    if high <= TINY or low > high:
        return tiny
    special = sizes_past_tiny(low, high)
    past = st.integers(max(low, TINY + 1), high)
    return st.one_of(tiny, st.one_of(past, st.sampled_from(special)) if special else past)


def draw_tp(draw: st.DrawFn, world: int, tp_sizes: tuple[int, ...] | None, subgroups: bool,
            least: int = 1) -> tuple[int, str]:
    """``(tp size, tp layout)`` of a world of ``world`` ranks, for every family's cases: one of
    ``tp_sizes`` that divides it (largest first), else with ``subgroups`` half the time a proper
    divisor (of at least ``least`` ranks), else the whole world; the layout is drawn only where both
    differ (several groups of several ranks each)."""
    smaller = [t for t in range(world - 1, 0, -1) if world % t == 0 and t >= least]
    if tp_sizes is not None:
        tp = draw(st.sampled_from(sorted((t for t in tp_sizes if world % t == 0 and t >= least), reverse=True)))
    elif subgroups and smaller and draw(st.sampled_from((False, True))):
        tp = draw(st.sampled_from(smaller))
    else:
        tp = world
    layout = draw(st.sampled_from(("consecutive", "strided"))) if 1 < tp < world else "consecutive"
    return tp, layout


@st.composite
def world_and_tp(draw: st.DrawFn, sizes: tuple[int, ...], tp_sizes: tuple[int, ...] | None,
                 subgroups: bool) -> tuple[int, int, str]:
    """``(world size, tp size, tp layout)``: a world size of ``sizes`` that a tp size of ``tp_sizes``
    divides, and its tp groups (:func:`draw_tp`)."""
    worlds = [w for w in sizes if tp_sizes is None or any(w % t == 0 for t in tp_sizes)]
    if not worlds:
        raise InvalidArgument(f"no world size in {list(sizes)} is divisible by a tp size in {list(tp_sizes or ())}")
    world = draw(st.sampled_from(worlds))
    return (world, *draw_tp(draw, world, tp_sizes, subgroups))


def default_world_sizes() -> tuple[int, ...]:
    """:data:`DEFAULT_WORLD_SIZES`, or :data:`THOROUGH_WORLD_SIZES` under ``TPSIM_THOROUGH=1``."""
    return THOROUGH_WORLD_SIZES if os.environ.get("TPSIM_THOROUGH") == "1" else DEFAULT_WORLD_SIZES


#: The micro-batches a drawn case's first optimizer step accumulates (shrinking toward the first): 2,
#: and 3 one case in four (every micro-batch is a forward and backward of the whole world, and of the
#: reference: a module's check costs about a fifth more with 3; the budget keeps searches as fast).
MICRO_BATCH_CHOICES = (2, 2, 2, 3)


def training(draw: st.DrawFn) -> dict[str, object]:
    """The training fields of a case of a family that trains (drawn last: the rest shrinks as before):
    ``micro_batches`` from :data:`MICRO_BATCH_CHOICES` (at least 2 in every case, so every training case
    accumulates; 3 one case in four; shrinking toward 2) and ``set_to_none`` (``optimizer.zero_grad``'s mode, shrinking
    toward torch's default, True)."""
    return {"micro_batches": draw(st.sampled_from(MICRO_BATCH_CHOICES)),
            "set_to_none": draw(st.sampled_from((True, False)))}
