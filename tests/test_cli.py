"""End-to-end runs of the ``tpsim`` command: ``main(argv)`` in-process (printed output and exit
codes), plus real subprocess runs of ``python -m tpsim`` and of the ``tpsim`` console script."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import textwrap

import pytest
from helpers import BUGGY, FAST, ROOT, run_cli

from tpsim.cli import main
from tpsim.props.case import load_case

SKILL = "examples/skill_convention.py"
LAYER_NAMES = [
    "ColumnParallelLinear",
    "ColumnParallelLinear(gather_output=True)",
    "RowParallelLinear",
    "RowParallelLinear(input_is_parallel=False)",
    "ColumnParallelLinear(parts=gate,up)",
    "ColumnParallelLinear(parts=q8,k2,v2)",
    "ColumnParallelLinear(sequence_parallel=True)",
    "RowParallelLinear(sequence_parallel=True)",
    "ParallelMLP(swiglu)",
    "ParallelMLP(swiglu, sequence_parallel=True)",
]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    # The examples are named by paths relative to the repository root, as the docs show them.
    monkeypatch.chdir(ROOT)


# --- check: passing ------------------------------------------------------------------------------


@pytest.mark.slow
def test_check_tpsim_layers_passes_every_variant(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "check", "tpsim.layers", *FAST, "--cases-dir", str(tmp_path))
    assert code == 0, out + err
    lines = out.splitlines()
    # tpsim.layers grows with the layer core: its linear layers and MLPs at least, every one passing
    n = sum(1 for line in lines if line.startswith("PASS "))
    assert n >= len(LAYER_NAMES) and not any(line.startswith("FAIL ") for line in lines), out
    assert lines[0].startswith(f"tpsim check tpsim.layers: {n} variants on inproc, world sizes 1,2,3")
    for name in LAYER_NAMES:
        assert any(line.startswith("PASS ") and f" {name} " in line for line in lines), (name, out)
    assert lines[-1].startswith(f"all properties hold: {n} variants, ")
    assert err == ""  # no progress: stderr is not a terminal here
    assert list(tmp_path.iterdir()) == []  # nothing failed, nothing saved


@pytest.mark.slow
def test_check_json_report_of_a_passing_target(capsys, tmp_path) -> None:
    code, out, _ = run_cli(capsys, "check", "tpsim.layers", *FAST, "--report", "json", "--cases-dir", str(tmp_path))
    assert code == 0
    doc = json.loads(out)  # stdout is exactly one JSON document
    assert doc["passed"] is True
    assert doc["failures"] == []
    names = [v["name"] for v in doc["variants"]]
    assert [n for n in names if n in LAYER_NAMES] == LAYER_NAMES
    assert doc["examples"] == sum(v["examples"] for v in doc["variants"])
    assert all(v["examples"] >= 10 and v["passed"] for v in doc["variants"])
    assert doc["settings"]["world_sizes"] == [1, 2, 3]
    assert doc["settings"]["backend"] == "inproc"


def test_a_class_without_bias_flag_runs_bias_free_cases_and_says_so(capsys, tmp_path) -> None:
    target = "examples/tutorial_convention.py:RowParallelLinear"
    code, out, _ = run_cli(capsys, "check", target, *FAST, "--cases-dir", str(tmp_path))
    assert code == 0, out
    assert "note: RowParallelLinear has no bias parameter: bias-free cases only" in out
    code, out, _ = run_cli(capsys, "check", target, *FAST, "--report", "json", "--cases-dir", str(tmp_path))
    doc = json.loads(out)
    assert doc["variants"][0]["bias"] is False
    assert any("bias-free cases only" in n for n in doc["variants"][0]["notes"])


# --- check: failing ------------------------------------------------------------------------------


def test_buggy_row_layer_fails_with_bias_duplication_and_saves_the_case(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "check", BUGGY, *FAST, "--cases-dir", str(tmp_path))
    assert code == 1, out + err
    assert "FAIL BuggyRowParallelLinear" in out
    assert "FAILED forward-equivalence: bias-duplication" in out
    assert "off by exactly (world_size-1)*bias" in out
    files = list(tmp_path.glob("*.json"))
    assert len(files) >= 1
    path = next(str(f) for f in files if "forward_equivalence" in f.name)
    # The failure block names the minimal case, its file and the exact replay command.
    assert "minimal case: world_size=2 " in out  # shrunk: the smallest world that shows the bug
    assert f"case file:    {path}" in out
    assert f"replay:       tpsim replay {path}" in out
    assert f"tpsim replay {path} --backend gloo" in out
    case, found = load_case(path)
    assert (case.target, case.variant, case.property) == (BUGGY, "BuggyRowParallelLinear", "forward-equivalence")
    assert case.bias is True and case.world_size == 2
    assert found["diagnosis"] == "bias-duplication" and found["backend"] == "inproc"


def test_json_report_of_a_failure(capsys, tmp_path) -> None:
    code, out, _ = run_cli(capsys, "check", BUGGY, *FAST, "--report", "json", "--cases-dir", str(tmp_path))
    assert code == 1
    doc = json.loads(out)
    assert doc["passed"] is False
    failure = next(f for f in doc["failures"] if f["property"] == "forward-equivalence")
    assert failure["diagnosis"] == "bias-duplication"
    assert "bias" in failure["message"]
    assert failure["case"]["world_size"] == 2 and failure["case"]["bias"] is True
    assert os.path.isfile(failure["case_file"])
    assert failure["replay"] == f"tpsim replay {failure['case_file']}"
    assert doc["variants"][0]["failures"] == [
        {k: f[k] for k in ("property", "diagnosis", "case_file")} for f in doc["failures"]
    ]


EXPLODING = '''
import torch, torch.distributed as dist
from torch import nn


class ExplodingColumn(nn.Module):
    def __init__(self, in_features, out_features, bias, master_weight):
        super().__init__()
        ws, rank = dist.get_world_size(), dist.get_rank()
        self.rank = rank
        self.weight = nn.Parameter(master_weight.chunk(ws, 0)[rank].clone())
        self.bias = nn.Parameter(torch.zeros(out_features // ws, dtype=master_weight.dtype)) if bias else None

    def forward(self, x):
        if self.rank == 1:
            raise RuntimeError("rank one refuses")
        return torch.nn.functional.linear(x, self.weight, self.bias)
'''


def test_an_exception_inside_the_variant_is_a_failure_not_a_usage_error(capsys, tmp_path) -> None:
    module = tmp_path / "exploding.py"
    module.write_text(textwrap.dedent(EXPLODING))
    cases = tmp_path / "cases"
    argv = ["check", f"{module}:ExplodingColumn", "--world-sizes", "2", "--max-examples", "5", "--seed", "0",
            "--input-grad", "partial", "--cases-dir", str(cases)]
    code, out, err = run_cli(capsys, *argv)
    assert code == 1, out + err
    assert ": exception" in out
    assert "rank 1 raised" in out and "RuntimeError: rank one refuses" in out
    assert 'raise RuntimeError("rank one refuses")' in out  # the rank's traceback is shown
    code, out, _ = run_cli(capsys, *argv, "--report", "json")
    failure = json.loads(out)["failures"][0]
    assert failure["diagnosis"] == "exception" and failure["rank"] == 1
    assert "rank one refuses" in failure["traceback"]


# --- progress ------------------------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_is_shown_on_a_terminal_only(capsys, monkeypatch, tmp_path) -> None:
    terminal = _Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    code = main(["check", "tpsim.layers:RowParallelLinear", *FAST, "--cases-dir", str(tmp_path)])
    assert code == 0
    shown = terminal.getvalue()
    assert "RowParallelLinear: 10/10 examples" in shown
    assert shown.endswith("\r\x1b[K")  # the progress line is cleared before the result is printed
    assert "10/10 examples" not in capsys.readouterr().out  # progress goes to stderr only


# --- usage and import errors: exit 2, one line on stderr, nothing on stdout -----------------------


def _one_line_error(code: int, out: str, err: str) -> str:
    assert code == 2, (out, err)
    assert out == ""
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    return lines[0]


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["check"], ["the following arguments are required: TARGET"]),
        (["check", "tpsim.layers", "--backend", "mpi"], ["--backend", "'mpi'", "inproc, gloo, nccl"]),
        (["check", "tpsim.layers", "--world-sizes", "1,x"], ["--world-sizes", "'x'", "int >= 1"]),
        (["check", "tpsim.layers", "--world-sizes", "0"], ["--world-sizes", "'0'", "int >= 1"]),
        (["check", "tpsim.layers", "--dtypes", "float8"], ["--dtypes", "'float8'", "float64, float32, bfloat16, float16"]),
        (["check", "tpsim.layers", "--max-examples", "0"], ["--max-examples", "'0'", "int >= 1"]),
        (["check", "tpsim.layers", "--seed", "-1"], ["--seed", "'-1'", "int >= 0"]),
        (["check", "tpsim.layers", "--timeout", "0"], ["--timeout", "'0'", "positive number of seconds"]),
        (["check", "tpsim.layers", "--report", "xml"], ["--report", "'xml'", "text, json"]),
        (["check", "tpsim.layers", "--convention", "megatron"], ["--convention", "'megatron'", "master-weight, tp-rank"]),
        (["check", "tpsim.layers", "--kind", "diagonal"], ["--kind", "'diagonal'", "column, row"]),
        (["check", "tpsim.layers", "--input", "scattered"], ["--input", "'scattered'", "replicated, sharded"]),
        (["check", "tpsim.layers", "--output", "summed"], ["--output", "'summed'", "sharded, gathered, partial, reduced"]),
        (["check", "tpsim.layers", "--input-grad", "full"], ["--input-grad", "'full'", "complete, partial"]),
        (["check", "tpsim.layers", "--faults", "drop,meteor"], ["--faults", "'meteor'", "drop, crash, delay, corrupt, mismatch"]),
        (["check", "tpsim.layers", "--bogus"], ["unrecognized arguments: --bogus"]),
        (["frobnicate"], ["invalid choice: 'frobnicate'"]),
        (["replay"], ["the following arguments are required: CASE.json"]),
        (["replay", "x.json", "--backend", "mpi"], ["--backend", "'mpi'"]),
    ],
)
def test_bad_options_exit_2_naming_value_and_choices(capsys, argv, expected) -> None:
    line = _one_line_error(*run_cli(capsys, *argv))
    assert line.startswith("tpsim")
    assert ": error: " in line
    for text in expected:
        assert text in line, line


def test_no_command_is_a_usage_error(capsys) -> None:
    code, out, err = run_cli(capsys)
    assert code == 2 and out == ""
    assert "name a command: check, replay or zoo" in err


@pytest.mark.parametrize(
    "target, expected",
    [
        ("no_such_module_tpsim:Layer", ["cannot import module 'no_such_module_tpsim'"]),
        ("missing/layer.py:Layer", ["target file 'missing/layer.py' does not exist"]),
        ("tpsim.layers:NoSuchLayer", ["declares no variant named 'NoSuchLayer'", "ColumnParallelLinear"]),
        (f"{SKILL}:NoSuchClass", ["has no attribute 'NoSuchClass'"]),
        (f"{SKILL}:torch", ["is module, not a tpsim Variant", "or an nn.Module class"]),
        ("tpsim.errors", ["declares no variants"]),
        ("examples/skill_convention.py:_SumOverRanks", ["not a tpsim Variant", "or an nn.Module class"]),
    ],
)
def test_targets_that_cannot_be_resolved_exit_2_naming_the_target(capsys, target, expected) -> None:
    line = _one_line_error(*run_cli(capsys, "check", target, *FAST))
    assert line.startswith(f"tpsim check: error: cannot check {target!r}: ")
    for text in expected:
        assert text in line, line


def test_a_target_file_that_raises_on_import_exits_2(capsys, tmp_path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("import torch\nraise ImportError('needs a GPU library')\n")
    line = _one_line_error(*run_cli(capsys, "check", f"{bad}:Layer"))
    assert f"importing {str(bad)!r} failed: ImportError: needs a GPU library" in line


def test_convention_and_kind_that_cannot_be_told_exit_2(capsys, tmp_path) -> None:
    module = tmp_path / "odd.py"
    module.write_text(textwrap.dedent("""
        from torch import nn

        class Both(nn.Module):
            def __init__(self, in_features, out_features, tp_size, tp_rank, master_weight):
                super().__init__()

        class Projection(nn.Module):
            def __init__(self, in_features, out_features, bias, master_weight):
                super().__init__()
    """))
    line = _one_line_error(*run_cli(capsys, "check", f"{module}:Both", "--kind", "row"))
    assert "cannot tell the convention of Both" in line and "--convention master-weight|tp-rank" in line
    line = _one_line_error(*run_cli(capsys, "check", f"{module}:Projection"))
    assert "cannot tell whether Projection is column- or row-parallel" in line and "--kind column|row" in line


def test_adapter_options_that_contradict_a_variant_exit_2(capsys) -> None:
    line = _one_line_error(*run_cli(capsys, "check", "tpsim.layers", "--convention", "tp-rank"))
    assert "--convention applies to plain nn.Module classes only" in line
    line = _one_line_error(*run_cli(capsys, "check", "tpsim.layers:RowParallelLinear", "--kind", "column"))
    assert "is a row variant; --kind column contradicts it" in line
    line = _one_line_error(*run_cli(capsys, "check", "tpsim.layers:RowParallelLinear", "--output", "sharded"))
    assert "output='sharded' is not valid for a row layer" in line


def test_nccl_without_gpus_says_why_and_exits_2(capsys) -> None:
    from tpsim.comm.procs import nccl_unavailable_reason

    reason = nccl_unavailable_reason(3)
    if reason is None:
        pytest.skip("this machine can run nccl with 3 ranks")
    line = _one_line_error(*run_cli(capsys, "check", "tpsim.layers", "--backend", "nccl", "--world-sizes", "1,3"))
    assert line == f"tpsim check: error: backend nccl cannot run here: {reason}; use --backend gloo or inproc"


def test_help_and_version_exit_0(capsys) -> None:
    code, out, _ = run_cli(capsys, "check", "--help")
    assert code == 0 and "--input-grad" in out and "--cases-dir" in out
    code, out, _ = run_cli(capsys, "--version")
    assert code == 0 and out.startswith("tpsim ")


def test_faults_run_fault_plans_too(capsys, tmp_path) -> None:
    code, out, _ = run_cli(capsys, "check", "tpsim.layers:RowParallelLinear", "--faults", "drop,crash",
                       "--max-examples", "4", "--world-sizes", "2", "--seed", "0", "--report", "json",
                       "--cases-dir", str(tmp_path))
    assert code == 0, out
    doc = json.loads(out)
    assert doc["settings"]["faults"] == ["drop", "crash"]
    # The property search's examples plus the fault plans (up to --max-examples of each).
    assert doc["examples"] > 4


@pytest.mark.gloo
def test_check_on_gloo_imports_a_file_target_in_every_worker(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "check", "examples/tutorial_convention.py:RowParallelLinear", "--backend", "gloo",
                         "--world-sizes", "2", "--max-examples", "3", "--seed", "0", "--cases-dir", str(tmp_path))
    assert code == 0, out + err
    assert out.splitlines()[0].startswith("tpsim check examples/tutorial_convention.py:RowParallelLinear: 1 variant on gloo")
    assert "PASS RowParallelLinear" in out


# --- real processes ------------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    return env


@pytest.mark.slow
def test_python_dash_m_tpsim_check(tmp_path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tpsim", "check", "tpsim.layers", "--max-examples", "3", "--world-sizes", "1,2",
         "--seed", "0", "--cases-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "all properties hold: " in proc.stdout and " FAIL " not in proc.stdout
    assert proc.stderr == ""


def _console_script() -> str:
    found = shutil.which("tpsim") or os.path.join(sysconfig.get_path("scripts"), "tpsim")
    if not os.path.exists(found):
        pytest.skip("the tpsim console script is not installed (pip install -e .)")
    return found


@pytest.mark.slow
def test_console_script_check_of_a_buggy_example_exits_1(tmp_path) -> None:
    proc = subprocess.run(
        [_console_script(), "check", BUGGY, "--max-examples", "10", "--world-sizes", "1,2,3", "--seed", "0",
         "--cases-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "FAILED forward-equivalence: bias-duplication" in proc.stdout
    assert "tpsim replay " in proc.stdout


@pytest.mark.slow
def test_console_script_imports_modules_from_the_working_directory(tmp_path) -> None:
    # Like `python -m`, the console script makes the working directory importable.
    shutil.copy(ROOT / SKILL, tmp_path / "my_tp_layers.py")
    proc = subprocess.run(
        [_console_script(), "check", "my_tp_layers:RowParallelLinear", "--output", "reduced", "--max-examples", "3",
         "--world-sizes", "2", "--seed", "0"],
        cwd=tmp_path, capture_output=True, text=True, timeout=300, env=_env(),
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS RowParallelLinear" in proc.stdout


def test_console_script_usage_error_exits_2(tmp_path) -> None:
    proc = subprocess.run([_console_script(), "check", "tpsim.layers", "--backend", "mpi"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2
    assert proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "tpsim check: error: argument --backend: invalid value 'mpi'; expected one of inproc, gloo, nccl "
        "(see 'tpsim check --help')"
    ]
