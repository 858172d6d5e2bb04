"""README "Check your own MLP / block": the example it shows is the real file, and the commands it
documents do what it says (run verbatim, with a smaller budget appended)."""

from __future__ import annotations

import pathlib
import re
import shlex

import pytest

from tpsim.cli import main

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = ["--max-examples", "30", "--world-sizes", "1,2,3,4"]


def _section() -> str:
    text = (ROOT / "README.md").read_text()
    match = re.search(r"^## Check your own MLP / block\n(.*?)^## ", text, re.S | re.M)
    assert match, "README.md has no 'Check your own MLP / block' section"
    return match.group(1)


def _commands() -> list[list[str]]:
    return [shlex.split(line[2:]) for line in _section().splitlines() if line.startswith("$ tpsim check ")]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def test_the_readme_shows_the_example_file_as_it_is() -> None:
    block = re.search(r"```python\n(class TensorParallelMLP.*?)```", _section(), re.S)
    assert block, "the section shows no TensorParallelMLP"
    source = (ROOT / "examples" / "my_mlp.py").read_text()
    # Verbatim, up to the annotations the README leaves out for brevity (and spacing).
    def plain(text: str) -> str:
        return re.sub(r"\s+", "", re.sub(r": Any|-> (None|torch\.Tensor)|: torch\.Tensor", "", text))

    for line in block.group(1).strip().splitlines():
        assert plain(line) in plain(source), line


@pytest.mark.slow
def test_the_documented_commands_exit_and_report_as_shown(capsys, tmp_path) -> None:
    # The section's MLP commands (the block commands after them are checked by tests/test_blocks.py).
    commands = [c for c in _commands() if c[2].startswith("examples/my_mlp.py")]
    assert [c[2] for c in commands] == ["examples/my_mlp.py:TensorParallelMLP", "examples/my_mlp.py:BuggyMLP"]
    good, buggy = commands
    assert main([*good[1:], *FAST, "--cases-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "PASS TensorParallelMLP" in out and "all properties hold" in out
    assert main([*buggy[1:], *FAST, "--cases-dir", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAILED forward-equivalence: fc2: bias-duplication" in out
    assert "minimal case: world_size=2 hidden=2 ffn=2 batch_shape=[] dtype=float64 seed=0" in out
    shown = _section()
    assert "FAILED forward-equivalence: fc2: bias-duplication" in shown
    assert "minimal case: world_size=2 hidden=2 ffn=2 batch_shape=[] dtype=float64 seed=0" in shown
