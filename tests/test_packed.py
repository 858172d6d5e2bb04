"""Packed column weights (gate/up, grouped-query QKV): placements, variants, mutants, CLI options."""

from __future__ import annotations

import json

import pytest
import torch

from tpsim import builtin_variants
from tpsim.cli import main
from tpsim.errors import InvalidArgument
from tpsim.mutants import CATALOG, CORRECT_PACKED_AND_SEQUENCE
from tpsim.placement import Shard, assemble, part_sizes, shard_shape, shard_tensor
from tpsim.props import check_case
from tpsim.props.linear.case import Case
from tpsim.props.search import search

MUTANTS = {m.name: m for m in CATALOG}


def test_packed_shard_holds_the_rank_th_shard_of_every_part_incl_unequal_gqa_parts() -> None:
    # Rows 0..23 of a QKV weight in proportions 8:2:2 -> parts of 16, 4, 4 rows.
    w = torch.arange(24.0).reshape(24, 1)
    placement = Shard(0, parts=(8, 2, 2))
    assert part_sizes(24, placement) == (16, 4, 4)
    for ws in (1, 2, 4):
        pieces = [shard_tensor(w, placement, r, ws) for r in range(ws)]
        for r, piece in enumerate(pieces):
            q, k, v = (16 // ws, 4 // ws, 4 // ws)
            want = [*range(r * q, (r + 1) * q), *range(16 + r * k, 16 + (r + 1) * k), *range(20 + r * v, 20 + (r + 1) * v)]
            assert piece.flatten().tolist() == [float(i) for i in want]
        assert torch.equal(assemble(pieces, placement), w)
    # Sizes that add up to the dim are sizes; a multiple scales them.
    assert part_sizes(12, Shard(0, parts=(8, 2, 2))) == (8, 2, 2)
    assert part_sizes(6, Shard(0, parts=(1, 1))) == (3, 3)


def test_packed_part_not_divisible_is_refused_naming_the_part() -> None:
    with pytest.raises(InvalidArgument, match=r"part 1 \(size 6\) is not divisible by world_size=4"):
        shard_shape((36, 3), Shard(0, parts=(8, 2, 2)), 4)
    with pytest.raises(InvalidArgument, match="the parts add up to 12 but the sharded dim has size 25"):
        shard_shape((25, 3), Shard(0, parts=(8, 2, 2)), 1)


def test_variant_packed_sets_the_weight_bias_and_output_placements() -> None:
    v = builtin_variants.column.replace(packed=(8, 2, 2))
    assert v.param("weight").placement == Shard(0, parts=(8, 2, 2))
    assert v.param("bias").placement == Shard(0, parts=(8, 2, 2))
    assert v.output_placement == Shard(-1, parts=(8, 2, 2))
    assert builtin_variants.column.replace(packed=2).packed == (1, 1)
    with pytest.raises(InvalidArgument, match="column layers only"):
        builtin_variants.row.replace(packed=(1, 1))
    with pytest.raises(InvalidArgument, match="packed="):
        builtin_variants.column.replace(packed=(0, 1))


@pytest.mark.parametrize(
    "variant",
    [builtin_variants.column_gate_up, builtin_variants.column_qkv_gqa, builtin_variants.column_qkv_gathered,
     *CORRECT_PACKED_AND_SEQUENCE[:2]],
    ids=lambda v: v.name,
)
def test_correct_packed_variants_pass(variant) -> None:
    report = search(variant, max_examples=60, seed=3)
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 60


def test_non_divisible_part_case_is_refused_by_the_layer() -> None:
    # gate/up of 3 each at ws=2: the packed 6 divides, the parts do not; the layer must refuse it.
    case = Case(world_size=2, in_features=2, out_features=6, seed=0)
    assert check_case(builtin_variants.column_gate_up, case) == []
    failures = check_case(MUTANTS["packed-divisibility-on-total"].variant, case)
    assert [(f.property, f.diagnosis) for f in failures] == [("divisibility", "divisibility-unchecked")]
    assert "packed part 0=3" in failures[0].message


@pytest.mark.parametrize("name", ["packed-gate-up-contiguous", "packed-qkv-gqa-contiguous", "packed-divisibility-on-total"])
@pytest.mark.parametrize("seed", [0, pytest.param(1, marks=pytest.mark.thorough)])  # seed 1: thorough tier
def test_packed_mutant_is_caught_with_its_intended_diagnosis(name, seed) -> None:
    mutant = MUTANTS[name]
    report = search(mutant.variant, max_examples=200, seed=seed)
    hits = [f for f in report.failures if f.diagnosis == mutant.diagnosis]
    assert hits, (name, [(f.property, f.diagnosis) for f in report.failures])
    assert hits[0].found_after is not None and hits[0].found_after <= 200
    assert hits[0].case.world_size >= 2
    if mutant.diagnosis == "packed-shard-layout":
        assert "contiguous 1/" in hits[0].message and "vllm #3775" in hits[0].message


def test_cli_packed_option(tmp_path, capsys) -> None:
    rc = main(["check", "tpsim.mutants:correct_column", "--packed", "8,2,2", "--world-sizes", "2", "--max-examples", "10",
               "--seed", "0", "--report", "json", "--cases-dir", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert doc["failures"][0]["diagnosis"] == "packed-shard-layout"
    assert doc["failures"][0]["case"]["options"] == {"packed": [8, 2, 2]}
    # The saved case replays (its options come back from JSON as a list).
    assert main(["replay", doc["failures"][0]["case_file"]]) == 1
    assert "packed-shard-layout" in capsys.readouterr().out
    rc = main(["check", "tpsim.layers:ColumnParallelLinear", "--packed", "1"])
    assert rc == 2
    assert "expected K >= 2" in capsys.readouterr().err


@pytest.mark.gloo
def test_packed_mutant_caught_on_gloo() -> None:
    report = search(MUTANTS["packed-gate-up-contiguous"].variant, backend="gloo", world_sizes=(2,), max_examples=5, seed=0)
    assert "packed-shard-layout" in [f.diagnosis for f in report.failures]
    report = search(builtin_variants.column_gate_up, backend="gloo", world_sizes=(2,), max_examples=4, seed=0)
    assert report.passed, [f.describe() for f in report.failures]
