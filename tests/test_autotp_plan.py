"""DeepSpeed AutoTP as a plan: ``tpsim check MODULE:DenseClass --plan tpsim.presets.deepspeed:autotp``.

DeepSpeed's own AutoTP partitioning (its policy choosing ``LinearLayer`` / ``LinearAllreduce``) is
applied to a dense MLP over the case's tp group and checked against the dense MLP: Hugging Face's
``LlamaMLP`` and a plain gated MLP pass on contiguous inputs, at sizes AutoTP splits unevenly too;
the library's own finding (the input grad of a non-contiguous input is not reduced by
``LinearLayer``) is reported on the sublayer it reaches first; seeded bugs are named with their
path; a module AutoTP has no policy for is reported, not passed as the dense module it would stay."""

from __future__ import annotations

import json
import pathlib

import pytest

from tpsim.cli import main
from tpsim.diagnosis import BIAS_DUPLICATION, GRAD_NOT_REDUCED
from tpsim.props.family import family_of
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.plans import PlanVariant
from tpsim.props.search import search
from tpsim.target import resolve_target

pytest.importorskip("deepspeed")

ROOT = pathlib.Path(__file__).resolve().parent.parent
TARGETS = "tests/autotp_targets.py"
AUTOTP = "tpsim.presets.deepspeed:autotp"
FAST = ["--max-examples", "6", "--world-sizes", "1,2,4", "--seed", "0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.fixture
def check(capsys, tmp_path):
    """``check(target, *options)`` -> (exit code, JSON report)."""

    def run(target: str, *options: str) -> tuple[int, dict]:
        code = main(["check", target, *FAST, *options, "--report", "json", "--cases-dir", str(tmp_path)])
        out = capsys.readouterr().out
        return code, json.loads(out)

    return run


def _variant(dense: str, plan: str = AUTOTP) -> PlanVariant:
    (variant,) = resolve_target(f"{TARGETS}:{dense}", plan=plan)
    return variant


def _causes(doc: dict) -> list[tuple[str | None, str, str]]:
    return [(f["sublayer"], f["property"], f["diagnosis"]) for f in doc["failures"]]


def test_the_plan_declares_deepspeed_state_rank_local_and_uneven_sizes_as_cases() -> None:
    variant = _variant("GatedMLP")
    assert isinstance(variant, PlanVariant) and variant.uneven_sizes_are_cases
    for module in ("deepspeed.comm.comm", "deepspeed.module_inject.layers", "deepspeed.utils.groups"):
        assert module in variant.rank_local, variant.rank_local
    notes = family_of(variant).notes(variant)
    assert any("torch.tensor_split pieces" in n and "must be exact" in n for n in notes), notes


@pytest.mark.parametrize("dense", ["GatedMLP", "LlamaMLPTiny"])
def test_a_correct_mlp_passes_on_contiguous_inputs(dense) -> None:
    drawn: list[ModuleCase] = []
    report = search(_variant(dense), max_examples=6, world_sizes=(1, 2, 4), seed=0, layouts=("contiguous",),
                    on_example=lambda n, case: drawn.append(case))
    assert report.passed, [(f.sublayer, f.property, f.diagnosis, f.message) for f in report.failures]
    assert report.examples >= 6
    assert {c.input_layout for c in drawn} == {"contiguous"}
    # AutoTP's uneven splits are among the cases, not left out
    assert any(s % (c.tp_size or c.world_size) for c in drawn for s in c.sizes), [c.sizes for c in drawn]


@pytest.mark.parametrize("world_size, sizes, tp_size", [(4, (4, 7), None), (2, (3, 5), None), (4, (5, 3), 2)])
def test_sizes_autotp_splits_unevenly_are_exact(world_size, sizes, tp_size) -> None:
    variant = _variant("LlamaMLPTiny")
    case = ModuleCase(world_size=world_size, tp_size=tp_size, sizes=sizes, batch_shape=(3,), seed=1,
                      size_names=variant.sizes, target=variant.target, variant=variant.name, options=variant.options)
    assert family_of(variant).check_case(variant, case) == []


def test_the_library_finding_a_non_contiguous_input_grad_is_not_reduced(check) -> None:
    # LinearLayer's backward all-reduces grad_output.contiguous(), a copy when the grad is not
    # contiguous, and returns the unreduced grad (tests/test_presets_deepspeed.py, single layer).
    code, doc = check(f"{TARGETS}:LlamaMLPTiny", "--plan", AUTOTP)
    assert code == 1
    assert _causes(doc) == [("gate_proj", "input-grad-equivalence", GRAD_NOT_REDUCED)], json.dumps(doc["failures"])
    assert doc["failures"][0]["case"]["input_layout"] != "contiguous"


@pytest.mark.slow
def test_a_row_layer_adding_its_bias_before_the_reduction_is_named(check) -> None:
    code, doc = check(f"{TARGETS}:GatedMLP", "--plan", f"{TARGETS}:autotp_bias_before_reduce")
    assert code == 1
    assert ("down_proj", "forward-equivalence", BIAS_DUPLICATION) in _causes(doc), json.dumps(doc["failures"])


def test_a_projection_the_policy_makes_column_parallel_is_named(check) -> None:
    # `out` is neither a row-parallel name nor followed by a LayerNorm: its output stays sharded.
    code, doc = check(f"{TARGETS}:MLPWithOutput", "--plan", AUTOTP)
    assert code == 1
    assert _causes(doc) == [("after out", "forward-equivalence", "shape-error")], json.dumps(doc["failures"])


def test_a_module_autotp_has_no_policy_for_is_reported_not_passed(check) -> None:
    code, doc = check(f"{TARGETS}:NoRowMLP", "--plan", AUTOTP)
    assert code == 1
    messages = [f["message"] for f in doc["failures"]]
    assert any("DeepSpeed AutoTP cannot shard NoRowMLP" in m and "down_proj, o_proj or out_proj" in m
               for m in messages), messages


@pytest.mark.gloo
@pytest.mark.slow
def test_autotp_plan_passes_on_gloo(check) -> None:
    code, doc = check(f"{TARGETS}:GatedMLP", "--plan", AUTOTP, "--backend", "gloo", "--max-examples", "2",
                      "--world-sizes", "2", "--dtypes", "float64", "--timeout", "60")
    # gloo draws every layout: the library's non-contiguous finding may be among them, nothing else.
    assert code in (0, 1)
    assert all(c == ("gate_proj", "input-grad-equivalence", GRAD_NOT_REDUCED) for c in _causes(doc)), doc["failures"]
