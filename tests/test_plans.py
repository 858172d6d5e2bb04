"""Plans as targets: ``tpsim check MODULE:DenseClass --plan MODULE:PLAN``.

A correct plan (DTensor styles, Hugging Face style strings, a function, sequence parallelism) passes
against its dense module; a buggy plan is caught with the path of the entry at fault, confirmed by a
twin plan that changes only that entry; modules with DTensor parameters and DTensor outputs are
loaded and read in their own placements; bad plans are usage errors (exit 2)."""

from __future__ import annotations

import json
import pathlib

import pytest

from tpsim.cli import main
from tpsim.props.module.plans import PlanVariant, twin_plans
from tpsim.target import resolve_target

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = "examples/plan_mlp.py"
TARGETS = "tests/plan_targets.py"
FAST = ["--max-examples", "8", "--world-sizes", "1,2,4", "--seed", "0"]
SP = ["--input", "sequence-sharded", "--output", "sequence-sharded", "--sequence-dim", "1"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.fixture
def check(capsys, tmp_path):
    """``check(target, *options)`` -> (exit code, JSON report or the error text)."""

    def run(target: str, *options: str) -> tuple[int, dict | str]:
        code = main(["check", target, *FAST, *options, "--report", "json", "--cases-dir", str(tmp_path)])
        captured = capsys.readouterr()
        return code, json.loads(captured.out) if code in (0, 1) else captured.err

    return run


def _causes(doc: dict) -> list[tuple[str | None, str]]:
    return [(f["sublayer"], f["diagnosis"]) for f in doc["failures"]]


@pytest.mark.parametrize("plan, extra", [
    ("PLAN", []),
    ("HF_PLAN", []),
    ("parallelize", []),
    ("SP_PLAN", SP),
])
def test_correct_plans_pass(check, plan, extra) -> None:
    target = f"{EXAMPLE}:{'NormMLP' if plan == 'SP_PLAN' else 'GatedMLP'}"
    code, doc = check(target, "--plan", f"{EXAMPLE}:{plan}", *extra)
    assert code == 0, json.dumps(doc["failures"], indent=1)
    (variant,) = doc["variants"]
    assert variant["examples"] >= 8
    # sizes read from the dense constructor; DTensor's uneven shards by design leave divisibility out
    assert any("divisibility property does not apply" in n for n in variant["notes"]), variant["notes"]


def test_dtensor_output_is_read_as_its_full_tensor(check) -> None:
    code, doc = check(f"{EXAMPLE}:GatedMLP", "--plan", f"{TARGETS}:DTENSOR_OUT")
    assert code == 0, json.dumps(doc["failures"], indent=1)


def test_module_with_dtensor_parameters_passes(check) -> None:
    # A plain ModuleVariant whose builder parallelises itself: its DTensor parameters are loaded with
    # their own pieces, its grads read in their placements (no mixed Tensor/DTensor copy).
    code, doc = check(f"{TARGETS}:DTENSOR_PARAMS")
    assert code == 0, json.dumps(doc["failures"], indent=1)


@pytest.mark.parametrize("target, plan, extra, expected", [
    (f"{EXAMPLE}:GatedMLP", f"{EXAMPLE}:BUGGY_PLAN", [], ("down_proj", "wrong-shard-dim")),
    (f"{EXAMPLE}:GatedMLP", f"{TARGETS}:HF_DOWN_COLWISE", [], ("down_proj", "wrong-shard-dim")),
    (f"{EXAMPLE}:GatedMLP", f"{TARGETS}:HF_GATE_ROWWISE", [], ("gate_proj", "wrong-shard-dim")),
    (f"{EXAMPLE}:NormMLP", f"{EXAMPLE}:BUGGY_SP_PLAN", SP, ("mlp", "plan-input-layout")),
])
def test_buggy_plans_are_named_with_their_path(check, target, plan, extra, expected) -> None:
    code, doc = check(target, "--plan", plan, *extra)
    assert code == 1
    assert _causes(doc) == [expected], json.dumps(doc["failures"], indent=1)
    (failure,) = doc["failures"]
    assert "(nothing else changed) the case passes" in failure["message"] or "it passes" in failure["message"]


@pytest.mark.slow
def test_replicated_dtensor_parameters_must_agree_across_ranks(check) -> None:
    code, doc = check(f"{EXAMPLE}:NormMLP", "--plan", f"{TARGETS}:rank_skewed_norm", *SP)
    assert code == 1
    diagnoses = [f["diagnosis"] for f in doc["failures"]]
    assert "replica-divergence" in diagnoses, json.dumps(doc["failures"], indent=1)
    assert any("norm.weight right after construction" in f["message"] for f in doc["failures"])


@pytest.mark.parametrize("plan, message", [
    (f"{TARGETS}:NOT_A_PLAN", "expected a dict of parallel styles"),
    (f"{TARGETS}:nothing_here", "has no attribute 'nothing_here'"),
    ("no_colon", "expected MODULE:NAME"),
])
def test_bad_plans_are_usage_errors(check, plan, message) -> None:
    code, err = check(f"{EXAMPLE}:GatedMLP", "--plan", plan)
    assert code == 2
    assert message in err, err


def test_plan_on_a_parallel_variant_is_refused(check) -> None:
    code, err = check(f"{TARGETS}:DTENSOR_PARAMS", "--plan", f"{EXAMPLE}:PLAN")
    assert code == 2
    assert "--plan applies to a dense nn.Module class" in err, err


@pytest.mark.parametrize("plan", ["TYPO", "TORCH_TYPO"])
def test_plan_entry_naming_nothing_is_reported_with_its_name(check, plan) -> None:
    code, doc = check(f"{EXAMPLE}:GatedMLP", "--plan", f"{TARGETS}:{plan}")
    assert code == 1
    assert any("'down_prj' names nothing in GatedMLP" in f["message"] for f in doc["failures"]), doc["failures"]


def test_plan_variant_resolves_with_constructor_sizes() -> None:
    (variant,) = resolve_target(f"{EXAMPLE}:GatedMLP", plan=f"{EXAMPLE}:PLAN")
    assert isinstance(variant, PlanVariant)
    assert variant.sizes == ("hidden", "ffn") and variant.min_sizes == (2, 2)
    assert "down_proj: RowwiseParallel()" in variant.describe()


def test_twin_plans_change_one_entry() -> None:
    from plan_targets import HF_DOWN_COLWISE

    twins = twin_plans(HF_DOWN_COLWISE)
    # Each entry planned along its other dim; each style string that cuts a weight as one block planned packed;
    # each planned with its gather (colwise) or split (rowwise).
    assert [(path, name) for _, path, name, _ in twins] == [
        (path, name) for path in ("gate_proj", "up_proj", "down_proj")
        for name in ("wrong-shard-dim", "packed-shard-layout", "plan-input-layout")]
    assert twins[1][3]["gate_proj"] == "packed_colwise" and twins[1][0] == "packed:gate_proj"
    assert twins[2][3]["gate_proj"] == "colwise_gather_output" and twins[2][0] == "layout:gate_proj"
    assert twins[8][3]["down_proj"] == "colwise_gather_output"  # down_proj is planned colwise there
    down = twins[6][3]
    assert down == {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    assert twin_plans(lambda module, mesh: module) == []  # a function has no twins


@pytest.mark.gloo
def test_plan_passes_on_gloo(check) -> None:
    # Worker processes resolve the same plan target again by name (the --plan option travels).
    code, doc = check(f"{EXAMPLE}:GatedMLP", "--plan", f"{EXAMPLE}:PLAN", "--backend", "gloo", "--max-examples", "2",
                      "--world-sizes", "2", "--timeout", "30")
    assert code == 0, json.dumps(doc["failures"], indent=1)
