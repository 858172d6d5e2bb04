"""Nothing found is lost: ``tpsim check`` reports a failure before anything that can go wrong with
it (saving its case file), survives Ctrl-C with what it had found, and keeps ``--report json``
valid whatever the checked layer prints."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import pytest
from helpers import BUGGY, FAST, ROOT, run_cli

from tpsim.props.case import MAX_NAME_CHARS, load_case


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


# --- saving case files -----------------------------------------------------------------------------


def test_an_unwritable_cases_dir_falls_back_to_a_temp_dir_and_says_so(capsys, tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cases = blocker / "cases"  # cannot be created, whoever runs the test (root included)
    code, out, err = run_cli(capsys, "check", BUGGY, *FAST, "--cases-dir", str(cases))
    assert code == 1, out + err
    lines = out.splitlines()
    failed = lines.index("  FAILED forward-equivalence: bias-duplication")
    note = next(line for line in lines[failed:] if line.startswith("    note:"))
    assert f"--cases-dir {str(cases)!r} cannot be written (Not a directory); saved in " in note
    fallback = note.rsplit("saved in ", 1)[1].removesuffix(" instead")
    path = next(line for line in lines if line.startswith("    case file:")).split(":", 1)[1].strip()
    assert os.path.dirname(path) == fallback and os.path.isfile(path)
    assert lines.index(note) < lines.index(f"    case file:    {path}")  # the note comes first
    case, found = load_case(path)
    assert found["diagnosis"] == "bias-duplication" and case.world_size == 2
    code, out, _ = run_cli(capsys, "check", BUGGY, *FAST, "--cases-dir", str(cases), "--report", "json")
    failure = json.loads(out)["failures"][0]
    assert os.path.isfile(failure["case_file"]) and "cannot be written" in failure["case_file_note"]


def test_a_path_too_long_for_the_file_system_falls_back_too(capsys, tmp_path) -> None:
    cases = tmp_path / ("d" * 300)  # one name component over 255 bytes: ENAMETOOLONG
    code, out, err = run_cli(capsys, "check", BUGGY, *FAST, "--cases-dir", str(cases))
    assert code == 1, out + err
    assert "cannot be written (File name too long); saved in " in out
    assert "    replay:       tpsim replay " in out


LONG_NAME = '''
from tpsim.mutants import row_bias_before_reduce

long_variant = row_bias_before_reduce.replace(name="RowBiasBeforeReduceWithAVeryLongName" * 12)
'''


def test_a_very_long_variant_name_gets_a_short_case_file_name_that_replays(capsys, tmp_path) -> None:
    module = tmp_path / "long_names.py"
    module.write_text(LONG_NAME)
    cases = tmp_path / "cases"
    code, out, err = run_cli(capsys, "check", f"{module}:long_variant", "--world-sizes", "2", "--max-examples", "30",
                         "--seed", "0", "--cases-dir", str(cases), "--report", "json")
    assert code == 1, out + err
    failure = json.loads(out)["failures"][0]
    name = os.path.basename(failure["case_file"])
    assert os.path.dirname(failure["case_file"]) == str(cases) and "case_file_note" not in failure
    assert len(name.encode()) < 255 and name.startswith("RowBiasBeforeReduceWithAVeryLongName")
    assert name.split("-")[0][MAX_NAME_CHARS] == "~"  # cut, then a hash of the whole name
    os.chdir(tmp_path)  # the target file is here (the fixture restores the directory)
    code, out, err = run_cli(capsys, "replay", failure["case_file"])
    assert code == 1 and "reproduced: forward-equivalence: bias-duplication" in out, out + err


# --- stdout belongs to the JSON report -----------------------------------------------------------------


NOISY = '''
import os
import sys

print("importing the noisy layer")
sys.path.insert(0, {examples!r})
from skill_convention import BuggyRowParallelLinear as _Base


class NoisyRowParallelLinear(_Base):
    def forward(self, x):
        import torch.distributed as dist

        print(f"hello from rank {{dist.get_rank()}}")
        os.write(1, b"native write\\n")  # below Python's sys.stdout, as C code would write
        return super().forward(x)
'''


def _noisy(tmp_path: pathlib.Path) -> str:
    module = tmp_path / "noisy.py"
    module.write_text(NOISY.format(examples=str(ROOT / "examples")))
    return f"{module}:NoisyRowParallelLinear"


def test_json_report_stays_valid_whatever_the_layer_prints(capsys, tmp_path) -> None:
    code, out, err = run_cli(capsys, "check", _noisy(tmp_path), *FAST, "--report", "json",
                         "--cases-dir", str(tmp_path / "cases"))
    assert code == 1, out + err
    doc = json.loads(out)  # stdout is exactly one JSON document
    failure = next(f for f in doc["failures"] if f["diagnosis"] == "bias-duplication")
    # the output of the failure's own run (its minimal case has two ranks)
    assert failure["case"]["world_size"] == 2
    printed = "".join(failure["output"].values())
    assert "hello from rank 0\n" in printed and "hello from rank 1\n" in printed and "native write\n" in printed
    assert "hello from rank 2" not in printed  # the output of larger cases stays with them
    os.chdir(tmp_path)  # the target file is here (the fixture restores the directory)
    code, out, err = run_cli(capsys, "replay", failure["case_file"], "--report", "json")
    assert code == 1, out + err
    doc = json.loads(out)
    assert "hello from rank 1\n" in "".join(doc["failures"][0]["output"].values())


def test_ranks_in_this_process_have_their_output_told_apart(capsys, tmp_path) -> None:
    # Ranks that run as threads of the checker itself (no isolating worker process): each rank's
    # Python-level output under its own key, native writes under "process".
    code, out, err = run_cli(capsys, "check", _noisy(tmp_path), *FAST, "--report", "json", "--no-isolate",
                         "--cases-dir", str(tmp_path / "cases"))
    assert code == 1, out + err
    failure = next(f for f in json.loads(out)["failures"] if f["diagnosis"] == "bias-duplication")
    assert set(failure["output"]["rank 0"].splitlines()) == {"hello from rank 0"}
    assert set(failure["output"]["rank 1"].splitlines()) == {"hello from rank 1"}
    assert set(failure["output"]["process"].splitlines()) == {"native write"}


@pytest.mark.slow
def test_json_report_in_a_subprocess_has_nothing_else_on_stdout(tmp_path) -> None:
    # The real descriptor 1 of a real process: native writes and late flushes included.
    proc = subprocess.run(
        [sys.executable, "-m", "tpsim", "check", _noisy(tmp_path), "--max-examples", "5", "--world-sizes", "2",
         "--seed", "0", "--report", "json", "--cases-dir", str(tmp_path / "cases")],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    doc = json.loads(proc.stdout)
    assert doc["failures"] and "native write" in doc["failures"][0]["output"]["process"]


# --- Ctrl-C ---------------------------------------------------------------------------------------------


SLOW_AND_WRONG = '''
import os
import time

import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class SlowDoubledColumn(nn.Module):
    """Wrong on every case (twice the output), and slow: a search of it runs until interrupted."""

    def __init__(self, in_features, out_features, bias, master_weight):
        super().__init__()
        ws, rank = dist.get_world_size(), dist.get_rank()
        self.weight = nn.Parameter(master_weight.chunk(ws, 0)[rank].clone())
        self.bias = None

    def forward(self, x):
        with open({counter!r}, "a") as fh:
            fh.write(".")
        time.sleep(0.05)
        # From the 20th call on, wait (bounded, within the example timeout) for the test to release
        # it: the search is then surely still running when Ctrl-C arrives, however loaded the machine.
        if os.path.getsize({counter!r}) >= 20:
            deadline = time.monotonic() + 20
            while not os.path.exists({release!r}) and time.monotonic() < deadline:
                time.sleep(0.05)
        return 2 * F.linear(x, self.weight)
'''


def _interrupted_run(tmp_path: pathlib.Path, *extra: str) -> subprocess.CompletedProcess[str]:
    counter, release = tmp_path / "calls", tmp_path / "release"
    module = tmp_path / "slow.py"
    module.write_text(SLOW_AND_WRONG.format(counter=str(counter), release=str(release)))
    argv = [sys.executable, "-m", "tpsim", "check", f"{module}:SlowDoubledColumn", "--input-grad", "partial",
            "--max-examples", "1000", "--world-sizes", "1,2", "--seed", "0", "--cases-dir", str(tmp_path / "cases"),
            *extra]
    # A session of its own: the signal goes to the whole process group, as Ctrl-C in a terminal does.
    proc = subprocess.Popen(argv, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        # The event: 20 forward calls. Every case fails and examples run one after another, so by
        # then the first failing example has been recorded (it made 3 calls with --seed 0) and the
        # search is shrinking it; the 20th call waits for the release below, so the search cannot
        # end before Ctrl-C. A count of calls, not a delay: a loaded machine only makes it later.
        while not (counter.exists() and len(counter.read_text()) >= 20):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the search did not get going: {proc.communicate()}")
            time.sleep(0.1)
        os.killpg(proc.pid, signal.SIGINT)
        release.touch()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.slow
def test_ctrl_c_reports_and_saves_what_was_found(tmp_path) -> None:
    done = _interrupted_run(tmp_path)
    assert done.returncode == 130, done.stdout + done.stderr
    assert "FAIL SlowDoubledColumn" in done.stdout
    assert "  FAILED forward-equivalence: " in done.stdout
    assert "note: interrupted after " in done.stdout
    assert "interrupted: " in done.stdout.splitlines()[-1]
    path = next(line for line in done.stdout.splitlines() if line.startswith("    case file:")).split(":", 1)[1].strip()
    case, found = load_case(str(tmp_path / path) if not os.path.isabs(path) else path)
    assert found["property"] == "forward-equivalence" and case.variant == "SlowDoubledColumn"
    assert "tpsim check: interrupted" in done.stderr


@pytest.mark.slow
def test_ctrl_c_with_a_json_report_still_prints_valid_json(tmp_path) -> None:
    done = _interrupted_run(tmp_path, "--report", "json")
    assert done.returncode == 130, done.stdout + done.stderr
    doc = json.loads(done.stdout)
    assert doc["interrupted"] is True and doc["passed"] is False
    assert doc["failures"] and all(os.path.isfile(f["case_file"]) for f in doc["failures"])


def test_the_report_is_printed_before_the_case_is_saved(capsys, monkeypatch, tmp_path) -> None:
    # Whatever goes wrong while saving (here: a bug of our own), the failure is on stdout first.
    from tpsim.props import case as case_module

    def broken(*args, **kwargs):
        raise RuntimeError("disk on fire")

    monkeypatch.setattr(case_module, "save_case", broken)
    code, out, err = run_cli(capsys, "check", BUGGY, *FAST, "--cases-dir", str(tmp_path))
    assert code == 1, out + err
    assert "  FAILED forward-equivalence: bias-duplication" in out
    assert "minimal case: world_size=2 " in out
    assert "could not be saved in --cases-dir" in out and "RuntimeError: disk on fire" in out
    assert "case file:" not in out
