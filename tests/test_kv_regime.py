"""Packed Q/K/V weights with fewer key/value heads than ranks (vLLM's ``QKVParallelLinear``).

``Shard(0, parts=(q, k, v), head_size=d)`` (``Variant(packed=..., head_size=d)``) shards query heads
and replicates a key/value part in groups when it has fewer heads than ranks: rank ``r`` holds head
``r * num_kv_heads // tp``. The search draws fewer, as many and more key/value heads than ranks (a
cover bucket each, the attention family's ``kv-heads`` words), and checks every rank against the
replica-expanded dense twin (tpsim.props.linear.world.expanded_out_features): a replica's grad is its own
query heads' share, and the master's grad of a key/value row is the sum over its replicas. The
weight's ParamSpec.grad says who takes that sum: "partial" (vLLM), the trainer, before each SGD step;
"complete" (tpsim's own QKVParallelLinear), the layer. Either way every replica trains like the
master's head. The
layers are tests/wild/vllm_qkv.py, written in vLLM's style.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from hypothesis import HealthCheck, Phase, find, settings
from hypothesis.errors import NoSuchExample

from tpsim.cli import main
from tpsim.errors import InvalidArgument
from tpsim.placement import Shard, assemble, replica_expanded, replicated_parts, shard_shape, shard_tensor
from tpsim.props import check_case
from tpsim.props.cover import cover_cases
from tpsim.props.family import family_of
from tpsim.props.linear.case import Case
from tpsim.props.linear.family import LINEAR
from tpsim.props.linear.world import expanded_out_features, make_masters, non_divisible_sizes
from tpsim.props.search import search
from tpsim.target import resolve_target

WILD = "tests/wild/vllm_qkv.py"


def _variant(name: str):
    (variant,) = resolve_target(f"{WILD}:{name}")
    return variant


def _heads(variant, case: Case) -> tuple[int, int]:
    """(query heads, key/value heads) of a case of a (2, 1, 1) head-packed variant."""
    q, k, _ = (p // variant.head_size for p in (case.out_features // 2, case.out_features // 4, 0))
    return q, k


# --- the placement ------------------------------------------------------------------------------------


def test_head_packed_shard_replicates_kv_heads_below_the_tp_size() -> None:
    # 8 query heads, 2 key/value heads of 2 rows: rows 0-15 Q, 16-19 K (heads 0, 1), 20-23 V.
    w = torch.arange(24.0).reshape(24, 1)
    placement = Shard(0, parts=(4, 1, 1), head_size=2)
    q_rows = lambda r, ws: list(range(r * 16 // ws, (r + 1) * 16 // ws))  # noqa: E731
    for ws in (1, 2, 4, 8):
        pieces = [shard_tensor(w, placement, r, ws) for r in range(ws)]
        for r, piece in enumerate(pieces):
            if ws <= 2:  # whole heads: rank r's block of each part
                kv = [*range(16 + r * 4 // ws, 16 + (r + 1) * 4 // ws), *range(20 + r * 4 // ws, 20 + (r + 1) * 4 // ws)]
            else:  # fewer key/value heads than ranks: head r * 2 // ws, replicated on ws // 2 ranks
                h = r * 2 // ws
                kv = [16 + 2 * h, 17 + 2 * h, 20 + 2 * h, 21 + 2 * h]
            assert piece.flatten().int().tolist() == q_rows(r, ws) + kv, (ws, r)
            assert tuple(piece.shape) == shard_shape((24, 1), placement, ws)
        assert torch.equal(assemble(pieces, placement), w)
        assert replicated_parts(24, placement, ws) == (False, ws > 2, ws > 2)
    expanded = replica_expanded(w, placement, 4)
    assert expanded.flatten().int().tolist() == [0, 1, 2, 3, 16, 17, 20, 21, 4, 5, 6, 7, 16, 17, 20, 21,
                                                 8, 9, 10, 11, 18, 19, 22, 23, 12, 13, 14, 15, 18, 19, 22, 23]
    assert str(placement) == "S(0,parts=[4, 1, 1],head_size=2)"


def test_head_packed_shard_refuses_heads_the_tp_size_cannot_split_naming_them() -> None:
    placement = Shard(0, parts=(2, 1, 1), head_size=2)
    with pytest.raises(InvalidArgument, match=r"part 1 \(size 6\): its 3 key/value heads and world_size=2 do not divide"):
        shard_shape((24, 1), placement, 2)
    with pytest.raises(InvalidArgument, match=r"part 0 \(size 4\): its 2 query heads are not divisible by world_size=4"):
        shard_tensor(torch.zeros(8, 1), placement, 0, 4)
    with pytest.raises(InvalidArgument, match=r"part 1 \(size 3\) is not a whole number of heads of head_size=2"):
        shard_shape((12, 1), placement, 1)
    with pytest.raises(InvalidArgument, match=r"head_size=0\): head_size must be an int >= 1"):
        Shard(0, parts=(2, 1, 1), head_size=0)
    with pytest.raises(InvalidArgument, match="head_size needs packed parts"):
        Shard(0, head_size=2)


def test_variant_head_size_sets_the_placements_and_builder_keywords() -> None:
    v = _variant("correct")
    assert (v.packed, v.head_size) == ((2, 1, 1), 2)
    assert v.param("weight").placement == Shard(0, parts=(2, 1, 1), head_size=2)
    assert v.output_placement == Shard(-1, parts=(2, 1, 1), head_size=2)
    assert v.layout_kwargs(16) == {"parts": (8, 4, 4), "head_size": 2}
    with pytest.raises(InvalidArgument, match="head_size=2 needs packed Q/K/V proportions"):
        v.replace(packed=None, params=None, head_size=2)
    with pytest.raises(InvalidArgument, match=r"Variant 'vllm_qkv': Shard\(head_size=2, parts=\(4,\)\): head_size needs"):
        v.replace(packed=(4,), head_size=2)


def test_reports_note_the_head_layout_and_its_grad_rule() -> None:
    (note,) = [n for n in LINEAR.notes(_variant("correct")) if "by heads" in n]
    assert note == ("vllm_qkv packs Q/K/V [2, 1, 1] by heads of 2 rows: key/value heads fewer than ranks are replicated "
                    "(rank r holds head r*heads//tp); each replica's grad of weight, bias is its own share, summed by "
                    "the trainer")
    assert "the layer sums the shares" in " ".join(LINEAR.notes(_variant("summed_replica_grad_complete")))


def test_the_rule_a_replicas_grad_is_its_own_share_and_the_master_grad_their_sum() -> None:
    # 4 query heads, 2 key/value heads of 2 rows on 4 ranks: ranks 0, 1 hold head 0 and ranks 2, 3 head 1.
    variant = _variant("correct")
    case = Case(world_size=4, in_features=3, out_features=16, batch_shape=(2,), bias=True, seed=5)
    width = 2 + 2 + 2  # per rank: 1 query head, its K head, its V head
    assert expanded_out_features(variant, case) == 4 * width
    obs = LINEAR.observe(variant, case, backend="inproc", timeout=60)
    m = make_masters(case, expanded_out_features(variant, case))
    x, g = m.inputs[0].double(), m.grads[0].double()  # g: every rank's own columns, side by side
    shares = [v.grads["weight"][2:].double() for v in obs.values]  # each rank's K/V rows' grad
    for head, replicas in ((0, (0, 1)), (1, (2, 3))):
        # Each replica got its own upstream grad for the head, so the shares differ ...
        assert not torch.allclose(shares[replicas[0]], shares[replicas[1]])
        # ... and the dense grad of the master's K/V rows of the head (upstream: the replicas' summed) is their sum.
        upstream = sum(g[:, r * width + 2: (r + 1) * width] for r in replicas)
        dense = torch.cat([upstream[:, :2].t() @ x, upstream[:, 2:].t() @ x])
        torch.testing.assert_close(sum(shares[r] for r in replicas), dense, rtol=0, atol=1e-12)
        # The trainer sums the shares before each step, so both replicas train alike, like the master's head.
        finals = [obs.values[r].final["weight"][2:] for r in replicas]
        assert torch.equal(finals[0], finals[1])
        w0 = torch.cat([m.weight[8 + 2 * head: 10 + 2 * head], m.weight[12 + 2 * head: 14 + 2 * head]])
        assert not torch.allclose(finals[0], w0)  # it did train
    assert not torch.allclose(obs.values[0].final["weight"][2:], obs.values[2].final["weight"][2:])
    assert check_case(variant, case) == []


def test_non_divisible_heads_are_named() -> None:
    variant = _variant("correct")
    case = Case(world_size=2, in_features=3, out_features=24, seed=0)  # 3 key/value heads on 2 ranks
    assert non_divisible_sizes(variant, case) == {"packed part 1 (3 heads of head_size=2)": 3,
                                                  "packed part 2 (3 heads of head_size=2)": 3}
    assert check_case(variant, case) == []  # the layer refuses them on every rank


# --- the search ---------------------------------------------------------------------------------------


def _drawn(variant, world_sizes, n: int = 200) -> set[tuple[int, int]]:
    strategy = LINEAR.cases(variant, world_sizes=world_sizes, dtypes=("float64",), non_divisible=True,
                            tp_sizes=None, subgroups=False, layouts=("contiguous",))
    seen = set()

    def record(case) -> bool:  # never holds: every case the run generates is recorded
        if family_of(variant).divisible(variant, case):
            seen.add((case.world_size, _heads(variant, case)[1]))
        return False

    with pytest.raises(NoSuchExample):
        find(strategy, record, random=random.Random(0), settings=settings(
            max_examples=n, phases=[Phase.generate], database=None, suppress_health_check=list(HealthCheck)))
    return seen


def test_search_draws_fewer_as_many_and_more_kv_heads_than_ranks() -> None:
    seen = _drawn(_variant("correct"), (1, 2, 4, 8))
    assert {kv for _, kv in seen} >= {1, 2, 4}
    assert any(kv < ws for ws, kv in seen) and any(kv == ws for ws, kv in seen) and any(kv > ws for ws, kv in seen)
    assert any(1 < kv < ws for ws, kv in seen)  # several heads, each replicated


@pytest.mark.parametrize("seed", range(5))
def test_cover_phase_fills_every_kv_regime_at_every_seed(seed) -> None:
    variant = _variant("correct")
    family = family_of(variant)
    strategy = family.cases(variant, world_sizes=(1, 2, 4, 8), dtypes=("float64",), non_divisible=True,
                            tp_sizes=None, subgroups=False, layouts=("contiguous",))
    seen: set = set()

    def keys_of(case):
        keys = family.cover_keys(variant, case, (1, 2, 4, 8))
        seen.update(k for k in keys if k[0] == "kv-heads")
        return keys

    cover_cases(strategy, keys_of, seed=seed, limit=100)
    assert {k[1] for k in seen} >= {"replicated, one", "replicated, several", "1 per rank", "2 per rank"}


def test_correct_layer_passes_on_1_2_4_8_ranks() -> None:
    report = search(_variant("correct"), world_sizes=(1, 2, 4, 8), max_examples=60, seed=0)
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 60


@pytest.mark.parametrize("seed", range(5))
def test_round_robin_kv_heads_are_caught_and_named_at_every_seed(seed) -> None:
    # Default world sizes and dtypes. A first failing case may be in bfloat16, where the wrong heads' output
    # stays within the forward's bound and only the grads fail (mismatch); its shrunk float64 case is named.
    report = search(_variant("round_robin"), max_examples=100, seed=seed)
    assert not report.passed and report.failures[0].found_after <= 100
    hits = [f for f in report.failures if f.diagnosis == "kv-heads-not-replicated"]
    assert hits, (seed, [(f.property, f.diagnosis) for f in report.failures])
    assert "round robin" in hits[0].message and hits[0].case.world_size >= 4


def test_round_robin_failure_shrinks_to_two_kv_heads_on_four_ranks() -> None:
    report = search(_variant("round_robin"), world_sizes=(1, 2, 4), max_examples=100, seed=0)
    hit = next(f for f in report.failures if f.diagnosis == "kv-heads-not-replicated")
    assert (hit.case.world_size, hit.case.out_features, _heads(_variant("round_robin"), hit.case)) == (4, 16, (4, 2))
    assert hit.details["held"] == [0, 1, 0, 1] and hit.details["expected"] == [0, 0, 1, 1]


def test_replicating_kv_heads_when_there_are_enough_is_caught() -> None:
    report = search(_variant("always_replicated"), world_sizes=(1, 2, 4), max_examples=100, seed=0)
    shape = [f for f in report.failures if f.diagnosis == "shape-error"]
    assert shape and "parameter 'weight' has shape" in shape[0].message, [f.describe() for f in report.failures]
    assert _heads(_variant("always_replicated"), shape[0].case)[1] > shape[0].case.world_size


def test_summing_a_replicated_heads_grad_over_its_replicas_is_caught() -> None:
    # The layer completes the grad itself (the trainer's job here): each replica's grad is then the sum of
    # the shares, not its own, and after the trainer's sum it trains tp / num_kv_heads times too far.
    variant = _variant("summed_replica_grad")
    case = Case(world_size=4, in_features=3, out_features=16, batch_shape=(2,), bias=False, seed=5)
    failures = check_case(variant, case)
    assert [f.property for f in failures] == ["weight-grad-equivalence"], [f.describe() for f in failures]
    # Trained with that grad, the replicas drift too: a consequence of the same cause.
    assert [c.property for c in failures[0].consequences] == ["training-equivalence"]


def test_the_grad_rule_follows_the_declaration_complete_or_partial() -> None:
    # ParamSpec(grad="complete"): every replica must hold the head's whole grad (the layer sums the shares).
    case = Case(world_size=4, in_features=3, out_features=16, batch_shape=(2,), bias=True, seed=5)
    failures = check_case(_variant("correct_declared_complete"), case)  # leaves its shares partial
    assert {f.property for f in failures} >= {"weight-grad-equivalence", "bias-grad-equivalence"}, \
        [f.describe() for f in failures]
    report = search(_variant("summed_replica_grad_complete"), world_sizes=(1, 2, 4, 8), max_examples=40, seed=1)
    assert report.passed, [f.describe() for f in report.failures]
    assert check_case(_variant("correct"), case) == []


@pytest.mark.gloo
@pytest.mark.slow
def test_correct_layer_replays_on_gloo() -> None:
    variant = _variant("correct")
    case = Case(world_size=4, in_features=3, out_features=16, batch_shape=(2,), bias=True, seed=1)  # 2 kv heads, 4 query heads
    assert expanded_out_features(variant, case) is not None
    assert check_case(variant, case, backend="gloo") == []
    failures = check_case(_variant("round_robin"), case, backend="gloo")
    assert failures and failures[0].diagnosis == "kv-heads-not-replicated"


def test_cli_head_size_option(tmp_path, capsys) -> None:
    # The round-robin layer declared without head_size: --packed/--head-size declare it on the command line.
    rc = main(["check", f"{WILD}:round_robin_undeclared", "--packed", "2,1,1", "--head-size", "2", "--world-sizes", "4",
               "--max-examples", "30", "--seed", "0", "--report", "json", "--cases-dir", str(tmp_path)])
    doc = json.loads(capsys.readouterr().out)
    assert rc == 1
    failure = doc["failures"][0]
    assert failure["diagnosis"] == "kv-heads-not-replicated"
    assert failure["case"]["options"] == {"packed": [2, 1, 1], "head_size": 2}
    assert main(["replay", failure["case_file"]]) == 1  # its options come back from JSON
    assert "kv-heads-not-replicated" in capsys.readouterr().out
    assert main(["check", f"{WILD}:round_robin_undeclared", "--head-size", "0"]) == 2
    assert "invalid value '0' for --head-size; expected an int >= 1" in capsys.readouterr().err
