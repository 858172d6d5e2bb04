"""Layers in libraries' own styles, checked with no adapter code: vLLM-style inference layers
forward-only (``--forward-only``, ``Variant(forward_only=True)``, ``property_tests(forward_only=True)``),
a divisibility refusal by bare ``assert`` accepted there, vLLM's ``(output, output_bias)`` return and
its tp group read by the layer itself (the implicit-group convention, ``--ctor-arg``), nanotron's ``pg=``
group keyword, its row bias held by tp rank 0 only and its required ``mode`` (ALL_REDUCE, or
REDUCE_SCATTER under sequence parallelism)."""

from __future__ import annotations

import pathlib

import pytest

from tpsim.cli import main
from tpsim.diagnosis import DIVISIBILITY_UNCHECKED
from tpsim.errors import InvalidArgument
from tpsim.placement import Replicate, Shard
from tpsim.props.linear.case import Case
from tpsim.props.linear.family import check_case
from tpsim.props.suite import property_tests
from tpsim.target import resolve_target
from tpsim.variant import ParamSpec

ROOT = pathlib.Path(__file__).resolve().parent.parent
STYLES = "tests/wild/inference_style.py"
NANOTRON = "tests/wild/nanotron_style.py"
SMALL = ["--max-examples", "15", "--world-sizes", "1,2,3", "--dtypes", "float64,float32", "--seed", "0"]


def _check(capsys, tmp_path, monkeypatch, *args: str) -> tuple[int, str]:
    monkeypatch.chdir(ROOT)
    code = main(["check", *args, *SMALL, "--cases-dir", str(tmp_path)])
    return code, capsys.readouterr().out


def test_an_inference_layer_passes_forward_only(capsys, tmp_path, monkeypatch) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{STYLES}:InferenceRowLinear", "--forward-only")
    assert code == 0, out
    assert "declares forward only" in out and "python -O strips asserts" in out


def test_the_same_layer_without_forward_only_has_no_grads(capsys, tmp_path, monkeypatch) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{STYLES}:InferenceRowLinear")
    assert code == 1 and "grad-missing" in out, out


def test_a_bare_assert_refuses_only_for_a_forward_only_layer() -> None:
    (variant,) = resolve_target(f"{ROOT / STYLES}:InferenceRowLinear")
    case = Case(world_size=2, in_features=3, out_features=2, batch_shape=(2,), bias=True, seed=0)
    assert check_case(variant.replace(forward_only=True), case) == []
    failures = check_case(variant, case)
    assert [(f.property, f.diagnosis) for f in failures] == [("divisibility", DIVISIBILITY_UNCHECKED)]
    assert "does not say why" in failures[0].message


def test_forward_only_variants_get_the_forward_only_properties_only() -> None:
    (variant,) = resolve_target(f"{ROOT / STYLES}:InferenceRowLinear", forward_only=True)
    assert variant.forward_only and "forward only" in variant.describe()
    suite = property_tests(f"{ROOT / STYLES}:InferenceRowLinear", forward_only=True, max_examples=5, seed=0)
    assert sorted(n for n in vars(suite) if n.startswith("test_")) == [
        "test_divisibility", "test_forward_equivalence", "test_replica_consistency"]
    with pytest.raises(InvalidArgument, match="forward_only='yes'"):
        property_tests(f"{ROOT / STYLES}:InferenceRowLinear", forward_only="yes")


def test_forward_only_is_validated() -> None:
    (variant,) = resolve_target(f"{ROOT / STYLES}:InferenceRowLinear")
    with pytest.raises(InvalidArgument, match=r"forward_only=1; expected a bool"):
        variant.replace(forward_only=1)


def test_nanotron_pg_keyword_is_the_group_convention(capsys, tmp_path, monkeypatch) -> None:
    (variant,) = resolve_target(f"{ROOT / STYLES}:PgColumnLinear")
    assert "pg=" in variant.description
    code, out = _check(capsys, tmp_path, monkeypatch, f"{STYLES}:PgColumnLinear")
    assert code == 0, out


def test_a_module_global_group_is_exit_2_naming_the_module_and_the_global(capsys, tmp_path, monkeypatch) -> None:
    # picotron's style: the tp group lives in a manager held by a module global of another file.
    monkeypatch.chdir(ROOT / "tests" / "wild")
    args = ["check", "picotron_style.py:row", "--max-examples", "10", "--world-sizes", "1,2", "--dtypes", "float64",
            "--seed", "0", "--cases-dir", str(tmp_path)]
    code = main(args)
    out = capsys.readouterr()
    text = out.out + out.err
    assert code == 2, text
    assert "picotron_state.process_group_manager" in text and "--rank-local picotron_state" in text
    assert not list(tmp_path.iterdir())  # no case file: a usage error, not a finding
    # The suggested command works.
    assert main([*args, "--rank-local", "picotron_state"]) == 0, capsys.readouterr().out


# --- a parameter held by tp rank 0 only (nanotron's row bias) ------------------------------------


def _failures(target: str, world_size: int = 2) -> list[tuple[str, str | None]]:
    (variant,) = resolve_target(f"{ROOT / NANOTRON}:{target}")
    case = Case(world_size=world_size, in_features=6, out_features=3, batch_shape=(2,), bias=True, seed=0)
    return [(f.property, f.diagnosis) for f in check_case(variant, case)]


@pytest.mark.parametrize("target", ["Rank0BiasRowLinear", "rank0_row"])
def test_a_bias_held_by_rank0_only_passes_detected_and_declared(capsys, tmp_path, monkeypatch, target) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{NANOTRON}:{target}")
    assert code == 0, out
    assert "PASS" in out and "15 examples" in out


def test_the_conventions_detect_who_holds_a_replicated_bias() -> None:
    (row,) = resolve_target(f"{ROOT / NANOTRON}:Rank0BiasRowLinear")
    assert row.param("bias").held_by == "detect"
    assert "bias R;" in row.describe()  # either holding is right: nothing to say
    (column,) = resolve_target(f"{ROOT / STYLES}:PgColumnLinear")
    assert column.param("bias").held_by == "all"  # a sharded bias lives on every rank
    (declared,) = resolve_target(f"{ROOT / NANOTRON}:rank0_row")
    assert "bias R on tp rank 0 only" in declared.describe()


@pytest.mark.parametrize(("target", "world_size", "expected"), [
    # Every rank holds and adds the bias before the all-reduce: the sum holds it ws times.
    ("EveryRankBiasRowLinear", 2, ("forward-equivalence", "bias-duplication")),
    # Rank 0's bias grad is scaled by the tp size, detected and declared.
    ("Rank0BiasBadGradRowLinear", 2, ("bias-grad-equivalence", "grad-scaled")),
    ("rank0_bad_grad_row", 2, ("bias-grad-equivalence", "grad-scaled")),
    # Rank 0 adds it after the all-reduce: the other ranks' outputs lack it.
    ("Rank0BiasAfterReduceRowLinear", 2, ("forward-equivalence", "bias-missing")),
    # Ranks 0 and 2 hold one, rank 1 does not.
    ("MixedBiasRowLinear", 3, ("bias-grad-equivalence", "shape-error")),
    # Declarations that do not fit the layer.
    ("every_rank_declared_rank0", 2, ("forward-equivalence", "shape-error")),
    ("rank0_declared_all", 2, ("forward-equivalence", "shape-error")),
])
def test_rank0_bias_bugs_are_caught_with_their_diagnosis(target, world_size, expected) -> None:
    assert _failures(target, world_size)[0] == expected


def test_rank0_bias_declaration_errors_name_the_fix() -> None:
    (variant,) = resolve_target(f"{ROOT / NANOTRON}:rank0_declared_all")
    case = Case(world_size=2, in_features=6, out_features=3, batch_shape=(2,), bias=True, seed=0)
    (failure, *_) = check_case(variant, case)
    assert "no tensor at 'bias' on tp rank 1" in failure.message and "held_by='rank0'" in failure.message
    (variant,) = resolve_target(f"{ROOT / NANOTRON}:every_rank_declared_rank0")
    (failure, *_) = check_case(variant, case)
    assert "declared held by tp rank 0 only" in failure.message and "tp rank 1 holds one of shape [3]" in failure.message
    (variant,) = resolve_target(f"{ROOT / NANOTRON}:MixedBiasRowLinear")
    (failure, *_) = check_case(variant, case.replace(world_size=3, tp_size=None))
    assert "held by tp ranks [0, 2] but not by [1]" in failure.message


def test_held_by_is_validated() -> None:
    with pytest.raises(InvalidArgument, match=r"held_by='rank1'\): expected one of all, rank0, detect"):
        ParamSpec("bias", "bias", Replicate(), held_by="rank1")
    with pytest.raises(InvalidArgument, match=r"held_by='rank0'\) with placement S\(0\).*expected placement Replicate"):
        ParamSpec("bias", "bias", Shard(0), held_by="rank0")
    with pytest.raises(InvalidArgument, match=r"grad='partial'"):
        ParamSpec("bias", "bias", Replicate(), grad="partial", held_by="rank0")


# --- vLLM's (output, output_bias) return and its group read by the layer itself -------------------

VLLM = "tests/wild/vllm_style.py"


@pytest.mark.parametrize("skip_bias_add", [(), ("--ctor-arg", "skip_bias_add=True")], ids=["bias-added", "skip-bias-add"])
@pytest.mark.parametrize("layer", ["ColumnParallelLinear", "RowParallelLinear"])
def test_vllm_layers_pass_with_no_adapter(capsys, tmp_path, monkeypatch, layer, skip_bias_add) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{VLLM}:{layer}", "--forward-only", *skip_bias_add)
    assert code == 0, out
    assert "PASS" in out and "tp groups spanning the whole world only" in out


def test_vllm_layers_are_the_implicit_group_convention() -> None:
    (row,) = resolve_target(f"{ROOT / VLLM}:RowParallelLinear", forward_only=True)
    assert "implicit-group convention" in row.description and not row.subgroups
    assert any("takes no tp group" in n and "needs a Variant whose builder initialises it" in n for n in row.notes)
    assert (row.input, row.output) == ("sharded", "reduced")
    (skip,) = resolve_target(f"{ROOT / VLLM}:RowParallelLinear", ctor_arg=(("skip_bias_add", "True"),))
    assert "skip_bias_add=True" in skip.description
    (column,) = resolve_target(f"{ROOT / VLLM}:ColumnParallelLinear")
    assert (column.input, column.output) == ("replicated", "sharded")


_UNINITIALISED = """
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_TP = None


def get_tp_group():
    # vLLM's own check: its parallel state must be initialised before a layer is built.
    assert _TP is not None, "tensor model parallel group is not initialized"
    return _TP


class RowParallelLinear(nn.Module):
    def __init__(self, input_size, output_size, bias=True, input_is_parallel=True, skip_bias_add=False,
                 reduce_results=True, params_dtype=None):
        super().__init__()
        tp = dist.get_world_size(get_tp_group())
        self.weight = nn.Parameter(torch.empty(output_size, input_size // tp, dtype=params_dtype))
        self.bias = nn.Parameter(torch.zeros(output_size, dtype=params_dtype)) if bias else None

    def forward(self, x):
        y = F.linear(x, self.weight)
        dist.all_reduce(y, group=get_tp_group())
        return (y if self.bias is None else y + self.bias), None
"""


def test_a_layer_whose_library_state_is_not_initialised_is_a_usage_error_not_a_finding(capsys, tmp_path,
                                                                                      monkeypatch) -> None:
    # Its constructor fails at tp size 1, where every size divides: set-up tpsim cannot see, not a bug of
    # the layer; exit 2 quoting the layer's own error and the way in, and no case file.
    layer = tmp_path / "uninitialised_vllm.py"
    layer.write_text(_UNINITIALISED)
    cases = tmp_path / "cases"
    monkeypatch.chdir(tmp_path)
    code = main(["check", f"{layer}:RowParallelLinear", *SMALL, "--cases-dir", str(cases)])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "cannot be built in a one-rank world" in err and "tensor model parallel group is not initialized" in err
    assert "needs a Variant whose builder initialises it" in err
    assert not cases.exists() or not any(cases.iterdir())


def test_vllm_options_follow_the_placements() -> None:
    # gather_output / input_is_parallel / reduce_results are set from --output/--input, and pass.
    for layer, options in [("ColumnParallelLinear", {"output": "gathered"}),
                           ("RowParallelLinear", {"input": "replicated"}),
                           ("RowParallelLinear", {"output": "partial", "ctor_arg": (("skip_bias_add", "True"),)})]:
        (variant,) = resolve_target(f"{ROOT / VLLM}:{layer}", forward_only=True, **options)
        for ws in (1, 2, 3):
            case = Case(world_size=ws, in_features=6, out_features=3 * ws, batch_shape=(2,), bias=True, seed=0)
            assert check_case(variant, case) == [], (layer, options, ws)


@pytest.mark.parametrize(("layer", "args", "world_size", "message"), [
    # Every rank adds the bias before the all-reduce.
    ("BiasOnEveryRankRowLinear", (), 3, "off by exactly (world_size-1)*bias = 2*bias"),
    # Under skip_bias_add it returns the bias and adds it too: off by +1*bias at every world size.
    ("ReturnsBiasAndAddsItRowLinear", (("skip_bias_add", "True"),), 3, "also returns it for the caller"),
    ("ReturnsBiasAndAddsItRowLinear", (("skip_bias_add", "True"),), 1, "also returns it for the caller"),
])
def test_vllm_bias_bugs_are_caught_as_bias_duplication(layer, args, world_size, message) -> None:
    (variant,) = resolve_target(f"{ROOT / VLLM}:{layer}", forward_only=True, ctor_arg=args or None)
    case = Case(world_size=world_size, in_features=6, out_features=3, batch_shape=(2,), bias=True, seed=0)
    failures = check_case(variant, case)
    assert [(f.property, f.diagnosis) for f in failures][:1] == [("forward-equivalence", "bias-duplication")]
    assert message in failures[0].message


def test_the_twin_that_returns_and_adds_the_bias_is_right_without_skip_bias_add(capsys, tmp_path, monkeypatch) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{VLLM}:ReturnsBiasAndAddsItRowLinear", "--forward-only")
    assert code == 0, out


def test_ctor_args_are_validated(capsys, tmp_path, monkeypatch) -> None:
    target = f"{ROOT / VLLM}:RowParallelLinear"
    with pytest.raises(InvalidArgument, match=r"--ctor-arg reduce_results=False: tpsim passes reduce_results itself "
                                              r"\(--output reduced\|partial\)"):
        resolve_target(target, ctor_arg=(("reduce_results", "False"),))
    with pytest.raises(InvalidArgument, match=r"--ctor-arg bias=False: tpsim passes bias itself"):
        resolve_target(target, ctor_arg=(("bias", "False"),))
    with pytest.raises(InvalidArgument, match=r"--ctor-arg colour=1: RowParallelLinear\(input_size, .*\) has no "
                                              r"parameter 'colour'"):
        resolve_target(target, ctor_arg=(("colour", "1"),))
    with pytest.raises(InvalidArgument, match=r"--ctor-arg skip_bias_add=yes: expected a Python literal"):
        resolve_target(target, ctor_arg=(("skip_bias_add", "yes"),))
    with pytest.raises(InvalidArgument, match=r"--ctor-arg applies to plain nn.Module classes only"):
        resolve_target(f"{ROOT / NANOTRON}:rank0_row", ctor_arg=(("bias", "True"),))
    code, out = _check(capsys, tmp_path, monkeypatch, f"{VLLM}:RowParallelLinear", "--ctor-arg", "skip_bias_add")
    assert code == 2


@pytest.mark.parametrize("output", ["reduced", "partial"])
def test_a_returned_bias_joins_a_partial_output_once_with_its_whole_grad_on_every_rank(output) -> None:
    # The caller adds a returned bias once, after its all-reduce: every rank's bias gets the whole grad.
    (variant,) = resolve_target(f"{ROOT / VLLM}:TrainableRowLinear", output=output,
                                ctor_arg=(("skip_bias_add", "True"),))
    for ws in (1, 2, 3):
        case = Case(world_size=ws, in_features=6, out_features=3, batch_shape=(2,), bias=True, seed=0)
        assert check_case(variant, case) == [], (output, ws)


# --- nanotron's mode: ALL_REDUCE, or REDUCE_SCATTER (sequence parallel) ---------------------------

SEQ_COLUMN, SEQ_ROW = ("--input", "sequence-sharded"), ("--output", "sequence-sharded")


@pytest.mark.parametrize(("layer", "args"), [
    ("TensorParallelColumnLinear", ()), ("TensorParallelRowLinear", ()),
    ("TensorParallelColumnLinear", SEQ_COLUMN), ("TensorParallelRowLinear", SEQ_ROW),
], ids=["column-all-reduce", "row-all-reduce", "column-reduce-scatter", "row-reduce-scatter"])
def test_nanotron_layers_with_a_required_mode_pass_with_no_adapter(capsys, tmp_path, monkeypatch, layer, args) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{NANOTRON}:{layer}", *args)
    assert code == 0, out
    assert "PASS" in out


def test_nanotrons_mode_follows_the_placements() -> None:
    target = f"{ROOT / NANOTRON}:TensorParallelRowLinear"
    (row,) = resolve_target(target)
    assert "mode=ALL_REDUCE" in row.description and row.output == "reduced"
    assert row.param("bias").held_by == "detect"  # nanotron's row bias lives on tp rank 0
    (seq,) = resolve_target(target, output="sequence-sharded")
    assert "mode=REDUCE_SCATTER" in seq.description and seq.sequence_dim == 0  # [seq, batch, hidden]
    with pytest.raises(InvalidArgument, match=r"--ctor-arg mode=REDUCE_SCATTER: tpsim passes mode itself "
                                              r"\(ALL_REDUCE, or REDUCE_SCATTER with --input/--output sequence-sharded\)"):
        resolve_target(target, ctor_arg=(("mode", "REDUCE_SCATTER"),))


def test_the_split_backward_of_the_sequence_gather_is_grad_not_reduced() -> None:
    target = f"{ROOT / NANOTRON}:SplitBackwardColumnLinear"
    (plain,) = resolve_target(target)
    (seq,) = resolve_target(target, input="sequence-sharded")
    case = Case(world_size=2, in_features=4, out_features=6, batch_shape=(4, 3), bias=True, seed=0)
    assert check_case(plain, case) == []  # ALL_REDUCE mode does not gather: the bug is not on its path
    failures = check_case(seq, case)
    assert [(f.property, f.diagnosis) for f in failures][:1] == [("input-grad-equivalence", "grad-not-reduced")]
    assert "instead of reduce-scattering it" in failures[0].message


def test_a_required_parameter_no_convention_passes_is_named_with_the_flag(tmp_path) -> None:
    (tmp_path / "needs.py").write_text(
        "import enum\n"
        "import torch\n"
        "class Layout(enum.Enum):\n"
        "    FLAT = 1\n"
        "    CHUNKED = 2\n"
        "class NeedsRowLinear(torch.nn.Module):\n"
        "    def __init__(self, in_features, out_features, pg, chunks, bias=True, layout=Layout.FLAT):\n"
        "        super().__init__()\n")
    target = f"{tmp_path / 'needs.py'}:NeedsRowLinear"
    with pytest.raises(InvalidArgument, match=r"requires chunks, which the group convention does not pass: fix it "
                                              r"with --ctor-arg chunks=VALUE"):
        resolve_target(target)
    (variant,) = resolve_target(target, ctor_arg=(("chunks", "2"), ("layout", "CHUNKED")))
    assert "chunks=2, layout=<Layout.CHUNKED: 2>" in variant.description
    with pytest.raises(InvalidArgument, match=r"--ctor-arg layout=SIDEWAYS: NeedsRowLinear's layout is a Layout; "
                                              r"expected one of FLAT, CHUNKED"):
        resolve_target(target, ctor_arg=(("chunks", "2"), ("layout", "SIDEWAYS")))


# --- torch.chunk's uneven pieces (5 over 4 ranks: 2, 2, 1, 0) -------------------------------------

CHUNK = "tests/wild/chunk_style.py"
#: (in/out size, tp size): an empty piece and a rank whose piece has tensor_split's size at another
#: offset (5 over 4), chunk's pieces differing from tensor_split's on several ranks (7 over 3, 9 over
#: 4), and sizes where both layouts agree (5 over 2, 2 over 4: every piece of one element or none).
CHUNK_SIZES = [(5, 4), (7, 3), (9, 4), (5, 2), (2, 4)]


def _chunk_case(layer: str, size: int, ws: int) -> Case:
    sizes = dict(in_features=size, out_features=3) if "Row" in layer else dict(in_features=3, out_features=size)
    return Case(world_size=ws, batch_shape=(2,), bias=True, seed=0, **sizes)


@pytest.mark.parametrize(("size", "ws"), CHUNK_SIZES)
@pytest.mark.parametrize("layer", ["ChunkColumnLinear", "ChunkRowLinear"])
def test_layers_cut_by_torch_chunk_pass(layer, size, ws) -> None:
    (variant,) = resolve_target(f"{ROOT / CHUNK}:{layer}")
    assert check_case(variant, _chunk_case(layer, size, ws)) == []


def test_a_chunk_layer_is_loaded_and_fed_by_chunks_pieces_on_every_rank() -> None:
    from tpsim.props.linear.family import LINEAR

    (variant,) = resolve_target(f"{ROOT / CHUNK}:ChunkRowLinear")
    obs = LINEAR.observe(variant, _chunk_case("ChunkRowLinear", 5, 4))
    assert [v.pieces for v in obs.values] == ["chunk"] * 4
    # Rank 2's piece (one column) has tensor_split's size too, at another offset: only its peers tell.
    assert [v.fits for v in obs.values] == [("tensor_split", "chunk"), ("chunk",), ("tensor_split", "chunk"), ("chunk",)]


@pytest.mark.parametrize(("size", "ws"), CHUNK_SIZES)
def test_a_truncating_layer_is_still_divisibility_unchecked(size, ws) -> None:
    (variant,) = resolve_target(f"{ROOT / CHUNK}:FloorRowLinear")
    failures = check_case(variant, _chunk_case("FloorRowLinear", size, ws))
    assert [(f.property, f.diagnosis) for f in failures] == [("divisibility", DIVISIBILITY_UNCHECKED)]


def test_a_chunk_layer_passes_a_search(capsys, tmp_path, monkeypatch) -> None:
    code, out = _check(capsys, tmp_path, monkeypatch, f"{CHUNK}:ChunkRowLinear")
    assert code == 0, out
