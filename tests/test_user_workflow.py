"""The daily workflow end to end, as a user meets it: the one-liner in their own test suite fails,
the failure names a case file and a replay command, and the replay reproduces it (inproc and gloo)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap

import pytest

pytest_plugins = ["pytester"]

USER_TESTS = """
from tpsim.props.suite import property_tests

TestRowLayer = property_tests("{target}", max_examples=40, seed=0, world_sizes=(1, 2, 3))
"""


def _run_user_suite(pytester: pytest.Pytester, target: str) -> pytest.RunResult:
    pytester.makepyfile(test_my_layer=textwrap.dedent(USER_TESTS.format(target=target)))
    return pytester.runpytest_subprocess("-p", "no:cacheprovider", "-W", "ignore::FutureWarning")


@pytest.mark.slow
def test_one_liner_passes_a_correct_variant(pytester: pytest.Pytester) -> None:
    result = _run_user_suite(pytester, "tpsim.layers:RowParallelLinear")
    result.assert_outcomes(passed=7)


def _replay(path: str, cwd: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tpsim", "replay", path, *extra],
        cwd=cwd, capture_output=True, text=True, timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["inproc", "gloo"])
def test_failing_one_liner_saves_a_case_that_replays(pytester: pytest.Pytester, backend: str) -> None:
    result = _run_user_suite(pytester, "tpsim.mutants:row_bias_before_reduce")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 1, result.stdout.str()
    out = result.stdout.str()
    assert "bias-duplication" in out
    match = re.search(r"Reproduce: tpsim replay (\S+\.json)", out)
    assert match, out
    path = match.group(1)
    saved = json.loads((pytester.path / path).read_text())
    assert saved["case"]["target"] == "tpsim.mutants:row_bias_before_reduce"
    assert saved["found"]["diagnosis"] == "bias-duplication"

    replay = _replay(path, str(pytester.path), "--backend", backend)
    assert replay.returncode == 1, replay.stdout + replay.stderr
    assert "FAIL reproduced: forward-equivalence: bias-duplication" in replay.stdout
