"""The DeepSpeed preset: ``tpsim check deepspeed.module_inject.layers`` checks AutoTP's
``LinearLayer``, ``LinearAllreduce`` and ``LinearAllreduceWithReplicatedInput`` (training and
inference mode) with no adapter code; patched subclasses (``tests/wild/deepspeed_patches.py``) are
caught with their diagnosis; the library's own finding (the input grad of a non-contiguous input is
not reduced) is reported; sizes AutoTP splits unevenly by design pass."""

from __future__ import annotations

import pathlib

import pytest

from tpsim.cli import main
from tpsim.diagnosis import BIAS_DUPLICATION, DIVISIBILITY_UNCHECKED, GRAD_NOT_REDUCED
from tpsim.props.linear.case import Case
from tpsim.props.linear.family import check_case
from tpsim.props.search import search
from tpsim.target import resolve_target

pytest.importorskip("deepspeed")

ROOT = pathlib.Path(__file__).resolve().parent.parent
LAYERS = "deepspeed.module_inject.layers"
PATCHES = str(ROOT / "tests" / "wild" / "deepspeed_patches.py")
NAMES = [
    "LinearLayer",
    "LinearLayer(gather_output=True)",
    "LinearLayer(training=False)",
    "LinearLayer(gather_output=True, training=False)",
    "LinearAllreduce",
    "LinearAllreduce(training=False)",
    "LinearAllreduceWithReplicatedInput",
    "LinearAllreduceWithReplicatedInput(training=False)",
]
SMALL = dict(max_examples=20, seed=0, world_sizes=(1, 2, 3, 4), dtypes=("float64", "float32"))


def _variants(target: str) -> dict:
    return {v.name: v for v in resolve_target(target)}


def test_the_preset_declares_every_layer_and_mode() -> None:
    variants = _variants(LAYERS)
    assert list(variants) == NAMES
    for name, v in variants.items():
        assert "(deepspeed preset)" in v.description
        assert v.forward_only == ("training=False" in name)
        # The layer slices the dense layer it is given: tpsim checks those slices, it does not overwrite them.
        assert all(not p.load for p in v.params)
        assert "deepspeed.comm.comm" in v.rank_local and LAYERS in v.rank_local
    assert variants["LinearLayer"].kind == "column" and variants["LinearLayer"].output == "sharded"
    assert variants["LinearLayer(gather_output=True)"].output == "gathered"
    assert (variants["LinearAllreduce"].input, variants["LinearAllreduce"].output) == ("sharded", "reduced")
    assert variants["LinearAllreduceWithReplicatedInput"].input == "replicated"


@pytest.mark.parametrize("name", [n for n in NAMES if not n.startswith("LinearLayer") or "training=False" in n])
def test_the_library_layers_pass(name) -> None:
    report = search(_variants(LAYERS)[name], **SMALL)
    assert report.passed, [(f.property, f.diagnosis, f.message) for f in report.failures]


@pytest.mark.parametrize("name", ["LinearLayer", "LinearLayer(gather_output=True)"])
def test_the_library_finding_a_non_contiguous_input_grad_is_not_reduced(name) -> None:
    report = search(_variants(LAYERS)[name], **SMALL)
    assert report.failures
    for f in report.failures:
        assert (f.property, f.diagnosis) == ("input-grad-equivalence", GRAD_NOT_REDUCED)
        assert f.case.input_layout != "contiguous" and "the contiguous twin of this case" in f.message


def test_uneven_by_design_is_checked_not_refused() -> None:
    # in=3 over 2 ranks: AutoTP gives rank 0 two columns and rank 1 one, and computes the dense result.
    case = Case(world_size=2, in_features=3, out_features=2, batch_shape=(2,), bias=True, seed=0)
    for name in ("LinearAllreduce", "LinearAllreduce(training=False)", "LinearAllreduceWithReplicatedInput"):
        assert check_case(_variants(LAYERS)[name], case) == [], name
    column = Case(world_size=4, in_features=2, out_features=5, batch_shape=(3,), bias=True, seed=1)
    for name in ("LinearLayer(gather_output=True, training=False)", "LinearLayer(training=False)"):
        assert check_case(_variants(LAYERS)[name], column) == [], name


@pytest.mark.parametrize("cls, name, prop, diagnosis", [
    ("BiasBeforeReduceLinearAllreduce", "BiasBeforeReduceLinearAllreduce", "forward-equivalence", BIAS_DUPLICATION),
    ("NoCopyLinearLayer", "NoCopyLinearLayer", "input-grad-equivalence", GRAD_NOT_REDUCED),
    ("ReversedSlicesLinearLayer", "ReversedSlicesLinearLayer", "forward-equivalence", "wrong-shard-order"),
    ("FloorLinearAllreduce", "FloorLinearAllreduce", "divisibility", DIVISIBILITY_UNCHECKED),
    ("FloorLinearAllreduce", "FloorLinearAllreduce(training=False)", "divisibility", DIVISIBILITY_UNCHECKED),
])
def test_a_patched_subclass_is_caught_with_its_diagnosis(cls, name, prop, diagnosis) -> None:
    report = search(_variants(f"{PATCHES}:{cls}")[name], **SMALL)
    found = {(f.property, f.diagnosis) for f in report.failures}
    assert (prop, diagnosis) in found, found


def test_a_uneven_layer_with_a_wrong_result_is_a_finding() -> None:
    # Uneven pieces are no excuse: the bias added before the reduction is wrong at in=3 over 2 too.
    case = Case(world_size=2, in_features=3, out_features=2, batch_shape=(), bias=True, seed=0)
    failures = check_case(_variants(f"{PATCHES}:BiasBeforeReduceLinearAllreduce")["BiasBeforeReduceLinearAllreduce"],
                          case)
    assert [(f.property, f.diagnosis) for f in failures] == [("divisibility", DIVISIBILITY_UNCHECKED)]
    assert "uneven by design" in failures[0].message and "bias-duplication" in failures[0].message


def test_the_fixed_layer_passes_every_option_combination() -> None:
    variants = _variants(f"{PATCHES}:ContiguousGradLinearLayer")
    assert len(variants) == 4
    for v in variants.values():
        report = search(v, **SMALL)
        assert report.passed, (v.name, [(f.property, f.diagnosis, f.message) for f in report.failures])


def test_one_command_checks_the_library(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    code = main(["check", f"{LAYERS}:LinearAllreduce", "--max-examples", "10", "--world-sizes", "1,2,3",
                 "--dtypes", "float64", "--seed", "0", "--cases-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    assert out.splitlines()[0].startswith(f"tpsim check {LAYERS}:LinearAllreduce: 2 variants on inproc")
    assert "PASS LinearAllreduce " in out and "PASS LinearAllreduce(training=False)" in out


def test_no_kernel_is_compiled_for_the_communication_backend() -> None:
    import deepspeed.ops as ops

    from tpsim.presets.deepspeed import _no_shm_op

    _no_shm_op()
    assert ops.__compatible_ops__["deepspeed_shm_comm"] is False


@pytest.mark.gloo
@pytest.mark.slow
def test_the_library_check_on_gloo(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    code = main(["check", f"{LAYERS}:LinearAllreduce", "--backend", "gloo", "--max-examples", "5",
                 "--world-sizes", "2,3", "--dtypes", "float64", "--seed", "0", "--cases-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
