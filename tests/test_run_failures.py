"""How every family observes a run and names what went wrong (tpsim/props/blame.py, launch.py, results.py).

One path for all families: ranks return typed results (dataclasses that survive the isolated
worker), wrap what the variant raises in ``VariantRaised`` — recording, as a declared field, when it
was a collective that could not complete — and the parent names a failed run with one function. A
rank left waiting in a collective is never blamed while another rank raised on its own, died or is
stuck; a dead rank is ``rank-exited``/``rank-crashed`` in every family; a module parameter whose
layout no shape explains is a usage error (exit 2), never a failure; and a target that is slow to
import is imported before the first case, not counted against it.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from helpers import run_cli

import tpsim
from tpsim.props.blame import VariantRaised, refusal_failure, run_failure, variant_raised
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.family import MODULE
from tpsim.props.module.sharding import UnknownLayout
from tpsim.props.observation import RankOutput
from tpsim.props.search import HANG_BUDGET, search
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.props.vocab.family import CROSS_ENTROPY, EMBEDDING
from tpsim.target import resolve_target

# --- rank functions: rank 1 misbehaves while rank 0 goes into an all_reduce ------------------------


def _rank_1(how: str) -> None:
    if how == "raise":
        raise ValueError("rank 1's own bug")
    if how == "refuse":
        raise ValueError("in_features=3 is not divisible by tp_size=2")
    if how == "spin":  # busy in its own code far past the timeout (bounded, in case nothing stops it)
        end = time.monotonic() + 60.0
        while time.monotonic() < end:
            pass


def rank_forward(how: str) -> int:
    """A variant's forward as a family's rank function runs it: rank 1 misbehaves in its own code,
    rank 0 is left waiting in its all_reduce."""
    try:
        if dist.get_rank() == 1:
            _rank_1(how)
        t = torch.ones(2)
        dist.all_reduce(t)
    except Exception as err:
        raise variant_raised("forward", 0, err) from err
    return 0


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_the_rank_that_raised_is_named_not_the_peer_left_waiting(isolate: bool) -> None:
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(rank_forward, 2, args=("raise",), timeout=10.0, isolate=isolate)
    errors = info.value.errors
    # Declared fields, kept across the isolated worker: rank 0 was stopped in a collective, rank 1 was not.
    assert isinstance(errors[0], VariantRaised) and errors[0].collective is not None
    assert errors[0].collective.collective == "all_reduce" and 1 in errors[0].collective.faulty_ranks
    assert isinstance(errors[1], VariantRaised) and errors[1].collective is None
    failure = run_failure("v", None, info.value)
    assert (failure.property, failure.diagnosis, failure.rank) == ("forward-equivalence", "exception", 1)
    assert failure.message == "rank 1 raised during forward (step 0): ValueError: rank 1's own bug"
    assert failure.details["ranks"] == [1] and failure.details["waiting"] == [0]


@pytest.mark.slow
def test_a_rank_that_spins_is_named_stuck_not_the_peer_waiting_for_it() -> None:
    # Isolated: the spinning rank is abandoned with its worker process, which is replaced.
    with pytest.raises(tpsim.CollectiveError) as info:
        tpsim.run(rank_forward, 2, args=("spin",), timeout=1.0, isolate=True)
    failure = run_failure("v", None, info.value)
    assert (failure.diagnosis, failure.rank) == ("exception", 1), failure.message
    assert failure.message.startswith("rank 1 is stuck: it was still running its own code when the world timed out")
    assert failure.details["stuck"] == [1]


def test_a_refusal_counts_only_ranks_that_refused_in_their_own_code() -> None:
    # Rank 0's error is its collective failing because rank 1 refused: that is no refusal of its own.
    with pytest.raises(tpsim.RankError) as info:
        tpsim.run(rank_forward, 2, args=("refuse",), timeout=10.0)
    case = ModuleCase(world_size=2, sizes=(3, 4), seed=0)
    failure = refusal_failure("v", case, info.value, "in_features=3 is not divisible by tp_size=2", [3])
    assert failure is not None and failure.diagnosis == "divisibility-unchecked"
    assert ("the layer did not refuse it on every rank: ranks [1] raised but ranks [0] did not (they failed waiting "
            "in a collective instead); rank 1 raised during ") in failure.message
    # The raising rank's own error is quoted: the waiting rank only echoes it.
    assert failure.message.endswith("ValueError: in_features=3 is not divisible by tp_size=2"), failure.message


def test_variant_raised_keeps_its_declared_fields_when_pickled() -> None:
    try:
        try:
            raise tpsim.CollectiveError("all_reduce #2 on group world: rank 1 left", rank=0, collective="all_reduce",
                                        call_index=2, group="world", faulty_ranks=(1,))
        except tpsim.CollectiveError as stopped:
            raise RuntimeError("a layer wrapping it") from stopped  # found anywhere in the chain
    except RuntimeError as err:
        wrapped = variant_raised("backward", 2, err)
    again = pickle.loads(pickle.dumps(wrapped))
    assert (again.phase, again.step, again.summary) == ("backward", 2, "RuntimeError: a layer wrapping it")
    assert again.collective is not None and (again.collective.call_index, again.collective.faulty_ranks) == (2, (1,))
    assert "a layer wrapping it" in again.traceback_text


# --- every family, end to end ----------------------------------------------------------------------

HOSTILE = '''
"""Correct layers, made to misbehave on rank 1 in their own code."""
import os
import time

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding


class _MLP(nn.Module):
    def __init__(self, hidden, ffn, *, process_group=None):
        super().__init__()
        self.rank = dist.get_rank(process_group)
        self.fc1 = ColumnParallelLinear(hidden, ffn, group=process_group)
        self.fc2 = RowParallelLinear(ffn, hidden, group=process_group)

    def misbehave(self):
        pass

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        if self.rank == 1:
            self.misbehave()  # rank 0 goes on into fc2's all_reduce
        return self.fc2(h)


class RaisesOnRank1(_MLP):
    def misbehave(self):
        raise ValueError("rank 1's own bug")


class SpinsOnRank1(_MLP):
    def misbehave(self):
        end = time.monotonic() + 60.0
        while time.monotonic() < end:
            pass


class SleepsOnRank1(_MLP):
    def misbehave(self):
        time.sleep(1.0)


class ExitsOnRank1(_MLP):
    def misbehave(self):
        os._exit(1)


class ExitsOnRank1Embedding(VocabParallelEmbedding):
    def forward(self, ids):
        if dist.get_rank(self.group) == 1:
            os._exit(1)
        return super().forward(ids)
'''

MODULE_CASE = ModuleCase(world_size=2, sizes=(4, 4), batch_shape=(2,), seed=0)
EMBEDDING_CASE = EmbeddingCase(world_size=2, vocab_size=6, embedding_dim=3, batch_shape=(4,), seed=0)


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    path = tmp_path / "hostile_modules.py"
    path.write_text(HOSTILE)
    return path


@pytest.mark.parametrize("isolate", [False, True], ids=["in-process", "isolated"])
def test_the_module_family_names_the_rank_whose_own_code_raised(hostile: Path, isolate: bool) -> None:
    (variant,) = resolve_target(f"{hostile}:RaisesOnRank1", kind="module")
    (failure,) = MODULE.check_case(variant, MODULE_CASE, isolate=isolate)
    assert (failure.property, failure.diagnosis, failure.rank) == ("forward-equivalence", "exception", 1)
    assert failure.message == "rank 1 raised during forward (step 0): ValueError: rank 1's own bug"


@pytest.mark.slow
def test_the_module_family_names_a_stuck_rank(hostile: Path) -> None:
    (variant,) = resolve_target(f"{hostile}:SpinsOnRank1", kind="module")
    (failure,) = MODULE.check_case(variant, MODULE_CASE, isolate=True, timeout=2.0)
    assert (failure.diagnosis, failure.rank) == ("exception", 1), failure.message
    assert failure.message.startswith("rank 1 is stuck")


def test_shrinking_a_hang_stops_after_its_budget_with_a_note(hostile: Path) -> None:
    # Every case hangs (rank 1 sleeps past the timeout): each shrink attempt would wait out the
    # timeout again. The search stops shrinking once the hung runs took HANG_BUDGET timeouts, and
    # still reports the failure on the smallest case found by then.
    (variant,) = resolve_target(f"{hostile}:SleepsOnRank1", kind="module")
    report = search(variant, world_sizes=(2,), dtypes=("float32",), max_examples=4, seed=0, timeout=0.25)
    assert not report.passed and "rank 1 has been running for over 0.25 s" in report.failures[0].message, (
        report.failures)
    assert any(n.startswith("shrinking stopped after") and "0.25 s timeout" in n for n in report.notes), report.notes
    assert not any("flaky" in n for n in report.notes), report.notes  # the final replay fails from memory
    # Hung runs of at least 0.25 s each: at most HANG_BUDGET + 1 of them, plus the replay from memory.
    assert report.examples <= HANG_BUDGET + 2, report.examples


def test_the_module_family_names_a_dead_rank(hostile: Path) -> None:
    (variant,) = resolve_target(f"{hostile}:ExitsOnRank1", kind="module")
    (failure,) = MODULE.check_case(variant, MODULE_CASE, isolate=True)
    assert (failure.property, failure.diagnosis, failure.rank) == ("forward-equivalence", "rank-exited", 1)
    assert (failure.details["phase"], failure.details["step"], failure.details["exitcode"]) == ("forward", 0, 1)


def test_the_vocab_family_names_a_dead_rank(hostile: Path) -> None:
    (variant,) = resolve_target(f"{hostile}:ExitsOnRank1Embedding", kind="embedding")
    (failure,) = EMBEDDING.check_case(variant, EMBEDDING_CASE, backend="inproc", isolate=True)
    assert (failure.property, failure.diagnosis, failure.rank) == ("forward-equivalence", "rank-exited", 1)
    assert (failure.details["phase"], failure.details["exitcode"]) == ("forward", 1)
    # The correct layer passes on the same case, in the (replaced) worker.
    (correct,) = resolve_target("tpsim.layers:VocabParallelEmbedding")
    assert EMBEDDING.check_case(correct, EMBEDDING_CASE, backend="inproc", isolate=True) == []


@pytest.mark.parametrize(("name", "run"), [
    ("ParallelMLP(gelu)", lambda v: MODULE.check_case(v, MODULE_CASE, isolate=True)),
    ("VocabParallelEmbedding", lambda v: EMBEDDING.check_case(v, EMBEDDING_CASE, backend="inproc", isolate=True)),
    ("vocab_parallel_linear_cross_entropy", lambda v: CROSS_ENTROPY.check_case(
        v, CrossEntropyCase(2, 6, (3,), "float64", 1, 0.1, 0, "mean", hidden=4), backend="inproc", isolate=True)),
])
def test_typed_rank_results_come_back_from_the_isolated_worker(name: str, run) -> None:
    (variant,) = resolve_target(f"tpsim.layers:{name}")
    assert run(variant) == []


def test_every_rank_result_is_a_dataclass_with_the_common_head() -> None:
    from tpsim.props.attention.world import AttentionRankResult
    from tpsim.props.linear.world import RankResult
    from tpsim.props.module.world import ModuleRankResult
    from tpsim.props.vocab.world import CrossEntropyRankResult, EmbeddingRankResult

    for cls in (RankResult, ModuleRankResult, EmbeddingRankResult, CrossEntropyRankResult, AttentionRankResult):
        assert dataclasses.is_dataclass(cls) and issubclass(cls, RankOutput), cls
        pickle.loads(pickle.dumps(cls()))  # plain data: gloo workers and the isolated worker send it


# --- a layout shapes cannot explain is a usage error -------------------------------------------------

GQA_BLOCK = '''
from torch import nn

from tpsim.layers import ParallelAttention


class GQAAttention(nn.Module):
    """A correct GQA block: one key/value head, replicated on every rank of the tp group."""

    def __init__(self, hidden, num_heads, *, process_group=None, dtype=None):
        super().__init__()
        self.attn = ParallelAttention(hidden, num_heads, 1, head_dim=2, group=process_group, dtype=dtype)

    def forward(self, x):
        return self.attn(x.unsqueeze(0)).squeeze(0) if x.dim() == 1 else self.attn(x)
'''


def test_a_gqa_block_with_replicated_key_value_heads_is_a_usage_error_not_a_failure(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "gqa_block.py"
    path.write_text(GQA_BLOCK)
    # The check itself: shapes at tp 1 and 2 cannot say how the packed Q/K/V rows are laid out.
    (variant,) = resolve_target(f"{path}:GQAAttention", kind="module")
    with pytest.raises(UnknownLayout) as info:
        MODULE.check_case(variant, ModuleCase(world_size=2, sizes=(4, 2), batch_shape=(3,), seed=0))
    err = info.value
    assert (err.param, err.shape, err.full, err.tp_size) == ("attn.qkv.weight", (6, 4), (8, 4), 2)
    assert isinstance(err, tpsim.InvalidArgument)
    # The CLI: exit 2 (never 1), naming the parameter, both shapes and both ways forward.
    code, out, err_text = run_cli(capsys, "check", f"{path}:GQAAttention", "--kind", "module", "--max-examples", "30",
                                  "--world-sizes", "1,2,4", "--seed", "0", "--cases-dir", str(tmp_path / "cases"))
    assert code == 2, out + err_text
    assert "parameter 'attn.qkv.weight' has shape [" in err_text and "in the dense module" in err_text
    assert "ModuleVariant(params=(ParamSpec('attn.qkv.weight', 'weight'," in err_text
    assert "--kind attention" in err_text
    assert not (tmp_path / "cases").exists() or not any((tmp_path / "cases").iterdir())


# --- a slow import is not part of a case --------------------------------------------------------------

SLOW_IMPORT = '''
"""Correct layers in a module that takes seconds to import (as Megatron-core does on a loaded machine)."""
import time

from tpsim.layers import VocabParallelEmbedding

time.sleep({seconds})


class SlowEmbedding(VocabParallelEmbedding):
    """A correct embedding."""
'''


@pytest.mark.slow
def test_a_target_slower_to_import_than_the_timeout_is_imported_before_the_first_case(tmp_path: Path) -> None:
    (plain,) = resolve_target("tpsim.layers:VocabParallelEmbedding")
    # The isolated worker exists (and has run an embedding) before the slow target is imported here, so
    # it has to import the target itself.
    assert EMBEDDING.check_case(plain, EMBEDDING_CASE, backend="inproc", isolate=True) == []
    path = tmp_path / "slow_targets.py"
    path.write_text(SLOW_IMPORT.format(seconds=8.0))
    (slow,) = resolve_target(f"{path}:SlowEmbedding", kind="embedding")
    # 8 s of import against a 2 s timeout (the world gives up after 4 s): only a warm worker passes.
    assert EMBEDDING.check_case(slow, EMBEDDING_CASE, backend="inproc", isolate=True, timeout=2.0) == []
