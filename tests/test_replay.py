"""``tpsim replay``: a case saved by ``tpsim check`` re-runs exactly, on inproc and on gloo, and
bad case files are refused with exit 2 and a one-line reason."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import BUGGY, FAST, ROOT, run_cli

from tpsim.props.case import SCHEMA_VERSION, load_case, save_case
from tpsim.props.linear.case import Case


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


@pytest.fixture
def buggy_case(capsys, tmp_path) -> str:
    """The case file ``tpsim check`` saves for the skill's buggy row layer."""
    code, out, _ = run_cli(capsys, "check", BUGGY, *FAST, "--report", "json", "--cases-dir", str(tmp_path))
    assert code == 1, out
    failure = next(f for f in json.loads(out)["failures"] if f["property"] == "forward-equivalence")
    assert failure["diagnosis"] == "bias-duplication"
    return failure["case_file"]


def test_replay_on_inproc_gives_the_same_diagnosis(capsys, buggy_case) -> None:
    code, out, err = run_cli(capsys, "replay", buggy_case)
    assert code == 1, out + err
    lines = out.splitlines()
    assert lines[0] == f"tpsim replay {buggy_case}: BuggyRowParallelLinear ({BUGGY}) on inproc"
    assert "  recorded: forward-equivalence: bias-duplication on inproc" in lines
    assert "  FAILED forward-equivalence: bias-duplication" in lines
    assert "FAIL reproduced: forward-equivalence: bias-duplication, as recorded on inproc" in out
    assert f"tpsim replay {buggy_case} --backend gloo" in out


def test_replay_json(capsys, buggy_case) -> None:
    code, out, _ = run_cli(capsys, "replay", buggy_case, "--report", "json")
    assert code == 1
    doc = json.loads(out)
    assert doc["passed"] is False and doc["reproduced"] is True
    assert doc["examples"] == 1 and doc["backend"] == "inproc"
    assert [(f["property"], f["diagnosis"]) for f in doc["failures"]][0] == ("forward-equivalence", "bias-duplication")
    assert doc["failures"][0]["case_file"] == buggy_case
    assert doc["recorded"]["diagnosis"] == "bias-duplication"


@pytest.mark.gloo
@pytest.mark.smoke
def test_a_case_found_on_inproc_replays_on_gloo(capsys, buggy_case) -> None:
    code, out, err = run_cli(capsys, "replay", buggy_case, "--backend", "gloo")
    assert code == 1, out + err
    assert out.splitlines()[0].endswith("on gloo")
    assert "  FAILED forward-equivalence: bias-duplication" in out
    assert "FAIL reproduced: forward-equivalence: bias-duplication, as recorded on inproc" in out


def test_replay_of_a_case_that_passes_exits_0(capsys, tmp_path) -> None:
    case = Case(world_size=2, in_features=4, out_features=6, batch_shape=(3,), bias=True, seed=7,
                target="tpsim.layers", variant="RowParallelLinear", property="forward-equivalence")
    path = save_case(case, str(tmp_path), found={"property": "forward-equivalence", "diagnosis": "bias-duplication"})
    code, out, _ = run_cli(capsys, "replay", path)
    assert code == 0, out
    assert "PASS every property holds on this case now" in out
    code, out, _ = run_cli(capsys, "replay", path, "--report", "json")
    doc = json.loads(out)
    assert code == 0 and doc["passed"] is True and doc["failures"] == [] and doc["reproduced"] is False


MY_ROW = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class RowParallelLinear(nn.Module):
    def __init__(self, in_features, out_features, bias, master_weight):
        super().__init__()
        ws, rank = dist.get_world_size(), dist.get_rank()
        if in_features % ws:
            raise ValueError(f"in_features={in_features} is not divisible by world_size={ws}")
        self.weight = nn.Parameter(master_weight.chunk(ws, dim=1)[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=master_weight.dtype)) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight, self.bias)  # BUG: the bias joins every rank's summand
        dist.all_reduce(y)
        return y
"""

MY_ROW_FIXED_FORWARD = """
    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y)
        return y + self.bias if self.bias is not None else y
"""


@pytest.mark.slow
def test_fixing_the_layer_makes_its_replay_pass(tmp_path) -> None:
    # The user's loop: check finds the bug, replay reproduces it, they fix the file, replay passes.
    # Each command in its own process, as a user runs them (a process imports a file once).
    module = tmp_path / "my_layers.py"
    module.write_text(MY_ROW)
    cases = tmp_path / "cases"

    def tpsim(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "tpsim", *argv], cwd=tmp_path, capture_output=True,
                              text=True, timeout=300)

    found = tpsim("check", "my_layers.py:RowParallelLinear", "--output", "reduced", *FAST, "--cases-dir", str(cases))
    assert found.returncode == 1, found.stdout + found.stderr
    assert "FAILED forward-equivalence: bias-duplication" in found.stdout
    path = next(str(p) for p in cases.glob("*forward_equivalence*.json"))
    before = tpsim("replay", path)
    assert before.returncode == 1 and "reproduced: forward-equivalence: bias-duplication" in before.stdout
    text = module.read_text()
    module.write_text(text[: text.index("    def forward")] + MY_ROW_FIXED_FORWARD.lstrip("\n"))
    after = tpsim("replay", path)
    assert after.returncode == 0, after.stdout + after.stderr
    assert "PASS every property holds on this case now" in after.stdout


def _found_in_work(capsys, tmp_path, monkeypatch) -> str:
    """A case found from ``tmp/work`` (target ``layers_here.py``, relative), saved in ``tmp/cases``."""
    work = tmp_path / "work"
    work.mkdir()
    shutil.copy(ROOT / "examples" / "skill_convention.py", work / "layers_here.py")
    monkeypatch.chdir(work)
    code, out, _ = run_cli(capsys, "check", "layers_here.py:BuggyRowParallelLinear", *FAST, "--report", "json",
                       "--cases-dir", str(tmp_path / "cases"))
    assert code == 1
    return json.loads(out)["failures"][0]["case_file"]


def test_replay_prints_the_file_it_imports(capsys, buggy_case) -> None:
    code, out, _ = run_cli(capsys, "replay", buggy_case)
    assert code == 1
    assert f"  imports:  {ROOT / 'examples' / 'skill_convention.py'}" in out.splitlines()
    code, out, _ = run_cli(capsys, "replay", buggy_case, "--report", "json")
    assert json.loads(out)["target_file"] == str(ROOT / "examples" / "skill_convention.py")


def test_a_target_outside_the_working_and_case_directories_needs_a_flag(capsys, tmp_path, monkeypatch) -> None:
    # found.cwd is informational: it does not make replay import code from there by itself.
    path = _found_in_work(capsys, tmp_path, monkeypatch)
    monkeypatch.chdir(tmp_path)  # layers_here.py is in tmp/work: neither here nor beside the case file
    line = _one_line_error(*run_cli(capsys, "replay", path))
    assert f"names the target file {str(tmp_path / 'work' / 'layers_here.py')!r}, outside the current directory" in line
    assert "--allow-outside-target" in line
    code, out, err = run_cli(capsys, "replay", path, "--allow-outside-target")
    assert code == 1, out + err
    assert f"  imports:  {tmp_path / 'work' / 'layers_here.py'}" in out.splitlines()
    assert "FAILED forward-equivalence: bias-duplication" in out


def test_a_target_beside_the_case_file_replays_from_anywhere(capsys, tmp_path, monkeypatch) -> None:
    path = _found_in_work(capsys, tmp_path, monkeypatch)
    shutil.copy(tmp_path / "work" / "layers_here.py", tmp_path / "cases" / "layers_here.py")
    monkeypatch.chdir(tmp_path)
    code, out, err = run_cli(capsys, "replay", path)
    assert code == 1, out + err
    assert f"  imports:  {tmp_path / 'cases' / 'layers_here.py'}" in out.splitlines()


def test_an_absolute_target_elsewhere_is_refused(capsys, tmp_path) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(ROOT / "examples" / "skill_convention.py", elsewhere / "evil.py")
    case = Case(world_size=2, in_features=2, out_features=2, bias=True,
                target=f"{elsewhere / 'evil.py'}:BuggyRowParallelLinear", variant="BuggyRowParallelLinear")
    path = save_case(case, str(tmp_path / "cases"))
    line = _one_line_error(*run_cli(capsys, "replay", path))
    assert "outside the current directory and the case file's directory" in line
    link = tmp_path / "cases" / "link.py"  # a link beside the case file still points outside
    link.symlink_to(elsewhere / "evil.py")
    path = save_case(case.replace(target="link.py:BuggyRowParallelLinear"), str(tmp_path / "cases"))
    line = _one_line_error(*run_cli(capsys, "replay", path))
    assert "outside the current directory" in line


def test_replay_of_a_fault_case(capsys, tmp_path) -> None:
    # A dropped rank in the row layer's all-reduce must surface as an error naming it: the
    # fault-detection property holds, so the replay passes.
    case = Case(world_size=2, in_features=4, out_features=4, batch_shape=(2,), bias=True, seed=0,
                faults=({"kind": "drop", "rank": 1, "at_call": 1},), target="tpsim.layers",
                variant="RowParallelLinear", property="fault-detection")
    path = save_case(case, str(tmp_path), found={"property": "fault-detection", "diagnosis": "fault-not-surfaced"})
    code, out, err = run_cli(capsys, "replay", path)
    assert code == 0, out + err
    assert "PASS every property holds on this case now" in out


# --- bad case files: exit 2, one line -------------------------------------------------------------


def _one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("tpsim replay: error: ")
    return lines[0]


def _valid_doc() -> dict:
    case = Case(world_size=2, in_features=2, out_features=2, target="tpsim.layers", variant="RowParallelLinear")
    return {"format": "tpsim-case", "schema_version": SCHEMA_VERSION, "case": case.to_dict(), "found": {}}


def test_missing_case_file(capsys, tmp_path) -> None:
    path = str(tmp_path / "nope.json")
    line = _one_line_error(*run_cli(capsys, "replay", path))
    assert f"case file {path!r} does not exist" in line


def test_corrupt_case_file(capsys, tmp_path) -> None:
    path = tmp_path / "corrupt.json"
    path.write_text('{"format": "tpsim-case", "schema_version": 1, "case": {')
    line = _one_line_error(*run_cli(capsys, "replay", str(path)))
    assert "is not valid JSON (line 1" in line


def test_case_file_with_a_bad_field(capsys, tmp_path) -> None:
    doc = _valid_doc()
    doc["case"]["world_size"] = 0
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    line = _one_line_error(*run_cli(capsys, "replay", str(path)))
    assert "is corrupt: world_size=0 must be an int >= 1" in line


def test_newer_schema_case_file(capsys, tmp_path) -> None:
    doc = _valid_doc()
    doc["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "newer.json"
    path.write_text(json.dumps(doc))
    line = _one_line_error(*run_cli(capsys, "replay", str(path)))
    assert f"schema_version={SCHEMA_VERSION + 1}, newer than this tpsim reads ({SCHEMA_VERSION})" in line
    assert "upgrade tpsim" in line


def test_a_json_file_that_is_not_a_case_file(capsys, tmp_path) -> None:
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"hello": "world"}))
    line = _one_line_error(*run_cli(capsys, "replay", str(path)))
    assert 'is not a tpsim case file (no "format": "tpsim-case")' in line


def test_a_case_file_without_a_variant(capsys, tmp_path) -> None:
    path = save_case(Case(world_size=2, in_features=2, out_features=2), str(tmp_path))
    line = _one_line_error(*run_cli(capsys, "replay", path))
    assert "names no variant (target=None, variant=None); it cannot be replayed" in line


def test_a_case_file_whose_target_is_gone(capsys, tmp_path) -> None:
    case = Case(world_size=2, in_features=2, out_features=2, target="tpsim.layers", variant="Renamed")
    path = save_case(case, str(tmp_path))
    line = _one_line_error(*run_cli(capsys, "replay", path))
    assert f"cannot replay {path!r}: 'tpsim.layers' declares no variant named 'Renamed'" in line


def test_nccl_replay_without_gpus(capsys, buggy_case) -> None:
    from tpsim.comm.procs import nccl_unavailable_reason

    reason = nccl_unavailable_reason(2)
    if reason is None:
        pytest.skip("this machine can run nccl with 2 ranks")
    line = _one_line_error(*run_cli(capsys, "replay", buggy_case, "--backend", "nccl"))
    assert line == f"tpsim replay: error: backend nccl cannot run here: {reason}; use --backend gloo or inproc"


def test_saved_case_file_round_trips(buggy_case) -> None:
    case, found = load_case(buggy_case)
    assert os.path.basename(buggy_case).startswith("BuggyRowParallelLinear-forward_equivalence-")
    assert case.to_dict()["target"] == BUGGY
    assert found["command"].startswith(f"tpsim check {BUGGY}")
    assert found["cwd"] == str(ROOT)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("seed", 2**80, "seed=1208925819614629174706176 must be an int <= 18446744073709551615"),
        ("world_size", 10**6, "world_size=1000000 is above the inproc limit"),
        ("faults", [{"kind": "meteor", "rank": 1, "at_call": 1}], "meteor"),
        ("faults", [{"kind": "drop", "rank": 5, "at_call": 1}], "rank=5 is not a rank of a world of world_size=2"),
        ("dtype", ["float32"], "dtype=['float32']; expected one of float64"),
        ("in_features", 10**9, "would have 2000000000 elements"),
        ("batch_shape", [True], "batch_shape entry=True must be an int >= 1"),
        ("options", {"packed": {"a": 1}}, "option packed={'a': 1} must be"),
        ("target", 7, "target=7 must be a string or null"),
        ("input_layout", None, "input_layout=None; expected one of contiguous"),
    ],
)
def test_malformed_fields_exit_2_with_the_reason(capsys, tmp_path, field, value, expected) -> None:
    # Hand-edited or hostile case files: every bad field is a one-line usage error, never an
    # internal error, and nothing runs.
    doc = _valid_doc()
    doc["case"][field] = value
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    line = _one_line_error(*run_cli(capsys, "replay", str(path)))
    assert expected in line, line


def test_case_file_that_is_not_utf8(capsys, tmp_path) -> None:
    path = tmp_path / "latin1.json"
    path.write_bytes(json.dumps(_valid_doc()).encode().replace(b'"RowParallelLinear"', b'"Row\xe9"'))
    line = _one_line_error(*run_cli(capsys, "replay", str(path)))
    assert "is not UTF-8 text (byte " in line


def test_case_file_nested_too_deeply_or_too_large(capsys, tmp_path) -> None:
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    assert "nested too deeply" in _one_line_error(*run_cli(capsys, "replay", str(deep)))
    big = tmp_path / "big.json"
    big.write_text(" " * (2 << 20) + "{}")
    assert "larger than 1048576 bytes" in _one_line_error(*run_cli(capsys, "replay", str(big)))
