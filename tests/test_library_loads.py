"""The library loads the weights; tpsim reads them back and judges them.

Module, plan and preset targets get the case's dense weights through their own loader (a builder that
takes them, a loader method, vLLM's ``weight_loader``, a plan's ``distribute_tensor``, transformers'
``from_pretrained`` cut), and tpsim never writes over what they loaded: a mis-slice is named right
after construction, a declaration cannot hide it, and a crash at sizes a target says it shards is a
failure. Correct twins pass on inproc and gloo (tests/wild/loaders.py, tests/wild/packed_plans.py).
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch

from tpsim.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
LOADERS = "tests/wild/loaders.py"
PLANS = "tests/wild/packed_plans.py"
FAST = ["--max-examples", "10", "--world-sizes", "1,2,4", "--seed", "0", "--dtypes", "float64,float32"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.fixture
def check(capsys, tmp_path):
    """``check(target, *options)`` -> (exit code, JSON report)."""

    def run(target: str, *options: str) -> tuple[int, dict]:
        code = main(["check", target, *FAST, *options, "--report", "json", "--cases-dir", str(tmp_path)])
        out = capsys.readouterr()
        assert code in (0, 1), out.err
        return code, json.loads(out.out)

    return run


def _causes(doc: dict) -> list[tuple[str | None, str, str]]:
    return [(f["sublayer"], f["property"], f["diagnosis"]) for f in doc["failures"]]


@pytest.mark.parametrize("target, options", [
    (f"{LOADERS}:InferenceMLP", ("--kind", "module", "--forward-only")),
    (f"{LOADERS}:FUSED_QKV", ()),
    (f"{LOADERS}:RANK_ZERO_BIAS_INFERENCE", ()),
    (f"{PLANS}:FusedGateUpMLP", ("--plan", f"{PLANS}:PACKED")),
    (f"{PLANS}:PlainMLP", ("--plan", f"{PLANS}:refusing_plan")),
    (f"{PLANS}:SLICING_BUILDER", ()),
])
def test_correct_loaders_pass(check, target, options) -> None:
    code, doc = check(target, *options)
    assert code == 0, json.dumps(doc["failures"], indent=1)


def test_a_weight_loader_that_forgets_to_scale_the_row_bias_fails_the_forward(check) -> None:
    # Every rank adds the whole bias before the all-reduce: the sum holds it tp times.
    code, doc = check(f"{LOADERS}:UnscaledBiasMLP", "--kind", "module", "--forward-only")
    assert code == 1
    (cause,) = doc["failures"]
    assert cause["property"] == "forward-equivalence" and cause["case"]["world_size"] >= 2
    # Named where the bias is added (fc2), although the all-reduce that duplicates it is the parent's.
    assert (cause["diagnosis"], cause["sublayer"]) == ("bias-duplication", "fc2"), json.dumps(cause, indent=1)


def test_a_fused_qkv_loader_that_cuts_in_the_wrong_order_is_named_as_the_loaders(check) -> None:
    code, doc = check(f"{LOADERS}:WRONG_ORDER_QKV")
    assert code == 1
    assert _causes(doc)[0] == ("qkv", "forward-equivalence", "packed-shard-layout"), json.dumps(doc["failures"], indent=1)
    message = doc["failures"][0]["message"]
    # Named as the loader's defect, with no declaration suggested (a declaration could only hide it).
    assert "library's loader" in message and "ParamSpec" not in message


def test_a_declaration_cannot_hide_a_mis_slice(check) -> None:
    # Declared the way the packed layout would be, the loader's contiguous pieces fail right after construction.
    code, doc = check(f"{LOADERS}:DECLARED_WRONG_ORDER")
    assert code == 1
    cause = doc["failures"][0]
    assert (cause["sublayer"], cause["diagnosis"]) == ("qkv", "packed-shard-layout"), json.dumps(cause, indent=1)
    assert cause["details"]["construction"] is True and "right after construction" in cause["message"]


def test_a_builders_own_slices_are_what_is_checked(check) -> None:
    code, doc = check(f"{PLANS}:REVERSED_SLICING_BUILDER")
    assert code == 1
    cause = doc["failures"][0]
    assert (cause["sublayer"], cause["diagnosis"]) == ("fc1", "wrong-shard-order"), json.dumps(cause, indent=1)
    assert cause["details"]["construction"] is True


def test_a_rank_zero_bias_forwards_right_and_its_drifting_zero_copies_are_named(check) -> None:
    code, doc = check(f"{LOADERS}:RANK_ZERO_BIAS")
    assert code == 1
    assert _causes(doc) == [("fc2", "training-equivalence", "zero-copies-drift")], json.dumps(doc["failures"], indent=1)
    verdicts = doc["variants"][0]["verdicts"]
    for prop in ("forward-equivalence", "input-grad-equivalence", "weight-grad-equivalence", "bias-grad-equivalence"):
        assert verdicts[prop]["verdict"] == "pass", (prop, verdicts[prop])
    assert doc["failures"][0]["details"]["drift"] > 0


def test_packed_strided_shard_parameters_are_checked_with_no_declaration(check) -> None:
    from tpsim.target import resolve_target

    (variant,) = resolve_target(f"{PLANS}:FusedGateUpMLP", plan=f"{PLANS}:PACKED")
    assert variant.params == () and variant.load == "build"
    code, doc = check(f"{PLANS}:FusedGateUpMLP", "--plan", f"{PLANS}:COLWISE")
    assert code == 1
    assert _causes(doc)[0] == ("gate_up_proj", "forward-equivalence", "packed-shard-layout"), \
        json.dumps(doc["failures"], indent=1)
    assert "planned packed_colwise" in doc["failures"][0]["message"]


def test_a_plan_that_declares_uneven_sizes_fails_when_it_crashes_there(check) -> None:
    code, doc = check(f"{PLANS}:PlainMLP", "--plan", f"{PLANS}:crashing_uneven_plan")
    assert code == 1
    cause = doc["failures"][0]
    assert cause["diagnosis"] == "exception" and cause["rank"] == 0, json.dumps(cause, indent=1)
    assert "ValueError: ffn=" in cause["message"] and "not divisible" in cause["message"]
    assert cause["case"]["sizes"][1] % cause["case"]["world_size"] != 0


def test_a_strided_shard_is_read_as_the_shard_of_each_part() -> None:
    from tpsim.placement import Shard, assemble
    from tpsim.props.module.dtensor_pieces import DTensorLayout, MeshPlacement, expected_piece

    full = torch.arange(16.0).reshape(8, 2)
    layout = DTensorLayout(shape=(8, 2), mesh_shape=(2,), ranks=(0, 1),
                           placements=(MeshPlacement("strided_shard", dim=0, split_factor=2),))
    pieces = [expected_piece(full, layout, r) for r in range(2)]
    # What tpsim reads a _StridedShard(0, split_factor=2) parameter as (tpsim.props.module.dtensors).
    assert torch.equal(assemble(pieces, Shard(0, parts=(4, 4))), full)


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize("target, options", [
    (f"{LOADERS}:InferenceMLP", ("--kind", "module", "--forward-only")),
    (f"{LOADERS}:FUSED_QKV", ()),
    (f"{PLANS}:FusedGateUpMLP", ("--plan", f"{PLANS}:PACKED")),
    (f"{PLANS}:SLICING_BUILDER", ()),
])
def test_correct_loaders_pass_on_gloo(capsys, tmp_path, target, options) -> None:
    code = main(["check", target, *options, "--backend", "gloo", "--max-examples", "3", "--world-sizes", "1,2",
                 "--seed", "0", "--dtypes", "float64", "--timeout", "120", "--report", "json", "--cases-dir",
                 str(tmp_path)])
    out = capsys.readouterr()
    assert code == 0, out.out[-3000:] + out.err[-3000:]


def test_megatron_weights_are_loaded_through_its_own_checkpoint_metadata(check) -> None:
    # The preset copies the slice Megatron's sharded_state_dict places each tensor at: metadata that
    # misplaces the shards is caught right after construction, before any forward.
    code, doc = check("tests/wild/megatron_checkpoint.py:ReversedOffsetsColumnParallelLinear", "--max-examples", "4",
                      "--world-sizes", "2")
    assert code == 1
    cause = doc["failures"][0]
    assert (cause["property"], cause["diagnosis"]) == ("forward-equivalence", "wrong-shard-order"), \
        json.dumps(cause, indent=1)
    assert cause["details"]["construction"] is True
