"""Forward-only module targets: inference blocks (weights with ``requires_grad=False``, an all-reduce
outside autograd) checked with ``ModuleVariant(forward_only=True)`` / ``--kind module --forward-only`` /
``property_tests(..., forward_only=True)``: one forward under ``torch.no_grad()``, the forward
properties only (tests/wild/inference_block.py)."""

from __future__ import annotations

import pathlib

import pytest

from tpsim.cli import main
from tpsim.diagnosis import BIAS_DUPLICATION, GRAD_NOT_REDUCED, MISSING_REDUCTION
from tpsim.errors import InvalidArgument
from tpsim.module_variant import ModuleVariant
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.family import MODULE
from tpsim.props.property_names import DIVISIBILITY, FORWARD, FORWARD_ONLY, INPUT_GRAD, REPLICA
from tpsim.props.search import search
from tpsim.props.suite import property_tests
from tpsim.target import resolve_target

ROOT = pathlib.Path(__file__).resolve().parent.parent
BLOCKS = str(ROOT / "tests" / "wild" / "inference_block.py")
SMALL = {"world_sizes": (1, 2, 4), "dtypes": ("float64", "float32"), "max_examples": 8, "seed": 0}
CLI_SMALL = ["--max-examples", "8", "--world-sizes", "1,2,4", "--dtypes", "float64,float32", "--seed", "0"]


def _variant(name: str, **options: object) -> ModuleVariant:
    (variant,) = resolve_target(f"{BLOCKS}:{name}", kind="module", **options)
    assert isinstance(variant, ModuleVariant)
    return variant


def _cli(capsys: pytest.CaptureFixture[str], tmp_path: pathlib.Path, name: str, *extra: str) -> tuple[int, str]:
    code = main(["check", f"{BLOCKS}:{name}", "--kind", "module", *CLI_SMALL, "--cases-dir", str(tmp_path), *extra])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("name", ["InferenceMLP", "InferenceBlock"])
def test_a_correct_inference_module_passes_forward_only(name: str) -> None:
    variant = _variant(name, forward_only=True)
    assert variant.forward_only and "forward only" in variant.describe()
    report = search(variant, **SMALL)
    assert report.failures == [], [f.describe() for f in report.failures]
    assert report.examples >= SMALL["max_examples"]


def test_forward_only_never_runs_with_grad_mode_on() -> None:
    # NoGradBlock raises under grad mode: the reference, its magnitude run or twin, or a rank that ran
    # it so would fail the check. bfloat16 is judged by the dense twin, float64 by the magnitude run.
    report = search(_variant("NoGradBlock", forward_only=True), world_sizes=(1, 2), dtypes=("float64", "bfloat16"),
                    max_examples=6, seed=0)
    assert report.failures == [], [f.describe() for f in report.failures]
    # The same block checked with grads fails in its reference run: grad mode is on there.
    failures = MODULE.check_case(_variant("NoGradBlock"), ModuleCase(world_size=2, sizes=(2, 2), batch_shape=(2,),
                                                                    seed=0, size_names=("hidden", "ffn")))
    assert failures and "torch.no_grad()" in failures[0].message


@pytest.mark.parametrize(("name", "diagnosis"), [("BiasOnEveryRankBlock", BIAS_DUPLICATION),
                                                 ("UnreducedBlock", MISSING_REDUCTION)])
def test_a_seeded_bug_is_caught_forward_only_with_its_sublayer(name: str, diagnosis: str) -> None:
    report = search(_variant(name, forward_only=True), **SMALL)
    assert report.failures, f"{name}: the seeded bug was not caught"
    first = report.failures[0]
    assert (first.property, first.sublayer, first.diagnosis) == (FORWARD, "mlp.down_proj", diagnosis), first.describe()
    assert {f.property for f in report.failures} <= set(FORWARD_ONLY)


def test_without_forward_only_an_inference_block_fails_and_says_to_check_it_forward_only(capsys, tmp_path) -> None:
    code, out = _cli(capsys, tmp_path, "InferenceBlock")
    assert code == 1, out
    # The all-reduce outside autograd leaves the input grad a per-rank summand: named, with the way out.
    assert f"FAILED {INPUT_GRAD}: norm: {GRAD_NOT_REDUCED}" in out, out
    assert "every parameter of InferenceBlock has requires_grad=False" in out and "--forward-only" in out, out


def test_the_cli_checks_a_module_forward_only(capsys, tmp_path) -> None:
    code, out = _cli(capsys, tmp_path, "InferenceBlock", "--forward-only")
    assert code == 0, out
    assert "InferenceBlock is forward-only" in out and "python -O strips asserts" in out, out
    code, out = _cli(capsys, tmp_path, "BiasOnEveryRankBlock", "--forward-only")
    assert code == 1, out
    assert f"FAILED {FORWARD}: mlp.down_proj: {BIAS_DUPLICATION}" in out, out
    assert INPUT_GRAD not in out, out


def test_a_bare_assert_refusal_counts_for_a_forward_only_module() -> None:
    # vLLM's divide() refuses by assert: every rank raises AssertionError naming the sizes.
    case = ModuleCase(world_size=2, sizes=(3, 2), batch_shape=(2,), seed=0, size_names=("hidden", "ffn"))
    variant = _variant("InferenceMLP", forward_only=True)
    assert not MODULE.divisible(variant, case)
    assert MODULE.check_case(variant, case) == []


def test_property_tests_accept_a_module_forward_only() -> None:
    suite = property_tests(f"{BLOCKS}:InferenceBlock", target_options={"kind": "module"}, forward_only=True,
                           max_examples=4, seed=0)
    assert sorted(n for n in vars(suite) if n.startswith("test_")) == [
        "test_divisibility", "test_forward_equivalence", "test_replica_consistency"]
    assert set(MODULE.applicable(_variant("InferenceBlock", forward_only=True))) == {FORWARD, REPLICA, DIVISIBILITY}


def test_forward_only_is_validated_as_a_bool() -> None:
    variant = _variant("InferenceBlock")
    with pytest.raises(InvalidArgument, match=r"ModuleVariant 'InferenceBlock': forward_only='yes'; expected a bool"):
        ModuleVariant(name="InferenceBlock", build=variant.build, sizes=variant.sizes, forward_only="yes")
    with pytest.raises(InvalidArgument, match=r"forward_only=1; expected a bool"):
        variant.replace(forward_only=1)


def test_a_module_refuses_a_linear_only_flag_saying_what_to_do(capsys, tmp_path) -> None:
    code, out = _cli(capsys, tmp_path, "InferenceBlock", "--convention", "group")
    assert code == 2, out
    assert "--convention applies to single linear layers" in out and "check it without --convention" in out, out
    assert "packed parameter" not in out, out


def test_a_plan_target_is_checked_forward_only(capsys, tmp_path, monkeypatch) -> None:
    # A dense class under a DTensor plan is a ModuleVariant too: --forward-only applies to it.
    monkeypatch.chdir(ROOT)
    args = ["check", "examples/plan_mlp.py:GatedMLP", "--plan", "examples/plan_mlp.py:PLAN", "--forward-only",
            "--max-examples", "4", "--world-sizes", "1,2", "--dtypes", "float64", "--seed", "0",
            "--cases-dir", str(tmp_path)]
    code = main(args)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 0, text
    assert "GatedMLP is forward-only" in text and "only forward-equivalence, replica-consistency apply" in text, text


@pytest.mark.slow
def test_a_buggy_plan_is_caught_forward_only(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(ROOT)
    args = ["check", "examples/plan_mlp.py:GatedMLP", "--plan", "examples/plan_mlp.py:BUGGY_PLAN", "--forward-only",
            "--max-examples", "6", "--world-sizes", "1,2", "--dtypes", "float64", "--seed", "0",
            "--cases-dir", str(tmp_path)]
    code = main(args)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 1, text
    assert "FAILED forward-equivalence: down_proj: wrong-shard-dim" in text, text
