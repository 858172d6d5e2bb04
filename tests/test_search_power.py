"""Search power: what the search reaches at small budgets, at every seed.

- The cover phase (tpsim/props/cover.py): each world size asked for, with and without a bias, and
  each memory layout, are checked first at every seed; a bias-duplication bug is caught within 20
  examples at each of 20 seeds, and a failure the cover phase finds is still shrunk to its minimal case.
- Sizes past the tiny (tpsim.props.strategies.per_rank): mutants correct only below a tile, a chunk
  or a large K are caught, and shrink to the smallest size that fails.
- The search-power table (thorough tier, ``slow``): every catalogued mutant caught within 100 examples
  at each of 20 seeds. ``pytest tests/test_search_power.py -m slow -s`` prints the table (median and
  worst examples to catch); ``python -m bench.search_power --write`` records it for docs/bugs.md.
"""

from __future__ import annotations

import statistics

import pytest
from hypothesis.database import InMemoryExampleDatabase

from bench.search_power import BUDGET, SEEDS, examples_to_catch
from tpsim.mutants import CATALOG, correct_row
from tpsim.props.cover import cover_choices
from tpsim.props.family import family_of
from tpsim.props.layouts import cover_bucket
from tpsim.props.linear.strategies import cases
from tpsim.props.search import search
from tpsim.props.strategies import DEFAULT_MAX_SIZE, sizes_past_tiny

_BY_NAME = {m.name: m for m in CATALOG}


# --- the cover phase ---------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(20))
def test_bias_duplication_is_caught_within_20_examples_at_every_seed(seed) -> None:
    mutant = _BY_NAME["row-bias-before-reduce"]
    report = search(mutant.variant, world_sizes=(1, 2), max_examples=20, seed=seed, shrink=False)
    assert not report.passed, f"seed {seed}: bias duplication passed {report.examples} examples"
    assert report.failures[0].diagnosis == "bias-duplication"
    assert report.failures[0].found_after <= 20


def test_bias_duplication_is_caught_within_5_examples_at_seed_0_and_shrunk() -> None:
    # What tpsim check --max-examples 5 --world-sizes 2 --seed 0 runs (tests/test_cli_robust.py).
    mutant = _BY_NAME["row-bias-before-reduce"]
    report = search(mutant.variant, world_sizes=(2,), max_examples=5, seed=0)
    hit = [f for f in report.failures if f.diagnosis == "bias-duplication"]
    assert hit and hit[0].found_after <= 5, report.failures
    # The cover case that found it has typical sizes; the report's case is the minimal one.
    case = hit[0].case
    assert (case.world_size, case.in_features, case.out_features, case.batch_shape, case.bias) == (2, 2, 2, (), True)


def test_the_cover_phase_checks_every_world_size_with_and_without_bias_and_every_layout_first() -> None:
    variant = _BY_NAME["row-bias-before-reduce"].variant
    for seed in (0, 7):
        seen = []
        search(correct_row, world_sizes=(1, 2, 3), max_examples=14, seed=seed,
               on_example=lambda n, c, seen=seen: seen.append(c))
        # The cover phase: 6 world-size buckets, 5 layout buckets (a transposed matrix and a transposed
        # batch are two), 2 sizes to refuse at most.
        first = seen[:13]
        full = [c for c in first if c.tp_size == c.world_size]
        assert {(c.world_size, c.bias) for c in full} == {(w, b) for w in (1, 2, 3) for b in (False, True)}, seed
        assert {cover_bucket(c.input_layout, c.batch_shape) for c in first} == {
            "contiguous", "transposed matrix", "transposed", "strided", "expanded"}, seed
    # Deterministic: the same seed, the same cover cases; another seed, other cases.
    strategy = cases(variant, world_sizes=(1, 2, 3), subgroups=True,
                     layouts=("contiguous", "transposed", "strided", "expanded"))
    family = family_of(variant)

    def keys(case):
        return family.cover_keys(variant, case, (1, 2, 3))

    assert cover_choices(strategy, keys, seed=3, limit=20) == cover_choices(strategy, keys, seed=3, limit=20)
    assert cover_choices(strategy, keys, seed=3, limit=20) != cover_choices(strategy, keys, seed=4, limit=20)
    assert len(cover_choices(strategy, keys, seed=3, limit=4)) == 4


def test_a_failure_saved_by_a_previous_search_is_replayed_before_the_cover_cases() -> None:
    mutant = _BY_NAME["row-bias-before-reduce"]
    db = InMemoryExampleDatabase()
    assert not search(mutant.variant, max_examples=30, seed=1, database=db).passed
    again = search(mutant.variant, max_examples=30, seed=2, database=db)
    assert again.failures[0].found_after == 1


# --- sizes past the tiny -------------------------------------------------------------------------------


def test_sizes_past_tiny_are_tile_multiples_and_their_neighbours() -> None:
    sizes = sizes_past_tiny(1, DEFAULT_MAX_SIZE)
    assert {4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 63, 64} <= set(sizes)
    assert min(sizes) == 4 and max(sizes) == DEFAULT_MAX_SIZE and list(sizes) == sorted(set(sizes))
    assert sizes_past_tiny(1, 3) == ()


@pytest.mark.slow
@pytest.mark.parametrize(("name", "expected"), [
    # (mutant, what its minimal case must be): the smallest sizes that fail, not the typical ones.
    ("column-tile-reuses-first", lambda c: c.out_features == 5 * c.tp_size),
    ("row-chunk-drops-remainder", lambda c: c.in_features == 9 * c.tp_size),
    ("row-large-k-reduce-twice", lambda c: c.in_features == 16 * c.tp_size and c.world_size == 2),
])
def test_size_mutants_are_caught_and_shrink_to_their_threshold(name, expected) -> None:
    mutant = _BY_NAME[name]
    report = search(mutant.variant, max_examples=100, seed=0)
    hits = [f for f in report.failures if f.diagnosis == mutant.diagnosis]
    assert hits, (name, [(f.property, f.diagnosis) for f in report.failures])
    assert expected(hits[0].case), (name, hits[0].case.describe())


def test_max_size_bounds_the_sizes_drawn() -> None:
    # With at most 4 features per rank the tile mutant (wrong past 4) cannot be reached.
    mutant = _BY_NAME["column-tile-reuses-first"]
    assert search(mutant.variant, world_sizes=(1, 2), max_examples=40, seed=0, max_size=4).passed
    assert not search(mutant.variant, world_sizes=(1, 2), max_examples=40, seed=0, max_size=5).passed


# --- the search-power table (thorough tier) --------------------------------------------------------------

#: Seeds per test: the 20 seeds in blocks, so xdist spreads one mutant's seeds over the workers.
_BLOCK = 5
_TABLE: dict[str, list[int | None]] = {}


@pytest.fixture(scope="module", autouse=True)
def search_power_table():
    yield
    if _TABLE:
        print(f"\n\nmutant{'':<38} median  worst  (examples to catch, {SEEDS} seeds, budget {BUDGET})")
        for name, counts in _TABLE.items():
            caught = [c for c in counts if c is not None]
            print(f"{name:<44} {statistics.median(caught) if caught else '-':>6}  "
                  f"{max(caught) if caught else '-':>5}" + ("" if len(caught) == len(counts) else "  MISSED"))


@pytest.mark.slow
@pytest.mark.parametrize("first_seed", range(0, SEEDS, _BLOCK))
@pytest.mark.parametrize("mutant", CATALOG, ids=lambda m: m.name)
def test_every_mutant_is_caught_within_100_examples_at_every_seed(mutant, first_seed) -> None:
    counts = {seed: examples_to_catch(mutant, seed) for seed in range(first_seed, first_seed + _BLOCK)}
    _TABLE.setdefault(mutant.name, []).extend(counts.values())
    missed = [seed for seed, n in counts.items() if n is None]
    assert not missed, f"{mutant.name} passed {BUDGET} examples at seeds {missed}"
