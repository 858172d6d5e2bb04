"""The project's property tests for the vocab-parallel layers and attention (``tpsim.layers``).

``properties/test_layer_core.py`` already runs every variant of ``tpsim.layers`` — these included
— through its family with one tp group spanning the world. Here the same families are searched with
tp groups smaller than the world (consecutive and strided, as in a tp × dp mesh: a layer must only
talk to its own group), and Megatron's vocabulary padding is checked as the algebra it is.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim import builtin_variants
from tpsim.layers import padded_vocab_size
from tpsim.props.search import search

_EXAMPLES = max(25, settings().max_examples)
_VARIANTS = [*builtin_variants.TPSIM_VOCAB, builtin_variants.attention, builtin_variants.attention_sequence_parallel]


@pytest.mark.parametrize("variant", _VARIANTS, ids=lambda v: v.name)
def test_every_property_holds_with_tp_groups_smaller_than_the_world(variant):
    report = search(variant, max_examples=_EXAMPLES, seed=17, subgroups=True, world_sizes=(2, 4))
    assert report.passed, "\n".join(f.describe() for f in report.failures)


@given(st.integers(1, 10**6), st.integers(1, 64), st.integers(1, 256))
def test_megatron_padding_is_the_least_multiple_that_holds_the_vocabulary(vocab, tp, multiple):
    padded = padded_vocab_size(vocab, tp, multiple)
    assert padded % (tp * multiple) == 0
    assert vocab <= padded < vocab + tp * multiple
