"""Search power: what the search reaches at small budgets, at every seed.

- The cover phase (tpsim/props/cover.py): each world size asked for, with and without a bias, and
  each memory layout, are checked first at every seed; a bias-duplication bug is caught within 20
  examples at each of 20 seeds, and a failure the cover phase finds is still shrunk to its minimal case
  (its draw run, run again, reaches the cover case). A seed gives the same cases and the same report
  every time; the failures a search shrank replay first in the next one (``database=``).
- Sizes past the tiny (tpsim.props.strategies.per_rank): mutants correct only below a tile, a chunk
  or a large K are caught, and shrink to the smallest size that fails.
- The search-power table (thorough tier, ``slow``): every catalogued mutant caught within 100 examples
  at each of 20 seeds. ``pytest tests/test_search_power.py -m slow -s`` prints the table (median and
  worst examples to catch); ``python -m bench.search_power --write`` records it for docs/bugs.md.
"""

from __future__ import annotations

import json
import statistics

import pytest
from hypothesis.database import InMemoryExampleDatabase

from bench.search_power import BUDGET, SEEDS, examples_to_catch
from tpsim.mutants import CATALOG, correct_row
from tpsim.props.cover import RUN_EXAMPLES, SUBGROUPS, cover_cases, cover_order, shrink_cover
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
        # batch are two), 2 sizes to refuse, 1 split into several tp groups, at most.
        first = seen[:14]
        full = [c for c in first if c.tp_size == c.world_size]
        assert {(c.world_size, c.bias) for c in full} == {(w, b) for w in (1, 2, 3) for b in (False, True)}, seed
        assert {cover_bucket(c.input_layout, c.batch_shape) for c in first} == {
            "contiguous", "transposed matrix", "transposed", "strided", "expanded"}, seed
        assert any(c.tp_size < c.world_size for c in first), seed
        # Taking turns: a bias (on the most ranks first), a layout, sizes that do not divide, no bias, all
        # within the first four cases (a case first in two buckets is checked once, at the earlier).
        assert seen[0].bias and seen[0].world_size == 3, seed
        head = seen[:4]
        assert any(c.input_layout != "contiguous" for c in head), seed
        assert any(c.in_features % c.world_size + c.out_features % c.world_size for c in head), seed
        assert any(not c.bias and c.world_size > 1 for c in head), seed
    # Deterministic: the same seed, the same cover cases; another seed, other cases.
    strategy = cases(variant, world_sizes=(1, 2, 3), subgroups=True,
                     layouts=("contiguous", "transposed", "strided", "expanded"))
    family = family_of(variant)

    def keys(case):
        return family.cover_keys(variant, case, (1, 2, 3))

    def drawn(seed, limit=20):
        return [c.case for c in cover_cases(strategy, keys, seed=seed, limit=limit)]

    assert drawn(3) == drawn(3)
    assert drawn(3) != drawn(4)
    assert len(drawn(3, limit=4)) == 4


def test_the_cover_order_takes_turns_between_kinds_from_the_largest_world_down() -> None:
    keys = [("world", w, b) for w in (1, 2, 4) for b in (False, True)] + [("not divisible", w) for w in (2, 4)]
    keys += [("layout", "strided"), ("layout", "expanded"), SUBGROUPS]
    keys += [("layout", "contiguous"), ("layout", "transposed matrix")]
    assert cover_order(keys) == [
        ("world", 4, True), ("layout", "transposed matrix"), ("not divisible", 2), ("world", 4, False), SUBGROUPS,
        ("world", 2, True), ("layout", "strided"), ("not divisible", 4), ("world", 2, False),
        ("layout", "expanded"), ("layout", "contiguous"),
        ("world", 1, False), ("world", 1, True)]
    # A family without biases: its world buckets are one kind.
    assert cover_order([("world", 2, None), ("world", 3, None), ("not divisible", 3)]) == [
        ("world", 3, None), ("not divisible", 3), ("world", 2, None)]


def test_a_failing_cover_case_is_shrunk_to_the_minimal_case_of_its_failure() -> None:
    mutant = _BY_NAME["row-bias-before-reduce"]
    for seed in (0, 5):
        seen = []
        report = search(mutant.variant, world_sizes=(1, 2, 3), max_examples=30, seed=seed,
                        on_example=lambda n, c, seen=seen: seen.append(c))
        hit = report.failures[0]
        assert (hit.property, hit.diagnosis) == ("forward-equivalence", "bias-duplication"), seed
        # Caught in the cover phase (14 cases at most here) on a typical case ...
        assert hit.found_after <= 14, seed
        caught = seen[hit.found_after - 1]
        assert caught.bias and caught.in_features * caught.out_features > 4, (seed, caught.describe())
        # ... reported on its minimal case, with the same (property, diagnosis); nothing generated after.
        case = hit.case
        assert (case.world_size, case.in_features, case.out_features, case.batch_shape, case.bias) == (2, 2, 2, (), True)
        assert report.examples == len(seen) < 30 + 14, seed


def test_a_shrink_run_replays_the_draw_run_up_to_the_cover_case() -> None:
    variant = correct_row
    strategy = cases(variant, world_sizes=(1, 2, 3), subgroups=True,
                     layouts=("contiguous", "transposed", "strided", "expanded"))
    family = family_of(variant)
    layouts = [("layout", b) for b in ("transposed matrix", "transposed", "strided", "expanded")]
    covers = cover_cases(strategy, lambda case: family.cover_keys(variant, case, (1, 2, 3)), seed=1, limit=20,
                         wanted=layouts)
    assert len(covers) >= 10
    # Every layout the search asks for is covered, the rare ones (a transposed matrix) included, each by
    # a case that really is non-contiguous (shrunk below by its own draw run like any other).
    assert set(layouts) <= {b for cover in covers for b in cover.buckets}
    for cover in covers:
        asked = []

        def only_the_cover_case(case, asked=asked, cover=cover) -> bool:
            asked.append(case)
            return case == cover.case

        # The one case that "fails" is met within its draw run, every case before it asked truthfully.
        assert shrink_cover(strategy, cover, only_the_cover_case) == cover.case
        assert asked.index(cover.case) < RUN_EXAMPLES

    # A failure more cases share: shrunk from the cover case to a minimal case that still fails.
    def fails(case) -> bool:
        return case.world_size >= 2 and case.bias and case.in_features > 2

    starts = [cover for cover in covers if fails(cover.case)]
    assert starts
    for cover in starts:
        minimal = shrink_cover(strategy, cover, fails)
        assert fails(minimal)
        assert (minimal.world_size, minimal.batch_shape) == (2, ()) and minimal.in_features <= 4, minimal.describe()
        assert minimal.out_features <= 2 and minimal.dtype == "float64", minimal.describe()


def test_a_seed_gives_the_same_cases_and_the_same_report_every_time() -> None:
    def run(variant, seed, **options):
        seen = []
        report = search(variant, world_sizes=(1, 2), max_examples=20, seed=seed,
                        on_example=lambda n, c: seen.append(c.describe()), **options)
        doc = report.to_json()
        doc.pop("seconds")
        return seen, doc

    # A failure of the cover phase (and its shrink), and a passing search (cover phase, then generation).
    for variant in (_BY_NAME["row-bias-before-reduce"].variant, correct_row):
        first = run(variant, 3)
        assert run(variant, 3) == first, variant.name
        assert run(variant, 4)[0] != first[0], variant.name
    # shrink=False: stops at the first failing example, reported as found.
    seen, doc = run(_BY_NAME["row-bias-before-reduce"].variant, 3, shrink=False)
    assert doc["examples"] == len(seen) == doc["failures"][0]["found_after"]
    assert doc["failures"][0]["case"]["in_features"] > 2  # the cover case itself, unshrunk


class _KeysSeen(InMemoryExampleDatabase):
    """An in-memory database that records the keys it is asked to save under."""

    def __init__(self) -> None:
        super().__init__()
        self.keys: set[bytes] = set()

    def save(self, key: bytes, value: bytes) -> None:
        self.keys.add(key)
        super().save(key, value)


def test_a_failure_saved_by_a_previous_search_is_replayed_before_the_cover_cases() -> None:
    mutant = _BY_NAME["row-bias-before-reduce"]
    db = InMemoryExampleDatabase()
    assert not search(mutant.variant, max_examples=30, seed=1, database=db).passed
    again = search(mutant.variant, max_examples=30, seed=2, database=db)
    assert again.failures[0].found_after == 1


def test_the_database_keeps_minimal_failures_and_drops_what_passes_now() -> None:
    mutant = _BY_NAME["row-bias-before-reduce"]
    db = _KeysSeen()
    report = search(mutant.variant, world_sizes=(1, 2), max_examples=20, seed=0, database=db)
    (key,) = db.keys  # one key: this variant and its options
    (value,) = db.fetch(key)
    saved = json.loads(value)
    hit = report.failures[0]
    assert (saved["property"], saved["diagnosis"]) == (hit.property, hit.diagnosis)
    assert saved["case"] == hit.case.replace(property=None).to_dict()  # the minimal case
    # A case that passes now (no bias) and one this tpsim cannot read: both removed by the next search,
    # which replays the saved failure first and reports it on that case.
    db.save(key, json.dumps(dict(saved, case=dict(saved["case"], bias=False))).encode())
    db.save(key, b"not json")
    again = search(mutant.variant, world_sizes=(1, 2), max_examples=20, seed=1, database=db)
    assert set(db.fetch(key)) == {value}
    assert again.failures[0].found_after <= 2 and again.failures[0].case == hit.case
    # A saved case that now fails otherwise is reported as replayed, with a note: it is not minimal for that.
    other_key = json.dumps(dict(saved, diagnosis="mismatch")).encode()
    db.delete(key, value)
    db.save(key, other_key)
    third = search(mutant.variant, world_sizes=(1, 2), max_examples=20, seed=1, database=db)
    assert third.failures[0].found_after == 1 and third.failures[0].diagnosis == "bias-duplication"
    assert any("saved by a previous search for forward-equivalence: mismatch now fails with "
               "forward-equivalence: bias-duplication" in n for n in third.notes), third.notes
    # shrink=False saves nothing: what it reports is not minimal.
    other = _KeysSeen()
    search(mutant.variant, world_sizes=(1, 2), max_examples=20, seed=0, database=other, shrink=False)
    assert not other.keys


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
#: The seeds the thorough tier searches each mutant at: the first half of the bench's (python -m
#: bench.search_power searches all of them and its table is docs/search_power.json); the whole set cost
#: the tier 16 minutes of its 60 on 2 cores.
_TESTED_SEEDS = SEEDS // 2
_TABLE: dict[str, list[int | None]] = {}


@pytest.fixture(scope="module", autouse=True)
def search_power_table():
    yield
    if _TABLE:
        print(f"\n\nmutant{'':<38} median  worst  (examples to catch, {_TESTED_SEEDS} seeds, budget {BUDGET})")
        for name, counts in _TABLE.items():
            caught = [c for c in counts if c is not None]
            print(f"{name:<44} {statistics.median(caught) if caught else '-':>6}  "
                  f"{max(caught) if caught else '-':>5}" + ("" if len(caught) == len(counts) else "  MISSED"))


@pytest.mark.slow
@pytest.mark.parametrize("first_seed", range(0, _TESTED_SEEDS, _BLOCK))
@pytest.mark.parametrize("mutant", CATALOG, ids=lambda m: m.name)
def test_every_mutant_is_caught_within_100_examples_at_every_seed(mutant, first_seed) -> None:
    counts = {seed: examples_to_catch(mutant, seed) for seed in range(first_seed, first_seed + _BLOCK)}
    _TABLE.setdefault(mutant.name, []).extend(counts.values())
    missed = [seed for seed, n in counts.items() if n is None]
    assert not missed, f"{mutant.name} passed {BUDGET} examples at seeds {missed}"


def test_a_drawn_non_contiguous_layout_is_never_contiguous_memory() -> None:
    # A transposed input with a dim of one element, or a one-row expand, is contiguous memory: a case
    # that names the layout but tests nothing of it (it once filled the cover bucket of the layout).
    from hypothesis import given
    from hypothesis import settings as hsettings

    from tpsim.props.layouts import layout_info

    strategy = cases(correct_row, world_sizes=(1, 2, 4), subgroups=True,
                     layouts=("contiguous", "transposed", "strided", "expanded"))

    @hsettings(max_examples=200, database=None, derandomize=True)
    @given(strategy)
    def check(case) -> None:
        info = layout_info((*case.batch_shape, case.in_features), case.input_layout)
        assert info["contiguous"] == (case.input_layout == "contiguous"), (case.describe(), info)

    check()
