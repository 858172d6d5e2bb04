"""The mutant catalog (tpsim/mutants): every catalogued bug is caught by ``search`` with its intended
diagnosis, and every correct variant passes.

``pytest tests/test_mutants.py -s`` prints the catch table (mutant, diagnosis, examples to catch,
seconds). The 500-example runs of the correct variants are marked ``slow``; run them with
``pytest tests/test_mutants.py -m slow``.
"""

from __future__ import annotations

import time

import pytest

from tpsim import builtin_variants
from tpsim.diagnosis import DIAGNOSES
from tpsim.mutants import CATALOG, CORRECT, CORRECT_NORMS
from tpsim.props.family import family_of
from tpsim.props.search import search

#: Budget for catching a mutant: every one is caught well within it (the table shows how fast).
CATCH_BUDGET = 200
#: Seed 0 in the fast tier (every mutant caught once; unshrunk where the first failing example already
#: shows the diagnosis), seed 1 in the thorough tier (caught and shrunk).
SEEDS = (0, pytest.param(1, marks=pytest.mark.thorough))
CORRECT_VARIANTS = CORRECT + builtin_variants.TPSIM_VARIANTS + CORRECT_NORMS

_TABLE: list[tuple[str, str, int, str, float]] = []


@pytest.fixture(scope="module", autouse=True)
def catch_table():
    yield
    if _TABLE:
        print("\n\nmutant                       diagnosis               seed  examples to catch  seconds")
        for name, diagnosis, seed, found, seconds in _TABLE:
            print(f"{name:<28} {diagnosis:<23} {seed:>4}  {found:>17}  {seconds:7.2f}")


def test_the_catalog_is_complete_and_documented() -> None:
    assert len(CATALOG) >= 12
    names = [m.name for m in CATALOG]
    assert len(set(names)) == len(names)
    for m in CATALOG:
        assert m.diagnosis in DIAGNOSES, m.name
        assert len(m.description) > 40, m.name
        assert m.target == f"tpsim.mutants:{m.variant.name}"
    # The list, by mechanism.
    required = {"bias-duplication", "bias-grad-rank0-only", "grad-scaled", "wrong-shard-dim", "wrong-shard-order",
                "grad-not-reduced", "divisibility-unchecked", "missing-reduction", "precision-loss"}
    assert required <= {m.diagnosis for m in CATALOG}


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mutant", CATALOG, ids=lambda m: m.name)
def test_mutant_is_caught_with_its_intended_diagnosis(mutant, seed) -> None:
    started = time.monotonic()
    report = search(mutant.variant, max_examples=CATCH_BUDGET, seed=seed, shrink=seed != 0)
    if seed == 0 and not any(f.diagnosis == mutant.diagnosis for f in report.failures):
        # Its first failing case shows another mechanism (a larger case, several effects at once):
        # the diagnosis is the minimal case's.
        report = search(mutant.variant, max_examples=CATCH_BUDGET, seed=seed)
    seconds = time.monotonic() - started
    assert not report.passed, f"{mutant.name} passed {report.examples} examples"
    hits = [f for f in report.failures if f.diagnosis == mutant.diagnosis]
    found = [(f.property, f.diagnosis) for f in report.failures]
    assert hits, f"{mutant.name}: expected diagnosis {mutant.diagnosis!r}, got {found}"
    _TABLE.append((mutant.name, mutant.diagnosis, seed, hits[0].found_after, seconds))
    # The reported case is the example itself: checked again on its own, outside the search, it
    # fails the same property with the same diagnosis.
    again = family_of(mutant.variant).check_case(mutant.variant, hits[0].case, backend="inproc", timeout=60.0)
    assert (hits[0].property, mutant.diagnosis) in [(f.property, f.diagnosis) for f in again], (
        mutant.name, hits[0].case.describe(), [(f.property, f.diagnosis) for f in again])


def test_the_targeted_mutants_need_what_their_docstrings_say() -> None:
    # Each "only visible with ..." mutant passes when the search cannot reach its trigger.
    by_name = {m.name: m for m in CATALOG}
    assert search(by_name["column-node-local-rank"].variant, world_sizes=(1, 2, 3, 4), max_examples=60, seed=0).passed
    # ... and that every case it is caught on has the trigger (never vacuous: it must be caught).
    report = search(by_name["column-gather-dim1"].variant, max_examples=200, seed=0)
    assert "wrong-shard-dim" in [f.diagnosis for f in report.failures], report.failures
    assert all(len(f.case.batch_shape) >= 2 for f in report.failures)
    report = search(by_name["row-no-reduce-without-bias"].variant, max_examples=60, seed=0)
    assert "missing-reduction" in [f.diagnosis for f in report.failures], report.failures
    assert all(not f.case.bias for f in report.failures)


@pytest.mark.parametrize("variant", CORRECT_VARIANTS, ids=lambda v: v.name)
def test_correct_variant_passes(variant) -> None:
    # 40 examples (the cover phase and more) in the fast tier; 500 on every world size in the thorough one.
    report = search(variant, max_examples=40, seed=11)
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 40


@pytest.mark.slow
@pytest.mark.parametrize("variant", CORRECT_VARIANTS, ids=lambda v: v.name)
def test_correct_variant_passes_500_examples(variant) -> None:
    report = search(variant, world_sizes=(1, 2, 3, 4, 5, 6, 7, 8), max_examples=500, seed=2024)
    assert report.passed, [f.describe() for f in report.failures]
    assert report.examples == 500


@pytest.mark.smoke
@pytest.mark.parametrize("backend", ["gloo"])
def test_search_on_gloo_catches_a_mutant_and_passes_a_correct_variant(backend) -> None:
    by_name = {m.name: m for m in CATALOG}
    report = search(by_name["row-bias-before-reduce"].variant, backend=backend, world_sizes=(2,), max_examples=10,
                    seed=0)
    assert [f.diagnosis for f in report.failures] == ["bias-duplication"]
    assert report.failures[0].case.world_size == 2
    report = search(builtin_variants.row, backend=backend, world_sizes=(2,), max_examples=5, seed=0)
    assert report.passed, [f.describe() for f in report.failures]
