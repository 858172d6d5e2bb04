"""The adapters in examples/: the correct ones pass ``tpsim check``, the buggy ones fail with the
diagnosis they were written to show, and every command a docstring shows works as it says."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import shlex

import pytest

from tpsim.cli import main
from tpsim.target import resolve_target

ROOT = pathlib.Path(__file__).resolve().parent.parent
# dtensor_*.py are benchmark comparisons (not adapters), owned by the bench.
EXAMPLES = sorted(p for p in (ROOT / "examples").glob("*.py") if not p.name.startswith("dtensor_"))
FAST = ["--max-examples", "15", "--world-sizes", "1,2,3,4", "--seed", "0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.fixture
def check(capsys, tmp_path):
    """``check(target, *options)`` -> (exit code, JSON report), cases saved under tmp_path."""

    def run(target: str, *options: str) -> tuple[int, dict]:
        code = main(["check", target, *options, *FAST, "--report", "json", "--cases-dir", str(tmp_path)])
        return code, json.loads(capsys.readouterr().out)

    return run


@pytest.mark.parametrize(
    "target, options, names",
    [
        ("examples/tpsim_layers.py", [], ["layers.column", "layers.row"]),
        ("examples/skill_convention.py", [], ["skill.ColumnParallelLinear", "skill.RowParallelLinear"]),
        ("examples/skill_convention.py:ColumnParallelLinear", ["--input-grad", "partial"], ["ColumnParallelLinear"]),
        ("examples/skill_convention.py:RowParallelLinear", ["--output", "reduced"], ["RowParallelLinear"]),
        ("examples/tutorial_convention.py", [], ["tutorial.ColumnParallelLinear", "tutorial.RowParallelLinear"]),
        ("examples/tutorial_convention.py:ColumnParallelLinear", ["--input-grad", "partial"], ["ColumnParallelLinear"]),
        ("examples/tutorial_convention.py:RowParallelLinear", [], ["RowParallelLinear"]),
        ("examples/my_layer.py:projection", [], ["ShardedProjection"]),
    ],
)
def test_correct_examples_pass(check, target, options, names) -> None:
    code, doc = check(target, *options)
    assert code == 0, json.dumps(doc["failures"], indent=1)
    assert [v["name"] for v in doc["variants"]] == names
    assert all(v["examples"] >= 15 for v in doc["variants"])


def test_skill_buggy_row_is_diagnosed_bias_duplication(check) -> None:
    code, doc = check("examples/skill_convention.py:BuggyRowParallelLinear")
    assert code == 1
    first = doc["failures"][0]
    assert (first["property"], first["diagnosis"]) == ("forward-equivalence", "bias-duplication")
    assert first["case"]["bias"] is True and first["case"]["world_size"] == 2


def test_tutorial_column_under_megatron_input_grad_rule_is_grad_not_reduced(check) -> None:
    # Without --input-grad partial the replicated input's grad must be complete on every rank;
    # the tutorial's column layer leaves that reduction to its caller.
    code, doc = check("examples/tutorial_convention.py:ColumnParallelLinear")
    assert code == 1
    assert ("input-grad-equivalence", "grad-not-reduced") in {(f["property"], f["diagnosis"]) for f in doc["failures"]}


def test_tutorial_layers_are_bias_free_and_their_init_is_overwritten() -> None:
    for variant in resolve_target("examples/tutorial_convention.py"):
        assert variant.bias is False
        weight = variant.param("weight")
        assert weight is not None and weight.transposed and weight.load
        assert any("bias-free cases only" in n for n in variant.notes)


def test_skill_layers_slice_the_master_weight_themselves() -> None:
    column, row = resolve_target("examples/skill_convention.py")
    for variant in (column, row):
        assert variant.param("weight").load is False  # the slicing is what gets checked
        assert variant.param("bias").load is True  # zero-initialised; the harness loads the master bias
    assert str(column.param("bias").placement) == "S(0)" and str(row.param("bias").placement) == "R"


# --- every example documents itself and its commands work -----------------------------------------


def _doc_commands(path: pathlib.Path) -> list[tuple[list[str], int]]:
    """The ``tpsim check ...`` lines of the module docstring, with the exit code each expects."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    commands = []
    for line in doc.splitlines():
        line = line.strip()
        if line.startswith("tpsim check "):
            command, _, comment = line.partition("#")
            expected = 1 if re.search(r"exit 1", comment) else 0
            commands.append((shlex.split(command)[1:], expected))
    return commands


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_has_a_docstring_with_the_command_to_check_it(path) -> None:
    commands = _doc_commands(path)
    assert commands, f"{path.name}: the docstring shows no 'tpsim check' command"
    assert any(path.name in " ".join(argv) for argv, _ in commands)


@pytest.mark.slow
@pytest.mark.parametrize(
    "argv, expected",
    [pytest.param(argv, code, id=" ".join(argv)) for path in EXAMPLES for argv, code in _doc_commands(path)],
)
def test_docstring_commands_exit_as_documented(capsys, argv, expected, tmp_path) -> None:
    # Smaller budget and the in-process backend (the last option wins); the command is otherwise verbatim.
    code = main([*argv, *FAST, "--backend", "inproc", "--cases-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == expected, out
