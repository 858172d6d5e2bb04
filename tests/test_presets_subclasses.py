"""Subclasses get their library's preset: patched Megatron-core and fairscale layers (written in
``tests/wild/*_patches.py``, as teams that fork them write) are checked in one command, each bug
caught with its intended diagnosis, and a harmless subclass passes."""

from __future__ import annotations

import pathlib

import pytest

from tpsim.cli import main
from tpsim.props.search import search
from tpsim.target import resolve_target

pytest.importorskip("megatron.core")
pytest.importorskip("fairscale")

WILD = pathlib.Path(__file__).resolve().parent / "wild"
MEGATRON_PATCHES = str(WILD / "megatron_patches.py")
FAIRSCALE_PATCHES = str(WILD / "fairscale_patches.py")
SMALL = dict(max_examples=40, seed=0, world_sizes=(1, 2, 4), dtypes=("float64", "float32"))


def _variant(path: str, cls: str, name: str):
    variants = {v.name: v for v in resolve_target(f"{path}:{cls}")}
    assert name in variants, sorted(variants)
    return variants[name]


@pytest.mark.parametrize(
    "path, cls, variant, prop, diagnosis",
    [
        (MEGATRON_PATCHES, "BiasBeforeReduceRowParallelLinear", "BiasBeforeReduceRowParallelLinear",
         "forward-equivalence", "bias-duplication"),
        (MEGATRON_PATCHES, "NoCopyColumnParallelLinear", "NoCopyColumnParallelLinear",
         "input-grad-equivalence", "grad-not-reduced"),
        (MEGATRON_PATCHES, "UnmarkedSequenceRowParallelLinear",
         "UnmarkedSequenceRowParallelLinear(sequence_parallel=True)", "bias-grad-equivalence", "grad-not-reduced"),
        (FAIRSCALE_PATCHES, "BiasBeforeReduceRowParallelLinear", "BiasBeforeReduceRowParallelLinear",
         "forward-equivalence", "bias-duplication"),
        (FAIRSCALE_PATCHES, "NoCopyColumnParallelLinear", "NoCopyColumnParallelLinear",
         "input-grad-equivalence", "grad-not-reduced"),
    ],
)
def test_a_patched_subclass_is_caught_with_its_diagnosis(path, cls, variant, prop, diagnosis) -> None:
    report = search(_variant(path, cls, variant), **SMALL)
    found = {(f.property, f.diagnosis) for f in report.failures}
    assert (prop, diagnosis) in found, found


@pytest.mark.parametrize("path, cls, library", [(MEGATRON_PATCHES, "CountingColumnParallelLinear", "Megatron-core"),
                                                (FAIRSCALE_PATCHES, "QuietRowParallelLinear", "fairscale")])
def test_a_harmless_subclass_passes_every_option_combination(path, cls, library) -> None:
    variants = resolve_target(f"{path}:{cls}")
    assert all(v.name.startswith(cls) and f"({library} preset)" in v.description for v in variants)
    for v in variants:
        report = search(v, max_examples=8, seed=0, world_sizes=(1, 2, 4))
        if library == "Megatron-core" and "sequence_parallel=True" in v.name and cls.endswith("ColumnParallelLinear"):
            # The library's precondition, inherited (docs/_found_in_libraries.md): its sequence-parallel
            # column layer all-gathers its input as given, so it declares contiguous inputs only, and
            # the report says so.
            assert v.contiguous_inputs and any("contiguous inputs only" in n for n in report.notes), (v.name, report.notes)
        assert report.passed, (v.name, [(f.property, f.diagnosis, f.message) for f in report.failures])


def test_one_command_checks_a_patch(capsys, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(WILD.parent.parent)
    code = main(["check", "tests/wild/megatron_patches.py:BiasBeforeReduceRowParallelLinear", "--max-examples", "15",
                 "--world-sizes", "1,2", "--dtypes", "float64", "--seed", "0", "--cases-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 1
    assert out.splitlines()[0].startswith("tpsim check tests/wild/megatron_patches.py:BiasBeforeReduceRowParallelLinear:"
                                          " 6 variants on inproc")
    assert "FAILED forward-equivalence: bias-duplication" in out
