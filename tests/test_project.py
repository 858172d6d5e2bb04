"""Project-level contracts: README <-> CI commands, public API, import direction, no asserts."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def readme_commands() -> list[str]:
    """The commands of the README's first code block (the two set-up commands)."""
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```(?:bash|sh|console)\n(.*?)```", text, re.S)
    if block is None:
        raise AssertionError("README.md has no fenced bash block with the set-up commands")
    return [line for line in block.group(1).splitlines() if line.strip() and not line.startswith("#")]


def test_readme_opens_with_two_commands() -> None:
    commands = readme_commands()
    assert len(commands) == 2, commands
    install, tests = commands
    assert "constraints.txt" in install, "the install command must pin torch to the CPU wheel"
    assert "tpsim check tpsim.layers" in install
    assert "pytest" in tests


def test_ci_runs_exactly_the_readme_commands() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    for command in readme_commands():
        assert command in ci, f".ci/run does not run the README command {command!r}"


def test_torch_pin_admits_no_newer_release() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert re.search(r'"torch>=2\.13,<2\.14"', pyproject)
    assert "torch==2.13.0" in (ROOT / "constraints.txt").read_text()
    tox = (ROOT / "tox.ini").read_text()
    assert "PIP_CONSTRAINT = {toxinidir}/constraints.txt" in tox


@pytest.mark.parametrize("module", ["tpsim", "tpsim.layers", "tpsim.faults", "tpsim.mutants", "tpsim.props"])
def test_public_all_resolves(module: str) -> None:
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    assert len(exported) == len(mod.__all__), "duplicate names in __all__"
    missing = [name for name in exported if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names missing attributes: {missing}"


@pytest.mark.parametrize("module", ["tpsim", "tpsim.layers", "tpsim.props"])
def test_package_exports_exactly_all(module: str) -> None:
    # The thin public packages re-export from private modules: everything public is in __all__.
    mod = importlib.import_module(module)
    exported = set(mod.__all__)
    public = {n for n, v in vars(mod).items() if not n.startswith("_") and not isinstance(v, type(ast))}
    public.discard("annotations")
    assert public - exported == set(), f"{module} exposes names missing from __all__: {sorted(public - exported)}"


def _imports(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def test_layers_never_import_the_harness() -> None:
    for path in (ROOT / "tpsim" / "layers").rglob("*.py"):
        bad = {n for n in _imports(path) if n.startswith("tpsim") and not n.startswith("tpsim.layers")}
        assert not bad, f"{path.relative_to(ROOT)} imports the harness: {sorted(bad)}"


def test_backends_never_import_layers_or_properties() -> None:
    for path in (ROOT / "tpsim" / "comm").rglob("*.py"):
        bad = {n for n in _imports(path) if n.startswith(("tpsim.layers", "tpsim.props"))}
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_no_assert_statements_in_library_code() -> None:
    # `python -O` strips asserts: input checks must raise real exceptions.
    offenders = []
    for package in ("tpsim",):
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Assert):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_readme_documents_every_diagnosis() -> None:
    from tpsim.diagnosis import DIAGNOSES

    readme = (ROOT / "README.md").read_text()
    missing = [name for name in DIAGNOSES if f"`{name}`" not in readme]
    assert not missing, f"README.md does not document the diagnoses {missing}"


def test_readme_has_no_unfilled_placeholders() -> None:
    readme = (ROOT / "README.md").read_text()
    assert not re.findall(r"^[A-Z_]{10,}$", readme, re.M)
