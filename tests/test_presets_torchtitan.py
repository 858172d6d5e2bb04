"""The torchtitan preset: Llama 3's feed-forward, attention and transformer block under torchtitan
0.3.0's own tp sharding (``Module.parallelize(ParallelDims)``, the spmd_types backend inside
``get_spmd_context``), on a CPU mesh, one tp group spanning the world; the feed-forward outside the
context, and an attention and a block whose output projection is not reduced, are caught; torchtitan's
own clip by global norm, on this backend's plain local parameters, clips every rank by its own norm
(a defect of the released library, reproduced without tpsim in tests/wild/torchtitan_clip_local_norm.py)."""

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


def _check(capsys, tmp_path, target: str, *extra: str, search: tuple[str, ...] = tuple(FAST)) -> tuple[int, dict]:
    code = main(["check", target, *search, *extra, "--report", "json", "--cases-dir", str(tmp_path)])
    return code, json.loads(capsys.readouterr().out)


def _only_the_local_norm_clip(doc: dict) -> None:
    """torchtitan's clip_grad_norm_ on the spmd_types backend's plain local parameters: each rank clips by
    its own norm (tests/wild/torchtitan_clip_local_norm.py); every other property holds."""
    causes = [(f["property"], f["diagnosis"], f["sublayer"]) for f in doc["failures"]]
    assert causes == [("training-equivalence", "norm-not-reduced", None)], json.dumps(doc["failures"], indent=1)
    (failure,) = doc["failures"]
    details = failure["details"]
    assert details["norm"] == pytest.approx(details["local_norm"]) and details["norm"] < details["dense_norm"]
    for variant in doc["variants"]:
        # The replicated RMSNorm weights of a block are clipped by different coefficients and drift apart:
        # a consequence, reported under its cause.
        assert all(v["verdict"] in ("pass", "not-applicable")
                   or (v["verdict"] == "fail" and v["cause"] == "training-equivalence: norm-not-reduced")
                   for k, v in variant["verdicts"].items() if k != "training-equivalence"), variant["verdicts"]


@pytest.mark.parametrize("target", ["torchtitan.models.common.feed_forward"])
def test_preset_finds_the_clip_by_local_norm(capsys, tmp_path, target) -> None:
    code, doc = _check(capsys, tmp_path, target)
    assert code == 1
    _only_the_local_norm_clip(doc)
    (variant,) = doc["variants"]
    assert variant["name"] == "FeedForward-spmd_types" and variant["examples"] >= 1
    assert any("spanning the whole world" in n for n in variant["notes"])


def test_with_the_norm_reduced_the_feed_forward_passes(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "tests/titan_targets.py:REDUCED_CLIP")
    assert code == 0, json.dumps(doc["failures"], indent=1)
    (variant,) = doc["variants"]
    assert variant["examples"] >= 8 and variant["verdicts"]["training-equivalence"]["verdict"] == "pass"


def test_llama3_lists_its_feed_forward_attention_and_block(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "torchtitan.models.llama3", search=("--max-examples", "2", "--world-sizes",
                                                                             "1,2", "--seed", "0"))
    assert code == 1
    assert [v["name"] for v in doc["variants"]] == ["FeedForward-spmd_types", "GQAttention-spmd_types",
                                                    "Llama3TransformerBlock-spmd_types"]


ATTENTION = ["--max-examples", "6", "--world-sizes", "1,2,4", "--seed", "0"]


LAYERS = [("torchtitan.models.common.attention:GQAttention", "GQAttention-spmd_types"),
          ("torchtitan.models.llama3.model:Llama3TransformerBlock", "Llama3TransformerBlock-spmd_types")]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize(("target", "name"), LAYERS)
def test_llama3_attention_and_block_clip_by_local_norm(capsys, tmp_path, target, name, dtype) -> None:
    code, doc = _check(capsys, tmp_path, target, "--dtypes", dtype, search=tuple(ATTENTION))
    assert code == 1
    _only_the_local_norm_clip(doc)
    (variant,) = doc["variants"]
    assert variant["name"] == name
    # torchtitan's attention and feed-forward declare an I -> R input redistribution: the input grad
    # is all-reduced.
    assert variant["input_grad"] == "complete"
    assert all(v["verdict"] == "pass" for k, v in variant["verdicts"].items()
               if k in ("forward-equivalence", "input-grad-equivalence", "weight-grad-equivalence"))
    # torchtitan's attention and block have no bias: nothing for a bias-grad check to compare.
    assert variant["verdicts"]["bias-grad-equivalence"] == {"verdict": "not-applicable", "diagnoses": [],
                                                             "cause": None, "why": "the module has no bias parameter"}


@pytest.mark.parametrize(("target", "sublayer"), [("UnreducedOutputAttention", "wo"),
                                                  ("UnreducedFeedForwardBlock", "feed_forward.w2")])
def test_an_unreduced_projection_is_named(capsys, tmp_path, target, sublayer) -> None:
    code, doc = _check(capsys, tmp_path, f"tests/titan_targets.py:{target}", "--dtypes", "float64,float32",
                       search=tuple(ATTENTION))
    assert code == 1
    causes = [(f["sublayer"], f["property"], f["diagnosis"]) for f in doc["failures"]]
    assert causes == [(sublayer, "forward-equivalence", "missing-reduction")], json.dumps(doc["failures"], indent=1)
    (variant,) = doc["variants"]
    assert variant["name"] == f"{target}-spmd_types"


def test_attention_is_built_as_llama3_builds_it() -> None:
    import torch
    from torchtitan.models.common.attention import FusedQKVLinear, GQAttention, ScaledDotProductAttention
    from torchtitan.models.common.rope import ComplexRoPE

    from tpsim.presets.torchtitan import ROPE_POSITIONS, _Dense

    module = _Dense(GQAttention, "attention")(16, 4, 2, dtype=torch.float64)
    assert isinstance(module.qkv_linear, FusedQKVLinear) and isinstance(module.rope, ComplexRoPE)
    assert isinstance(module.inner_attention, ScaledDotProductAttention)
    assert (module.n_heads, module.n_kv_heads, module.head_dim) == (4, 2, 4)
    assert module.wo.weight.dtype == torch.float64
    # The rotary table stays torchtitan's complex one (Module.to(float64) would keep its real part only).
    assert module.rope.cache.dtype == torch.complex64 and module.rope.cache.shape == (ROPE_POSITIONS, 2)
    assert torch.equal(module.rope.cache, module.rope._precompute_cache())
    assert module._sharding_config is not None  # its own I -> R input redistribution, as config.build() sets


@pytest.mark.gloo
@pytest.mark.slow
@pytest.mark.parametrize(("target", "name"), LAYERS)
def test_llama3_attention_and_block_on_gloo(capsys, tmp_path, target, name) -> None:
    code, doc = _check(capsys, tmp_path, target, "--backend", "gloo", "--dtypes", "float64,float32", "--timeout",
                       "120", search=("--max-examples", "3", "--world-sizes", "1,2", "--seed", "0"))
    assert code == 1
    _only_the_local_norm_clip(doc)
    (variant,) = doc["variants"]
    assert variant["name"] == name


def test_outside_the_spmd_context_the_reduction_is_missing(capsys, tmp_path) -> None:
    code, doc = _check(capsys, tmp_path, "tests/titan_targets.py:NO_CONTEXT")
    assert code == 1
    causes = [(f["sublayer"], f["diagnosis"]) for f in doc["failures"]]
    assert causes and causes[0][1] == "missing-reduction", json.dumps(doc["failures"], indent=1)


def test_attention_heads_are_multiples_of_the_tp_size() -> None:
    from hypothesis import given, settings
    from torchtitan.models.common.attention import GQAttention

    from tpsim.presets.torchtitan import attention_variant
    from tpsim.props.family import family_of

    variant = attention_variant(GQAttention, "spmd_types", True)
    strategy = family_of(variant).cases(variant, world_sizes=(1, 2, 4), dtypes=("float64",), non_divisible=True,
                                         tp_sizes=None, subgroups=True, layouts=("contiguous",))

    @settings(max_examples=40, database=None)
    @given(strategy)
    def check(case):
        hidden, heads, kv = case.sizes
        tp = case.tp_size or case.world_size
        assert tp == case.world_size and heads % kv == 0 and kv % tp == 0
        assert hidden // heads in (2, 4) and hidden % heads == 0
        assert len(case.batch_shape) == 2  # [batch, seq, dim]

    check()


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


@pytest.mark.gloo
@pytest.mark.slow
def test_the_clip_defect_reproduces_without_tpsim() -> None:
    import subprocess
    import sys

    script = ROOT / "tests" / "wild" / "torchtitan_clip_local_norm.py"
    found = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert found.returncode == 1 and "DEFECT: each rank clips by its own local norm" in found.stdout, found.stderr
    fixed = subprocess.run([sys.executable, str(script), "--fixed"], capture_output=True, text=True, timeout=600)
    assert fixed.returncode == 0 and "OK: every rank uses the dense norm" in fixed.stdout, fixed.stderr
