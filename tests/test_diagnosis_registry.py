"""The diagnosis registry (tpsim/diagnosis.py): every diagnosis is one entry with its evidence, a
recogniser that looks for exactly that evidence, and — unless it is one of the harness's own
outcomes — a catalogued mutant that shows it (tests/test_mutants.py checks that each mutant is
caught with its diagnosis). No code reports a name the registry does not hold; one cause gives one
report with its consequences listed under it."""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import tpsim
import tpsim.props
from tpsim import diagnosis
from tpsim.diagnosis import (
    DIAGNOSES,
    RECOGNISERS,
    REGISTRY,
    DiagnosisSpec,
    Failure,
    diagnosis_table,
    follows_from,
    group_causes,
    register,
)
from tpsim.mutants import CATALOG

ROOT = Path(tpsim.__file__).parent


def _import_everything() -> None:
    # Recognisers register themselves when their module is imported.
    for package in (tpsim, tpsim.props):
        for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
            if info.name.startswith("tpsim.comm._") or info.name.endswith("__main__"):
                continue
            importlib.import_module(info.name)


def _known_properties() -> set[str]:
    from tpsim.props.faults import FAULT_DETECTION
    from tpsim.props.linear.checks import PROPERTIES

    known = set(PROPERTIES) | {FAULT_DETECTION}
    # Module families may add properties of their own (e.g. a loss check).
    for module in list(importlib.sys.modules.values()):  # type: ignore[attr-defined]
        name = getattr(module, "__name__", "")
        if name.startswith("tpsim.props.") and isinstance(getattr(module, "PROPERTIES", None), tuple):
            known |= set(module.PROPERTIES)
    return known


def test_every_diagnosis_has_a_recogniser() -> None:
    _import_everything()
    missing = [name for name in REGISTRY if not RECOGNISERS.get(name)]
    assert not missing, f"registered diagnoses without a recogniser (decorate it with @recogniser(NAME)): {missing}"


@pytest.mark.parametrize("spec", list(REGISTRY.values()), ids=lambda s: s.name)
def test_every_diagnosis_names_its_evidence_and_its_mutant(spec: DiagnosisSpec) -> None:
    catalog = {m.name: m for m in CATALOG}
    assert len(spec.evidence) > 40 and len(spec.doc) > 20, spec.name
    if spec.mutant is None:
        # A harness outcome: the evidence says why no mutant defines it.
        assert "mutant" in spec.evidence, f"{spec.name}: say in its evidence why no catalogued mutant shows it"
    else:
        assert spec.mutant in catalog, f"{spec.name}: mutant {spec.mutant!r} is not in tpsim.mutants.CATALOG"
        assert catalog[spec.mutant].diagnosis == spec.name, (
            f"{spec.name}: catalogued mutant {spec.mutant!r} is caught as {catalog[spec.mutant].diagnosis!r}"
        )


def test_registry_properties_and_consequences_are_properties() -> None:
    _import_everything()
    known = _known_properties()
    for spec in REGISTRY.values():
        assert set(spec.properties) <= known, (spec.name, set(spec.properties) - known)
        assert set(spec.consequences) <= known, (spec.name, set(spec.consequences) - known)


def test_catalogued_mutants_carry_registered_diagnoses() -> None:
    assert {m.diagnosis for m in CATALOG} <= set(REGISTRY)


# Calls whose diagnosis argument must be a registry constant, never a string literal:
# (callee name, index of the diagnosis among the positional arguments).
_DIAGNOSIS_ARGS = {"Failure": 1, "Diagnosis": 0, "_mutant": 3, "Mutant": 3, "fail": 1}


def test_no_code_spells_a_diagnosis_name_instead_of_using_its_constant() -> None:
    offenders = []
    for path in ROOT.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
            index = _DIAGNOSIS_ARGS.get(callee or "")
            if index is None:
                continue
            arg = node.args[index] if len(node.args) > index else None
            if arg is None:
                arg = next((k.value for k in node.keywords if k.arg == "diagnosis"), None)
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                offenders.append(f"{path.relative_to(ROOT.parent)}:{node.lineno}: {callee}(... {arg.value!r} ...)")
    assert not offenders, "use the constants of tpsim.diagnosis:\n" + "\n".join(offenders)


def test_every_name_constant_is_registered() -> None:
    constants = {k: v for k, v in vars(diagnosis).items() if k.isupper() and isinstance(v, str) and not k.startswith("_")}
    assert set(constants.values()) == set(REGISTRY)
    for key, value in constants.items():
        assert key == value.upper().replace("-", "_"), (key, value)


def test_register_refuses_duplicates_and_bad_specs() -> None:
    with pytest.raises(ValueError, match="'mismatch' is already registered"):
        register(DiagnosisSpec("mismatch", ("forward-equivalence",), "doc text here", "evidence " * 10, None))
    with pytest.raises(ValueError, match="properties is empty"):
        DiagnosisSpec("x-y", (), "doc text here", "evidence", None)
    with pytest.raises(ValueError, match="expected a lower-case name"):
        DiagnosisSpec("Bias Dup", ("forward-equivalence",), "doc", "evidence", None)
    with pytest.raises(ValueError, match="Diagnosis\\(name='oops'\\) is not one of"):
        diagnosis.Diagnosis("oops", "x")
    with pytest.raises(ValueError, match="diagnosis 'oops' is not registered"):
        diagnosis.recogniser("oops")


def test_the_compatibility_mapping_and_the_docs_table_read_the_registry() -> None:
    assert dict(DIAGNOSES) == {name: spec.doc for name, spec in REGISTRY.items()}
    assert diagnosis_table() == [(s.name, s.doc) for s in REGISTRY.values()]
    with pytest.raises(TypeError):
        DIAGNOSES["new"] = "x"  # type: ignore[index]


# --- one cause, one report -----------------------------------------------------------------------


def _f(prop: str, diag: str, sublayer: str | None = None) -> Failure:
    return Failure(prop, diag, f"{prop} failed", sublayer=sublayer)


def test_consequences_are_listed_under_their_cause() -> None:
    cause = _f("input-grad-equivalence", "grad-not-reduced")
    replica = _f("replica-consistency", "replica-divergence")
    training = _f("training-equivalence", "mismatch")
    assert group_causes([cause, replica, training]) == [cause]
    assert cause.consequences == [replica, training]
    # Another cause stays a cause: a forward bug does not explain a wrong input grad.
    fwd, grad = _f("forward-equivalence", "bias-duplication"), _f("input-grad-equivalence", "grad-scaled")
    assert group_causes([fwd, grad]) == [fwd, grad]
    assert fwd.consequences == []


def test_a_consequence_follows_only_the_rules_of_the_registry() -> None:
    # mismatch explains nothing else; the same property is never its own consequence; a cause in
    # one sublayer does not swallow a failure reported for another.
    assert not follows_from(_f("forward-equivalence", "mismatch"), _f("input-grad-equivalence", "mismatch"))
    assert not follows_from(_f("bias-grad-equivalence", "grad-missing"), _f("bias-grad-equivalence", "mismatch"))
    assert follows_from(_f("weight-grad-equivalence", "grad-missing", "fc1"), _f("training-equivalence", "mismatch", "fc1"))
    assert not follows_from(_f("weight-grad-equivalence", "grad-missing", "fc1"), _f("training-equivalence", "mismatch", "fc2"))
    for spec in REGISTRY.values():
        assert spec.properties[0] not in spec.consequences or len(spec.properties) > 1, spec.name


def test_failure_renders_its_sublayer_and_its_consequences() -> None:
    cause = _f("forward-equivalence", "bias-duplication", sublayer="fc2")
    cause.consequences.append(_f("training-equivalence", "mismatch", sublayer="fc2"))
    text = cause.describe()
    assert text.startswith("forward-equivalence: fc2: bias-duplication")
    assert "consequences of the same cause:\n    training-equivalence: fc2: mismatch" in text
    data = cause.to_json()
    assert data["sublayer"] == "fc2" and data["consequences"][0]["property"] == "training-equivalence"
