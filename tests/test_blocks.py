"""Whole transformer blocks as module targets: the Llama-style block of examples/llama_block.py, its
seeded bugs (examples/llama_block_bugs.py), the dense-twin oracle that needs no rule per operation,
sublayers that return tuples or dicts, nondeterminism, and non-contiguous inputs."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import find
from torch import nn

from tpsim.cli import main
from tpsim.mutants import module_dropout_in_train_mode
from tpsim.placement import Shard
from tpsim.props.module.case import ModuleCase
from tpsim.props.module.family import MODULE
from tpsim.props.module.strategies import module_cases
from tpsim.props.module.twin import TWIN_FACTOR, resolved, twin_bound, twin_magnitudes
from tpsim.props.module.world import DERIVED, TWIN, reference_run
from tpsim.props.search import search
from tpsim.props.tolerance import FACTOR
from tpsim.target import resolve_target

ROOT = Path(__file__).resolve().parent.parent
BLOCK = str(ROOT / "examples" / "llama_block.py")
BUGS = str(ROOT / "examples" / "llama_block_bugs.py")


def _variant(path: str, name: str) -> Any:
    (v,) = [v for v in resolve_target(path, kind="module") if v.name == name]
    return v


def _labels(failures: list) -> list[tuple[str, str]]:
    return [(f.property, f.label) for f in failures]


def _case(v: Any, dtype: str = "float64", seed: int = 1, **changes: Any) -> ModuleCase:
    sp = v.input == "sequence-sharded"  # sequence first: [seq, batch, hidden]
    base = ModuleCase(world_size=2, sizes=(4, 4, 2), batch_shape=(4, 2) if sp else (2, 4), seed=seed, dtype=dtype)
    return base.replace(**changes) if changes else base


# --- the block passes ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float64", "float32", "bfloat16"])
@pytest.mark.parametrize("name", ["LlamaBlock", "LlamaBlockComplexRope", "LlamaBlockSP"])
def test_the_llama_block_passes(name: str, dtype: str) -> None:
    report = search(_variant(BLOCK, name), max_examples=8, seed=0, dtypes=(dtype,), world_sizes=(1, 2, 4))
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 8


@pytest.mark.slow
@pytest.mark.parametrize("name", ["LlamaBlock", "LlamaBlockComplexRope", "LlamaBlockSP"])
def test_the_llama_block_passes_a_longer_search_in_every_dtype(name: str) -> None:
    report = search(_variant(BLOCK, name), max_examples=60, seed=3)
    assert report.passed, [f.describe() for f in report.failures]


def test_the_block_has_no_dtype_note_and_uses_the_twin() -> None:
    v = _variant(BLOCK, "LlamaBlock")
    report = search(v, max_examples=3, seed=0, world_sizes=(2,))
    assert not any("dtypes" in n and "only" in n for n in report.notes)
    # Rotary tables (cos, sin), a softmax: no magnitude rule; the dense twin sets the tolerance.
    ref = reference_run(v, _case(v), timeout=60.0)
    assert ref.oracle == TWIN
    # Its RMSNorm computes in float32 as Llama's does: a float64 case is judged at float32 (the
    # derived float64 bound flagged the sequence-parallel block's norm at 1e-7 relative).
    assert ref.narrowed == "float32"
    assert reference_run(v, _case(v, "float32"), timeout=60.0).narrowed is None


# --- seeded bugs: the sublayer and the mechanism --------------------------------------------------


@pytest.mark.parametrize("name, expected", [
    ("OProjBiasBeforeReduce", [("forward-equivalence", "self_attn.o_proj: bias-duplication")]),
    ("DownProjNotReduced", [("forward-equivalence", "mlp.down_proj: missing-reduction")]),
    ("GateUpContiguous", [("forward-equivalence", "mlp.gate_up_proj: packed-shard-layout")]),
    ("KVHeadsTiled", [("forward-equivalence", "self_attn: qkv-head-mismatch")]),
    ("NormGradNotReducedSP", [("weight-grad-equivalence", "input_layernorm: grad-not-reduced")]),
])
@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_a_seeded_bug_is_named_with_its_sublayer(name: str, expected: list, dtype: str) -> None:
    v = _variant(BUGS, name)
    assert _labels(MODULE.check_case(v, _case(v, dtype))) == expected


def test_a_forward_cause_lists_the_grads_it_moves_under_it() -> None:
    v = _variant(BUGS, "OProjBiasBeforeReduce")
    (cause,) = MODULE.check_case(v, _case(v))
    assert {c.property for c in cause.consequences} >= {"input-grad-equivalence", "weight-grad-equivalence"}


def test_the_packed_layout_is_confirmed_by_a_rerun_and_says_how_to_declare_it() -> None:
    v = _variant(BUGS, "GateUpContiguous")
    (f,) = MODULE.check_case(v, _case(v))
    assert f.details["parts"] == [1, 1] and f.details["module_diagnosis"] == "mismatch"
    assert "ParamSpec('mlp.gate_up_proj.weight', 'weight', Shard(0, parts=(1, 1)))" in f.message


def test_in_bfloat16_a_bug_is_caught_and_only_float64_confirmed_mechanisms_are_named() -> None:
    from tpsim.props.module.checks import NUMERIC_PATTERNS

    for name in ("OProjBiasBeforeReduce", "GateUpContiguous", "KVHeadsTiled", "NormGradNotReducedSP"):
        v = _variant(BUGS, name)
        failures = MODULE.check_case(v, _case(v, "bfloat16"))
        assert failures, name
        float64 = {(g.diagnosis, g.sublayer) for f in MODULE.check_case(v, _case(v)) for g in (f, *f.consequences)}
        for f in failures:
            for g in (f, *f.consequences):
                if g.diagnosis in NUMERIC_PATTERNS:
                    assert (g.diagnosis, g.sublayer) in float64, (name, g.label)
                if "unconfirmed" in g.details:  # the facts, or the name float64 shows for it
                    assert (g.diagnosis == "mismatch" and "the same case in float64 shows" in g.message
                            or (g.diagnosis, g.sublayer) in float64 and "named from the same case in float64" in g.message)


def test_a_head_pairing_is_confirmed_by_a_rerun_with_every_key_value_head_the_same() -> None:
    from tpsim.props.module.checks import kv_ties
    from tpsim.props.module.sharding import ParamLayout

    v = _variant(BUGS, "KVHeadsTiled")
    (f,) = MODULE.check_case(v, _case(v))
    assert f.details["module_diagnosis"] == "mismatch" and f.details["params"] == ["self_attn.qkv_proj.weight"]
    assert "passes once every key/value head is made the same head" in f.message
    # (Training, on every grad, follows wherever the trained parameter is.)
    assert {c.sublayer for c in f.consequences if c.property != "training-equivalence"} == {"self_attn"}
    # One rank is one grouping among others: the dense twin of the bug is no finding.
    assert MODULE.check_case(v, _case(v, world_size=1, tp_size=1)) == []
    # The key and value rows: the last two of three packed parts, or projections named so.
    packed = {"a.qkv.weight": ParamLayout(Shard(0, parts=(8, 4, 4))), "a.o.weight": ParamLayout(Shard(1))}
    assert kv_ties(packed, {"a.qkv.weight": (16, 4), "a.o.weight": (4, 8)}, "a") == (
        ("a.qkv.weight", 0, ((8, 12),)), ("a.qkv.weight", 0, ((12, 16),)))
    assert kv_ties(packed, {"a.qkv.weight": (16, 4), "a.o.weight": (4, 8)}, "b") == ()
    split = {"k_proj.weight": ParamLayout(Shard(0)), "v_proj.weight": ParamLayout(Shard(0)),
             "q_proj.weight": ParamLayout(Shard(0))}
    shapes = {"k_proj.weight": (4, 6), "v_proj.weight": (4, 6), "q_proj.weight": (8, 6)}
    assert kv_ties(split, shapes, "") == (("k_proj.weight", 0, ((0, 4),)), ("v_proj.weight", 0, ((0, 4),)))
    assert kv_ties({"k_proj.weight": ParamLayout(Shard(0))}, shapes, "") == ()  # no values: no claim


class _ScaleByLocalHeads(nn.Module):
    """An attention-shaped block whose softmax scale reads the local query width (a tp-dependent
    factor, not a pairing): its key/value heads made one head, it still fails."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group: Any = None) -> None:
        super().__init__()
        import sys

        sys.path.insert(0, str(ROOT / "examples"))
        from llama_block import Attention

        class _Scaled(Attention):
            def repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
                return super().repeat_kv(t) * dist.get_world_size(self.group)

        self.self_attn = _Scaled(hidden, kv_heads, process_group=process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.self_attn(x)[0]


def test_an_attention_bug_that_is_no_pairing_is_not_named_a_head_mismatch() -> None:
    from tpsim.module_variant import module_from_class

    v = module_from_class(_ScaleByLocalHeads)
    (f,) = MODULE.check_case(v, ModuleCase(world_size=2, sizes=(4, 4, 2), batch_shape=(2, 4), seed=1))
    assert f.property == "forward-equivalence" and f.diagnosis != "qkv-head-mismatch", f.label


def test_the_check_shrinks_saves_and_replays_a_block_bug(capsys, tmp_path) -> None:
    code = main(["check", f"{BUGS}:OProjBiasBeforeReduce", "--kind", "module", "--seed", "0", "--max-examples", "30",
                 "--world-sizes", "1,2,4", "--cases-dir", str(tmp_path), "--report", "json", "--no-isolate"])
    doc = json.loads(capsys.readouterr().out)
    assert code == 1
    (failure,) = doc["failures"]
    assert (failure["property"], failure["sublayer"], failure["diagnosis"]) == (
        "forward-equivalence", "self_attn.o_proj", "bias-duplication")
    assert failure["case"]["world_size"] == 2 and failure["case"]["dtype"] == "float64"  # shrunk
    assert main(["replay", failure["case_file"], "--no-isolate"]) == 1
    out = capsys.readouterr().out
    assert "FAILED forward-equivalence: self_attn.o_proj: bias-duplication" in out and "FAIL reproduced" in out


@pytest.mark.gloo
@pytest.mark.slow
def test_a_block_bug_replays_on_gloo(capsys, tmp_path) -> None:
    main(["check", f"{BUGS}:NormGradNotReducedSP", "--kind", "module", "--input", "sequence-sharded", "--output",
          "sequence-sharded", "--sequence-dim", "0", "--seed", "0", "--max-examples", "30", "--world-sizes", "2",
          "--cases-dir", str(tmp_path), "--report", "json", "--no-isolate"])
    doc = json.loads(capsys.readouterr().out)
    (failure,) = doc["failures"]
    assert (failure["sublayer"], failure["diagnosis"]) == ("input_layernorm", "grad-not-reduced")
    assert main(["replay", failure["case_file"], "--backend", "gloo"]) == 1
    assert "input_layernorm: grad-not-reduced" in capsys.readouterr().out


# --- the dense twin ------------------------------------------------------------------------------


def test_the_twin_bound_follows_its_formula() -> None:
    ref = torch.tensor([1.0, -2.0], dtype=torch.float64)
    # bfloat16: the twin's relative error times the factor, plus eps of the scale.
    eps = torch.finfo(torch.bfloat16).eps
    assert twin_bound(ref, 0.01, torch.bfloat16, 3) == pytest.approx(TWIN_FACTOR * 2.0 * (0.01 + eps) * 2.0)
    # float64: the float32 twin's error scaled by eps(float64)/eps(float32).
    r = torch.finfo(torch.float64).eps / torch.finfo(torch.float32).eps
    e64 = torch.finfo(torch.float64).eps
    assert twin_bound(ref, 1e-6, torch.float64, 1) == pytest.approx(TWIN_FACTOR * math.sqrt(2) * (r * 1e-6 + e64) * 2)
    # A twin that did not stay finite: half the digits in float64, nothing to judge in a narrower dtype.
    assert twin_bound(ref, math.inf, torch.float64, 2) == pytest.approx(math.sqrt(e64) * 2.0)
    assert twin_bound(ref, math.inf, torch.bfloat16, 2) == math.inf
    # Never less than the twin's own error on the tensor: a reference of exact zeros (s = 0) is
    # allowed the rounding the twin made of it, not a bound of zero.
    zero = torch.zeros(2, dtype=torch.float64)
    assert twin_bound(zero, 0.01, torch.bfloat16, 1) == 0.0
    assert twin_bound(zero, 0.01, torch.bfloat16, 1, own=1e-9) == pytest.approx(TWIN_FACTOR * math.sqrt(2) * 1e-9)
    assert twin_bound(ref, 0.01, torch.bfloat16, 3, own=1e-9) == twin_bound(ref, 0.01, torch.bfloat16, 3)


def test_a_tensor_the_twin_gets_no_digit_of_is_left_out_of_rho_and_allowed_its_scale() -> None:
    # A one-token attention's query grad: zero in exact arithmetic, 1e-18 of rounding in the float64
    # reference; the float32 twin either rounds it to 1e-9 (relative error 1e9) or, with some CPUs'
    # kernels, exactly to zero (relative error 1: the twin's "error" is the reference's own).
    noise = torch.tensor([1e-18, -5e-19], dtype=torch.float64)
    for twin in (torch.tensor([1e-9, 0.0]), torch.zeros(2)):
        assert not resolved(noise, twin)
    ref = torch.tensor([1.0, -2.0], dtype=torch.float64)
    assert resolved(ref, ref.float() + 1e-7) and resolved(None, None) and resolved(torch.zeros(2), torch.ones(2))
    e64 = torch.finfo(torch.float64).eps
    r = e64 / torch.finfo(torch.float32).eps
    # Twin exactly zero: at least the reference's own scale, not 2**-29 of it.
    assert twin_bound(noise, 1e-7, torch.float64, 1, own=1e-18) == pytest.approx(
        TWIN_FACTOR * math.sqrt(2) * (1e-18 + e64 * 1e-18))
    # Twin rounding larger: its error scaled to float64, as for any tensor.
    assert twin_bound(noise, 1e-7, torch.float64, 1, own=1e-9) == pytest.approx(
        TWIN_FACTOR * math.sqrt(2) * (r * 1e-9 + e64 * 1e-18))
    # A resolved tensor keeps the tight bound (its own error below its scale).
    assert twin_bound(ref, 1e-7, torch.float64, 1, own=1e-7) == pytest.approx(
        TWIN_FACTOR * math.sqrt(2) * (r * 2e-7 + e64 * 2.0))


def test_rho_is_pooled_over_the_tensors_the_twin_resolves_only() -> None:
    from tpsim.props.module.steps import StepTensors

    case = ModuleCase(world_size=2, sizes=(2,), batch_shape=(1,), dtype="float64")
    ref = torch.tensor([1.0, -2.0], dtype=torch.float64)
    noise = torch.tensor([1e-18, -5e-19], dtype=torch.float64)
    value = StepTensors(ref, None, {"q": noise, "v": ref})
    twin = StepTensors(ref.float() * (1 + 1e-7), None, {"q": torch.tensor([1e-9, 0.0]), "v": ref.float()})
    mags = twin_magnitudes(value, twin, case)
    unit = FACTOR * torch.finfo(torch.float64).eps * math.sqrt(case.rows + 2)
    # The output's bound comes from its own relative error (1e-7), not the query grad's 1e9.
    assert float(mags.y.max()) * unit == pytest.approx(twin_bound(ref, 1e-7, torch.float64, 2, own=2e-7))
    assert twin_bound(ref, 1e9, torch.float64, 2) > 1.0  # what pooling the query grad in would allow


def test_a_one_element_rms_norm_in_bfloat16_is_no_false_alarm() -> None:
    # Its input grad is exactly zero in float64 and a rounding away from it in bfloat16, on the
    # tp run and on the twin alike (found by the 500-example run of the correct norms).
    from tpsim.mutants import CORRECT_NORMS

    (v,) = [n for n in CORRECT_NORMS if n.name == "correct_sequence_rms_norm"]
    case = ModuleCase(world_size=3, sizes=(1,), batch_shape=(1,), dtype="bfloat16", seed=2, tp_size=1)
    assert MODULE.check_case(v, case) == []


class _Softmaxed(nn.Module):
    """A column layer, an elementwise ``exp(-h²)/(1 + h²)`` (exp and a division by a tensor: no
    magnitude rule), a row layer."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        import sys

        sys.path.insert(0, str(ROOT / "examples"))
        from llama_block import ColumnParallelLinear, RowParallelLinear

        self.up = ColumnParallelLinear(hidden, ffn, bias=True, process_group=process_group)
        self.down = RowParallelLinear(ffn, hidden, bias=True, process_group=process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.up(x)
        y, _ = self.down(torch.exp(-h.square()) / (1.0 + h.square()))
        return y


def test_an_op_without_a_rule_is_never_a_refusal_and_the_derived_bound_stays_where_it_exists() -> None:
    from tpsim.module_variant import module_from_class

    v = module_from_class(_Softmaxed)
    for dtype in ("float64", "float32", "bfloat16", "float16"):
        case = ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), dtype=dtype, seed=2)
        assert MODULE.check_case(v, case) == [], dtype
    from tpsim.builtin_variants import mlp_gelu

    assert reference_run(mlp_gelu, ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), seed=0),
                         timeout=60.0).oracle == DERIVED


# --- the traced run that explains a failure -------------------------------------------------------


@pytest.mark.parametrize("name", ["LlamaBlock", "OProjBiasBeforeReduce"])
def test_a_traced_run_runs_the_first_micro_batch_alone_on_the_same_numbers(name: str) -> None:
    # A failure is explained by running its case again with every sublayer's boundaries recorded, which
    # only the first micro-batch's are: that run trains nothing (at the lab note's size a second whole
    # training beside the first run's observation was 7 GB more), yet every tp group gets the numbers the
    # failing run drew, micro-batches it skips included (tp groups draw one after another).
    v = _variant(BLOCK if name == "LlamaBlock" else BUGS, name)
    case = _case(v, "float32", world_size=4, tp_size=2, micro_batches=3)
    plain = reference_run(v, case, timeout=60.0)
    traced = reference_run(v, case, timeout=60.0, capture=True)
    assert len(traced.inputs) == len(plain.inputs) == 2
    for a, b in zip(plain.inputs + plain.grads, traced.inputs + traced.grads, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))  # the same draws, not a computation
    for g_plain, g_traced in zip(plain.groups, traced.groups, strict=True):
        assert g_plain.value.final and g_plain.value.accumulated
        assert g_traced.value.final == {} and g_traced.value.accumulated == {} and g_traced.value.capture
        assert g_traced.mag.final == {} and g_traced.mag.accumulated == {}
        assert set(g_traced.value.grads) == set(g_plain.value.grads)
    # ... and the traced tp world stops there too: the localisation still names the sublayer.
    if name != "LlamaBlock":
        (f,) = MODULE.check_case(v, case)
        assert f.label == "self_attn.o_proj: bias-duplication", f.describe()


# --- sublayers returning tuples and dicts --------------------------------------------------------


class _DictRow(nn.Module):
    """A row layer returning ``{"hidden": y, "bias": b}`` that adds its bias before the all-reduce."""

    def __init__(self, ffn: int, hidden: int, group: Any) -> None:
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(hidden, ffn // dist.get_world_size(group)))
        self.bias = nn.Parameter(torch.zeros(hidden))

    def forward(self, x: torch.Tensor) -> dict[str, Any]:
        y = F.linear(x, self.weight, self.bias).contiguous()
        dist.all_reduce(y, group=self.group)  # not through autograd: fine for the forward check
        return {"hidden": y, "bias": None}


class _TupleColumn(nn.Module):
    def __init__(self, hidden: int, ffn: int, group: Any) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(ffn // dist.get_world_size(group), hidden))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, None]:
        return F.linear(x, self.weight), None


class _DictBlock(nn.Module):
    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        group = dist.group.WORLD if process_group is None else process_group
        self.fc1 = _TupleColumn(hidden, ffn, group)
        self.fc2 = _DictRow(ffn, hidden, group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.fc1(x)
        return self.fc2(F.gelu(h))["hidden"]


def test_sublayers_returning_tuples_and_dicts_are_localised_like_plain_ones() -> None:
    from tpsim.module_variant import module_from_class

    v = module_from_class(_DictBlock)
    failures = MODULE.check_case(v, ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,), seed=0),
                                 properties=("forward-equivalence",))
    assert _labels(failures) == [("forward-equivalence", "fc2: bias-duplication")]


# --- nondeterminism ------------------------------------------------------------------------------


def test_dropout_in_train_mode_is_named_nondeterministic_not_a_reduction_bug() -> None:
    (f,) = MODULE.check_case(module_dropout_in_train_mode, ModuleCase(world_size=2, sizes=(4, 6), batch_shape=(3,),
                                                                      seed=0))
    assert f.diagnosis == "nondeterministic"
    assert "not deterministic" in f.message and "eval mode" in f.message


def test_the_block_in_eval_mode_is_deterministic() -> None:
    v = _variant(BLOCK, "LlamaBlock")
    assert MODULE.check_case(v, _case(v, world_size=1, tp_size=1)) == []


# --- inputs as real callers make them ------------------------------------------------------------


class _ViewFlatten(nn.Module):
    """Flattens its input with ``.view``: fine on a contiguous input, refused on a transposed one."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x.view(-1, x.shape[-1])).view(x.shape)


def test_the_module_family_draws_transposed_and_strided_inputs_of_both_batch_orders() -> None:
    v = _variant(BLOCK, "LlamaBlock")
    strategy = module_cases(v, world_sizes=(1, 2), dtypes=("float64",))
    for layout in ("transposed", "strided"):
        case = find(strategy, lambda c, lay=layout: c.input_layout == lay and len(c.batch_shape) == 2)
        assert case.input_layout == layout
    from tpsim.module_variant import module_from_class

    flat = module_from_class(_ViewFlatten)
    base = ModuleCase(world_size=2, sizes=(4, 4), batch_shape=(3, 2), seed=0)
    assert MODULE.check_case(flat, base) == []
    (f,) = MODULE.check_case(flat, base.replace(input_layout="transposed"))
    assert f.diagnosis == "exception" and "view" in f.message
    # The block reads [b, s, h] and [s, b, h] views alike.
    block = _variant(BLOCK, "LlamaBlock")
    assert MODULE.check_case(block, _case(block, input_layout="transposed")) == []
    sp = _variant(BLOCK, "LlamaBlockSP")
    assert MODULE.check_case(sp, _case(sp, input_layout="strided")) == []
