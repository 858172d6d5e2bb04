"""Case files tpsim wrote on other machines, where its verdict was wrong or depended on the machine:
each comes out right, the same way on every machine, in ``tpsim replay`` and in the ``tpsim check``
that found it, isolated or not (CI runs this file again under other MKL kernels, ``.ci/run``).

The files under ``tests/field_cases/`` are verbatim copies of the ones reported (the suite needs no
folder outside the repository); each test replays a copy, from the repository root, as a user would.

- ``picotron-kv_repeat_tiled-amd.json``: on an AMD EPYC machine the check of picotron's block with
  its key/value heads tiled (``repeat`` for ``repeat_interleave``) claimed a second, false cause,
  ``attention.out_proj: packed-shard-layout``, saved in this file: over one token, loading the
  out-projection's input heads per part undoes the wrong head pairing exactly, and the check ran
  that re-run with the packed declaration while the isolated replay's worker ran the block as
  declared. On an AVX-512 Intel machine the same case passed outright: a one-token attention's query
  grad is pure rounding, and the dense twin's tolerance took its relative error (1e9) for every
  tensor's.
  Truth: one cause, ``attention: qkv-head-mismatch``.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from helpers import ROOT, run_cli

FIELD_CASES = Path(__file__).resolve().parent / "field_cases"
PICOTRON = "picotron-kv_repeat_tiled-amd.json"
#: The one true cause of the picotron case: (property, sublayer, diagnosis).
PICOTRON_TRUTH = [("forward-equivalence", "attention", "qkv-head-mismatch")]
ISOLATION = [pytest.param([], id="isolated"), pytest.param(["--no-isolate"], id="no-isolate")]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)  # the case names its target relative to the repository root


def _causes(failures: list[dict]) -> list[tuple[str, str, str]]:
    return [(f["property"], f["sublayer"], f["diagnosis"]) for f in failures]


@pytest.mark.parametrize("flags", ISOLATION)
def test_the_picotron_field_case_replays_to_its_one_true_cause(capsys, tmp_path, flags) -> None:
    case_file = tmp_path / PICOTRON
    shutil.copy(FIELD_CASES / PICOTRON, case_file)
    code, out, err = run_cli(capsys, "replay", str(case_file), "--report", "json", *flags)
    assert code == 1, out + err
    doc = json.loads(out)
    assert doc["recorded"]["diagnosis"] == "packed-shard-layout"  # what the AMD machine saved
    assert doc["passed"] is False and doc["reproduced"] is False
    assert _causes(doc["failures"]) == PICOTRON_TRUTH, [f["message"] for f in doc["failures"]]
    # The confirmation behind the name: every key/value head made one head passes the case.
    assert doc["failures"][0]["details"]["params"] == ["attention.k_proj.weight", "attention.v_proj.weight"]


@pytest.mark.parametrize("flags", ISOLATION)
def test_the_check_that_found_the_picotron_field_case_finds_it_again_with_one_cause(capsys, tmp_path, flags) -> None:
    recorded = json.loads((FIELD_CASES / PICOTRON).read_text())
    command = recorded["found"]["command"].split()
    assert command[:2] == ["tpsim", "check"] and command[-1] == "--no-isolate"
    code, out, err = run_cli(capsys, *command[1:-1], "--report", "json", "--cases-dir", str(tmp_path), *flags)
    assert code == 1, out + err
    doc = json.loads(out)
    assert _causes(doc["failures"]) == PICOTRON_TRUTH, [f["message"] for f in doc["failures"]]
    # The same minimal case as on the AMD machine: the search saw the same verdicts on the way.
    saved = json.loads(Path(doc["failures"][0]["case_file"]).read_text())
    assert saved["case"] == recorded["case"]
