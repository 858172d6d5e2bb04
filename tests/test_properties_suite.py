"""``tpsim.props.suite.property_tests``: the one line a user drops into a test module.

The project's own use of it, over every variant ``tpsim.layers`` declares, is in
``properties/test_layer_core.py``; these tests check the one-liner's behaviour.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from tpsim.errors import InvalidArgument
from tpsim.mutants import CATALOG
from tpsim.props import PROPERTIES, PropertyFailed
from tpsim.props.suite import property_tests


def _request(backend: str = "inproc") -> SimpleNamespace:
    return SimpleNamespace(
        config=SimpleNamespace(getoption=lambda name, default=None: backend),
        node=SimpleNamespace(nodeid="tests/test_user.py::TestLayer::test_property"),
    )


def test_one_test_per_property() -> None:
    names = sorted(n for n in vars(property_tests("tpsim.layers", max_examples=5)) if n.startswith("test_"))
    assert names == sorted("test_" + p.replace("-", "_") for p in PROPERTIES)


def test_a_failing_property_fails_its_test_with_the_minimal_case_and_a_reproduction(
    tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # the failing case is saved under ./.tpsim/cases
    mutant = next(m for m in CATALOG if m.name == "row-bias-rank0-only")
    cls = property_tests(mutant.variant, max_examples=30, seed=0)
    instance = cls()
    instance.test_forward_equivalence(variant=mutant.variant, request=_request())  # the output is right
    with pytest.raises(PropertyFailed, match=r"bias-grad-equivalence failed \(bias-grad-rank0-only\)") as info:
        instance.test_bias_grad_equivalence(variant=mutant.variant, request=_request())
    notes = "\n".join(info.value.__notes__)
    assert "case: world_size=2" in notes
    saved = list((tmp_path / ".tpsim" / "cases").glob("*.json"))
    assert len(saved) == 1
    assert f"Reproduce: tpsim replay {saved[0].relative_to(tmp_path)}" in notes


def test_a_variant_without_target_gets_a_python_reproduction(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    mutant = next(m for m in CATALOG if m.name == "row-bias-rank0-only")
    anonymous = mutant.variant.replace(target=None)
    instance = property_tests(anonymous, max_examples=30, seed=0)()
    with pytest.raises(PropertyFailed) as info:
        instance.test_bias_grad_equivalence(variant=anonymous, request=_request())
    snippet = "\n".join(info.value.__notes__).split("Reproduce: ", 1)[1]
    # The snippet is valid Python that rebuilds the very case.
    compile(snippet, "<reproduction>", "exec")
    assert "check_case(VARIANT, Case.from_dict(json.loads(" in snippet


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(InvalidArgument, match=r"unknown option\(s\) \['examples'\]"):
        property_tests("tpsim.layers", examples=3)
    with pytest.raises(InvalidArgument, match="expected a tpsim Variant, a list of them, or a target string"):
        property_tests(42)
