"""Hostile targets cannot forge, lose or hang a check: the process that decides the exit code never runs them.

Each probe (tests/hostile_probes.py) is a layer module that does something a checker must survive,
checked by ``python -m tpsim check`` in a subprocess; each test asserts the exit code, what was
printed, the case files and that no process the check started is left behind.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hostile_probes import PROBES, ProbeRun, run_probe  # noqa: E402

# Every probe runs tpsim in a subprocess against a target that misbehaves (seconds each): the
# thorough tier, which CI runs after the fast one.
pytestmark = pytest.mark.slow


def _run(name: str, tmp_path: Path) -> ProbeRun:
    run = run_probe(PROBES[name], tmp_path)
    assert run.orphans == [], f"{name} left processes behind: {run.orphans}"
    assert "internal error" not in run.err and "Traceback (most recent call last)" not in run.err.split("FAILED")[0], run.err
    return run


def _tpsim(cwd: Path, command: str) -> subprocess.CompletedProcess[str]:
    """Run a printed ``tpsim ...`` command as printed (``python -m tpsim`` standing for ``tpsim``)."""
    argv = shlex.split(command)
    assert argv[0] == "tpsim", command
    return subprocess.run([sys.executable, "-m", "tpsim", *argv[1:]], cwd=cwd, capture_output=True, text=True,
                          timeout=300)


# --- exits at import --------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "what"), [
    ("system-exit-0-at-import", "the target module raised SystemExit(0) while being imported"),
    ("os-exit-0-at-import", "the target module called os._exit(0) while being imported"),
    ("sys-exit-1-at-import", "the target module raised SystemExit(1) while being imported"),
    ("keyboard-interrupt-at-import", "the target module raised KeyboardInterrupt while being imported"),
])
def test_a_target_that_ends_its_import_is_a_usage_error_naming_what_it_did(name: str, what: str,
                                                                          tmp_path: Path) -> None:
    run = _run(name, tmp_path)
    assert run.code == 2, run
    assert run.out == ""
    assert run.err.strip() == f"tpsim check: error: cannot check 'layer.py:Row': {what}"


def test_an_atexit_hook_cannot_turn_a_failure_into_a_pass(tmp_path: Path) -> None:
    run = _run("atexit-os-exit-0-after-fail", tmp_path)
    assert run.code == 1, run
    assert "FAILED forward-equivalence: exception" in run.out and "the layer is broken" in run.out
    assert len(run.cases) == 1


def test_a_thread_left_running_does_not_keep_tpsim_alive(tmp_path: Path) -> None:
    run = _run("non-daemon-thread-at-import", tmp_path)
    assert run.code == 0, run
    assert "all properties hold: 1 variant" in run.out


def test_chdir_at_import_changes_neither_where_cases_go_nor_the_replay_command(tmp_path: Path) -> None:
    run = _run("chdir-at-import", tmp_path)
    assert run.code == 1, run
    assert len(run.cases) == 1  # under the directory tpsim was run from
    found = json.loads(run.cases[0].read_text())["found"]
    assert found["cwd"] == str(run.cwd)
    replay = next(line.split("replay:", 1)[1].strip() for line in run.out.splitlines() if "replay:" in line)
    again = _tpsim(run.cwd, replay)
    assert again.returncode == 1 and "FAIL reproduced: forward-equivalence: exception" in again.stdout, again


def test_replacing_stdout_at_import_changes_nothing_in_the_report(tmp_path: Path) -> None:
    run = _run("stdout-replaced-at-import", tmp_path)
    assert run.code == 1, run
    assert run.out.startswith("tpsim check layer.py:Bad: 1 variant on inproc")
    assert "FAILED forward-equivalence: exception" in run.out
    assert "1 cause of failure" in run.out and len(run.cases) == 1


@pytest.mark.parametrize("name", ["signal-handlers-at-import", "env-vars-at-import"])
def test_process_state_a_target_sets_at_import_does_not_change_the_verdict(name: str, tmp_path: Path) -> None:
    run = _run(name, tmp_path)
    assert run.code == 0, run
    assert "all properties hold: 1 variant" in run.out


# --- the process tree -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["fork-child-in-forward", "setsid-grandchild-in-forward",
                                  pytest.param("fork-child-in-forward-gloo", marks=pytest.mark.gloo)])
def test_nothing_a_rank_forks_outlives_the_check(name: str, tmp_path: Path) -> None:
    run = _run(name, tmp_path)  # asserts no orphans
    assert run.code == 0, run
    assert "all properties hold: 1 variant" in run.out


# --- nothing found is lost ---------------------------------------------------------------------------


def test_a_refused_variant_among_others_is_reported_in_its_place(tmp_path: Path) -> None:
    run = _run("refused-variant-among-others", tmp_path)
    assert run.code == 1, run  # a found failure is never turned into a usage error
    doc = json.loads(run.out)
    assert [v["name"] for v in doc["variants"]] == ["Buggy", "Refused"]
    buggy, refused = doc["variants"]
    assert buggy["failures"] and not buggy["passed"]
    assert "checked in bfloat16 only" in refused["refused"] and refused["examples"] == 0
    assert "cannot check 'Refused'" in run.err
    assert len(run.cases) == 1


@pytest.mark.parametrize("name", ["stdout-head-c-10", "stdout-dev-full", "stdout-closed"])
def test_stdout_that_cannot_be_written_ends_quietly_with_the_case_saved(name: str, tmp_path: Path) -> None:
    run = _run(name, tmp_path)
    assert run.code == 1, run
    assert "Traceback" not in run.err and "Error" not in run.err, run.err
    assert len(run.cases) == 1


def test_a_rank_that_ends_the_session_worker_is_a_failure_with_a_json_report(tmp_path: Path) -> None:
    run = _run("os-exit-in-forward-no-isolate", tmp_path)  # --no-isolate: the ranks run in the session worker
    assert run.code == 1, run
    doc = json.loads(run.out)
    # The judge runs apart from the session worker the ranks ran in: the rank's exit is the layer's failure.
    assert doc["passed"] is False
    (failure,) = doc["failures"]
    assert (failure["property"], failure["diagnosis"], failure["rank"]) == ("forward-equivalence", "rank-exited", 0)
    assert "exit status 0" in failure["message"] and "during forward" in failure["message"]


# --- no internal error from the checked code ----------------------------------------------------------


def test_a_recursion_limit_set_in_forward_is_the_layers_failure(tmp_path: Path) -> None:
    run = _run("recursion-limit-in-forward", tmp_path)
    assert run.code in (0, 1), run
    assert "internal error" not in run.out + run.err


@pytest.mark.parametrize("name", ["unprintable-exception", "unprintable-exception-no-isolate"])
def test_an_exception_that_cannot_be_printed_is_reported(name: str, tmp_path: Path) -> None:
    run = _run(name, tmp_path)
    assert run.code == 1, run
    assert "FAILED forward-equivalence: exception" in run.out
    assert "Unprintable" in run.out and len(run.cases) == 1


def test_a_metaclass_that_raises_is_a_usage_error(tmp_path: Path) -> None:
    run = _run("metaclass-raises-on-mro", tmp_path)
    assert run.code == 2, run
    assert run.err.startswith("tpsim check: error: cannot check 'layer.py:Weird': ")
    assert "no mro for you" in run.err


def test_a_huge_message_is_cut_in_the_report_and_kept_in_the_case_file(tmp_path: Path) -> None:
    run = _run("huge-exception-message", tmp_path)
    assert run.code == 1, run
    assert "FAILED forward-equivalence: exception" in run.out
    assert len(run.out) < 64_000 and "more characters" in run.out
    assert len(run.cases) == 1
    found = json.loads(run.cases[0].read_text())["found"]
    assert found["traceback"].count("spam") > 30_000  # far more than the report shows, and still replayable
    assert run.cases[0].stat().st_size < 1 << 20


# --- replay runs only what the user pointed at ----------------------------------------------------------


def _case_outside(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A failing case of a target file outside the directory replay runs in: (target, case file, cwd)."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    target = elsewhere / "layer.py"
    target.write_text(PROBES["atexit-os-exit-0-after-fail"].source.split("import atexit")[0])
    cwd = tmp_path / "work"
    cwd.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tpsim", "check", f"{target}:Bad", "--kind", "row", "--output",
                           "reduced", "--world-sizes", "1,2", "--dtypes", "float64", "--seed", "0", "--max-examples",
                           "5"], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc
    [case] = sorted(cwd.glob(".tpsim/cases/*.json"))
    return target, case, cwd


def test_the_printed_replay_command_works_as_printed_for_a_target_outside(tmp_path: Path) -> None:
    target, case, cwd = _case_outside(tmp_path)
    doc = json.loads(case.read_text())
    assert doc["found"]["cwd"] == str(cwd)
    proc = subprocess.run([sys.executable, "-m", "tpsim", "check", f"{target}:Bad", "--kind", "row", "--output",
                           "reduced", "--world-sizes", "1,2", "--dtypes", "float64", "--seed", "0", "--max-examples",
                           "5", "--report", "json"], cwd=cwd, capture_output=True, text=True, timeout=300)
    [failure] = json.loads(proc.stdout)["failures"]
    assert failure["replay"].endswith(" --allow-outside-target")
    again = _tpsim(cwd, failure["replay"])
    assert again.returncode == 1 and "FAIL reproduced" in again.stdout, again


def test_an_encoded_target_name_is_held_to_the_rule_of_its_path(tmp_path: Path) -> None:
    from tpsim._target_files import module_name_of_path

    target, case, cwd = _case_outside(tmp_path)
    doc = json.loads(case.read_text())
    doc["case"]["target"] = module_name_of_path(str(target)) + ":Bad"
    forged = cwd / "forged.json"
    forged.write_text(json.dumps(doc))
    proc = subprocess.run([sys.executable, "-m", "tpsim", "replay", "forged.json"], cwd=cwd, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2, proc
    assert "outside the current directory and the case file's directory" in proc.stderr
    assert "--allow-outside-target" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "tpsim", "replay", "forged.json", "--allow-outside-target"], cwd=cwd,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "FAIL reproduced" in proc.stdout, proc
