"""The Hypothesis strategy of linear cases (:func:`cases`), shrinking toward the smallest readable case.

Draw order and value order are chosen so that shrinking moves toward the smallest, most readable
failing example: the world size is drawn first from the sorted sizes (shrinks toward 1, then 2),
the dtype from ``float64`` first, the "divisible" switch toward divisible, features toward a few
per rank, the batch toward a 1-D input, bias toward off, the seed toward 0.

Features: a sharded feature dim (``in_features`` of a row layer, ``out_features`` of a column
layer; see :meth:`Variant.sharded_features`) is ``k * ws`` in a divisible case and ``k * ws + r``
(``0 < r < ws``) in a non-divisible one — about one case in four, where only the divisibility
property applies; an unsharded dim is a multiple of ``ws`` half the time (shrinking prefers it) and
any size otherwise. Sizes per rank (:func:`per_rank`) are tiny (1 to 3) half the time and otherwise
reach past the tiny, up to ``max_per_rank`` (:data:`DEFAULT_MAX_SIZE`, 64; ``tpsim check
--max-size``): any size, or on purpose a power of two or a tile multiple ± 1 (15, 16, 17, 31, ...),
where kernels, chunked losses and fused layers switch code paths. Shrinking still goes to the
smallest size that fails (tiny first).

Batch: 0 to 3 leading dims of sizes 1 to 3 (size-1 dims included; 0 dims: a single vector).
Sequence-parallel variants (``input``/``output`` ``"sequence-sharded"``) get at least the batch dims
their ``sequence_dim`` needs (one for the default -2: 2-D inputs, where the sequence dim is dim 0,
and 3-D ones, where it is not), and a sequence length of a few tokens per rank; a row layer's
sequence-sharded output also gets sequence lengths that do not divide (it must refuse them).
Packed variants (``packed``: part proportions) get ``out_features = sum(packed) * unit``.
Head-packed ones (``head_size``: a Q/K/V weight whose key/value parts are replicated below the tp
size, see :mod:`tpsim.placement`) get ``unit = head_size * m``, part ``i`` holding ``packed[i] * m``
heads: half the time (when the proportions allow it at this tp size) ``m`` gives fewer key/value
heads than ranks, each replicated, otherwise as many or more, the smallest first; a non-divisible case
has heads the tp size cannot split.
A variant's declared restrictions (``min_batch_dims``, ``max_batch_dims``, ``min_features``,
``min_tp_size``, ``divisible_only``; see
:meth:`tpsim.variant.Variant.restrictions`) narrow these draws.
World sizes: ``DEFAULT_WORLD_SIZES`` (1, 2, 3, 4, 8), or ``THOROUGH_WORLD_SIZES`` (1-8, 12, 16) when the
environment sets ``TPSIM_THOROUGH=1`` (tpsim's ``thorough`` Hypothesis profile does).
Dtypes: float64, float32, bfloat16, float16; tolerances per dtype in :mod:`tpsim.props.tolerance`.

Tensor-parallel subgroups (``subgroups=True`` or ``tp_sizes``): the tp size is drawn after the
world size — with ``subgroups`` the whole world half the time (shrinking prefers it) and a proper
divisor otherwise, with ``tp_sizes`` one of those that divide the world (worlds none divides are
not drawn) — and the groups' layout (consecutive or strided, see :mod:`tpsim.props.groups`) when
there are several groups of several ranks. Every sharded size above then divides by (or is cut
over) the tp size, not the world size. Memory layouts (``layouts``, see :mod:`tpsim.props.layouts`):
one of contiguous (shrinking prefers it) and the non-contiguous layouts that fit the batch shape,
equally likely.
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tpsim.errors import InvalidArgument
from tpsim.props.case import DTYPES
from tpsim.props.layouts import INPUT_LAYOUTS, needs_batch
from tpsim.props.linear.case import Case
from tpsim.props.sizes import DEFAULT_MAX_SIZE
from tpsim.props.strategies import (
    TINY,
    batch_shapes,
    default_world_sizes,
    draw_tp,
    dtypes,
    per_rank,
    training,
    world_sizes,
)
from tpsim.variant import Variant

__all__ = ["cases", "head_units"]


_world_sizes = world_sizes


_dtypes = dtypes


def _feature(draw: st.DrawFn, ws: int, sharded: bool, divisible: bool, max_per_rank: int, minimum: int = 1) -> int:
    # ``minimum``: the variant's ``min_features`` (1 draws exactly as without it).
    low = -(-minimum // ws)  # the fewest features per rank that reach the minimum
    if not sharded:
        # Half the time a multiple of ws, and shrinking prefers it: a weight split along the wrong
        # dim is then recognisable as such (a clean shard of the other dim) in the minimal case.
        if ws > 1 and draw(st.sampled_from((True, False))):
            return ws * draw(per_rank(low, max(low, max_per_rank)))
        return draw(per_rank(minimum, max(minimum, 2 * max_per_rank)))
    k = draw(per_rank(low, max(low, max_per_rank)))
    if divisible or ws == 1:
        return k * ws
    return k * ws + draw(st.integers(1, ws - 1))


def _packed_features(draw: st.DrawFn, packed: tuple[int, ...], ws: int, divisible: bool, max_per_rank: int) -> int:
    # Packed parts are proportions: out_features = sum(packed) * unit, part i = packed[i] * unit. A
    # divisible unit (k * ws) makes every part divide; k * ws + r makes at least the packed total's
    # share uneven, so a layer that checks the packed total instead of each part shows (e.g. parts
    # (1, 1), unit 3, ws 2: out_features 6 divides, each part of 3 does not).
    unit = _feature(draw, ws, True, divisible, max(1, max_per_rank // 2 + 1))
    return sum(packed) * unit


def head_units(packed: tuple[int, ...], ws: int) -> tuple[list[int], list[int], list[int]]:
    """Head multipliers ``m`` (part ``i`` has ``packed[i] * m`` heads) up to ``2 * ws`` for a head-packed
    variant over ``ws`` ranks: (replicated: some key/value part has fewer heads than ranks; sharded:
    every part divides; neither: heads the tp size cannot split)."""
    fewer: list[int] = []
    even: list[int] = []
    bad: list[int] = []
    for m in range(1, 2 * ws + 2):
        heads = [p * m for p in packed]
        ok = heads[0] % ws == 0 and all(n % ws == 0 or ws % n == 0 for n in heads[1:])
        if not ok:
            bad.append(m)
        elif any(n < ws for n in heads[1:]):
            fewer.append(m)
        elif m <= 2 * ws:
            even.append(m)
    return fewer, even, bad


def _head_features(draw: st.DrawFn, packed: tuple[int, ...], head_size: int, ws: int, divisible: bool) -> int:
    fewer, even, bad = head_units(packed, ws)
    if not divisible and bad:
        m = draw(st.sampled_from(bad))
    elif fewer and (not even or draw(st.booleans())):
        m = draw(st.sampled_from(fewer[::-1]))  # the most heads first: several replicated ones
    else:
        m = draw(st.sampled_from(even or [ws]))
    return sum(packed) * head_size * m


@st.composite
def _cases(
    draw: st.DrawFn,
    variant: Variant | None,
    sizes: tuple[int, ...],
    dtype_names: tuple[str, ...],
    bias: bool | None,
    max_per_rank: int,
    non_divisible: bool,
    tp_sizes: tuple[int, ...] | None = None,
    subgroups: bool = False,
    layouts: tuple[str, ...] = ("contiguous",),
) -> Case:
    world = draw(_world_sizes(sizes))
    tp, tp_layout = _tp(draw, world, variant, tp_sizes, subgroups)
    ws = tp  # every sharded size below divides by (or is cut over) the tp size
    dtype = draw(_dtypes(dtype_names))
    sharded = variant.sharded_features() if variant is not None else ("out_features",)
    # True first: shrinking prefers a divisible case; about a quarter are non-divisible.
    if variant is not None and variant.divisible_only:
        non_divisible = False  # the variant declares divisible cases only (see Variant.restrictions)
    divisible = draw(st.sampled_from((True, True, True, False))) if non_divisible and ws > 1 else True
    least = variant.min_features if variant is not None else 1
    # A sequence-sharded output (a row layer's reduce-scatter) must also refuse a sequence length
    # that does not divide: a non-divisible case is then either in the features or in the sequence.
    # (A sequence-sharded *input* arrives already cut, so its sequence length always divides.)
    bad_sequence = (
        not divisible and variant is not None and variant.output == "sequence-sharded" and draw(st.booleans())
    )
    feature_divisible = divisible or bad_sequence
    in_features = _feature(draw, ws, "in_features" in sharded, feature_divisible, max_per_rank, least)
    if variant is not None and variant.packed and variant.head_size is not None:
        out_features = _head_features(draw, variant.packed, variant.head_size, ws, feature_divisible)
    elif variant is not None and variant.packed:
        out_features = _packed_features(draw, variant.packed, ws, feature_divisible, max_per_rank)
    else:
        out_features = _feature(draw, ws, "out_features" in sharded, feature_divisible, max_per_rank, least)
    min_dims = variant.min_batch_dims if variant is not None else 0
    if variant is not None:
        min_dims = max(min_dims, variant.min_sequence_batch_dims())
    max_dims = variant.max_batch_dims if variant is not None and variant.max_batch_dims is not None else 3
    batch = draw(batch_shapes(max_dims=max_dims, min_dims=min_dims))
    seq = variant.sequence_dim_of(len(batch) + 1) if variant is not None else None
    if seq is not None:
        # The sequence length: k * ws tokens (a few per rank), or k * ws + r when it must not divide.
        # (a few tokens per rank: the sequence multiplies every activation, and no layer tiles it)
        length = _feature(draw, ws, True, not bad_sequence, min(max_per_rank, TINY))
        batch = (*batch[:seq], length, *batch[seq + 1 :])
    if variant is not None and not variant.bias:
        has_bias = False
    elif variant is not None and variant.always_bias:
        has_bias = True  # a layer that always has a bias: its bias-free case does not exist
    else:
        has_bias = draw(st.booleans()) if bias is None else bias
    layout = _layout(draw, layouts, batch)
    seed = draw(st.integers(0, 2**31 - 1))
    train = training(draw)
    return Case(
        world_size=world,
        tp_size=tp,
        tp_layout=tp_layout,
        input_layout=layout,
        in_features=in_features,
        out_features=out_features,
        batch_shape=batch,
        dtype=dtype,
        bias=has_bias,
        seed=seed,
        target=variant.target if variant is not None else None,
        variant=variant.name if variant is not None else None,
        options=variant.options if variant is not None else (),
        **train,  # type: ignore[arg-type]
    )


def _tp(draw: st.DrawFn, world: int, variant: Variant | None, tp_sizes: tuple[int, ...] | None,
        subgroups: bool) -> tuple[int, str]:
    if variant is not None and not variant.subgroups:
        return world, "consecutive"
    # Proper divisors the variant supports (a variant's min_tp_size; 1 leaves the draws as they were).
    return draw_tp(draw, world, tp_sizes, subgroups, least=variant.min_tp_size if variant is not None else 1)


def _layout(draw: st.DrawFn, layouts: tuple[str, ...], batch: tuple[int, ...]) -> str:
    fitting = [name for name in layouts if name != "contiguous" and (batch or not needs_batch(name))]
    if not fitting:
        return "contiguous"
    # Contiguous first (shrinking prefers it), then each fitting non-contiguous layout, equally likely.
    return draw(st.sampled_from((["contiguous"] if "contiguous" in layouts else []) + fitting))


def cases(
    variant: Variant | None = None,
    *,
    world_sizes: Sequence[int] | None = None,
    dtypes: Sequence[str] = tuple(DTYPES),
    bias: bool | None = None,
    max_per_rank: int = DEFAULT_MAX_SIZE,
    non_divisible: bool = True,
    tp_sizes: Sequence[int] | None = None,
    subgroups: bool = False,
    layouts: Sequence[str] = ("contiguous",),
) -> st.SearchStrategy[Case]:
    """Cases for ``variant`` (its sharded dims and bias support shape the draws).

    ``subgroups=True`` also draws tp groups smaller than the world; ``tp_sizes`` draws the tp size
    from these (each world size is split into groups of one of them that divides it); neither: one
    tp group spanning the world. ``layouts``: memory layouts to draw from (default contiguous only;
    :data:`tpsim.props.layouts.INPUT_LAYOUTS` for all). A variant with ``subgroups=False`` always
    gets one group spanning the world.

    ``bias`` forces bias on/off (None: both; a variant without bias support: off).
    ``max_per_rank`` bounds features per rank of a sharded dim (:func:`per_rank`: tiny half the time,
    otherwise up to this, tile multiples ± 1 included; an unsharded dim up to twice it);
    ``non_divisible=False`` generates divisible cases only.
    """
    sizes = tuple(default_world_sizes() if world_sizes is None else world_sizes)
    names = tuple(dtypes)
    # Validate eagerly so a bad option is a usage error, not a Hypothesis error mid-run.
    _world_sizes(sizes)
    _dtypes(names)
    if isinstance(max_per_rank, bool) or not isinstance(max_per_rank, int) or max_per_rank < 1:
        raise InvalidArgument(f"max_per_rank={max_per_rank!r} must be an int >= 1")
    layout_names = tuple(layouts)
    bad = [name for name in layout_names if name not in INPUT_LAYOUTS]
    if bad or not layout_names:
        raise InvalidArgument(f"layouts={list(layout_names)!r}: expected a non-empty subset of {', '.join(INPUT_LAYOUTS)}")
    least = variant.min_tp_size if variant is not None else 1
    if least > 1:
        # Only worlds that can hold a tp group of the variant's minimum size (see Variant.min_tp_size).
        fits = tuple(w for w in sizes if w >= least)
        if not fits:
            raise InvalidArgument(
                f"world sizes {list(sizes)}: variant {variant.name!r} needs tp groups of at least {least} ranks "  # type: ignore[union-attr]
                f"(min_tp_size={least}); add a world size >= {least}"
            )
        sizes = fits
    tps = None
    if tp_sizes is not None:
        tps = tuple(sorted(set(int(t) for t in tp_sizes)))
        if not tps or tps[0] < 1:
            raise InvalidArgument(f"tp_sizes={list(tp_sizes)!r} must be a non-empty list of ints >= 1")
        if variant is None or variant.subgroups:
            fitting = tuple(w for w in sizes if any(w % t == 0 and t >= least for t in tps))
            if not fitting:
                floor = f" (of at least {least} ranks: the variant's min_tp_size)" if least > 1 else ""
                raise InvalidArgument(
                    f"tp_sizes={list(tps)} divide none of the world sizes {list(sizes)}{floor}: each world is split "
                    "into tp groups of one of the tp sizes"
                )
            sizes = fitting
    return _cases(variant, sizes, names, bias, max_per_rank, non_divisible, tps, subgroups, layout_names)
