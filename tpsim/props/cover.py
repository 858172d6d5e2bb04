"""The cover phase of a search: before Hypothesis generates anything, one case per coverage bucket.

Random generation alone leaves holes at small budgets: a seed may draw sixteen two-rank cases and
none with a bias, so a bias-duplication bug passes at one seed and fails at the next. The search
therefore checks first, at every seed, one case of each bucket its family names
(:meth:`tpsim.props.family.Family.cover_keys`: each world size asked for with and without a bias,
each memory layout), drawn by the search's own strategy: typical cases of the bucket, not minimal
ones (sizes past the tiny half the time).

Why not Hypothesis's ``@example``: explicit examples are never shrunk, and a failure must come back
on its minimal case. So the cover cases enter through Hypothesis's own replay of saved examples:
each is recorded as the choice sequence the strategy made to draw it, and served (never stored) by
:class:`CoverDatabase` as if a previous run had saved it. Hypothesis replays them before it
generates (they count as examples), and a failing one is shrunk like any failure it found itself.
Each sequence carries unused trailing choices: Hypothesis skips shrinking a replayed example whose
sequence it consumed exactly (it takes it for one it shrank before), and these were never shrunk;
and it replays saved examples shortest first, so the padding also puts the failures a previous run
saved (with ``database=``) before the cover cases.

Which case fills a bucket depends on the search's seed (the same seed, the same cases), so searches
at different seeds still check different cases; every bucket is checked at each.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from hypothesis.control import BuildContext
from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase, choices_to_bytes
from hypothesis.internal.conjecture.data import ConjectureData

__all__ = ["CoverDatabase", "cover_choices", "cover_order"]

#: Draws the cover phase may make to fill its buckets (a bucket the variant cannot fill, such as a
#: world size its tp groups do not fit, stays empty once these are spent).
MAX_DRAWS = 300
#: Draws after the last new bucket was filled before the cover phase stops looking.
PATIENCE = 50
#: Hypothesis's suffixes of the keys beside a test's primary one (its corpus of failing examples).
_OTHER_KEYS = (b".secondary", b".pareto")


def cover_order(key: tuple[Any, ...]) -> tuple[Any, ...]:
    """Sort key of buckets, most telling first (what a budget smaller than the buckets keeps): several
    ranks with a bias, then the other buckets (memory layouts, a family's own), then several ranks
    without a bias, then one rank."""
    if key[0] != "world":
        return (1, 0, repr(key))
    _, world, bias = key
    if world == 1:
        return (3, world, str(bias))
    return (0 if bias else 2, world, str(bias))


def cover_choices(strategy: Any, keys_of: Any, *, seed: int, limit: int) -> list[tuple[Any, ...]]:
    """The choice sequences of up to ``limit`` cases of ``strategy``, one per bucket ``keys_of(case)``
    (a list of buckets; several for a case that fills several) names, in :func:`cover_order`: drawn at
    random from ``seed``; a case fills every bucket it names that is still empty."""
    rng = random.Random(f"tpsim-cover-{seed}")
    filled: dict[Hashable, tuple[Any, ...]] = {}
    used: set[tuple[Any, ...]] = set()
    since_new = 0
    for _ in range(MAX_DRAWS):
        data = ConjectureData(random=random.Random(rng.getrandbits(64)))
        with BuildContext(data, wrapped_test=None):
            case = data.draw(strategy)
        new = [k for k in keys_of(case) if k not in filled]
        since_new = 0 if new else since_new + 1
        for k in new:
            filled[k] = tuple(data.choices)
        if since_new >= PATIENCE:
            break
    out: list[tuple[Any, ...]] = []
    for key in sorted(filled, key=cover_order):
        choices = filled[key]
        if choices not in used:  # one case filling two buckets is checked once
            used.add(choices)
            out.append(choices)
    return out[:limit]


class CoverDatabase(ExampleDatabase):
    """An example database that serves the cover cases (choice sequences, see the module docstring) as
    the first saved examples of a test, before those of ``db`` (None: an in-memory one for this search,
    so that Hypothesis replays at all). Writes go to ``db``; the cover cases are never stored, and
    Hypothesis deleting one (it passed) is ignored."""

    def __init__(self, db: ExampleDatabase | None, cover: Sequence[Sequence[Any]]) -> None:
        super().__init__()
        self.db = db if db is not None else InMemoryExampleDatabase()
        self._choices = [tuple(c) for c in cover]
        self._served: set[bytes] = set()

    def __repr__(self) -> str:
        return f"CoverDatabase({self.db!r}, {len(self._choices)} cover cases)"

    def save(self, key: bytes, value: bytes) -> None:
        self.db.save(key, value)

    def fetch(self, key: bytes) -> Iterable[bytes]:
        saved = [value for value in self.db.fetch(key) if value not in self._served]
        if not key.endswith(_OTHER_KEYS):
            yield from self._cover(max((len(v) for v in saved), default=0))
        yield from saved

    def _cover(self, longest: int) -> list[bytes]:
        # Trailing choices the test never draws: Hypothesis then shrinks a failing cover case (module
        # docstring); as many as make each longer than every saved example, which Hypothesis replays
        # in order of length: a failure a previous run saved is replayed first.
        out = []
        for choices in self._choices:
            pad = 1
            value = choices_to_bytes((*choices, *(0,) * pad))
            while len(value) <= longest:
                pad += max(1, longest - len(value))
                value = choices_to_bytes((*choices, *(0,) * pad))
            out.append(value)
        self._served.update(out)
        return out

    def delete(self, key: bytes, value: bytes) -> None:
        if value not in self._served:
            self.db.delete(key, value)

    def move(self, src: bytes, dest: bytes, value: bytes) -> None:
        if value not in self._served:
            self.db.move(src, dest, value)
