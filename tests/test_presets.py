"""The library presets: ``tpsim check megatron.core.tensor_parallel`` and
``tpsim check fairscale.nn.model_parallel.layers`` with no adapter code (small budgets here, so the
suite that CI runs exercises both), what the presets set up per rank, the CPU shim, the captured
library noise, and a missing library as a usage error with the install command."""

from __future__ import annotations

import json
import pathlib
import re
import sys

import pytest
import torch

import tpsim
from tpsim import target as target_module
from tpsim.cli import main
from tpsim.presets import LibraryMissing, preset_for_class, preset_for_target
from tpsim.target import resolve_target
from tpsim.variant import Variant

pytest.importorskip("megatron.core")
pytest.importorskip("fairscale")

ROOT = pathlib.Path(__file__).resolve().parent.parent
MEGATRON = "megatron.core.tensor_parallel"
FAIRSCALE = "fairscale.nn.model_parallel.layers"
#: The linear layers' variants (what resolve_target gives: the linear family).
MEGATRON_LINEAR_NAMES = [
    "ColumnParallelLinear",
    "ColumnParallelLinear(skip_bias_add=True)",
    "ColumnParallelLinear(gather_output=True)",
    "ColumnParallelLinear(disable_grad_reduce=True)",
    "ColumnParallelLinear(skip_bias_add=True, disable_grad_reduce=True)",
    "ColumnParallelLinear(gather_output=True, disable_grad_reduce=True)",
    "ColumnParallelLinear(sequence_parallel=True)",
    "ColumnParallelLinear(skip_bias_add=True, sequence_parallel=True)",
    "ColumnParallelLinear(gather_output=True, sequence_parallel=True)",
    "RowParallelLinear",
    "RowParallelLinear(skip_bias_add=True)",
    "RowParallelLinear(input_is_parallel=False)",
    "RowParallelLinear(input_is_parallel=False, skip_bias_add=True)",
    "RowParallelLinear(sequence_parallel=True)",
    "RowParallelLinear(skip_bias_add=True, sequence_parallel=True)",
]
MEGATRON_EMBEDDING_NAMES = [
    "VocabParallelEmbedding",
    "VocabParallelEmbedding(deterministic_mode=True)",
    "VocabParallelEmbedding(reduce_scatter_embeddings=True)",
    "VocabParallelEmbedding(reduce_scatter_embeddings=True, deterministic_mode=True)",
    "VocabParallelEmbedding(perform_initialization=False)",
    "VocabParallelEmbedding(use_cpu_initialization=False, perform_initialization=False)",
]
#: A variant that fails: Megatron's label smoothing over the shard (Megatron-LM #737, #7464).
MEGATRON_SMOOTHING = "vocab_parallel_cross_entropy"
#: The sequence-parallel column layers: they all-gather their input as given, which NCCL refuses
#: ("Tensors must be contiguous") for a non-contiguous one; the preset declares Megatron's contiguous
#: [sequence, batch, hidden] input as a precondition (contiguous inputs only, said in a note).
MEGATRON_SP_COLUMNS = [n for n in MEGATRON_LINEAR_NAMES if n.startswith("Column") and "sequence_parallel=True" in n]
MEGATRON_CROSS_ENTROPY_NAMES = ["vocab_parallel_cross_entropy(label_smoothing=0)", MEGATRON_SMOOTHING]
#: Every variant `tpsim check megatron.core.tensor_parallel` checks, in its order.
MEGATRON_NAMES = MEGATRON_LINEAR_NAMES + MEGATRON_EMBEDDING_NAMES + MEGATRON_CROSS_ENTROPY_NAMES
FAIRSCALE_NAMES = ["ColumnParallelLinear", "ColumnParallelLinear(gather_output=False)", "RowParallelLinear",
                   "RowParallelLinear(input_is_parallel=True)"]
#: fairscale's column layers: given a transposed input, the backward all-reduces a non-contiguous view,
#: which NCCL refuses (docs/bugs.md, "Found in released libraries").
FAIRSCALE_COLUMNS = FAIRSCALE_NAMES[:2]


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


# --- what the presets declare --------------------------------------------------------------------


def _linear(target: str) -> list:
    """The linear layers a library target resolves to (the one resolver gives every family's)."""
    return [v for v in resolve_target(target) if isinstance(v, Variant)]


def test_megatron_preset_declares_every_option_combination_and_its_limits() -> None:
    variants = _linear(MEGATRON)
    assert [v.name for v in variants] == MEGATRON_LINEAR_NAMES
    for v in variants:
        assert v.rank_local == ("megatron.core.parallel_state",)
        assert (v.min_batch_dims, v.max_batch_dims, v.sequence_dim) == (1, 2, 0)  # [s, h] or [s, b, h]
        assert v.subgroups  # the layers take tp_group=
        sp = "sequence_parallel=True" in v.name
        assert v.min_tp_size == (2 if sp else 1)
        assert (v.input == "sequence-sharded") == (sp and v.kind == "column")
        assert (v.output == "sequence-sharded") == (sp and v.kind == "row")
        assert v.input_grad == ("partial" if "disable_grad_reduce=True" in v.name else "complete")
    by_name = {v.name: v for v in variants}
    assert by_name["ColumnParallelLinear(gather_output=True)"].output == "gathered"
    assert by_name["RowParallelLinear(input_is_parallel=False)"].input == "replicated"


def test_fairscale_preset_declares_its_options_on_one_world_sized_group() -> None:
    variants = _linear(FAIRSCALE)
    assert [v.name for v in variants] == FAIRSCALE_NAMES
    assert all(v.rank_local == ("fairscale.nn.model_parallel.initialize",) and not v.subgroups for v in variants)
    assert [v.output for v in variants] == ["gathered", "sharded", "reduced", "reduced"]
    assert [v.input for v in variants] == ["replicated", "replicated", "replicated", "sharded"]
    assert [v.name for v in _linear("fairscale.nn.model_parallel")] == FAIRSCALE_NAMES


def test_presets_are_chosen_by_the_class_a_target_derives_from() -> None:
    from fairscale.nn.model_parallel.layers import RowParallelLinear as FairscaleRow
    from megatron.core.tensor_parallel import ColumnParallelLinear

    class Patched(ColumnParallelLinear):
        pass

    class Deeper(Patched):
        pass

    preset, kind = preset_for_class(Deeper)
    assert (preset.name, kind) == ("megatron-core", "column")
    assert preset_for_class(FairscaleRow)[0].name == "fairscale"
    assert preset_for_class(torch.nn.Linear) is None
    assert preset_for_target(MEGATRON).name == "megatron-core" and preset_for_target("tpsim.layers") is None
    names = [v.name for v in resolve_target(f"{MEGATRON}:RowParallelLinear")]
    assert names == [n for n in MEGATRON_LINEAR_NAMES if n.startswith("Row")]


# --- one command per library, small budgets (CI runs these) --------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("library, names", [
    (MEGATRON, MEGATRON_NAMES),
    # The layers module alone: its linear layers and embedding, not cross_entropy's function.
    (f"{MEGATRON}.layers", MEGATRON_LINEAR_NAMES + MEGATRON_EMBEDDING_NAMES),
    (FAIRSCALE, FAIRSCALE_NAMES),
])
def test_library_check_passes_with_the_same_output_format(capsys, tmp_path, library, names) -> None:
    # Every variant passes but real upstream bugs: Megatron's label smoothing (Megatron-LM #737, #7464)
    # fails with one cause, label-smoothing-per-shard, and nothing else; fairscale's column layers with
    # one, collective-on-strided-view. Its sequence-parallel
    # column layers draw contiguous inputs only (their declared precondition), and say so.
    code, out, err = run(capsys, "check", library, "--max-examples", "6", "--world-sizes", "1,2,4", "--seed", "0",
                         "--cases-dir", str(tmp_path))
    failing = ([MEGATRON_SMOOTHING] if library == MEGATRON else FAIRSCALE_COLUMNS if library == FAIRSCALE else [])
    assert code == (1 if failing else 0), out + err
    lines = out.splitlines()
    assert lines[0].startswith(f"tpsim check {library}: {len(names)} variants on inproc, world sizes 1,2,4")
    for name in names:
        verdict = "FAIL " if name in failing else "PASS "
        assert any(line.startswith(verdict) and f" {name} " in line for line in lines), (name, out)
    assert sum(line.startswith("FAIL ") for line in lines) == len(failing), out
    if library.startswith(MEGATRON):
        for name in MEGATRON_SP_COLUMNS:
            assert f"note: {name} declares contiguous inputs only" in out, name
    if failing:
        saved = sorted(p.name.split("-")[0] for p in tmp_path.iterdir())
        assert saved == sorted(re.sub(r"\W", "_", n) for n in failing)
    if library == FAIRSCALE:
        # fairscale's column layers all-reduce a transposed input's grad as the view it is, which NCCL
        # refuses (tests/wild/fairscale_strided_grad.py): one cause in each, nothing else.
        assert [line.strip() for line in lines if line.strip().startswith("FAILED ")] == [
            "FAILED input-grad-equivalence: collective-on-strided-view"] * 2, out
        assert re.match(rf"2 causes of failure \(2 failing properties\) in 2 of {len(names)} variants ", lines[-1]), out
    elif failing:
        assert [line.strip() for line in lines if line.strip().startswith("FAILED ")] == [
            "FAILED forward-equivalence: label-smoothing-per-shard"], out
        # One cause; its consequences (input grad, replica consistency) may fail on the same case or not.
        assert re.match(rf"1 cause of failure \(\d failing propert(y|ies)\) in 1 of {len(names)} variants ", lines[-1]), out
    else:
        assert lines[-1].startswith(f"all properties hold: {len(names)} variants, ")
        assert list(tmp_path.iterdir()) == []
    # Library noise is captured: a pass hides fairscale's prints and Megatron's warnings (a failure shows
    # them, by rank, under it).
    noise = [line for line in (out + err).splitlines() if "initializing model parallel" in line or "Warning" in line]
    assert not [line for line in noise if not line.lstrip().startswith("rank ")], noise


@pytest.mark.gloo
@pytest.mark.parametrize("target", [f"{MEGATRON}:RowParallelLinear", f"{FAIRSCALE}:RowParallelLinear"])
def test_library_check_passes_on_gloo(capsys, tmp_path, target) -> None:
    code, out, err = run(capsys, "check", target, "--backend", "gloo", "--max-examples", "3", "--world-sizes", "2",
                         "--dtypes", "float64,float32", "--seed", "0", "--cases-dir", str(tmp_path))
    assert code == 0, out + err
    assert out.splitlines()[-1].startswith("all properties hold: ")
    assert "initializing model parallel" not in out + err and "Warning" not in out + err


@pytest.mark.gloo
def test_fairscales_strided_grad_is_refused_on_gloo_as_on_inproc(capsys, tmp_path) -> None:
    code, out, err = run(capsys, "check", f"{FAIRSCALE}:ColumnParallelLinear", "--backend", "gloo", "--max-examples",
                         "8", "--world-sizes", "2", "--dtypes", "float64", "--seed", "0", "--cases-dir", str(tmp_path))
    assert code == 1, out + err
    assert "FAILED input-grad-equivalence: collective-on-strided-view" in out, out
    assert "input_layout=transposed" in out and "Tensors must be contiguous" in out, out


@pytest.mark.gloo
@pytest.mark.slow
def test_the_fairscale_strided_grad_defect_reproduces_without_tpsim() -> None:
    import subprocess

    script = ROOT / "tests" / "wild" / "fairscale_strided_grad.py"
    found = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert found.returncode == 1 and "DEFECT: all_reduce is given a non-contiguous view" in found.stdout, found.stderr
    fixed = subprocess.run([sys.executable, str(script), "--fixed"], capture_output=True, text=True, timeout=600)
    assert fixed.returncode == 0 and "OK: every all_reduce is given a contiguous tensor" in fixed.stdout, fixed.stderr


# --- per rank: config, parallel state, the CPU shim ---------------------------------------------


def test_megatron_parallel_state_is_per_rank_and_put_back() -> None:
    from megatron.core import parallel_state as ps

    (variant,) = [v for v in resolve_target(MEGATRON) if v.name == "ColumnParallelLinear(sequence_parallel=True)"]
    before = ps._TENSOR_MODEL_PARALLEL_GROUP

    def rank() -> tuple[int, int, bool, torch.dtype]:
        import torch.distributed as dist

        layer = variant.instantiate(2, 4, True, group=dist.group.WORLD, rank=dist.get_rank(), world_size=2,
                                    master_weight=torch.zeros(4, 2), master_bias=torch.zeros(4),
                                    dtype=torch.float64)
        dist.barrier()  # the other rank builds in between: its state must not leak into this one's
        return (ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size(),
                layer.config.use_cpu_initialization and not layer.config.gradient_accumulation_fusion,
                layer.weight.dtype)

    assert tpsim.run(rank, 2, rank_local=variant.rank_local) == [(0, 2, True, torch.float64), (1, 2, True,
                                                                                             torch.float64)]
    assert ps._TENSOR_MODEL_PARALLEL_GROUP is before  # rank-local: the module is put back afterwards


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU shim is installed only where CUDA is not")
def test_the_cpu_shim_answers_current_device_and_nothing_else() -> None:
    from tpsim.presets.megatron import SHIMMED_MODULES, cpu_shim_installed

    resolve_target(MEGATRON)
    assert cpu_shim_installed()
    for name in SHIMMED_MODULES:
        seen = sys.modules[name].torch
        assert seen.cuda.current_device() == torch.device("cpu")
        assert seen.matmul is torch.matmul and seen.distributed is torch.distributed
        assert seen.cuda.is_available is torch.cuda.is_available
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()  # torch itself is untouched


# --- a missing library ---------------------------------------------------------------------------


def test_a_missing_library_is_exit_2_with_the_install_command(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setattr(target_module, "_cache", {})
    for name in [n for n in sys.modules if n == "megatron" or n.startswith("megatron.")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    monkeypatch.setitem(sys.modules, "megatron", None)
    with pytest.raises(LibraryMissing):
        resolve_target(MEGATRON)
    code, out, err = run(capsys, "check", MEGATRON, "--max-examples", "1", "--cases-dir", str(tmp_path))
    assert code == 2
    assert "megatron-core is not installed" in err
    assert "pip install -c constraints.txt 'megatron-core==0.16.1'" in err and ".[libs]" in err


# --- library noise under a failure --------------------------------------------------------------


@pytest.mark.parametrize("isolation", [[], ["--no-isolate"]], ids=["isolated", "in-process"])
def test_a_failure_shows_the_library_output_with_its_rank(capsys, tmp_path, isolation) -> None:
    # Every rank's output carries its rank, whether the ranks run in a supervised worker process
    # (the default) or in this process.
    patches = str(ROOT / "tests" / "wild" / "fairscale_patches.py")
    argv = ["check", f"{patches}:BiasBeforeReduceRowParallelLinear", "--max-examples", "10", "--world-sizes", "2",
            "--dtypes", "float64", "--seed", "0", "--cases-dir", str(tmp_path), *isolation]
    code, out, err = run(capsys, *argv)
    assert code == 1, out + err
    assert "printed while the case ran:\n      rank 0 | > initializing model parallel with size 2" in out
    code, out, err = run(capsys, *argv, "--report", "json")
    doc = json.loads(out)  # the prints went into the report, not around it
    failure = next(f for f in doc["failures"] if f["diagnosis"] == "bias-duplication")
    assert "> initializing model parallel with size 2" in (failure.get("output") or {}).get("rank 0", ""), failure


# --- Megatron's vocab-parallel embedding and cross-entropy, and patches of them ----------------------


def _vocab_variants(target: str) -> list:
    from tpsim.target import resolve_target as resolve_any

    return resolve_any(target)


def test_the_megatron_embedding_declares_ids_of_one_or_two_dims() -> None:
    # Megatron's embedding takes ids [b, s]. deterministic_mode indexes self.weight[ids]: with a 0-dim
    # id that is basic indexing (a view of the weight), which the masking then writes in place, so
    # 0-dim ids are outside the declared contract; 1- and 2-dim ids must pass.
    from tpsim.props.vocab.case import EmbeddingCase
    from tpsim.props.vocab.family import EMBEDDING

    variants = {v.name: v for v in _vocab_variants(f"{MEGATRON}:VocabParallelEmbedding")}
    assert list(variants) == MEGATRON_EMBEDDING_NAMES
    for name, v in variants.items():
        assert (v.min_batch_dims, v.max_batch_dims) == ((2, 2) if "reduce_scatter" in name else (1, 2)), name
    deterministic = variants["VocabParallelEmbedding(deterministic_mode=True)"]
    for shape in [(5,), (2, 3)]:
        for tp in (1, 2, 4):
            case = EmbeddingCase(tp, 7, 3, shape, "float32", 1)
            assert EMBEDDING.check_case(deterministic, case, backend="inproc") == [], (shape, tp)
    (outside,) = EMBEDDING.check_case(deterministic, EmbeddingCase(2, 2, 1, (), "float64", 0), backend="inproc")
    assert outside.diagnosis == "exception" and "in-place" in outside.message  # why 0-dim ids are not drawn


PATCHES = ROOT / "tests" / "wild" / "megatron_vocab_patches.py"


def _patch_causes(name: str, smoothing: bool, **options) -> list[str]:
    """The causes a search finds in the patch ``name``'s variant with (or without) label smoothing."""
    from tpsim.props.search import search

    variants = _vocab_variants(f"{PATCHES}:{name}")
    variant = next(v for v in variants if ("label_smoothing=0" not in v.name) == smoothing) if len(variants) == 2 \
        else variants[0]
    report = search(variant, max_examples=30, seed=0, **options)
    return [f"{f.property}: {f.diagnosis}" for f in report.failures]


@pytest.mark.parametrize("name, smoothing, causes", [
    # Every embedding variant of the patch (deterministic_mode, reduce_scatter_embeddings...) is caught too.
    ("UnmaskedVocabParallelEmbedding", False, ["forward-equivalence: vocab-mask-missing"]),
    ("LocalMaxVocabParallelCrossEntropy", False, ["forward-equivalence: max-not-reduced"]),
    # The half fix keeps Megatron's bug: only the label-smoothing variant fails, with its one cause.
    ("GlobalFactorVocabParallelCrossEntropy", True, ["forward-equivalence: label-smoothing-per-shard"]),
    ("GlobalFactorVocabParallelCrossEntropy", False, []),
])
def test_each_megatron_vocab_patch_is_caught_with_its_diagnosis(name, smoothing, causes) -> None:
    # float64 and float32: in bfloat16, with one id per rank and a confident target, the local-max loss
    # log(tp) is also the dense loss plus log(tp) within the bound (loss-off-by-log-tp fits as well).
    assert _patch_causes(name, smoothing, world_sizes=(1, 2, 4), dtypes=("float64", "float32")) == causes


@pytest.mark.parametrize("smoothing", [False, True])
def test_the_megatron_smoothing_fix_passes_at_every_tp_size(smoothing) -> None:
    assert _patch_causes("FixedSmoothingVocabParallelCrossEntropy", smoothing, world_sizes=(1, 2, 3, 4, 8)) == []


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("tp", [1, 2, 4])
def test_the_patches_forward_with_no_switch_flipped_is_megatrons_own(tp, smoothing) -> None:
    # The patches share _forward, Megatron 0.16.1's forward written out with switches: with none
    # flipped it must give Megatron's own loss and grad, bit for bit (one code path, so the patches'
    # diagnoses are the switches' and nothing else).
    import importlib.util

    from megatron.core.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy

    from tpsim.presets.megatron import init_parallel_state

    spec = importlib.util.spec_from_file_location("megatron_vocab_patches_under_test", PATCHES)
    patches = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(patches)  # type: ignore[union-attr]
    generator = torch.Generator().manual_seed(tp)
    logits = torch.randn(3, 2, 8 * tp, generator=generator, dtype=torch.float32) * 3
    target = torch.randint(0, 8 * tp, (3, 2), generator=generator)

    def rank() -> list[torch.Tensor]:
        import torch.distributed as dist

        init_parallel_state(dist.group.WORLD)
        out = []
        for fn in (vocab_parallel_cross_entropy, patches.ReleasedVocabParallelCrossEntropy.apply):
            shard = logits.chunk(tp, -1)[dist.get_rank()].clone().requires_grad_()
            loss = fn(shard, target, smoothing)
            loss.backward(torch.ones_like(loss))
            out += [loss.detach(), shard.grad]
        return out

    for own_loss, own_grad, loss, grad in tpsim.run(rank, tp, rank_local=("megatron.core.parallel_state",)):
        assert torch.equal(loss, own_loss) and torch.equal(grad, own_grad)
