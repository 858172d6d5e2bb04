"""The cover phase of a search: before Hypothesis generates anything, one case per coverage bucket.

Random generation alone leaves holes at small budgets: a seed may draw sixteen two-rank cases and
none with a bias, so a bias-duplication bug passes at one seed and fails at the next. The search
therefore checks first, at every seed, one case of each bucket its family names
(:meth:`tpsim.props.family.Family.cover_keys`: each world size asked for with and without a bias,
each memory layout, sizes to refuse, a family's own) and of :data:`SUBGROUPS` (tp groups smaller
than the world), drawn by the search's own strategy: typical cases of the bucket, not minimal ones
(sizes past the tiny half the time). They are checked taking turns between the kinds of bucket
(:func:`cover_order`), so that whatever a bug needs comes within the first few cases. A failing
cover case must still come back on its minimal case, like any failure of the search: the typical
case that caught a bug is a poor report of it.

Everything here goes through Hypothesis's public API (``hypothesis.find`` with its ``random=``,
``settings``, ``Phase``); nothing reads or writes Hypothesis's internal data.

**Drawing.** The cases come from short Hypothesis runs of the search's strategy: ``find(strategy,
condition, settings=..., random=Random(s))`` with the generate phase only and :data:`RUN_EXAMPLES`
examples, for a sequence of run seeds ``s`` drawn from the search's seed. The condition never holds:
it only records the cases the run generates. A run starts with the simplest case of the strategy
(the same in every run: a bucket filled by it would get a minimal case), so each run's first case is
left out and the others are candidates, in order: a candidate fills every bucket it names that is
still empty (:data:`MAX_DRAWS` candidates at most, :data:`PATIENCE` after the last new bucket). The
cases are the buckets' first candidates, in :func:`cover_order` (a case first in several buckets is
checked once, where the first of them puts it).

**Shrinking.** A failing cover case is shrunk by running its draw run again (:func:`shrink_cover`):
the same ``find`` with the same run seed, the shrink phase on, and as condition "fails with the same
(property, diagnosis)". For a given seed Hypothesis generates the same cases in the same order as
long as the test answers the same way, and every case the draw run made before the cover case
passed its condition (none holds there): so this run meets the same cases, checks each of them for
that failure (truthfully: the first case of the run, the simplest of all, is a likely minimal
case), reaches the cover case (if no earlier one failed that way), and shrinks it as it shrinks any
failure it finds, accepting only smaller cases that fail with that very (property, diagnosis), never
trading it for another finding. ``find`` returns the minimal case. The search runs each case of the
phase once (it keeps their results), so meeting the cover case again, or the minimal case in
``find``'s last replay, costs no example. Should the run not reach a
failing case (only if Hypothesis's generation changed between the two runs, in one process), the
cover case is reported as found, with a note.

Why not the alternatives: ``@example`` cases are never shrunk; Hypothesis's example database holds
its own serialisation of a run's choices, which only its internals write, and a seeded run
(``hypothesis.seed``, ``derandomize``) uses no database at all.

Which case fills a bucket depends on the search's seed (the same seed, the same cases), so searches
at different seeds still check different cases; every bucket is checked at each.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Any

from hypothesis import HealthCheck, Phase, Verbosity, find, settings
from hypothesis.errors import NoSuchExample, Unsatisfiable

__all__ = ["LAYOUT_ORDER", "SUBGROUPS", "CoverCase", "cover_cases", "cover_order", "shrink_cover"]

#: Candidates the cover phase may draw to fill its buckets (a bucket the variant cannot fill, such as
#: a world size its tp groups do not fit, stays empty once these are spent).
MAX_DRAWS = 300
#: Candidates after the last new bucket was filled before the cover phase stops looking.
PATIENCE = 50
#: Examples of each draw run: its first (the strategy's simplest case) and the candidates. Small, so
#: that Hypothesis draws every case of the run at random (a long run starts with cases grown from the
#: simplest one) and that a shrink run checks few cases before it reaches the cover case.
RUN_EXAMPLES = 5


@dataclass(frozen=True)
class CoverCase:
    """A case of the cover phase: ``case``, the ``buckets`` it is the first case of (in
    :func:`cover_order`), and where it was drawn: ``run_seed``, the seed of its draw run (what
    :func:`shrink_cover` runs again)."""

    case: Any
    buckets: tuple[Hashable, ...]
    run_seed: int


#: The bucket of a divisible case whose tp groups are smaller than its world (several groups): the
#: search adds it to its family's buckets (:meth:`~tpsim.props.family.Family.cover_keys` names only
#: cases whose tp group spans the world), so a layer that uses the wrong process group is checked
#: early too.
SUBGROUPS = ("tp groups", "smaller than the world")


#: The order of the layout buckets (:func:`tpsim.props.layouts.cover_bucket`) within their kind: the
#: non-contiguous layouts as :data:`~tpsim.props.layouts.INPUT_LAYOUTS` lists them (a transposed
#: activation, the commonest view real training hands a layer, in both its buckets; a slice; a
#: broadcast, whose identical rows make some wrong grads look merely scaled), contiguous last: it is the
#: layout most cases of the other kinds have already.
LAYOUT_ORDER = ("transposed", "transposed matrix", "strided", "expanded", "contiguous")


def _kind(key: tuple[Any, ...]) -> tuple[int, str]:
    """The kind of a bucket, in the order :func:`cover_order` takes turns between them: several ranks
    with a bias (or of a family without biases), memory layouts, sizes that do not divide, several
    ranks without a bias, then the other kinds by name (a family's own, tp groups); one rank last."""
    if key[0] == "world":
        _, world, bias = key
        return (5, "") if world == 1 else (0, "") if bias is not False else (3, "")
    if key[0] == "layout":
        return (1, "")
    if key[0] == "not divisible":
        return (2, "")
    return (4, str(key[0]))


def _within(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """The order of a kind's buckets (see :func:`cover_order`)."""
    if key[0] == "world":
        return (-key[1], repr(key))
    if key[0] == "not divisible":
        return (key[1], repr(key))
    if key[0] == "layout":
        return (LAYOUT_ORDER.index(key[1]) if key[1] in LAYOUT_ORDER else len(LAYOUT_ORDER), repr(key))
    return (0, repr(key))


def cover_order(keys: Iterable[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
    """``keys`` (buckets) in the order their cases are checked, which is also what a budget smaller than
    the buckets keeps: taking turns between the kinds of bucket (:func:`_kind`), so that whatever a bug
    needs (a bias, a layout, sizes that do not divide, no bias, ...) comes within the first few cases.
    Within a kind: world sizes from the largest down (a bug that shows on some number of ranks mostly
    shows on more, so the first cases show the most), but sizes that do not divide from the smallest
    world up (the fewer the ranks, the likelier a size that does not divide still lets parts or sums
    of it divide, the near misses a layer's own check gets wrong); layouts in :data:`LAYOUT_ORDER`;
    the others by name; one rank last."""
    kinds: dict[tuple[int, str], list[tuple[Any, ...]]] = {}
    for key in sorted(keys, key=lambda k: (_kind(k), _within(k))):
        kinds.setdefault(_kind(key), []).append(key)
    several = [kind for kind in sorted(kinds) if kind[0] < 5]
    turns = max((len(kinds[kind]) for kind in several), default=0)
    out = [kinds[kind][i] for i in range(turns) for kind in several if i < len(kinds[kind])]
    return out + [key for kind in sorted(kinds) if kind[0] == 5 for key in kinds[kind]]


def _run_settings(*, shrink: bool) -> settings:
    # The draw run and its shrink run differ only in the shrink phase, so that Hypothesis generates the
    # same cases in both (module docstring). No database: the runs are seeded, and replays of a
    # previous search are the search's business (tpsim.props.search).
    return settings(
        max_examples=RUN_EXAMPLES,
        phases=(Phase.generate, Phase.shrink) if shrink else (Phase.generate,),
        database=None,
        deadline=None,
        verbosity=Verbosity.quiet,
        suppress_health_check=list(HealthCheck),
        report_multiple_bugs=False,
        print_blob=False,
    )


def _draw_run(strategy: Any, run_seed: int) -> list[Any]:
    """The cases a draw run generates, in order."""
    drawn: list[Any] = []

    def record(case: Any) -> bool:
        drawn.append(case)
        return False

    try:
        find(strategy, record, settings=_run_settings(shrink=False), random=random.Random(run_seed))
    except (NoSuchExample, Unsatisfiable):  # the condition never holds: every run ends here
        pass
    return drawn


def cover_cases(strategy: Any, keys_of: Callable[[Any], list[Hashable]], *, seed: int,
                limit: int) -> list[CoverCase]:
    """Up to ``limit`` cases of ``strategy``, one per bucket ``keys_of(case)`` (a list of buckets;
    several for a case that fills several) names, in :func:`cover_order`: drawn from ``seed`` (the
    module docstring says how); a case fills every bucket it names that is still empty, and is
    checked once."""
    rng = random.Random(f"tpsim-cover-{seed}")
    filled: dict[Hashable, tuple[Any, int]] = {}
    drawn = since_new = 0
    for _ in range(MAX_DRAWS):  # runs: each gives up to RUN_EXAMPLES - 1 candidates (none if all are invalid)
        if drawn >= MAX_DRAWS or since_new >= PATIENCE:
            break
        run_seed = rng.getrandbits(64)
        for case in _draw_run(strategy, run_seed)[1:]:  # the first: the strategy's simplest case
            drawn += 1
            new = [k for k in keys_of(case) if k not in filled]
            since_new = 0 if new else since_new + 1
            for k in new:
                filled[k] = (case, run_seed)
            if drawn >= MAX_DRAWS or since_new >= PATIENCE:
                break
    by_case: dict[str, CoverCase] = {}
    for key in cover_order(filled):
        case, run_seed = filled[key]
        seen = by_case.get(repr(case))
        if seen is None:
            by_case[repr(case)] = CoverCase(case, (key,), run_seed)
        else:  # one case filling two buckets is checked once
            by_case[repr(case)] = CoverCase(case, (*seen.buckets, key), run_seed)
    return list(by_case.values())[:limit]


def shrink_cover(strategy: Any, cover: CoverCase, fails: Callable[[Any], bool]) -> Any:
    """The minimal case of ``strategy`` that ``fails`` (the cover case failed: ``fails`` says whether a
    case fails with the same property and diagnosis), shrunk from ``cover.case`` by running its draw
    run again (module docstring). Raises ``hypothesis.errors.NoSuchExample`` when that run meets no
    case that fails."""
    return find(strategy, fails, settings=_run_settings(shrink=True), random=random.Random(cover.run_seed))
