"""The Hypothesis strategy of attention cases, shrinking toward the smallest readable case.

Draw order (what shrinks first): the world size (toward 1, then 2), the tp size (the whole world
unless subgroups are asked for), the dtype, whether the heads divide (about one case in four does
not: the block must refuse it), the key/value heads, the query heads per key/value head, the head
dim, the hidden size, the sequence, the batch, causal masking, biases, the seed.

Heads: ``num_kv_heads`` is drawn among the sizes the tp size can split — ``tp`` or ``2 tp`` (a
block of heads per rank), or, half the time, a proper divisor of ``tp`` (fewer heads than ranks,
each replicated on ``tp / num_kv_heads`` ranks; the largest first) — and ``num_heads`` is a
multiple of both ``tp`` and ``num_kv_heads``; a non-divisible case breaks one of the two rules.
The head dim and the hidden size are tiny half the time and otherwise up to ``max_size``, tile
multiples ± 1 included (:func:`tpsim.props.strategies.per_rank`). The sequence has a few tokens, a
multiple of ``tp`` for sequence-parallel variants.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from hypothesis import strategies as st

from tpsim.attention_variant import AttentionVariant
from tpsim.errors import InvalidArgument
from tpsim.props.attention.case import AttentionCase
from tpsim.props.case import DTYPES
from tpsim.props.strategies import DEFAULT_MAX_SIZE, batch_shapes, per_rank, world_and_tp

__all__ = ["attention_cases"]


def _lcm(a: int, b: int) -> int:
    return a * b // math.gcd(a, b)


def attention_cases(variant: AttentionVariant, *, world_sizes: Sequence[int], dtypes: Sequence[str],
                    non_divisible: bool = True, tp_sizes: Sequence[int] | None = None,
                    subgroups: bool = False, max_size: int = DEFAULT_MAX_SIZE) -> st.SearchStrategy[AttentionCase]:
    """Cases for an attention variant (see the module docstring)."""
    sizes = tuple(sorted(set(world_sizes)))
    names = tuple(dtypes)
    if not sizes or not names or any(d not in DTYPES for d in names):
        raise InvalidArgument(f"world_sizes={list(sizes)!r}, dtypes={list(names)!r}: expected some of each")
    tps = None if tp_sizes is None else tuple(tp_sizes)

    @st.composite
    def draw_case(draw: st.DrawFn) -> AttentionCase:
        world, tp, layout = draw(world_and_tp(sizes, tps, subgroups))
        dtype = draw(st.sampled_from(names))
        divisible = draw(st.sampled_from((True, True, True, False))) if non_divisible and tp > 1 else True
        if divisible:
            fewer = [t for t in range(tp - 1, 0, -1) if tp % t == 0]  # replicated: proper divisors of tp
            if fewer and draw(st.booleans()):
                kv = draw(st.sampled_from(fewer))
            else:
                kv = tp * draw(st.integers(1, 2))
            per_kv = _lcm(tp, kv) // kv
            heads = kv * per_kv * draw(st.integers(1, 2))
        elif draw(st.booleans()):  # query heads the tp size does not divide
            kv = 1
            heads = tp * draw(st.integers(1, 2)) + draw(st.integers(1, tp - 1))
        else:  # key/value heads and tp dividing neither one another
            bad = [k for k in range(2, 2 * tp + 1) if k % tp and tp % k]
            if not bad:
                kv, heads = 1, tp + 1
            else:
                kv = draw(st.sampled_from(bad))
                heads = _lcm(tp, kv)
        head_dim = draw(per_rank(1, max_size))
        hidden = draw(per_rank(1, max_size))
        seq = tp * draw(st.integers(1, 2)) if variant.sequence_parallel else draw(st.integers(1, 4))
        batch = draw(batch_shapes(max_dims=1, max_size=2))
        causal = draw(st.booleans())
        bias = draw(st.booleans()) if variant.bias is None else variant.bias
        seed = draw(st.integers(0, 2**31 - 1))
        return AttentionCase(world, hidden, heads, kv, head_dim, seq, batch, causal, bias, dtype, seed, tp, layout,
                             target=variant.target, variant=variant.name, options=variant.options)

    return draw_case()
