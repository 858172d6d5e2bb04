"""Hypothesis strategies for vocab-parallel cases.

Draw order and value order shrink toward the smallest readable failing example, as for linear
layers (:mod:`tpsim.props.strategies`): the world size first (toward 1, then 2), the tp size (the
whole world unless subgroups are asked for), the dtype (float64 first), the vocabulary (divisible
first: ``k * tp`` ids, ``k`` tiny half the time and otherwise up to ``max_size`` with tile multiples ± 1
(:func:`tpsim.props.strategies.per_rank`: chunked losses switch code paths there); otherwise ``k * tp + r``
with ``0 < r < tp``, about one case in four), the embedding dim (the same sizes), the
batch (0 to 2 dims of 1 to 4 tokens, so the shard boundaries the data puts first are all there
with a few more tokens), the seed toward 0.

Cross-entropies also draw ``label_smoothing`` (0 first, then 0.1, 0.25, 1), ``ignore_index``
(-100 first, then ``-1``, then an id inside the vocabulary, which ``F.cross_entropy`` ignores too)
and ``reduction`` (``"none"`` first) — each only when the variant accepts it — and, for a variant
of hidden states, the hidden size (the same sizes).
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from tpsim.errors import InvalidArgument
from tpsim.props.case import DTYPES
from tpsim.props.strategies import DEFAULT_MAX_SIZE, batch_shapes, per_rank, world_and_tp
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__all__ = ["cross_entropy_cases", "embedding_cases"]

#: Label smoothing values drawn (0 first: shrinking prefers none).
SMOOTHING = (0.0, 0.1, 0.25, 1.0)
def _check(world_sizes: Sequence[int], dtypes: Sequence[str]) -> tuple[tuple[int, ...], tuple[str, ...]]:
    sizes, names = tuple(world_sizes), tuple(dtypes)
    if not sizes or any(isinstance(w, bool) or not isinstance(w, int) or w < 1 for w in sizes):
        raise InvalidArgument(f"world_sizes={list(sizes)!r}: expected ints >= 1")
    bad = [d for d in names if d not in DTYPES]
    if bad or not names:
        raise InvalidArgument(f"dtypes={list(names)!r}: expected a non-empty subset of {', '.join(DTYPES)}")
    return tuple(sorted(set(sizes))), names


def _vocab(draw: st.DrawFn, tp: int, non_divisible: bool, max_size: int) -> int:
    divisible = draw(st.sampled_from((True, True, True, False))) if non_divisible and tp > 1 else True
    k = draw(per_rank(1, max_size))
    return k * tp if divisible else k * tp + draw(st.integers(1, tp - 1))


def embedding_cases(variant: EmbeddingVariant, *, world_sizes: Sequence[int], dtypes: Sequence[str],
                    non_divisible: bool = True, tp_sizes: Sequence[int] | None = None,
                    subgroups: bool = False, max_size: int = DEFAULT_MAX_SIZE) -> st.SearchStrategy[EmbeddingCase]:
    """Cases for an embedding variant (see the module docstring)."""
    sizes, names = _check(world_sizes, dtypes)
    tps = None if tp_sizes is None else tuple(tp_sizes)

    @st.composite
    def draw_case(draw: st.DrawFn) -> EmbeddingCase:
        world, tp, layout = draw(world_and_tp(sizes, tps, subgroups))
        dtype = draw(st.sampled_from(names))
        vocab = _vocab(draw, tp, non_divisible, max_size)
        dim = draw(per_rank(1, max_size))
        batch = draw(batch_shapes(max_dims=variant.max_batch_dims, max_size=4, min_dims=variant.min_batch_dims))
        if variant.sequence_dim is not None:  # a dim the layer scatters its output along: a multiple of tp
            batch = tuple(n * tp if d == variant.sequence_dim else n for d, n in enumerate(batch))
        seed = draw(st.integers(0, 2**31 - 1))
        return EmbeddingCase(world, vocab, dim, batch, dtype, seed, tp, layout, target=variant.target,
                             variant=variant.name, options=variant.options)

    return draw_case()


def cross_entropy_cases(variant: CrossEntropyVariant, *, world_sizes: Sequence[int], dtypes: Sequence[str],
                        non_divisible: bool = True, tp_sizes: Sequence[int] | None = None,
                        subgroups: bool = False, max_size: int = DEFAULT_MAX_SIZE) -> st.SearchStrategy[CrossEntropyCase]:
    """Cases for a cross-entropy variant (see the module docstring)."""
    sizes, names = _check(world_sizes, dtypes)
    accepts = set(variant.accepts)
    tps = None if tp_sizes is None else tuple(tp_sizes)
    # Without a group keyword the function talks to the default group: one group spanning the world.
    if "group" not in accepts:
        tps, subgroups = None, False
    # Without vocab_size it cannot know the padding: vocabularies that divide only.
    pads = non_divisible and "vocab_size" in accepts

    @st.composite
    def draw_case(draw: st.DrawFn) -> CrossEntropyCase:
        world, tp, layout = draw(world_and_tp(sizes, tps, subgroups))
        dtype = draw(st.sampled_from(names))
        vocab = _vocab(draw, tp, pads, max_size)
        batch = draw(batch_shapes(max_dims=2, max_size=4))
        smoothing = draw(st.sampled_from(SMOOTHING)) if "label_smoothing" in accepts else 0.0
        ignore = draw(st.sampled_from((-100, -1, vocab - 1))) if "ignore_index" in accepts else -100
        reduction = draw(st.sampled_from(("none", "mean", "sum"))) if "reduction" in accepts else "none"
        hidden = draw(per_rank(1, max_size)) if variant.input == "hidden" else 0
        seed = draw(st.integers(0, 2**31 - 1))
        return CrossEntropyCase(world, vocab, batch, dtype, seed, smoothing, ignore, reduction, hidden, tp, layout,
                                target=variant.target, variant=variant.name, options=variant.options)

    return draw_case()
