"""The Hugging Face transformers preset: Llama, Qwen2 and Mistral modules under their own
``base_model_tp_plan``, built from tiny configs (no download).

- ``tpsim check transformers.models.{llama,qwen2,mistral}`` passes (the MLP: what the module check
  can bound today; the attention and decoder layer are refused with the reason when named);
- subclasses (a patch) are checked under the same plan: a correct one passes, a subclass whose own
  ``tp_plan`` plans the down projection colwise is ``down_proj: wrong-shard-dim``, one whose local
  kernel adds the bias on every rank is ``down_proj: bias-duplication``;
- the attention and decoder layer plans (rotary tables, grouped-query heads) are checked directly
  against the dense modules on inproc ranks: outputs, input grads and every parameter grad agree.
"""

from __future__ import annotations

import json
import pathlib

import pytest
import torch
import torch.distributed as dist

import tpsim
from tpsim.cli import main

pytest.importorskip("transformers")

ROOT = pathlib.Path(__file__).resolve().parent.parent
FAST = ["--max-examples", "6", "--world-sizes", "1,2,4", "--seed", "0"]


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(ROOT)


def _check(capsys, tmp_path, target: str) -> tuple[int, dict | str]:
    code = main(["check", target, *FAST, "--report", "json", "--cases-dir", str(tmp_path)])
    captured = capsys.readouterr()
    return code, json.loads(captured.out) if code in (0, 1) else captured.err


@pytest.mark.slow
@pytest.mark.parametrize("model, prefix", [("llama", "Llama"), ("qwen2", "Qwen2"), ("mistral", "Mistral")])
def test_model_preset_passes(capsys, tmp_path, model, prefix) -> None:
    code, doc = _check(capsys, tmp_path, f"transformers.models.{model}")
    assert code == 0, doc
    # The MLP, the attention (rotary tables, SDPA) and the decoder layer (RMSNorm too), each under the plan.
    assert [v["name"] for v in doc["variants"]] == [f"{prefix}MLP", f"{prefix}Attention", f"{prefix}DecoderLayer"]
    assert all(v["examples"] >= 6 for v in doc["variants"]), doc["variants"]


@pytest.mark.slow
@pytest.mark.parametrize("name, expected", [
    ("PatchedLlamaMLP", []),
    ("WrongPlanLlamaMLP", [("down_proj", "wrong-shard-dim")]),
    ("BiasTwiceLlamaMLP", [("down_proj", "bias-duplication")]),
    ("WrongPlanLlamaAttention", [("o_proj", "wrong-shard-dim")]),
    ("BiasTwiceLlamaDecoderLayer", [("mlp.down_proj", "bias-duplication")]),
])
def test_subclasses_under_the_model_plan(capsys, tmp_path, name, expected) -> None:
    code, doc = _check(capsys, tmp_path, f"tests/hf_subclasses.py:{name}")
    assert code == (1 if expected else 0), doc
    assert [(f["sublayer"], f["diagnosis"]) for f in doc["failures"]] == expected, json.dumps(doc["failures"], indent=1)


@pytest.mark.slow
def test_plans_are_re_rooted_at_the_checked_module() -> None:
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP

    from tpsim.presets.transformers import plan_for

    assert plan_for("llama", "mlp", LlamaMLP) == {"gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    assert plan_for("llama", "attention", LlamaAttention) == {
        "q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise"}
    layer = plan_for("llama", "layer", LlamaDecoderLayer)
    assert layer["self_attn.o_proj"] == "rowwise" and layer["mlp.down_proj"] == "rowwise"
    assert len(layer) == 7


def rank_plan_vs_dense(model: str, role: str, sizes: tuple[int, ...], seed: int) -> dict:
    """One rank: the dense module and the same module under the model's plan, from the same seed."""
    import importlib

    from tpsim.presets.transformers import _MODELS, _Dense, plan_for
    from tpsim.props.module.plans import _PlanBuild

    modeling = importlib.import_module(f"transformers.models.{model}.{_MODELS[model][0]}")
    cls = getattr(modeling, _MODELS[model][{"attention": 3, "layer": 4}[role]])
    dense_builder = _Dense(cls, model, role)
    torch.manual_seed(seed)
    dense = dense_builder(*sizes, dtype=torch.float64)
    torch.manual_seed(seed)
    tp = _PlanBuild(dense_builder, plan_for(model, role, cls))(*sizes, group=dist.group.WORLD, dtype=torch.float64)
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(2, 3, sizes[0], generator=gen, dtype=torch.float64)
    g = torch.randn(2, 3, sizes[0], generator=gen, dtype=torch.float64)
    out = {}
    for key, module in (("dense", dense), ("tp", tp)):
        xi = x.clone().requires_grad_(True)
        y = module(xi)
        y.backward(g)
        grads = {n: (p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad) for n, p in
                 module.named_parameters()}
        out[key] = {"y": y.detach(), "dx": xi.grad, "grads": grads}
    return out


@pytest.mark.parametrize("model", ["llama", "qwen2", "mistral"])
@pytest.mark.parametrize("role, sizes", [("attention", (16, 4, 2)), ("layer", (16, 4, 4, 2))])
def test_attention_and_layer_plans_match_the_dense_module(model, role, sizes) -> None:
    # float64, O(1) values, reductions of at most a few dozen terms: 1e-10 is orders above rounding
    # and orders below any sharding bug.
    for out in tpsim.run(rank_plan_vs_dense, 2, args=(model, role, sizes, 3), timeout=60):
        torch.testing.assert_close(out["tp"]["y"], out["dense"]["y"], rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(out["tp"]["dx"], out["dense"]["dx"], rtol=1e-10, atol=1e-10)
        assert out["tp"]["grads"].keys() == out["dense"]["grads"].keys()
        for name, grad in out["dense"]["grads"].items():
            torch.testing.assert_close(out["tp"]["grads"][name], grad, rtol=1e-10, atol=1e-10, msg=name)
