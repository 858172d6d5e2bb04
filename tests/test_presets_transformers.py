"""The Hugging Face transformers preset: any ``transformers.models.<family>`` with a tp plan, found
generically (no per-family table) and checked module by module under its own plan.

- discovery: Llama's and Qwen3-MoE's modules, switches and sizes are found from the model alone;
- ``tpsim check transformers.models.<family>`` passes for families whose plans are right (a fast
  pair; a fixed sample of 20 in the thorough tier) and names the released defects in others;
- seeded defects (one plan rule changed by a subclass, as a patch would): rowwise turned colwise in
  Llama, Qwen2, Mistral, Gemma3 and Mixtral's experts, and Qwen3-MoE's experts run local (no
  reduction), and GLM's packed gate/up projection with its gather dropped, each caught and named with its
  sublayer; a case file of one replays on gloo;
- the zoo: ``tpsim zoo transformers --families ...`` writes the table and its JSON twin.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest

from tpsim.cli import main

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = ["--max-examples", "4", "--world-sizes", "1,2,4", "--seed", "0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory) -> None:
    monkeypatch.chdir(ROOT)
    # discoveries are kept on disk between processes of one check; a test session keeps its own
    monkeypatch.setenv("TPSIM_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "tpsim-cache"))


def _check(capsys, tmp_path, target: str, *extra: str) -> tuple[int, dict | str]:
    code = main(["check", target, *FAST, *extra, "--report", "json", "--cases-dir", str(tmp_path)])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code in (0, 1) else captured.err


def test_discovery_finds_the_modules_a_plan_shards() -> None:
    from tpsim.presets.transformers import family_variants

    variants, skipped = family_variants("llama")
    assert skipped == []
    by_name = {v.name: v for v in variants}
    assert set(by_name) == {"lm_head", "embed_tokens", "LlamaDecoderLayer", "LlamaAttention", "LlamaMLP"}
    assert by_name["LlamaMLP"].sizes[:2] == ("hidden", "heads")
    assert dict(by_name["LlamaMLP"].plan) == {"model.layers.*.mlp.gate_proj": "colwise",
                                             "model.layers.*.mlp.up_proj": "colwise",
                                             "model.layers.*.mlp.down_proj": "rowwise"}
    # transformers' automatic embedding rule and the head's own plan are found from the model
    assert dict(by_name["embed_tokens"].plan) == {"model.embed_tokens": "embedding_rowwise"}
    assert dict(by_name["lm_head"].plan) == {"lm_head": "colwise_gather_output"}

    variants, _ = family_variants("qwen3_moe")
    by_name = {v.name: v for v in variants}
    moe = by_name["Qwen3MoeSparseMoeBlock"]
    assert {"experts", "top_k", "grouped_mm", "batched_mm"} <= set(moe.sizes)
    assert dict(moe.plan)["model.layers.*.mlp.experts"] == "moe_tp_experts"
    assert moe.dtypes == ("float64", "float32")  # a router decides on its values
    assert "Qwen3MoeMLP" in by_name  # the dense layer the tiny config keeps beside the sparse one
    attention = by_name["Qwen3MoeAttention"]
    assert dict(attention.plan)["model.layers.*.self_attn.q_norm"] == "replicated_with_grad_allreduce"


def test_llama_passes(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "transformers.models.llama")
    assert code == 0, doc
    assert {v["name"] for v in doc["variants"]} == {"lm_head", "embed_tokens", "LlamaDecoderLayer", "LlamaAttention",
                                                     "LlamaMLP"}
    assert all(v["examples"] >= 4 for v in doc["variants"]), doc["variants"]


#: Seeded defects: (subclass in tests/hf_subclasses.py, the first failure's sublayer and diagnosis).
SEEDED = [
    ("WrongPlanLlamaMLP", "model.layers.*.mlp.down_proj", "wrong-shard-dim"),
    ("WrongPlanMixtralMoeBlock", "model.layers.*.mlp.experts.down_proj", "wrong-shard-dim"),
    pytest.param("WrongPlanQwen2MLP", "model.layers.*.mlp.down_proj", "wrong-shard-dim", marks=pytest.mark.slow),
    pytest.param("WrongPlanMistralAttention", "model.layers.*.self_attn.o_proj", "wrong-shard-dim",
                 marks=pytest.mark.slow),
    pytest.param("WrongPlanGemma3MLP", "model.layers.*.mlp.down_proj", "wrong-shard-dim", marks=pytest.mark.slow),
    pytest.param("LocalExpertsQwen3MoeBlock", "model.layers.1.mlp.experts", "missing-reduction",
                 marks=pytest.mark.slow),
    pytest.param("BiasTwiceLlamaMLP", "model.layers.0.mlp.down_proj", "bias-duplication", marks=pytest.mark.slow),
    # A gather dropped: GLM's packed gate/up projection planned colwise for colwise_gather_output (the exception
    # it raises in down_proj is quoted; the plan entry is named because its one-entry twin with the gather passes).
    pytest.param("GatherDroppedGlmMLP", "model.layers.*.mlp.gate_up_proj", "plan-input-layout",
                 marks=pytest.mark.slow),
]


@pytest.mark.slow
def test_a_correct_patch_passes(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "tests/hf_subclasses.py:PatchedLlamaMLP")
    assert code == 0, doc


@pytest.mark.parametrize("name, sublayer, diagnosis", SEEDED)
def test_seeded_defects_are_caught_and_named(capsys, tmp_path, name, sublayer, diagnosis) -> None:
    code, doc = _check(capsys, tmp_path, f"tests/hf_subclasses.py:{name}")
    assert code == 1, doc
    first = doc["failures"][0]
    assert (first["sublayer"], first["diagnosis"]) == (sublayer, diagnosis), json.dumps(doc["failures"], indent=1)


@pytest.mark.gloo
def test_a_seeded_defect_replays_on_gloo(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "tests/hf_subclasses.py:WrongPlanMixtralMoeBlock")
    assert code == 1, doc
    case_file = doc["failures"][0]["case_file"]
    for backend in ("inproc", "gloo"):
        assert main(["replay", case_file, "--backend", backend]) == 1, backend
    assert "wrong-shard-dim" in capsys.readouterr().out


#: A fixed sample of families whose plans hold (every module PASS in docs/zoo.json).
PASSING_SAMPLE = ["arcee", "cohere2", "deepseek_v3", "gpt_oss", "mistral", "mixtral", "olmoe", "gemma",
                  "gemma2", "granite", "glm4", "phi3", "olmo", "granitemoe", "cwm", "afmoe", "bamba", "ernie4_5",
                  "hunyuan_v1_dense"]
#: Families with a released defect (docs/bugs.md): the diagnosis the check names.
DEFECTIVE_SAMPLE = {
    "qwen3": "grad-reduced-after-accumulation",  # replicated_with_grad_allreduce under gradient accumulation
    "apertus": "grad-not-reduced",  # xIELU's alpha_p / alpha_n without a grad all-reduce
    "cohere": "exception",  # use_qk_norm=True: per-head q/k norm weights left whole after a colwise q_proj
}


@pytest.mark.slow
@pytest.mark.parametrize("family", PASSING_SAMPLE)
def test_families_whose_plans_hold_pass(capsys, tmp_path, family) -> None:
    code, doc = _check(capsys, tmp_path, f"transformers.models.{family}")
    assert code == 0, doc


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(DEFECTIVE_SAMPLE))
def test_released_defects_are_named(capsys, tmp_path, family) -> None:
    code, doc = _check(capsys, tmp_path, f"transformers.models.{family}")
    assert code == 1, doc
    assert DEFECTIVE_SAMPLE[family] in {f["diagnosis"] for f in doc["failures"]}, json.dumps(doc["failures"], indent=1)


@pytest.mark.slow
def test_zoo_writes_the_table_and_its_json(tmp_path) -> None:
    out, twin = tmp_path / "zoo.md", tmp_path / "zoo.json"
    proc = subprocess.run([sys.executable, "-m", "tpsim", "zoo", "transformers", "--families", "llama,apertus",
                           "--max-examples", "2", "--world-sizes", "1,2", "--out", str(out), "--json", str(twin),
                           "--cases-dir", str(tmp_path / "cases")], cwd=ROOT, capture_output=True, text=True,
                          timeout=1200)
    assert proc.returncode == 0, proc.stderr
    assert "[2/2]" in proc.stderr
    doc = json.loads(twin.read_text())
    families = {r["family"]: r for r in doc["libraries"]["transformers"]["families"]}
    assert {m["status"] for m in families["llama"]["modules"]} == {"PASS"}
    failing = [m for m in families["apertus"]["modules"] if m["status"] == "FAIL"]
    assert failing and all(f["case_file"] for m in failing for f in m["failures"])
    table = out.read_text()
    assert "| llama | LlamaMLP |" in table and "grad-not-reduced" in table


@pytest.mark.slow
def test_the_plain_gloo_reproduction_shows_the_accumulation_defect_and_its_fix() -> None:
    script = ROOT / "tests" / "wild" / "transformers_grad_allreduce_accumulation.py"
    shipped = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert shipped.returncode == 1 and "DEFECT" in shipped.stdout, shipped.stdout + shipped.stderr
    fixed = subprocess.run([sys.executable, str(script), "--fixed"], capture_output=True, text=True, timeout=600)
    assert fixed.returncode == 0, fixed.stdout + fixed.stderr
