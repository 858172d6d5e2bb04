"""The benchmark scripts still run and write well-formed output (never asserts a timing).

``python -m bench --quick`` runs every section on a tiny configuration into a temporary folder;
the tests check the files it writes: the markdown tables, the JSON result, the PNG figures.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tpsim
from bench import report, workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
SECTION_TITLES = (
    "## What you wait for",
    "## Collective step vs world size",
    "## Property examples per second",
    "## Mutants: examples and seconds to catch",
    "## Lab-note MLP",
    "## Fault detection latency",
    "## Peak memory",
    "## DTensor path",
    "## Scale: a whole check vs the dense forward+backward",
)


# The quick benchmark run takes minutes and runs real gloo worlds (in its own process, where the
# conftest's gloo guard cannot see them): the tests that read it are slow and gloo (thorough tier).
@pytest.fixture(scope="module")
def quick_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    done = subprocess.run([sys.executable, "-m", "bench", "--quick", "--out", str(out)], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return out, done.stdout


@pytest.mark.slow
@pytest.mark.gloo
def test_quick_run_writes_every_output(quick_run):
    out, stdout = quick_run
    assert sorted(os.listdir(out)) == ["bench.json", "bench.md", "bench_props.png", "bench_scale.png", "bench_step.png"]
    for name in ("bench_props.png", "bench_scale.png", "bench_step.png"):
        with open(out / name, "rb") as fh:
            assert fh.read(8) == PNG_MAGIC, name
    assert "[bench] wrote" in stdout and "inproc/floor=" in stdout


@pytest.mark.slow
@pytest.mark.gloo
def test_quick_markdown_has_every_table(quick_run):
    out, _ = quick_run
    text = (out / "bench.md").read_text()
    for title in SECTION_TITLES:
        assert title in text, title
    machine = report.machine()
    assert machine["cpu"] in text and machine["torch"] in text  # the doc names its machine
    assert "![collective step vs world size](bench_step.png)" in text
    assert "| swiglu, sequence parallel |" in text and "examples to catch" in text
    # every table row has as many cells as its header
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("|---") or line.startswith("|:"):
            width = lines[i - 1].count("|")
            j = i + 1
            while j < len(lines) and lines[j].startswith("|"):
                assert lines[j].count("|") == width, (lines[i - 1], lines[j])
                j += 1


@pytest.mark.slow
@pytest.mark.gloo
def test_quick_json_is_well_formed(quick_run):
    out, _ = quick_run
    result = json.loads((out / "bench.json").read_text())
    assert result["quick"] is True
    step = result["step"]
    assert set(step["seconds"]) == {"floor", "compute", "inproc", "threaded", "gloo"}
    for ws in step["sizes"]:
        for backend in ("floor", "compute", "inproc"):
            assert isinstance(step["seconds"][backend][str(ws)], float)
            # the reported time is the fastest of the recorded samples
            assert step["seconds"][backend][str(ws)] == min(step["samples"][backend][str(ws)])
    assert [h["world_size"] for h in result["headline"]] == step["headline"]
    assert all(isinstance(h["inproc_over_floor"], float) for h in result["headline"])
    assert result["props"]["backends"]["inproc"]["failures"] == 0  # tpsim's own layer passes
    assert result["labmlp"]["equal"] is True
    assert [r["config"] for r in result["labmlp"]["rows"]] == ["gelu", "swiglu, sequence parallel"]
    assert all(r["equal"] for r in result["labmlp"]["rows"])
    mutants = result["mutants"]["rows"]
    assert mutants and all(r["caught"] for r in mutants)
    assert all(isinstance(r["found_after"], int) and 1 <= r["found_after"] <= r["examples"] for r in mutants)
    assert result["mutants"]["catalog_size"] >= len(mutants)
    assert set(result["load"]) == {"start", "end"}
    assert result["faults"]["rows"] and all(r["detected"] for r in result["faults"]["rows"])
    assert {r["mode"] for r in result["memory"]["rows"]} == {"dense", "inproc"}
    assert result["dtensor"]["rows"]["DTensor ColwiseParallel"]["inproc"]["failures"] == 0
    checks = result["checks"]
    # the quick run checks tpsim's column layer on inproc, isolated (the default) and not
    assert [(r["command"], r["backend"]) for r in checks["rows"]] == [("ws 1-4", "inproc"),
                                                                    ("ws 1-4", "inproc, not isolated")]
    for r in checks["rows"]:
        assert r["passed"] is True and r["exit"] == 0 and r["examples"] >= 1, r
        assert 0 < r["check_s"] <= r["wall_s"], r
        assert r["command_line"].startswith("tpsim check tpsim.layers:ColumnParallelLinear --seed 0")
    assert "overhead" not in checks  # a section of its own
    [overhead] = result["overhead"]["rows"]
    assert overhead["world_size"] == 4
    assert overhead["wall_us"] == min(w for w, _ in overhead["samples"]["inproc"])  # the fastest round
    assert overhead["cpu_us"] == min(c for _, c in overhead["samples"]["inproc"])
    # the floor beside it: a thread hand-off per rank (the cheaper ring), and torch's own all_reduce wrapper
    assert overhead["handoff_floor_us"] == min(overhead["plain_ring_us"], overhead["placed_ring_us"]) > 0
    assert overhead["torch_wrapper_us"] >= 0
    assert overhead["floor_us"] == overhead["handoff_floor_us"] + overhead["torch_wrapper_us"]
    assert overhead["ratio"] == overhead["wall_us"] / overhead["floor_us"]
    assert {k: len(v) for k, v in overhead["samples"].items()} == dict.fromkeys(
        ("inproc", "plain", "placed", "wrapped", "direct"), result["overhead"]["repeats"])
    scale = result["scale"]["families"]
    assert set(scale) == {"mlp", "embedding", "cross-entropy"}
    for rows in scale.values():
        assert rows and all(r["passed"] for r in rows)


@pytest.mark.slow
@pytest.mark.gloo
def test_quick_markdown_says_what_a_user_waits_for(quick_run):
    out, stdout = quick_run
    text = (out / "bench.md").read_text()
    assert "| `tpsim check tpsim.layers:ColumnParallelLinear --seed 0 --world-sizes 1,2,3,4 --max-examples 5 " \
           "--world-sizes 1,2` | inproc, not isolated |" in text
    assert "| inproc cost per collective per rank / its floor, world size 4, tiny tensors | <= 2x |" in text
    assert "[bench] inproc cost per collective per rank / its floor" in stdout
    assert "## Per-collective cost" in text


@pytest.mark.gloo
def test_checks_section_runs_gloo_and_counts_pool_replacements(tmp_path):
    # tpsim check on gloo, end to end in a fresh process: every refused (non-divisible) case keeps its
    # pool, so a correct layer's check replaces none
    import dataclasses

    from bench import sections

    cfg = dataclasses.replace(sections.QUICK, backends=("gloo",), check_extra=("--max-examples", "8", "--world-sizes",
                                                                              "2,3"))
    result = sections.checks(cfg)
    [row] = result["rows"]
    assert (row["command"], row["backend"]) == ("ws 1-4", "gloo")
    assert row["passed"] is True and row["examples"] >= 1
    assert row["pool_replacements"] == 0 and row["pool_replacements_by_reason"] == {}


def test_report_judges_every_goal():
    result = {
        "quick": False, "machine": report.machine(), "date": "today", "total_s": 1.0,
        "checks": {"rounds": 1, "extra": [], "notes": [],
                   "rows": [{"command": c, "what": c, "backend": b, "command_line": f"tpsim check {c}", "check_s": s,
                             "wall_s": s + 3, "examples": 100, "passed": True, "pool_replacements_total": 0}
                            for c, b, s in [("ws 1-4", "inproc", 1.5), ("ws 1-4", "gloo", 4.5),
                                            ("default", "inproc", 2.0), ("default", "gloo", 13.0)]]},
        "props": {"backends": {"inproc": {"fastest_per_example_s": 0.010},
                               "inproc isolated": {"fastest_per_example_s": 0.0105}}},
    }
    met = {t["target"]: (t["measured_text"], t["met"]) for t in report.targets(result)}
    assert met["gloo, column layer, 100 examples, world sizes 1-4"] == ("4.5 s", True)
    assert met["the same, gloo / inproc"] == ("3.00x", True)
    assert met["gloo, the default command (world sizes 1,2,3,4,8)"] == ("13 s", False)
    assert met["gloo, Megatron-core preset, 10 examples, world sizes 1,2,4"] == ("—", None)
    assert met["isolated inproc vs plain, per example (props section)"] == ("5.0% slower", True)
    assert met["inproc cost per collective per rank / its floor, world size ?, tiny tensors"] == ("—", None)
    # one goal per world size the overhead section measured, judged on wall time against the floor beside it
    result["overhead"] = {"repeats": 1, "torch_wrapper_hot_us": 1.5, "torch_wrapper_inproc_us": 3.5, "rows": [
        {"world_size": ws, "calls": 100, "wall_us": wall, "cpu_us": 9.0, "plain_ring_us": 4.0, "placed_ring_us": 2.0,
         "handoff_floor_us": 2.0, "torch_wrapper_us": 3.0, "floor_us": 5.0, "floor_cpu_us": 5.0,
         "ratio": wall / 5.0, "cpu_ratio": 9.0 / 5.0} for ws, wall in ((8, 9.5), (32, 12.5))]}
    met = {t["target"]: (t["measured_text"], t["met"]) for t in report.targets(result)}
    assert met["inproc cost per collective per rank / its floor, world size 8, tiny tensors"] == (
        "1.90x (9.5 us against a floor of 5 us; CPU time: 1.80x)", True)
    assert met["inproc cost per collective per rank / its floor, world size 32, tiny tensors"] == (
        "2.50x (12.5 us against a floor of 5 us; CPU time: 1.80x)", False)
    section = "\n".join(report.overhead_markdown(result))
    assert "| 32 | 100 | 12.5 | 9 | 4 | 2 | 3 | 5 | 2.50x | 1.80x |" in section
    assert "within 2x of its floor at every world size: met at 8; not met at 32." in section
    del result["overhead"]
    text = report.markdown({k: v for k, v in result.items() if k != "props"}, {})
    # the paragraph the README quotes reports the default command's measured times on both backends
    assert ("`tpsim check tpsim.layers:ColumnParallelLinear --seed 0` (the default: 100 generated examples at "
            "world sizes 1, 2, 3, 4 and 8) took 2 s on inproc and 13 s with `--backend gloo` (5 s and 16 s for the "
            "whole command") in text
    assert "| gloo, the default command (world sizes 1,2,3,4,8) | <= 12 s | 13 s | no |" in text
    assert "| `tpsim check default` | gloo | 13 | 16 | 100 | yes | 0 |" in text


def test_workload_rejects_unknown_backend():
    with pytest.raises(ValueError, match="backend='mpi'; expected one of floor, compute, inproc, threaded, gloo"):
        workload.measure("mpi", 2, 1)
    with pytest.raises(ValueError, match="backend='mpi'"):
        workload.measure_interleaved(["floor", "mpi"], 2, 1)
    with pytest.raises(ValueError, match="repeats=0; expected an integer >= 1"):
        workload.measure_interleaved(["floor"], 2, 1, repeats=0)
    with pytest.raises(ValueError, match="'threaded' must be measured in a process of its own"):
        workload.measure_interleaved(["threaded", "inproc"], 2, 1)


def test_workload_interleaves_and_keeps_the_fastest():
    result = workload.measure_interleaved(["floor", "compute", "inproc"], 2, 2, repeats=3)
    for backend in ("floor", "compute", "inproc"):
        assert len(result["samples"][backend]) == 3
        assert result["loop_s"][backend] == min(result["samples"][backend])
    # a run at or over repeat_below_s is not repeated
    once = workload.measure_interleaved(["floor"], 2, 2, repeats=3, repeat_below_s=0.0)
    assert len(once["samples"]["floor"]) == 1


def test_floor_delivers_what_the_collectives_deliver():
    # The floor's arithmetic is the backends' arithmetic: after a few steps every rank's weight
    # is what inproc gives, bit for bit (rank-order sums everywhere).
    floor_state = workload.floor_state(3, 2)
    world_state = tpsim.run(workload.rank_state, 3, args=(2,))
    for r in range(3):
        for name in ("weight", "gathered", "input_grad"):
            assert torch.equal(floor_state[r][name], world_state[r][name]), (r, name)


@pytest.mark.parametrize("backend", ["floor", "compute", "inproc"])
def test_workload_measures(backend):
    result = workload.measure(backend, 2, 2)
    assert result["backend"] == backend and result["world_size"] == 2 and result["steps"] == 2
    assert result["loop_s"] > 0 and result["wall_s"] >= result["loop_s"]


def test_report_renders_mutant_and_lab_rows():
    # a mutant that was not caught says what was found instead; lab rows render one line each
    result = {
        "quick": True, "machine": report.machine(), "date": "today", "total_s": 1.0,
        "load": {"start": 3.0, "end": 5.5},
        "mutants": {"max_examples": 200, "rows": [
            {"mutant": "m-a", "diagnosis": "bias-duplication", "needs": "", "caught": True, "found_after": 7,
             "examples": 30, "seconds": 1.5, "diagnoses": ["bias-duplication"]},
            {"mutant": "m-b", "diagnosis": "wrong-shard-dim", "needs": "bias", "caught": False, "found_after": None,
             "examples": 200, "seconds": 9.0, "diagnoses": ["shape-error"]}]},
        "labmlp": {"rows": [{"config": "gelu", "hidden": 4, "intermediate": 8, "tp": 2, "dtype": "float32",
                             "tokens": [2], "dense_fwd_bwd_s": 0.5, "world_fwd_bwd_s": 1.0, "check_s": 2.0,
                             "equal": True}]},
    }
    text = report.markdown(result, {})
    assert "| m-a | bias-duplication | — | yes | 7 | 30 | 1.5 |" in text
    assert "| m-b | wrong-shard-dim | bias | NO: shape-error | — | 200 | 9 |" in text
    assert "1 of 2 caught" in text and "at example 7 (m-a)" in text
    assert "| gelu | 0.5 | 1 | 2 | 4.00x | yes |" in text
    assert "Load average (1 min) at the start of the run: 3.0, at the end: 5.5" in text


def test_report_renders_skipped_sizes():
    # a series with sizes skipped (None) renders as dashes, and the ratio of a missing value is a dash
    result = {
        "quick": False, "machine": report.machine(), "date": "today", "total_s": 1.0,
        "step": {"steps": 200, "sizes": [8, 128], "headline": [8, 128], "skipped": {"threaded": "too slow"},
                 "seconds": {"floor": {8: 0.1, 128: 2.0}, "compute": {8: 0.08, 128: None},
                             "inproc": {8: 0.2, 128: 4.4}, "threaded": {8: 1.0, 128: None},
                             "gloo": {8: 5.0, 128: None}}},
    }
    text = report.markdown(result, {})
    assert "| 8 | 0.1 | 0.2 | 1 | 2.00x | 2.50x | 5.00x |" in text  # headline
    assert "| 8 | 0.1 | 0.08 | 0.2 | 1 | 5 | 2.00x | 2.50x | 5.00x | 25.00x |" in text
    assert "| 128 | 2 | — | 4.4 | — | — | 2.20x | — | — | — |" in text
    assert "Furthest from the floor between world sizes 2 and 128: **2.20x** at world size 128" in text
    assert "*threaded*: too slow." in text


def test_readme_performance_section_is_regenerated_from_the_report():
    result = {
        "quick": False, "machine": report.machine(), "date": "today", "total_s": 1.0,
        "step": {"steps": 200, "sizes": [8, 32], "headline": [8, 32], "skipped": {},
                 "seconds": {"floor": {8: 0.1, 32: 0.5}, "compute": {8: 0.09, 32: 0.4},
                             "inproc": {8: 0.2, 32: 1.4}, "threaded": {8: 1.0, 32: 7.0},
                             "gloo": {8: 5.0, 32: None}}},
    }
    md = report.markdown(result, {})
    readme = "# x\n\n## Performance\n\nold numbers\n\n## Project layout\n\nkept\n"
    new = report.update_readme(readme, md)
    assert "old numbers" not in new and new.endswith("## Project layout\n\nkept\n")
    assert "| 32 | 0.5 | 1.4 | 7 | 2.80x | 3.50x | 5.00x |" in new
    assert "**2.80x** at world size 32" in new
    with pytest.raises(ValueError, match="no '## Performance' section"):
        report.update_readme("# x\n", md)


def test_readme_quotes_the_current_benchmark():
    # The README's performance section is what `python -m bench` last wrote to docs/bench.md.
    with open(os.path.join(ROOT, "docs", "bench.md"), encoding="utf-8") as fh:
        md = fh.read()
    with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as fh:
        readme = fh.read()
    assert report.update_readme(readme, md) == readme


@pytest.mark.parametrize("family", ["mlp", "embedding", "cross-entropy"])
def test_scale_worker_measures_a_passing_check_beside_its_dense_twin(family):
    from bench import sections

    row = sections.scale_worker(family, 64, 1, quick=True)
    assert row["passed"] is True and row["family"] == family and row["size"] == 64
    [only] = row["rounds"]
    assert only["failures"] == 0 and row["check_s"] == only["check_s"] and row["dense_s"] == only["dense_s"]
    assert row["ratio"] == row["check_s"] / row["dense_s"] and row["cpu_ratio"] > 0
    # the floor is measured beside them: drawing the case and the float64 oracle, plus the layer once
    assert row["floor_s"] == only["floor_s"] > 0
    assert row["floor_ratio"] == (row["floor_s"] + row["dense_s"]) / row["dense_s"] > 1
    if family == "mlp":
        assert "sizes=[64, 172]" in row["case"]  # ffn in the lab note's proportion (11008 / 4096)


def test_scale_table_has_a_row_per_size_and_a_goal_per_family():
    rows = {f: [{"size": s, "dense_s": 0.5, "check_s": 1.5 * s / 512, "ratio": 3.0 * s / 512, "cpu_ratio": 2.0,
                 "passed": True} for s in (512, 1024)] for f in ("mlp", "embedding", "cross-entropy")}
    result = {"scale": {"families": rows, "skipped": {}, "rounds": 2, "tokens": [2, 8], "ce_tokens": [2, 256],
                        "embedding_dim": 4096, "load": 3.0}}
    text = "\n".join(report.scale_markdown(result, {"scale": "bench_scale.png"}))
    assert "| SwiGLU MLP (tp 2) | hidden 1024 | 0.5 | — | 3 | 6.0x | 2.0x | — | — | yes |" in text
    assert text.count("| vocab-parallel") == 4 and "![check time against size](bench_scale.png)" in text
    goals = {t["target"]: t for t in report.targets(result)}
    mlp = goals["lab-note MLP check / dense forward+backward (hidden 1024)"]
    assert mlp["measured"] == 6.0 and mlp["met"] is False and mlp["goal"] == "<= 4x"
    # with a floor measured, the table and the goal show it and the check against it
    rows["mlp"][1].update(floor_s=1.0, floor_ratio=3.0)
    text = "\n".join(report.scale_markdown(result, {}))
    assert "| SwiGLU MLP (tp 2) | hidden 1024 | 0.5 | 1 | 3 | 6.0x | 2.0x | 3.0x | 2.0x | yes |" in text
    goals = {t["target"]: t for t in report.targets(result)}
    assert goals["lab-note MLP check / dense forward+backward (hidden 1024)"]["measured_text"] == (
        "6.0x (CPU time: 2.0x; floor 3.0x)")


def test_overhead_worker_measures_inproc_beside_its_floor():
    import torch.distributed as dist

    from bench import sections

    result = sections.overhead_worker((3,), 20, 1)
    assert not dist.is_initialized()  # the one-rank world of the floor's wrapper is gone again
    [row] = result["rows"]
    assert row["world_size"] == 3 and row["calls"] == 20 * 32 // 3  # the calls at 32 ranks, scaled to 3
    assert row["wall_us"] > 0 and row["cpu_us"] > 0
    assert row["floor_us"] == min(row["plain_ring_us"], row["placed_ring_us"]) + row["torch_wrapper_us"]
    assert row["ratio"] == row["wall_us"] / row["floor_us"]
    assert result["torch_wrapper_hot_us"] is not None and result["torch_wrapper_inproc_us"] is not None
