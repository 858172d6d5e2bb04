"""The embedding and cross-entropy families (tpsim/props/vocab): cases, strategies, recognisers,
user targets through the CLI, case files and replay on gloo.

The layers themselves are checked against hand-written oracles in tests/test_layers_vocab.py; here
the harness is under test: it must pass correct code (tpsim's layers, a user's class without
``from_dense``, a layer that refuses what does not divide, a Megatron-style function without
``vocab_size``), and name each catalogued vocab mutant with its intended diagnosis.
"""

from __future__ import annotations

import json
import textwrap

import pytest
import torch
from helpers import assert_case_replays_on_gloo
from hypothesis import given, settings
from hypothesis import strategies as st

from tpsim import builtin_variants
from tpsim.cli import main
from tpsim.diagnosis import REGISTRY
from tpsim.errors import InvalidArgument
from tpsim.props.family import family_named, family_of
from tpsim.props.search import search
from tpsim.props.strategies import DEFAULT_MAX_SIZE
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.props.vocab.family import CROSS_ENTROPY, EMBEDDING
from tpsim.props.vocab.strategies import cross_entropy_cases, embedding_cases
from tpsim.props.vocab.world import boundary_ids, cross_entropy_data, embedding_data, vocab_rows
from tpsim.target import resolve_target
from tpsim.vocab_variant import CrossEntropyVariant, cross_entropy_from_function, embedding_from_class

FAST = {"max_examples": 40, "seed": 0, "world_sizes": (1, 2, 3, 4)}


# --- cases and data --------------------------------------------------------------------------------


@pytest.mark.parametrize("case", [
    EmbeddingCase(4, 7, 3, (2, 3), "bfloat16", 5, tp_size=2, tp_layout="strided"),
    CrossEntropyCase(2, 5, (4,), "float32", 9, 0.25, 4, "mean", hidden=3),
])
def test_cases_round_trip_through_their_dicts(case):
    data = json.loads(json.dumps(case.to_dict()))
    again = type(case).from_dict(data)
    assert again == case and again.key() == case.key()
    assert family_named(case.family).case_from_dict(data) == case


@pytest.mark.parametrize(("data", "message"), [
    ({"world_size": 2}, "embedding case is missing field(s) ['vocab_size', 'embedding_dim']"),
    ({"world_size": 2, "vocab_size": 0, "embedding_dim": 3}, "vocab_size=0 must be an int >= 1"),
    ({"world_size": 2, "vocab_size": 3, "embedding_dim": 3, "tp_size": 4}, "tp_size=4 does not divide world_size=2"),
    ({"world_size": 2, "vocab_size": 3, "embedding_dim": 3, "colour": 1}, "unknown embedding case field(s) ['colour']"),
])
def test_a_bad_case_file_names_the_field(data, message):
    with pytest.raises(InvalidArgument) as err:
        EmbeddingCase.from_dict(data)
    assert message in str(err.value)


def test_cross_entropy_case_refuses_bad_smoothing_and_reduction():
    with pytest.raises(InvalidArgument, match=r"label_smoothing=1.5 must be a number in \[0, 1\]"):
        CrossEntropyCase(2, 4, label_smoothing=1.5)
    with pytest.raises(InvalidArgument, match="reduction='avg'; expected one of none, mean, sum"):
        CrossEntropyCase(2, 4, reduction="avg")


def test_boundaries_come_first_and_cover_every_shard():
    # 7 ids on 3 ranks: padded to 9 (ranges [0,3) [3,6) [6,9)), uneven pieces [0,3) [3,5) [5,7)
    assert boundary_ids(7, 3) == [0, 2, 3, 5, 6, 4]
    case = EmbeddingCase(3, 7, 2, (8,))
    ids = embedding_data(case).ids[0]
    assert ids[:6].tolist() == [0, 2, 3, 5, 6, 4]
    ce = cross_entropy_data(CrossEntropyCase(3, 7, (8,), ignore_index=-100))
    assert ce.targets[0][:6].tolist() == [0, 2, 3, 5, 6, 4] and ce.targets[0][-1] == -100
    assert ce.width == 9 and bool((ce.logits[0][..., 7:] == 30.0).all())


def test_rows_are_read_from_the_stored_shape():
    assert vocab_rows(3, 7, 3, 2) == (6, 9)  # padded
    assert vocab_rows(2, 7, 3, 2, [3, 2, 2]) == (5, 7)  # torch.tensor_split
    assert vocab_rows(2, 7, 3, 0) is None  # 3 * 2 < 7: a truncated vocabulary


@settings(max_examples=30, deadline=None)
@given(st.data())
def test_strategies_draw_valid_cases(data):
    emb = data.draw(embedding_cases(builtin_variants.vocab_embedding, world_sizes=(1, 2, 4), dtypes=("float64",),
                                    subgroups=True))
    assert emb.world_size % emb.tp_size == 0 and 1 <= emb.vocab_size <= DEFAULT_MAX_SIZE * emb.tp_size + emb.tp_size
    megatron_like = CrossEntropyVariant("megatron", lambda logits, target, label_smoothing=0.0: logits,
                                        accepts=("label_smoothing",))
    ce = data.draw(cross_entropy_cases(megatron_like, world_sizes=(2, 4), dtypes=("float32",), subgroups=True))
    # without vocab_size, ignore_index, reduction and a group: divisible, nothing ignored, per token, one group
    assert ce.vocab_size % ce.tp_size == 0 and ce.tp_size == ce.world_size
    assert ce.ignore_index == -100 and ce.reduction == "none" and ce.hidden == 0


# --- tpsim's own layers pass; the diagnoses are registered -------------------------------------------


@pytest.mark.parametrize("variant", builtin_variants.TPSIM_VOCAB, ids=lambda v: v.name)
def test_tpsim_vocab_layers_pass(variant):
    report = search(variant, **FAST)
    assert report.passed, [f.describe() for f in report.failures]


def test_the_vocab_diagnoses_are_registered_with_their_mutants():
    from tpsim.mutants import CATALOG

    names = {m.name: m for m in CATALOG}
    for diagnosis in ("vocab-mask-missing", "label-smoothing-per-shard", "max-not-reduced", "loss-off-by-log-tp",
                      "vocab-padding-in-softmax"):
        spec = REGISTRY[diagnosis]
        assert spec.mutant in names and names[spec.mutant].diagnosis == diagnosis
        assert family_of(names[spec.mutant].variant).name in ("embedding", "cross-entropy")


# --- user targets ------------------------------------------------------------------------------------

USER_LAYERS = textwrap.dedent('''
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch import nn

    from tpsim.layers import reduce_from_tensor_parallel_region, vocab_parallel_cross_entropy


    class UnevenEmbedding(nn.Module):
        """Its own init, rows split as torch.tensor_split splits them (no padding)."""

        def __init__(self, num_embeddings, embedding_dim, *, process_group=None):
            super().__init__()
            self.group = process_group
            ws, r = dist.get_world_size(process_group), dist.get_rank(process_group)
            sizes = [num_embeddings // ws + (1 if i < num_embeddings % ws else 0) for i in range(ws)]
            self.start, self.stop = sum(sizes[:r]), sum(sizes[: r + 1])
            self.weight = nn.Parameter(torch.randn(sizes[r], embedding_dim))

        def forward(self, ids):
            outside = (ids < self.start) | (ids >= self.stop)
            out = F.embedding((ids - self.start).masked_fill(outside, 0), self.weight)
            return reduce_from_tensor_parallel_region(out.masked_fill(outside.unsqueeze(-1), 0.0), self.group)


    class StrictEmbedding(UnevenEmbedding):
        """Refuses a vocabulary that does not divide, on every rank, naming the sizes."""

        def __init__(self, num_embeddings, embedding_dim, *, process_group=None):
            ws = dist.get_world_size(process_group)
            if num_embeddings % ws:
                raise ValueError(f"num_embeddings={num_embeddings} is not divisible by the tp size {ws}")
            super().__init__(num_embeddings, embedding_dim, process_group=process_group)


    class TruncatingEmbedding(UnevenEmbedding):
        """Keeps num_embeddings // ws rows per rank: the last ids silently fall off."""

        def __init__(self, num_embeddings, embedding_dim, *, process_group=None):
            ws = dist.get_world_size(process_group)
            super().__init__(num_embeddings - num_embeddings % ws, embedding_dim, process_group=process_group)


    def megatron_style_loss(vocab_parallel_logits, target, label_smoothing=0.0):
        """Megatron's signature: the default group, no vocab_size, no ignore_index, per-token loss."""
        return vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)
''')


@pytest.fixture
def user_file(tmp_path):
    path = tmp_path / "user_vocab.py"
    path.write_text(USER_LAYERS)
    return str(path)


def _check(capsys, *argv):
    code = main(["check", *argv, "--max-examples", "25", "--world-sizes", "1,2,3", "--seed", "0"])
    out = capsys.readouterr().out
    return code, out


def test_a_user_embedding_class_with_its_own_init_and_uneven_rows_passes(capsys, user_file, tmp_path):
    code, out = _check(capsys, f"{user_file}:UnevenEmbedding", "--kind", "embedding", "--cases-dir", str(tmp_path))
    assert code == 0, out
    assert "PASS UnevenEmbedding" in out


def test_a_clear_refusal_passes_and_a_truncation_is_divisibility_unchecked(capsys, user_file, tmp_path):
    code, out = _check(capsys, f"{user_file}:StrictEmbedding", "--kind", "embedding", "--cases-dir", str(tmp_path))
    assert code == 0, out
    code, out = _check(capsys, f"{user_file}:TruncatingEmbedding", "--kind", "embedding", "--cases-dir", str(tmp_path))
    assert code == 1, out
    assert "FAILED divisibility: divisibility-unchecked" in out and "silently truncated" in out


def test_a_megatron_style_function_is_checked_within_what_it_takes(capsys, user_file, tmp_path):
    variant = resolve_target(f"{user_file}:megatron_style_loss", kind="cross-entropy")[0]
    assert variant.accepts == ("label_smoothing",)
    code, out = _check(capsys, f"{user_file}:megatron_style_loss", "--kind", "cross-entropy",
                       "--cases-dir", str(tmp_path))
    assert code == 0, out
    assert "takes no ignore_index, vocab_size, reduction, group" in out


def test_kind_needs_a_matching_object(user_file):
    with pytest.raises(InvalidArgument, match="not a function"):
        cross_entropy_from_function(torch.nn.Linear)
    with pytest.raises(InvalidArgument, match="takes no tp group"):
        embedding_from_class(torch.nn.Embedding)


@pytest.mark.gloo
def test_a_case_found_on_inproc_replays_on_gloo(capsys, tmp_path):
    assert_case_replays_on_gloo(capsys, tmp_path, "tpsim.mutants:embedding_unmasked_ids", "embedding",
                                "forward-equivalence: vocab-mask-missing")


def test_check_case_directly():
    case = CrossEntropyCase(2, 5, (3,), label_smoothing=0.1)
    assert CROSS_ENTROPY.check_case(builtin_variants.vocab_cross_entropy, case, backend="inproc") == []
    assert EMBEDDING.check_case(builtin_variants.vocab_embedding, EmbeddingCase(3, 7, 2, (6,)), backend="inproc") == []


# --- label smoothing over the shard: strict recognisers --------------------------------------------


def test_tpsim_cross_entropy_with_smoothing_passes_at_every_tp_size():
    # The correct cross-entropy must never be named label-smoothing-per-shard (its loss, its grad,
    # its one-id-per-rank cases).
    report = search(builtin_variants.vocab_cross_entropy, max_examples=40, seed=0, world_sizes=(1, 2, 3, 4, 8))
    assert report.passed, [f.describe() for f in report.failures]


def _divides_by_shard_size_minus_one(vocab_parallel_logits, target, label_smoothing=0.0):
    """Megatron's smoothing factor from the shard's size alone (and a correct loss otherwise)."""
    from tpsim.layers import vocab_parallel_cross_entropy

    n = vocab_parallel_logits.shape[-1]
    if label_smoothing > 0:
        label_smoothing * n / (n - 1)  # ZeroDivisionError where each rank owns one id
    return vocab_parallel_cross_entropy(vocab_parallel_logits, target, label_smoothing)


@pytest.mark.parametrize(("vocab", "smoothing", "diagnosis"), [
    (2, 0.1, "label-smoothing-per-shard"),  # one id per rank: the same bug, as a crash
    (4, 0.1, None),  # two ids per rank: the factor is finite (and unused): passes
    (2, 0.0, None),  # no smoothing, no division
])
def test_a_zero_division_is_the_smoothing_bug_only_where_each_rank_owns_one_id(vocab, smoothing, diagnosis):
    variant = cross_entropy_from_function(_divides_by_shard_size_minus_one)
    case = CrossEntropyCase(2, vocab, (3,), "float32", 0, smoothing)
    failures = CROSS_ENTROPY.check_case(variant, case, backend="inproc")
    assert [f.diagnosis for f in failures] == ([diagnosis] if diagnosis else [])
    if diagnosis:
        assert failures[0].property == "forward-equivalence" and "every rank owns one id" in failures[0].message


def test_another_error_where_each_rank_owns_one_id_stays_an_exception():
    def raises(vocab_parallel_logits, target, label_smoothing=0.0):
        raise ValueError("not a division")

    failures = CROSS_ENTROPY.check_case(cross_entropy_from_function(raises), CrossEntropyCase(2, 2, (3,), "float32", 0, 0.1),
                                        backend="inproc")
    assert [f.diagnosis for f in failures] == ["exception"]
