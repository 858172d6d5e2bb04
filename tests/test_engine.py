"""The one property engine (tpsim/props/family.py): what it does once for every family.

A family is a variant type, a case type, a rank function, its registry of checks (property -> check
of one tp group's context) and its diagnoses — the toy ``scale`` family below is all of that in some
sixty lines, and the search, case files, fault
plans and the pytest suite take it as they take tpsim's own. The rest checks what every family gets
from the engine: the properties a family declares are the ones it is tested and reported on,
``--rank-local`` and ``--param-grad`` reach every family, ``--faults`` runs on every family,
``--kind`` lists every family's kinds, Hypothesis's database keys every variant apart.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import pytest
import torch
import torch.distributed as dist
from hypothesis import strategies as st
from hypothesis.database import InMemoryExampleDatabase

from tpsim import builtin_variants
from tpsim.cli import KIND_CHOICES, main
from tpsim.diagnosis import MISMATCH, MISSING_REDUCTION, Diagnosis, Failure
from tpsim.errors import InvalidArgument
from tpsim.mutants import CATALOG
from tpsim.props.case import CaseBase, load_case, save_case
from tpsim.props.family import FAMILIES, Family, World, family_named, kind_choices, register
from tpsim.props.faults import check_faults
from tpsim.props.judging import GroupContext, Replicated, replica_consistency
from tpsim.props.observation import OK, RankOutput
from tpsim.props.property_names import FORWARD, REPLICA
from tpsim.props.rank import enter_rank, rank_phase
from tpsim.props.search import search
from tpsim.props.suite import property_tests
from tpsim.target import resolve_target

# --- a family in a few hooks: y = the sum of x over the tp group ----------------------------------


@dataclass(frozen=True)
class ScaleVariant:
    """``fn(x, group)``: every rank's ``x`` summed over its tp group, on every rank."""

    name: str
    fn: Any
    target: str | None = None
    options: tuple[tuple[str, Any], ...] = ()
    rank_local: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    kind: ClassVar[str] = "scale"
    input: ClassVar[str] = "replicated"
    output: ClassVar[str] = "reduced"
    input_grad: ClassVar[None] = None
    bias: ClassVar[None] = None

    def describe(self) -> str:
        return f"{self.name}: the sum over the tp group"

    def replace(self, **changes: Any) -> ScaleVariant:
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class ScaleCase(CaseBase):
    world_size: int
    size: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"

    family: ClassVar[str] = "scale"
    SIZES: ClassVar[tuple[str, ...]] = ("size",)

    def _largest(self) -> int:
        return self.size * math.prod(self.batch_shape)


def scale_rank(payload: dict[str, Any]) -> RankOutput:
    """The rank function: this rank's input, the variant's sum."""
    this_rank = enter_rank(payload)
    x = this_rank.data[this_rank.group_index][this_rank.rank].clone()
    with rank_phase("forward"):
        out = this_rank.variant.fn(x, this_rank.group)
    result = RankOutput(group=this_rank.group_index, tp_rank=this_rank.rank)
    if not result.unusable(out, x.shape):
        result.output = out.detach().clone()
    return result


def _sum_check(ctx: GroupContext) -> Failure | None:
    """forward-equivalence of a sum: every rank's output is the sum of the group's inputs."""
    xs = [t.double() for t in ctx.obs.data[ctx.group_index]]
    dense = torch.stack(xs).sum(0)
    tol = ctx.tol(torch.stack(xs).abs().sum(0), ctx.tp)
    for r, v in enumerate(ctx.values):
        got = v.output.double() if v.status == OK else None
        if got is not None and bool(((got - dense).abs() <= tol).all()):
            continue
        diagnosis = MISSING_REDUCTION if got is not None and ctx.tp > 1 and torch.equal(got, xs[r]) else MISMATCH
        return ctx.fail(FORWARD, Diagnosis(diagnosis, f"the output on rank {r} is not the sum"), r)
    return None


class _SumContext(GroupContext):
    def replicated(self) -> list[Replicated]:
        return [Replicated("the sum", [v.output for v in self.values])]


class ScaleFamily(Family, name="scale", kinds=("scale",), variant_type=ScaleVariant, case_type=ScaleCase,
                  properties=(FORWARD, REPLICA), subject="a sum"):
    checks = {FORWARD: _sum_check, REPLICA: replica_consistency}  # the registry: property -> check(group)
    context_type = _SumContext

    def cases(self, variant: Any, *, world_sizes: tuple[int, ...], dtypes: tuple[str, ...], **_: Any) -> Any:
        return st.builds(ScaleCase, world_size=st.sampled_from(world_sizes), size=st.integers(1, 3),
                         dtype=st.sampled_from(dtypes), seed=st.integers(0, 9), target=st.just(variant.target),
                         variant=st.just(variant.name))

    def fault_case(self, variant: Any, world_size: int, seed: int) -> ScaleCase:
        return ScaleCase(world_size, 2, seed=seed)

    def world(self, variant: Any, case: ScaleCase, **_: Any) -> World:
        g = torch.Generator().manual_seed(case.seed)
        tp = case.tp_size or case.world_size
        data = [[torch.randn(case.size, generator=g, dtype=torch.float64).to(case.torch_dtype) for _ in range(tp)]
                for _ in range(case.world_size // tp)]
        return World(scale_rank, {"case": case, "data": data}, data)



def _all_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    y = x.clone()
    dist.all_reduce(y, group=group)
    return y


def _forgets_to_reduce(x: torch.Tensor, group: Any) -> torch.Tensor:
    dist.all_reduce(x.clone(), group=group)  # a collective, but its result is dropped
    return x


SCALE = ScaleFamily()


@pytest.fixture
def scale_family():
    register(SCALE)
    yield SCALE
    FAMILIES.pop("scale", None)


def test_a_family_is_its_hooks_and_the_engine_does_the_rest(scale_family, tmp_path) -> None:
    correct, buggy = ScaleVariant("sum", _all_reduce), ScaleVariant("sum_dropped", _forgets_to_reduce)
    assert search(correct, max_examples=20, seed=0, world_sizes=(1, 2, 3)).passed
    report = search(buggy, max_examples=20, seed=0, world_sizes=(1, 2, 3))
    assert [(f.property, f.diagnosis) for f in report.failures] == [("forward-equivalence", "missing-reduction")]
    assert report.failures[0].case.world_size == 2  # shrunk to the smallest world that shows it
    assert set(report.verdicts) == {"forward-equivalence", "replica-consistency"}
    # Its case files replay by family; its faults run beneath its own world; its suite is its properties.
    case, _ = load_case(save_case(report.failures[0].case, str(tmp_path)))
    assert isinstance(case, ScaleCase) and case == report.failures[0].case
    assert [r for r in check_faults(correct, world_sizes=(2,), max_examples=5, timeout=1.0) if not r.ok] == []
    assert sorted(n for n in vars(property_tests(correct)) if n.startswith("test_")) == [
        "test_forward_equivalence", "test_replica_consistency"]


# --- what every family gets ------------------------------------------------------------------------


def test_generated_tests_are_the_properties_each_family_checks() -> None:
    suite = property_tests("tpsim.layers", max_examples=5)
    params = {name: [v.name for v in test.pytestmark[0].args[1]] for name, test in vars(suite).items()
              if name.startswith("test_")}
    # Every generated test can fail: no embedding is tested for training, no attention block for
    # training, no cross-entropy of logits for weight grads.
    assert "VocabParallelEmbedding" not in params["test_training_equivalence"]
    assert "ParallelAttention" not in params["test_training_equivalence"]
    assert "vocab_parallel_cross_entropy" not in params["test_weight_grad_equivalence"]
    assert "vocab_parallel_linear_cross_entropy" in params["test_weight_grad_equivalence"]
    assert "VocabParallelEmbedding" not in params["test_input_grad_equivalence"]
    embedding = property_tests("tpsim.layers:VocabParallelEmbedding", max_examples=5)
    assert sorted(n for n in vars(embedding) if n.startswith("test_")) == [
        "test_divisibility", "test_forward_equivalence", "test_replica_consistency", "test_weight_grad_equivalence"]


def test_a_module_without_a_bias_gets_no_bias_grad_test_or_verdict() -> None:
    # Read off the built module (its parameters), never assumed: a test that cannot fail is not generated.
    (without,) = resolve_target("tests/module_targets.py:UnreducedMLP", kind="module")
    (with_bias,) = resolve_target("tpsim.layers:ParallelMLP(gelu)")
    suite = property_tests([without, with_bias], max_examples=3)
    params = {name: [v.name for v in test.pytestmark[0].args[1]] for name, test in vars(suite).items()
              if name.startswith("test_")}
    assert params["test_bias_grad_equivalence"] == ["ParallelMLP(gelu)"]
    assert "UnreducedMLP" in params["test_weight_grad_equivalence"]
    report = search(without, max_examples=3, seed=0, world_sizes=(1, 2))
    assert report.verdicts["bias-grad-equivalence"]["verdict"] == "not-applicable"


def test_verdicts_name_the_properties_of_the_family() -> None:
    report = search(builtin_variants.vocab_cross_entropy, max_examples=3, seed=0)
    assert list(report.verdicts) == ["forward-equivalence", "input-grad-equivalence", "weight-grad-equivalence",
                                     "replica-consistency"]
    assert report.verdicts["weight-grad-equivalence"]["verdict"] == "not-applicable"


def test_rank_local_and_param_grad_reach_every_family(tmp_path) -> None:
    state = tmp_path / "state.py"
    state.write_text("GROUP = None\n")
    for target in ("tpsim.layers:VocabParallelEmbedding", "tpsim.layers:vocab_parallel_cross_entropy",
                   "tpsim.layers:ParallelAttention", "tpsim.layers:ParallelMLP(gelu)", "tpsim.layers:RowParallelLinear"):
        (variant,) = resolve_target(target, rank_local=(str(state),))
        assert variant.rank_local[-1].startswith("tpsim_target_"), target
    (row,) = resolve_target("tpsim.layers:RowParallelLinear", param_grad=(("bias", "partial"),))
    assert row.param("bias").grad == "partial"
    (mlp,) = resolve_target("tpsim.layers:ParallelMLP(gelu)", kind="module", param_grad=(("fc2.bias", "partial"),))
    assert mlp.param("fc2.bias").grad == "partial"
    # A family whose variants declare no trainer grads refuses the flag, naming why: never dropped.
    for target in ("tpsim.layers:VocabParallelEmbedding", "tpsim.layers:ParallelAttention"):
        with pytest.raises(InvalidArgument, match="--param-grad applies to linear layers and modules"):
            resolve_target(target, param_grad=(("weight", "partial"),))


@pytest.mark.parametrize("variant", [builtin_variants.mlp_gelu, builtin_variants.vocab_embedding,
                                     builtin_variants.vocab_cross_entropy, builtin_variants.attention],
                         ids=lambda v: v.name)
def test_faults_run_on_every_family(variant) -> None:
    reports = check_faults(variant, world_sizes=(2,), max_examples=6, seed=1, timeout=1.0)
    assert len(reports) == 6
    assert [r.message for r in reports if not r.ok] == []
    assert any(r.outcome == "error" for r in reports)  # a fault fired and was reported


def test_kind_choices_come_from_the_families(capsys) -> None:
    assert KIND_CHOICES == kind_choices() == ("column", "row", "module", "embedding", "cross-entropy", "attention")
    assert main(["check", "tpsim.layers:ParallelAttention", "--kind", "attention", "--max-examples", "2",
                 "--world-sizes", "2", "--seed", "0"]) == 0


def test_the_example_database_keeps_each_variant_apart() -> None:
    # (Without a seed: Hypothesis uses no database for a seeded search.)
    db = InMemoryExampleDatabase()
    mutant = next(m for m in CATALOG if m.name == "row-bias-before-reduce").variant
    first = search(mutant, max_examples=100, database=db)
    assert not first.passed
    keys = set(db.data)
    assert keys and all(len(k) > 32 for k in keys)  # prefixed by the variant's digest
    again = search(mutant, max_examples=100, database=db)
    assert again.failures[0].found_after == 1  # the saved failure is replayed first
    other = mutant.replace(name="row_bias_before_reduce_again")  # the same layer under another name
    assert not search(other, max_examples=100, database=db).passed
    new = set(db.data) - keys
    assert new and not {k[:32] for k in new} & {k[:32] for k in keys}


def test_a_family_is_named_in_case_files_and_messages() -> None:
    assert family_named("attention").subject == "an attention block"
    with pytest.raises(InvalidArgument, match="ParallelAttention is an attention block; --input applies to linear layers"):
        resolve_target("tpsim.layers:ParallelAttention", input="sharded")
    assert isinstance(family_named("linear"), Family)
