"""The torchtitan preset: Llama 3's feed-forward under torchtitan 0.3.0's own tp sharding
(``Module.parallelize(ParallelDims)``, the spmd_types backend inside ``get_spmd_context``), on a
CPU mesh, one tp group spanning the world; the same module outside the context is caught."""

from __future__ import annotations

import json
import pathlib

import pytest

from tpsim.cli import main

pytest.importorskip("torchtitan", reason="torchtitan (and triton, which it imports) not installed")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = ["--max-examples", "8", "--world-sizes", "1,2,4", "--seed", "0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _check(capsys, tmp_path, target: str, *extra: str) -> tuple[int, dict]:
    code = main(["check", target, *FAST, *extra, "--report", "json", "--cases-dir", str(tmp_path)])
    return code, json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("target", ["torchtitan.models.llama3", "torchtitan.models.common.feed_forward"])
def test_preset_passes(capsys, tmp_path, target) -> None:
    code, doc = _check(capsys, tmp_path, target)
    assert code == 0, json.dumps(doc["failures"], indent=1)
    (variant,) = doc["variants"]
    assert variant["name"] == "FeedForward-spmd_types" and variant["examples"] >= 8
    assert any("spanning the whole world" in n for n in variant["notes"])


def test_outside_the_spmd_context_the_reduction_is_missing(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "tests/titan_targets.py:NO_CONTEXT")
    assert code == 1
    causes = [(f["sublayer"], f["diagnosis"]) for f in doc["failures"]]
    assert causes and causes[0][1] == "missing-reduction", json.dumps(doc["failures"], indent=1)


def test_case_sizes_are_whole_world_groups() -> None:
    from hypothesis import given, settings
    from torchtitan.models.common.feed_forward import FeedForward

    from tpsim.presets.torchtitan import ffn_variant
    from tpsim.props.family import family_of

    variant = ffn_variant(FeedForward, "spmd_types", True)
    strategy = family_of(variant).cases(variant, world_sizes=(1, 2, 4), dtypes=("float64",), non_divisible=False,
                                         tp_sizes=(2,), subgroups=True, layouts=("contiguous",))

    @settings(max_examples=30, database=None)
    @given(strategy)
    def check(case):
        assert (case.tp_size or case.world_size) == case.world_size
        assert len(case.batch_shape) == 2  # [batch, seq, hidden]

    check()
