"""The Hypothesis strategy of module cases, shrinking toward the smallest readable case.

Draw order (what shrinks first): the world size (toward 1, then 2), the tp size (the whole world
first), the dtype (float64 first), whether the case is divisible (divisible first; about one case
in four is not), the sizes, the batch shape, the seed (toward 0).

Sizes: in a divisible case every size is ``k * tp`` with ``k`` units per rank (at least the
variant's ``min_sizes``; at most 3, or ``max_size`` if smaller: larger sizes wait for a magnitude run
that does not overflow through attention); in a non-divisible case one of them, drawn, is ``k * tp + r`` with
``0 < r < tp``. A module may shard that size (it must refuse it clearly, or shard it unevenly and
still compute the dense result) or not shard it at all (an MLP's hidden size: it must just work),
so nothing about which sizes are sharded needs declaring. A variant with a ``size_strategy``
draws its own sizes.

Batch: 0 to 2 leading dims of sizes 1 to 3 (``[b, s, h]`` or ``[s, b, h]``: the module reads them as
it does); a sequence-sharded input gets the batch dims its ``sequence_dim`` needs and a sequence of a
few tokens per rank. Input layout (shrinking toward contiguous): every rank's input and
upstream grads are contiguous, a sequence-first buffer viewed batch-first (``transposed``) or a
strided slice (``strided``), as real callers pass them (:mod:`tpsim.props.layouts`). Last, the
training fields (:func:`tpsim.props.strategies.training`: 2 micro-batches, 3 one case in four, ``zero_grad``'s mode).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tpsim.errors import InvalidArgument
from tpsim.module_variant import ModuleVariant
from tpsim.props.layouts import needs_batch
from tpsim.props.module.case import MODULE_INPUT_LAYOUTS, ModuleCase
from tpsim.props.strategies import DEFAULT_MAX_SIZE, batch_shapes, draw_tp, per_rank, training
from tpsim.props.strategies import dtypes as dtype_strategy
from tpsim.props.strategies import world_sizes as world_size_strategy

__all__ = ["module_cases"]

#: Units per rank of a drawn size and tokens per rank of a drawn sequence (see ``_sizes``).
MAX_PER_RANK = 3


def _sizes(draw: st.DrawFn, variant: ModuleVariant, tp: int, divisible: bool, max_size: int) -> tuple[int, ...]:
    if variant.size_strategy is not None:
        sizes = tuple(draw(variant.size_strategy(tp, divisible)))
        if len(sizes) != len(variant.sizes):
            raise InvalidArgument(
                f"the size_strategy of {variant.name!r} drew {list(sizes)}; expected {len(variant.sizes)} sizes "
                f"{list(variant.sizes)}"
            )
        return sizes
    out = []
    for low in variant.min_sizes or (1,) * len(variant.sizes):
        least = -(-low // tp)
        # Tiny only, for now: at larger sizes the magnitude run through attention overflows (a false
        # usage error on a correct block, tests/test_attention_family.py); max_size still bounds them.
        out.append(tp * draw(per_rank(least, max(least, min(max_size, MAX_PER_RANK)))))
    if not divisible:
        i = draw(st.integers(0, len(out) - 1))
        out[i] += draw(st.integers(1, tp - 1))
    return tuple(out)


@st.composite
def _module_cases(draw: st.DrawFn, variant: ModuleVariant, sizes: tuple[int, ...], dtype_names: tuple[str, ...],
                  non_divisible: bool, tp_sizes: tuple[int, ...] | None, subgroups: bool,
                  max_size: int = DEFAULT_MAX_SIZE, input_layouts: tuple[str, ...] = MODULE_INPUT_LAYOUTS) -> ModuleCase:
    world = draw(world_size_strategy(sizes))
    world_only = variant.tp == "world"
    tp, layout = draw_tp(draw, world, None if world_only else tp_sizes, subgroups and not world_only)
    dtype = draw(dtype_strategy(dtype_names))
    divisible = draw(st.sampled_from((True, True, True, False))) if non_divisible and tp > 1 else True
    drawn = _sizes(draw, variant, tp, divisible, max_size)
    sequence = "sequence-sharded" in (variant.input, variant.output)
    least = 0
    if sequence:
        # The fewest batch dims that put the sequence dim before the features.
        least = max(1, -variant.sequence_dim - 1) if variant.sequence_dim < 0 else variant.sequence_dim + 1
    least = max(least, variant.min_batch_dims)
    most = max(2, least) if variant.max_batch_dims is None else variant.max_batch_dims
    if most < least:
        raise InvalidArgument(f"ModuleVariant {variant.name!r}: max_batch_dims={most} leaves no input with the "
                              f"{least} batch dim(s) its sequence dim or min_batch_dims needs")
    batch = draw(batch_shapes(max_dims=most, min_dims=least))
    if sequence:
        d = variant.sequence_dim_of(len(batch) + 1)
        if d is not None:
            batch = (*batch[:d], tp * draw(st.integers(1, MAX_PER_RANK)), *batch[d + 1:])
    seed = draw(st.integers(0, 2**31 - 1))
    layouts = [lay for lay in input_layouts if batch or not needs_batch(lay)] or ["contiguous"]
    input_layout = draw(st.sampled_from(layouts))
    train = training(draw)
    return ModuleCase(world_size=world, tp_size=tp, tp_layout=layout, sizes=drawn, batch_shape=batch, dtype=dtype,
                      seed=seed, target=variant.target, variant=variant.name, options=variant.options,
                      size_names=variant.sizes, input_layout=input_layout, unsharded=variant.unsharded,
                      **train)  # type: ignore[arg-type]


def module_cases(
    variant: ModuleVariant,
    *,
    world_sizes: Sequence[int],
    dtypes: Sequence[str],
    non_divisible: bool = True,
    tp_sizes: Sequence[int] | None = None,
    subgroups: bool = True,
    max_size: int = DEFAULT_MAX_SIZE,
    layouts: Sequence[str] = MODULE_INPUT_LAYOUTS,
) -> st.SearchStrategy[ModuleCase]:
    """Cases for ``variant`` (see the module docstring); ``non_divisible=False``: divisible only;
    ``layouts``: the input memory layouts to draw (those of :data:`MODULE_INPUT_LAYOUTS` among them)."""
    names = tuple(dtypes)
    sizes = tuple(sorted(set(int(w) for w in world_sizes)))
    tps = None
    if tp_sizes is not None:
        tps = tuple(sorted(set(int(t) for t in tp_sizes)))
        sizes = tuple(w for w in sizes if any(w % t == 0 for t in tps))
        if not sizes:
            raise InvalidArgument(f"tp_sizes={list(tps)} divide none of the world sizes {list(world_sizes)}")
    chosen = tuple(lay for lay in MODULE_INPUT_LAYOUTS if lay in tuple(layouts))
    if not chosen:
        raise InvalidArgument(f"layouts={list(layouts)!r}; expected some of {', '.join(MODULE_INPUT_LAYOUTS)} "
                              "(the layouts module cases draw)")
    return _module_cases(variant, sizes, names, bool(non_divisible), tps, bool(subgroups), max_size, chosen)
