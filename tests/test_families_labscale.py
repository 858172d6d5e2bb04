"""Realistic sizes for the vocab-parallel and attention families (slow: a few GB and tens of seconds each).

Vocabulary 32000, hidden 4096, tp 2, float32 for the embedding and the cross-entropies; attention with
32 heads, 8 key/value heads, head dim 128, 128 tokens, tp 4, float32. tpsim's layers pass one case
each, and the mutants whose trigger such a case has are still named with their diagnoses: the
tolerances must stay far below the size of the bugs at realistic widths (a worst-case bound through
the softmax accepted the softmax-scale bug there). Timing is printed (``-s``), never asserted.
"""

from __future__ import annotations

import time

import pytest

from tpsim import builtin_variants
from tpsim.mutants import CATALOG
from tpsim.props.attention.case import AttentionCase
from tpsim.props.family import family_of
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase

# Lab-scale cases take up to ~18 GB each: CI and tox run them in a pytest of their own, one at a time, with
# nothing beside them (-m labscale; the rest of the thorough tier: -m "thorough and not labscale").
pytestmark = [pytest.mark.slow, pytest.mark.labscale]

EMBEDDING = EmbeddingCase(2, 32000, 4096, (4, 512), "float32")
CROSS_ENTROPY = CrossEntropyCase(2, 32000, (4, 512), "float32", label_smoothing=0.1)
LINEAR_CROSS_ENTROPY = CrossEntropyCase(2, 32000, (512,), "float32", hidden=4096)
ATTENTION = AttentionCase(4, 4096, 32, 8, 128, 128, (1,), dtype="float32")
BY_NAME = {m.name: m for m in CATALOG}


def _check(variant, case):
    started = time.perf_counter()
    failures = family_of(variant).check_case(variant, case, backend="inproc", timeout=600.0)
    print(f"\n{variant.name}: {case.describe()}: {time.perf_counter() - started:.1f}s")
    return [(f.property, f.diagnosis) for f in failures]


@pytest.mark.parametrize(("variant", "case"), [
    (builtin_variants.vocab_embedding, EMBEDDING),
    (builtin_variants.vocab_cross_entropy, CROSS_ENTROPY),
    (builtin_variants.vocab_linear_cross_entropy, LINEAR_CROSS_ENTROPY),
    (builtin_variants.attention, ATTENTION),
    (builtin_variants.attention_sequence_parallel, ATTENTION),
], ids=lambda x: getattr(x, "name", ""))
def test_tpsim_layers_pass_at_a_realistic_size(variant, case):
    assert _check(variant, case) == []


@pytest.mark.parametrize(("mutant", "case"), [
    ("embedding-unmasked-ids", EMBEDDING),
    ("cross-entropy-gathered-logits", CROSS_ENTROPY),
    ("cross-entropy-smoothing-per-shard", CROSS_ENTROPY),
    ("attention-local-head-dim-scale", ATTENTION),
    ("attention-kv-heads-round-robin", ATTENTION),
])
def test_mutants_are_named_at_a_realistic_size(mutant, case):
    m = BY_NAME[mutant]
    found = _check(m.variant, case)
    assert ("forward-equivalence", m.diagnosis) in found, found
