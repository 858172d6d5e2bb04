"""Hypothesis strategies that generate cases for a variant.

Draw order and value order are chosen so that shrinking moves toward the smallest, most readable
failing example: the world size is drawn first from the sorted sizes (shrinks toward 1, then 2),
the dtype from ``float64`` first, the "divisible" switch toward divisible, features toward a few
per rank, the batch toward a 1-D input, bias toward off, the seed toward 0.

Features: a sharded feature dim (``in_features`` of a row layer, ``out_features`` of a column
layer; see :meth:`Variant.sharded_features`) is ``k * ws`` in a divisible case and ``k * ws + r``
(``0 < r < ws``) in a non-divisible one — about one case in four, where only the divisibility
property applies; an unsharded dim is a multiple of ``ws`` half the time (shrinking prefers it) and
any small size otherwise.

Batch: 0 to 3 leading dims of sizes 1 to 3 (size-1 dims included; 0 dims: a single vector).
World sizes: ``DEFAULT_WORLD_SIZES`` (1-8), or ``THOROUGH_WORLD_SIZES`` (up to 16) when the
environment sets ``TPSIM_THOROUGH=1`` (tpsim's ``thorough`` Hypothesis profile does).
Dtypes: float64, float32, bfloat16, float16; tolerances per dtype in :mod:`properties.tolerance`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from hypothesis import strategies as st

from properties.case import DTYPES, Case
from tpsim.errors import InvalidArgument
from tpsim.variant import Variant

__all__ = [
    "DEFAULT_WORLD_SIZES",
    "THOROUGH_WORLD_SIZES",
    "batch_shapes",
    "cases",
    "default_world_sizes",
    "dtypes",
    "world_sizes",
]

#: Default world sizes: 1-8, non-powers of two included.
DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 5, 6, 7, 8)
#: World sizes of the thorough profile.
THOROUGH_WORLD_SIZES = (*DEFAULT_WORLD_SIZES, 12, 16)


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


def batch_shapes(max_dims: int = 3, max_size: int = 3) -> st.SearchStrategy[tuple[int, ...]]:
    """Leading batch shapes of 0 to ``max_dims`` dims, sizes 1 to ``max_size`` (size 1 included)."""
    return st.lists(st.integers(1, max_size), min_size=0, max_size=max_dims).map(tuple)


# Aliases: ``cases()`` takes parameters with the same names as these strategies.
_world_sizes = world_sizes
_dtypes = dtypes


def _feature(draw: st.DrawFn, ws: int, sharded: bool, divisible: bool, max_per_rank: int) -> int:
    if not sharded:
        # Half the time a multiple of ws, and shrinking prefers it: a weight split along the wrong
        # dim is then recognisable as such (a clean shard of the other dim) in the minimal case.
        if ws > 1 and draw(st.sampled_from((True, False))):
            return ws * draw(st.integers(1, max_per_rank))
        return draw(st.integers(1, 2 * max_per_rank))
    k = draw(st.integers(1, max_per_rank))
    if divisible or ws == 1:
        return k * ws
    return k * ws + draw(st.integers(1, ws - 1))


@st.composite
def _cases(
    draw: st.DrawFn,
    variant: Variant | None,
    sizes: tuple[int, ...],
    dtype_names: tuple[str, ...],
    bias: bool | None,
    max_per_rank: int,
    non_divisible: bool,
) -> Case:
    ws = draw(_world_sizes(sizes))
    dtype = draw(_dtypes(dtype_names))
    sharded = variant.sharded_features() if variant is not None else ("out_features",)
    # True first: shrinking prefers a divisible case; about a quarter are non-divisible.
    divisible = draw(st.sampled_from((True, True, True, False))) if non_divisible and ws > 1 else True
    in_features = _feature(draw, ws, "in_features" in sharded, divisible, max_per_rank)
    out_features = _feature(draw, ws, "out_features" in sharded, divisible, max_per_rank)
    batch = draw(batch_shapes())
    if variant is not None and not variant.bias:
        has_bias = False
    else:
        has_bias = draw(st.booleans()) if bias is None else bias
    seed = draw(st.integers(0, 2**31 - 1))
    return Case(
        world_size=ws,
        in_features=in_features,
        out_features=out_features,
        batch_shape=batch,
        dtype=dtype,
        bias=has_bias,
        seed=seed,
        target=variant.target if variant is not None else None,
        variant=variant.name if variant is not None else None,
        options=variant.options if variant is not None else (),
    )


def default_world_sizes() -> tuple[int, ...]:
    """1-8, or up to 16 under ``TPSIM_THOROUGH=1``."""
    return THOROUGH_WORLD_SIZES if os.environ.get("TPSIM_THOROUGH") == "1" else DEFAULT_WORLD_SIZES


def cases(
    variant: Variant | None = None,
    *,
    world_sizes: Sequence[int] | None = None,
    dtypes: Sequence[str] = tuple(DTYPES),
    bias: bool | None = None,
    max_per_rank: int = 3,
    non_divisible: bool = True,
) -> st.SearchStrategy[Case]:
    """Cases for ``variant`` (its sharded dims and bias support shape the draws).

    ``bias`` forces bias on/off (None: both; a variant without bias support: off).
    ``max_per_rank`` bounds features per rank of a sharded dim (small shapes keep examples fast);
    ``non_divisible=False`` generates divisible cases only.
    """
    sizes = tuple(default_world_sizes() if world_sizes is None else world_sizes)
    names = tuple(dtypes)
    # Validate eagerly so a bad option is a usage error, not a Hypothesis error mid-run.
    _world_sizes(sizes)
    _dtypes(names)
    if isinstance(max_per_rank, bool) or not isinstance(max_per_rank, int) or max_per_rank < 1:
        raise InvalidArgument(f"max_per_rank={max_per_rank!r} must be an int >= 1")
    return _cases(variant, sizes, names, bias, max_per_rank, non_divisible)
