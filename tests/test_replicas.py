"""Replica consistency at construction: every rank is seeded alike before the build, and
replicated parameters a layer initialises itself must be bit-identical across its tp group right
after construction, before the harness loads the master values."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tpsim.mutants import correct_tp_rank_row, row_replica_init_diverges, tp_rank_variant
from tpsim.mutants.tp_rank import CorrectTpRankRow
from tpsim.props import check_case
from tpsim.props.linear.case import Case
from tpsim.props.search import search


class SeededRandomBiasRow(CorrectTpRankRow):
    """A correct layer with a *random* replicated bias drawn from the global RNG: every rank was
    seeded alike, so every rank draws the same values."""

    def __init__(self, in_features: int, out_features: int, tp_size: int, tp_rank: int, tp_group: Any = None,
                 bias: bool = False):
        super().__init__(in_features, out_features, tp_size, tp_rank, tp_group=tp_group, bias=bias)
        if self.bias is not None:
            with torch.no_grad():
                self.bias.uniform_(-0.1, 0.1)


seeded_random_bias_row = tp_rank_variant(SeededRandomBiasRow, "row", name="seeded_random_bias_row").replace(
    target=None)

CASE = Case(world_size=2, in_features=4, out_features=3, batch_shape=(2,), bias=True, seed=4)


@pytest.mark.parametrize("variant", [correct_tp_rank_row, seeded_random_bias_row], ids=lambda v: v.name)
def test_a_correctly_seeded_variant_passes(variant) -> None:
    assert check_case(variant, CASE) == []
    assert check_case(variant, CASE.replace(world_size=4, tp_size=2, tp_layout="strided")) == []


def test_a_rank_dependent_init_is_a_replica_divergence() -> None:
    failures = check_case(row_replica_init_diverges, CASE)
    # The harness loads master values afterwards: only the construction check sees the bug.
    assert [(f.property, f.diagnosis) for f in failures] == [("replica-consistency", "replica-divergence")]
    f = failures[0]
    assert f.details["param"] == "bias" and f.details["ranks"] == [1]
    assert "parameter 'bias' (R) right after construction" in f.message and "ranks [1]" in f.message
    assert "torch.manual_seed(4)" in f.message
    # In tp groups smaller than the world, the group and its global ranks are named.
    f = check_case(row_replica_init_diverges, CASE.replace(world_size=4, tp_size=2, tp_layout="strided"))[0]
    assert f.diagnosis == "replica-divergence" and f.details["group_ranks"] == [0, 2] and f.rank == 2
    # Without a bias nothing replicated is initialised: nothing to diverge.
    assert check_case(row_replica_init_diverges, CASE.replace(bias=False)) == []


def test_search_finds_it() -> None:
    report = search(row_replica_init_diverges, max_examples=100, seed=0)
    assert "replica-divergence" in {f.diagnosis for f in report.failures}


@pytest.mark.gloo
def test_replicas_on_gloo() -> None:
    assert check_case(correct_tp_rank_row, CASE, backend="gloo", timeout=30) == []
    failures = check_case(row_replica_init_diverges, CASE, backend="gloo", timeout=30)
    assert [f.diagnosis for f in failures] == ["replica-divergence"]
