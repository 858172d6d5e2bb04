"""The search engine: Hypothesis generates cases for a variant, every property is checked on each,
and each failure comes back shrunk to its minimal case with a diagnosis.

This is what ``tpsim check`` and :func:`tpsim.props.suite.property_tests` call::

    from tpsim.props.search import search
    report = search(variant, max_examples=200, seed=0)
    for failure in report.failures:
        print(failure.describe())

How it works: one Hypothesis test (``@given(cases(variant, ...))``, run programmatically) checks
every property of each case (its family's :meth:`~tpsim.props.family.Family.check_case`: one world run per case). A case
that fails raises an exception whose *type* is specific to the first failing property and its
diagnosis, so Hypothesis treats each ``(property, diagnosis)`` as a distinct bug: it keeps
generating a little longer to find more of them, then shrinks each one on its own to the smallest
case that still fails *that* property with *that* diagnosis (shrinking never trades a
``bias-duplication`` for some other finding). The report lists, for every shrunk bug, the failure
of its property on its minimal case, plus the other properties that fail on those minimal cases.

A search has three phases, in this order, all on Hypothesis's public API:

1. *replay* (with ``database``): the failing cases previous searches of the same variant and
   options saved are checked first;
2. *cover* (:mod:`tpsim.props.cover`): one case per coverage bucket of the variant's family, at
   every seed; a failing one is shrunk (``hypothesis.find`` replaying the run that drew it);
3. *generate*: the Hypothesis test above, for the rest of ``max_examples``.

As Hypothesis does with the failures its database holds, a search whose first two phases found a
failure reports it without generating more (``max_examples`` is a budget, not a quota).

Determinism: with ``seed`` given, the cover cases and the generated examples are a function of the
seed (``hypothesis.seed``), so the same call finds and shrinks the same cases every time; with
``seed=None`` the active Hypothesis settings profile decides how the third phase generates
(derandomised under tpsim's ``ci`` profile), and the cover cases are those of seed 0.

``database`` (an ``ExampleDatabase`` or a directory path; None: none) makes the cases that failed
before replay first. A seeded Hypothesis run uses no database (``hypothesis.seed`` and
``derandomize`` turn it off), and what Hypothesis stores there is its internal serialisation of a
run; so the search keeps its own record, through the database's public interface
(:class:`FailureStore`): under a key of the variant and its options, each failure's minimal case
(the case's JSON, as its case file holds it) and its property and diagnosis. A saved case that
passes now is removed. A saved case that still fails is reported on that case, which was minimal
when it was saved (a note says when it now fails otherwise); only shrunk failures are saved.

Errors of the harness itself (a bad option, a backend that cannot start, a variant that gloo
workers cannot import) are raised, not reported as failures: they abort the search at once.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase
from hypothesis.errors import NoSuchExample, Unsatisfiable

from tpsim.comm.limits import check_world_size
from tpsim.diagnosis import (
    DIVISIBILITY_UNCHECKED,
    EXCEPTION,
    MISMATCH,
    SHAPE_ERROR,
    Failure,
    follows_from,
    group_causes,
)
from tpsim.errors import InvalidArgument
from tpsim.props.case import DTYPES
from tpsim.props.cover import SUBGROUPS, cover_cases, shrink_cover
from tpsim.props.family import Family, family_of
from tpsim.props.layouts import INPUT_LAYOUTS
from tpsim.props.linear.case import Case
from tpsim.props.property_names import BIAS_GRAD, DIVISIBILITY, PROPERTIES
from tpsim.props.strategies import DEFAULT_MAX_SIZE, DEFAULT_WORLD_SIZES
from tpsim.runner import BACKENDS, DEFAULT_TIMEOUT

__all__ = [
    "DEFAULT_DTYPES",
    "DEFAULT_MAX_SIZE",
    "DEFAULT_MAX_EXAMPLES",
    "DEFAULT_WORLD_SIZES",
    "HEALTH_CHECKS_SUPPRESSED",
    "FailureStore",
    "SearchInterrupted",
    "SearchReport",
    "property_verdicts",
    "search",
]

# The defaults below are the library's; ``tpsim check`` derives its own defaults from them.
# World sizes: DEFAULT_WORLD_SIZES of tpsim.props.strategies (re-exported here).
#: dtypes :func:`search` draws from by default: every dtype a case can carry.
DEFAULT_DTYPES = tuple(DTYPES)
#: Examples :func:`search` checks per variant by default.
DEFAULT_MAX_EXAMPLES = 100

#: The Hypothesis health checks tpsim's own Hypothesis tests (a search, fault plans) turn off, each
#: for its reason; the others stay on.
HEALTH_CHECKS_SUPPRESSED = [
    # Hypothesis times data generation by the wall clock: on a loaded machine (CI, a busy laptop, the
    # rank threads of the previous example winding down) drawing a few cases can take a second, and
    # the health check would then abort a check that found nothing wrong.
    HealthCheck.too_slow,
    # A search may run inside the caller's own Hypothesis test (a user's @given test that checks a
    # variant): the search is a separate engine with its own examples, deliberately nested.
    HealthCheck.nested_given,
]


class FailureStore:
    """The failures previous searches of one variant (and set of options) saved, in an example
    database through its public interface (``save``, ``fetch``, ``delete``), under ``key``.

    Each value is the JSON of one failure: its ``family``, its minimal ``case`` (the case's
    ``to_dict()``, as its case file holds it) and the ``property`` and ``diagnosis`` it failed with.
    A value this version of tpsim cannot read back is removed (as Hypothesis removes the entries it
    cannot read)."""

    def __init__(self, db: ExampleDatabase, key: bytes, family: Family) -> None:
        self.db, self.key, self.family = db, key, family

    def __repr__(self) -> str:
        return f"FailureStore({self.db!r}, {self.key!r})"

    def entries(self) -> list[tuple[bytes, Any, tuple[str, str]]]:
        """``(value, case, (property, diagnosis))`` of every saved failure, in a stable order."""
        out = []
        for value in sorted(set(self.db.fetch(self.key))):
            try:
                doc = json.loads(value.decode("utf-8"))
                if doc["family"] != self.family.name:
                    raise InvalidArgument(f"a {doc['family']} case")
                case = self.family.case_from_dict(doc["case"])
                failed = (str(doc["property"]), str(doc["diagnosis"]))
            except (ValueError, KeyError, TypeError, InvalidArgument):
                self.db.delete(self.key, value)
                continue
            out.append((value, case, failed))
        return out

    def save(self, case: Any, failed: tuple[str, str]) -> None:
        """Save ``case``, the minimal case of a failure of ``failed`` (property, diagnosis)."""
        doc = {"family": self.family.name, "case": case.to_dict(), "property": failed[0], "diagnosis": failed[1]}
        self.db.save(self.key, json.dumps(doc, sort_keys=True).encode("utf-8"))

    def delete(self, value: bytes) -> None:
        """Remove a saved failure (its case passes now)."""
        self.db.delete(self.key, value)


@dataclass
class SearchReport:
    """The outcome of :func:`search`.

    - ``passed``: every property held on every example;
    - ``examples``: cases checked in all (replayed, cover cases, generated, shrink attempts and
      Hypothesis's final replays; a case of the cover phase runs once);
    - ``failures``: one :class:`~tpsim.diagnosis.Failure` per *cause*, each on its minimal case,
      in property order, with the failures that follow from it in its ``consequences`` (see
      :func:`_merge`); ``len(failures)`` is the number of causes a summary counts;
    - ``seconds``: wall time of the search;
    - ``notes``: remarks a report should show (e.g. "bias-free cases only");
    - ``variant``: the variant's name;
    - ``verdicts``: every property's verdict, by name: ``{"verdict": "pass" | "fail" |
      "not-applicable", "diagnoses": [...], "cause": "property: diagnosis" or None, "why": ...}``
      (a failing property lists its diagnoses, and the cause it is a consequence of, if any).
    """

    passed: bool
    examples: int
    failures: list[Failure]
    seconds: float
    notes: list[str] = field(default_factory=list)
    variant: str | None = None
    verdicts: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def causes(self) -> int:
        """How many distinct causes failed (consequences are not counted)."""
        return len(self.failures)

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: the fields above, failures as :meth:`Failure.to_json`."""
        return {
            "variant": self.variant,
            "passed": self.passed,
            "examples": self.examples,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
            "causes": self.causes,
            "failures": [f.to_json() for f in self.failures],
            "verdicts": {k: dict(v) for k, v in self.verdicts.items()},
        }


def property_verdicts(properties: Sequence[str], causes: Sequence[Failure],
                      not_applicable: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Every property's verdict from a search's causes: ``fail`` (with its diagnoses, and the cause
    when the property failed only as a consequence), ``not-applicable`` (with why) or ``pass``."""
    out: dict[str, dict[str, Any]] = {}
    skipped = dict(not_applicable or {})
    for cause in causes:
        for f in (cause, *cause.consequences):
            v = out.setdefault(f.property, {"verdict": "fail", "diagnoses": [], "cause": None})
            if f.label not in v["diagnoses"]:
                v["diagnoses"].append(f.label)
            if f is cause:
                v["cause"] = None
                v["primary"] = True
            elif not v.get("primary"):
                v["cause"] = f"{cause.property}: {cause.label}"
    verdicts: dict[str, dict[str, Any]] = {}
    for prop in dict.fromkeys([*properties, *out]):
        if prop in out:
            v = out[prop]
            v.pop("primary", None)
            verdicts[prop] = v
        elif prop in skipped:
            verdicts[prop] = {"verdict": "not-applicable", "diagnoses": [], "cause": None, "why": skipped[prop]}
        else:
            verdicts[prop] = {"verdict": "pass", "diagnoses": [], "cause": None}
    return verdicts


class _Found(Exception):
    """Raised inside the Hypothesis test when a case fails; subclassed per (property, diagnosis)."""

    key: tuple[str, str] = ("", "")

    def __init__(self, case: Case, failures: list[Failure]) -> None:
        super().__init__(f"{self.key[0]} failed ({self.key[1]}) on {case.describe()}")
        self.case = case
        self.failures = failures


_FOUND_TYPES: dict[tuple[str, str], type[_Found]] = {}


def _found_type(prop: str, diagnosis: str) -> type[_Found]:
    # One exception type per (property, diagnosis): Hypothesis tells bugs apart by exception type
    # (and raise site), so each gets its own shrink. Cached: the same key must give the same type.
    key = (prop, diagnosis)
    cls = _FOUND_TYPES.get(key)
    if cls is None:
        name = "Failed_" + "".join(c if c.isalnum() else "_" for c in f"{prop}__{diagnosis}")
        cls = type(name, (_Found,), {"key": key})
        _FOUND_TYPES[key] = cls
    return cls


class SearchInterrupted(KeyboardInterrupt):
    """Ctrl-C (a ``KeyboardInterrupt``) stopped a :func:`search`; ``report`` holds what it had found.

    A ``KeyboardInterrupt`` so that code that does not know it still stops; callers that report
    (``tpsim check``) catch it and print ``report``: each failure on the smallest case seen so far
    for its (property, diagnosis), which shrinking may not have finished reducing.
    """

    def __init__(self, report: SearchReport) -> None:
        super().__init__(f"search interrupted after {report.examples} examples")
        self.report = report


class _Abort(BaseException):
    """Carries a harness error out of Hypothesis at once (BaseException: it is neither shrunk nor retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _as_variant(variant: Any) -> Any:
    """``variant`` itself when it is a variant of a family (:mod:`tpsim.props.family`), else the one
    variant a target string names."""
    from tpsim.props.family import families
    from tpsim.target import resolve_target

    if any(isinstance(variant, f.variant_type) for f in families()):
        return variant
    if isinstance(variant, str):
        found = resolve_target(variant)
        if len(found) != 1:
            names = ", ".join(v.name for v in found)
            raise InvalidArgument(
                f"variant={variant!r} names {len(found)} variants ({names}); search checks one: "
                "name it with MODULE:Name, or call search once per variant"
            )
        return found[0]
    raise InvalidArgument(f"variant={variant!r}: expected a tpsim Variant, a ModuleVariant or a target string (module:Name)")


def _database(database: Any) -> ExampleDatabase | None:
    if database is None or isinstance(database, ExampleDatabase):
        return database
    if isinstance(database, str):
        return DirectoryBasedExampleDatabase(database)
    raise InvalidArgument(f"database={database!r}: expected None, a directory path or a hypothesis ExampleDatabase")


def _check_options(max_examples: Any, backend: Any, timeout: Any, properties: Any, seed: Any) -> tuple[str, ...]:
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        raise InvalidArgument(f"max_examples={max_examples!r} must be an int >= 1")
    if backend not in BACKENDS:
        raise InvalidArgument(f"backend={backend!r}; expected one of {', '.join(BACKENDS)}")
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not (timeout > 0 and math.isfinite(timeout)):
        raise InvalidArgument(f"timeout={timeout!r} must be a positive number of seconds")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise InvalidArgument(f"seed={seed!r} must be an int or None")
    if properties is None:
        return PROPERTIES
    if isinstance(properties, str):
        properties = (properties,)
    wanted = tuple(properties)
    unknown = [p for p in wanted if p not in PROPERTIES]
    if unknown or not wanted:
        raise InvalidArgument(f"properties={list(wanted)!r}; expected a non-empty subset of {list(PROPERTIES)}")
    return wanted


def _check_world(world_sizes: Any, backend: str, isolate: Any, variant: Any) -> None:
    """World sizes within the backend's limit; ``isolate`` a bool, usable with this variant."""
    if not isinstance(isolate, bool):
        raise InvalidArgument(f"isolate={isolate!r} must be True or False")
    if isolate and backend == "inproc" and variant.target is None:
        raise InvalidArgument(
            f"isolate=True: variant {variant.name!r} has no target string, so the isolated worker process cannot "
            "import it; declare it at module level and check it by target (e.g. tpsim check mymodule:Name), or "
            "pass isolate=False"
        )
    for ws in world_sizes if isinstance(world_sizes, (list, tuple)) else ():
        if isinstance(ws, int) and not isinstance(ws, bool) and ws >= 1:  # other values: the strategy says why
            check_world_size(ws, backend)


def _digest(variant: Any, *parts: Any) -> bytes:
    # Distinguishes the saved failures of different variants and option sets: the key of their
    # :class:`FailureStore`.
    text = repr((variant.target, variant.name, variant.options, parts))
    return hashlib.sha256(text.encode()).digest()


def _collect(error: BaseException) -> list[_Found]:
    if isinstance(error, _Found):
        return [error]
    # Hypothesis reports several bugs as an exception group (builtin on 3.11+, the exceptiongroup
    # backport on 3.10): both carry the members in ``.exceptions``.
    members = getattr(error, "exceptions", None)
    if isinstance(members, (list, tuple)):
        return [f for sub in members for f in _collect(sub)]
    return []


def search(
    variant: Any,
    *,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    max_examples: int = DEFAULT_MAX_EXAMPLES,
    seed: int | None = None,
    backend: str = "inproc",
    timeout: float = DEFAULT_TIMEOUT,
    properties: Sequence[str] | None = None,
    on_example: Callable[[int, Case], None] | None = None,
    database: ExampleDatabase | str | None = None,
    tp_sizes: Sequence[int] | None = None,
    subgroups: bool = True,
    layouts: Sequence[str] = INPUT_LAYOUTS,
    isolate: bool = False,
    max_size: int = DEFAULT_MAX_SIZE,
    shrink: bool = True,
) -> SearchReport:
    """Check ``variant`` on up to ``max_examples`` generated cases; return a :class:`SearchReport`.

    ``variant``: a variant of any family (:mod:`tpsim.props.family`: a linear
    :class:`~tpsim.variant.Variant`, a :class:`~tpsim.module_variant.ModuleVariant`, ...) or a target
    string naming exactly one; its family draws and checks the cases.
    ``world_sizes``/``dtypes``: what cases draw from (a family may narrow the dtypes, and say so in
    the report's notes). ``seed``: makes the search repeatable.
    ``backend``: ``inproc`` | ``gloo`` | ``nccl`` (gloo/nccl need a variant with a ``target``
    their worker processes can import). ``timeout``: seconds any one world run may block in a
    collective before it counts as stuck. ``properties``: names from
    :data:`tpsim.props.linear.checks.PROPERTIES` (default: all; without ``divisibility`` only divisible
    cases are generated). ``on_example(n, case)`` is called before the n-th case runs (1-based).
    ``database``: see the module docstring. ``tp_sizes``: tp group sizes to split each world into
    (each world size is split into groups of a tp size that divides it; default: the whole world half
    the time, a proper divisor otherwise, as ``subgroups=True``); ``subgroups=False`` (and no
    ``tp_sizes``): one tp group spanning the world. ``layouts``: memory layouts of the inputs and
    upstream grads to draw from (default: all of :data:`tpsim.props.layouts.INPUT_LAYOUTS`).
    ``isolate=True``: run each inproc world in a supervised worker process (``tpsim check`` does), so a
    rank that exits, crashes or hangs in native code is a failure (``rank-exited``, ``rank-crashed``)
    instead of the end of this process; the variant needs a target string. World sizes above the
    backend's limit on this machine are refused up front (:func:`tpsim.comm.limits.check_world_size`).
    ``max_size``: the largest size per rank a sharded dim draws (tiny sizes half the time; see
    :func:`tpsim.props.strategies.per_rank`).

    ``shrink=False``: stop at the first failing example and report it as found, unshrunk (a quick "is
    it caught, and after how many examples?"; the search-power benchmark uses it).

    The first examples are the saved failures (with ``database``), then the cover phase
    (:mod:`tpsim.props.cover`): one case per world size asked for with and without a bias, per memory
    layout, per world size with sizes to refuse and with several tp groups, at every seed; then
    Hypothesis generates (the module docstring says more).

    Raises :class:`tpsim.InvalidArgument` for bad options and re-raises harness errors (backend
    unavailable, ...); anything the variant does wrong, exceptions included, is a failure.
    """
    started = time.monotonic()
    variant = _as_variant(variant)
    # The variant's family (linear layer, whole module, ...) draws and checks its cases.
    family = family_of(variant)
    variant = family.prepared(variant)
    wanted = _check_options(max_examples, backend, timeout, properties, seed)
    if not isinstance(shrink, bool):
        raise InvalidArgument(f"shrink={shrink!r} must be True or False")
    if isinstance(max_size, bool) or not isinstance(max_size, int) or max_size < 1:
        raise InvalidArgument(f"max_size={max_size!r} must be an int >= 1 (the largest size per rank drawn)")
    _check_world(world_sizes, backend, isolate, variant)
    wanted, dtypes, notes = family.plan(variant, wanted, tuple(dtypes))
    strategy = family.cases(
        variant,
        world_sizes=tuple(world_sizes),
        dtypes=tuple(dtypes),
        non_divisible=DIVISIBILITY in wanted,
        tp_sizes=None if tp_sizes is None else tuple(tp_sizes),
        subgroups=bool(subgroups),
        layouts=tuple(layouts),
        max_size=max_size,
    )
    db = _database(database)
    store = None if db is None else FailureStore(db, b"tpsim.search." + _digest(
        variant, tuple(world_sizes), tuple(dtypes), wanted,
        *(() if tp_sizes is None and subgroups and tuple(layouts) == INPUT_LAYOUTS
          else (tp_sizes, subgroups, tuple(layouts))),
        *(() if max_size == DEFAULT_MAX_SIZE else (("max_size", max_size),)),
    ), family)

    calls = 0
    first_seen: dict[tuple[str, str], int] = {}
    # The latest failing case of each (property, diagnosis), recorded as it is found so that an
    # interrupt can still report it (the shrinker only tries cases smaller than the current one).
    latest: dict[tuple[str, str], _Found] = {}

    # Shrinking a hang costs a whole timeout per attempt that hangs again (tens of attempts: minutes at
    # the default timeout). Once the failing runs that hung have taken HANG_BUDGET timeouts, no new
    # case runs: the remaining attempts count as passing (the smallest failing case found so far is
    # kept) and a case already seen failing fails again from memory (Hypothesis's final replay).
    hung = 0.0
    seen_failing: dict[str, list[Failure]] = {}

    def run_case(case: Any) -> list[Failure]:
        """Check ``case`` (one example: counted, ``on_example`` told); its failures, grouped by cause."""
        nonlocal calls, hung
        key = repr(case)
        if hung >= HANG_BUDGET * float(timeout):
            return seen_failing.get(key, [])  # a case seen failing fails again, from memory
        calls += 1
        if on_example is not None:
            on_example(calls, case)
        began = time.monotonic()
        try:
            failures = family.check_case(variant, case, backend=backend, timeout=float(timeout),
                                         properties=wanted, isolate=isolate)
        except Exception as err:  # the harness failed, not the variant: stop now
            raise _Abort(err) from err
        if failures and time.monotonic() - began >= float(timeout):
            hung += time.monotonic() - began
        if failures:
            # One cause, one report (a family's checks may return its failures ungrouped).
            failures = group_causes(failures)
            for f in failures:
                for g in (f, *f.consequences):
                    first_seen.setdefault((g.property, g.diagnosis), calls)
            seen_failing[key] = failures
        return failures

    def found_on(case: Any, failures: list[Failure]) -> _Found:
        """The finding of a failing case: keyed by its first cause's (property, diagnosis)."""
        head = failures[0]
        found_exc = _found_type(head.property, head.diagnosis)(case, failures)
        latest[found_exc.key] = found_exc
        return found_exc

    def check_one(case: Case) -> None:  # the Hypothesis test of the generate phase
        failures = run_case(case)
        if failures:
            raise found_on(case, failures)  # one raise site: Hypothesis tells failures apart by type and site

    found: list[_Found] = []
    # Failures the database is not to save (by id): replayed from it, or not on the minimal case of
    # their (property, diagnosis).
    unsaved: set[int] = set()
    try:
        if store is not None:
            found += _replay(store, run_case, found_on, notes, unsaved, shrink=shrink)
        if shrink or not found:
            found += _cover(strategy, lambda case: _cover_keys(family, variant, case, tuple(world_sizes)),
                            run_case, found_on, notes, unsaved, seed=0 if seed is None else seed,
                            limit=max_examples, shrink=shrink, known={f.key for f in found})
        if not found and calls < max_examples:
            found = _generate(strategy, check_one, notes, unsaved, max_examples=max_examples - calls,
                              seed=seed, shrink=shrink)
    except _Abort as abort:
        raise abort.error from None
    except KeyboardInterrupt:
        notes.append(
            f"interrupted after {calls} examples: each failure is on the smallest case found so far, "
            "which shrinking may not have finished reducing"
        )
        partial = _merge(list(latest.values()), first_seen)
        raise SearchInterrupted(SearchReport(
            passed=not partial, examples=calls, failures=partial, seconds=time.monotonic() - started,
            notes=notes, variant=variant.name,
        )) from None
    cut_short = hung >= HANG_BUDGET * float(timeout)
    if cut_short:
        notes.append(f"shrinking stopped after {hung:.0f} s of failing runs that hung (each waits out the "
                     f"{float(timeout):g} s timeout): each failure is on the smallest case found by then")
    if store is not None and shrink and not cut_short:  # only minimal cases are saved
        for exc in found:
            if id(exc) not in unsaved:
                store.save(exc.case, exc.key)
    failures = _merge(found, first_seen)
    return SearchReport(
        passed=not failures,
        examples=calls,
        failures=failures,
        seconds=time.monotonic() - started,
        notes=notes,
        variant=variant.name,
        verdicts=property_verdicts(family.properties, failures, _not_applicable(family, variant, wanted)),
    )


def _cover_keys(family: Family, variant: Any, case: Any, world_sizes: tuple[int, ...]) -> list[Any]:
    """The buckets ``case`` fills in the cover phase: its family's, and :data:`~tpsim.props.cover.SUBGROUPS`
    for a divisible case split into several tp groups."""
    keys = list(family.cover_keys(variant, case, world_sizes))
    if 1 <= case.tp_size < case.world_size and family.divisible(variant, case):
        keys.append(SUBGROUPS)
    return keys


def _replay(store: FailureStore, run_case: Callable[[Any], list[Failure]],
            found_on: Callable[[Any, list[Failure]], _Found], notes: list[str], unsaved: set[int],
            *, shrink: bool) -> list[_Found]:
    """The first phase: check the failures previous searches saved; those that pass now are removed."""
    out: list[_Found] = []
    for value, case, failed in store.entries():
        failures = run_case(case)
        if not failures:
            store.delete(value)
            continue
        exc = found_on(case, failures)
        unsaved.add(id(exc))  # saved already (and, failing otherwise now, not minimal for that)
        if exc.key != failed:
            notes.append(f"a case saved by a previous search for {failed[0]}: {failed[1]} now fails with "
                         f"{exc.key[0]}: {exc.key[1]}; it is reported on that case, not shrunk for it")
        out.append(exc)
        if not shrink:
            break
    return out


def _cover(strategy: Any, keys_of: Callable[[Any], list[Any]], run_case: Callable[[Any], list[Failure]],
           found_on: Callable[[Any, list[Failure]], _Found], notes: list[str], unsaved: set[int], *,
           seed: int, limit: int, shrink: bool, known: set[tuple[str, str]]) -> list[_Found]:
    """The second phase (:mod:`tpsim.props.cover`): one case per bucket, each run once; the first
    failing case of each (property, diagnosis) not ``known`` yet is shrunk (``shrink=False``: the
    phase stops at the first failing case)."""
    results: dict[str, list[Failure]] = {}  # every case of the phase runs once

    def run_once(case: Any) -> list[Failure]:
        key = repr(case)
        if key not in results:
            results[key] = run_case(case)
        return results[key]

    failing: dict[tuple[str, str], tuple[Any, _Found]] = {}
    for cover in cover_cases(strategy, keys_of, seed=seed, limit=limit):
        failures = run_once(cover.case)
        if failures and (failures[0].property, failures[0].diagnosis) not in failing:
            exc = found_on(cover.case, failures)
            if not shrink:
                return [exc]
            failing[exc.key] = (cover, exc)

    out: list[_Found] = []
    for key, (cover, exc) in failing.items():
        if key in known:
            continue

        def fails(case: Any, key: tuple[str, str] = key) -> bool:
            failures = run_once(case)
            if failures and (failures[0].property, failures[0].diagnosis) == key:
                found_on(case, failures)  # the smallest so far (what an interrupt reports)
                return True
            return False

        try:
            minimal = shrink_cover(strategy, cover, fails)
        except (NoSuchExample, Unsatisfiable):
            unsaved.add(id(exc))
            notes.append(f"the cover case that failed {key[0]} ({key[1]}) could not be drawn again to be "
                         "shrunk: it is reported as found")
            out.append(exc)
            continue
        out.append(found_on(minimal, run_once(minimal)))
    return out


def _generate(strategy: Any, check_one: Callable[[Any], None], notes: list[str], unsaved: set[int], *,
              max_examples: int, seed: int | None, shrink: bool) -> list[_Found]:
    """The third phase: Hypothesis generates ``max_examples`` cases and shrinks each (property,
    diagnosis) it finds (``shrink=False``: it stops at the first failing case)."""
    options: dict[str, Any] = dict(
        max_examples=max_examples,
        deadline=None,
        # The replays of previous failures are the first phase's (FailureStore); a seeded run uses none.
        database=None,
        suppress_health_check=HEALTH_CHECKS_SUPPRESSED,
        verbosity=Verbosity.quiet,
        report_multiple_bugs=bool(shrink),
        print_blob=False,
        phases=(Phase.generate, *((Phase.shrink,) if shrink else ())),
    )
    test = settings(**options)(given(strategy)(check_one))
    if seed is not None:
        test = hypothesis.seed(seed)(test)  # the seed decides every example (over the profile's derandomize)
    try:
        test()
    except (_Abort, KeyboardInterrupt):
        raise
    except hypothesis.errors.FlakyFailure as err:
        notes.append(
            "a failing case did not fail again when replayed (flaky): the variant or the backend is "
            "not deterministic; the failures below are from the first run"
        )
        found = _collect(err)
        unsaved.update(id(f) for f in found)
        return found
    except BaseException as err:  # noqa: BLE001 - sorted here: ours become failures, the rest propagate
        found = _collect(err)
        if not found:
            raise
        return found
    return []


#: How many timeouts' worth of failing runs that hung a search spends before it stops shrinking
#: (see :func:`search`).
HANG_BUDGET = 4


def _not_applicable(family: Family, variant: Any, wanted: Sequence[str]) -> dict[str, str]:
    """Why some of its family's properties were not checked in a search of ``variant`` (by name)."""
    why = {p: "not requested (properties=...)" for p in family.properties if p not in wanted}
    if getattr(variant, "divisible_only", False):
        why[DIVISIBILITY] = "the variant declares divisible cases only"
    if getattr(variant, "bias", True) is False and BIAS_GRAD in family.properties:
        why[BIAS_GRAD] = "the variant has no bias"
    why.update({p: reason for p, reason in family.why_not_applicable(variant).items() if p not in wanted})
    return why


#: The diagnoses given when no recogniser saw its evidence (values, shapes): see :func:`_merge` rule 4.
_FALLBACKS = (MISMATCH, SHAPE_ERROR)


def _merge(found: list[_Found], first_seen: dict[tuple[str, str], int]) -> list[Failure]:
    """One report per cause, each on its minimal case, in property order.

    Hypothesis shrinks every (property, diagnosis) of a case's *first cause* on its own (see
    :func:`search`). The causes reported, by these rules:

    1. each shrunk key gives its failure on its minimal case, with the consequences
       :func:`tpsim.diagnosis.group_causes` listed under it on that case;
    2. other causes on those minimal cases are added when their property is not covered yet;
    3. a shrunk key that was seen as a *consequence* of another cause (on that cause's minimal case)
       is listed under that cause, not beside it; so is one with that cause's diagnosis on a property
       the registry lists among its consequences (the same mechanism, recognised on its own minimal
       case, e.g. a grad that is wrong where the loss is still within its bound);
    4. a fallback diagnosis (``mismatch`` for values, ``shape-error`` for shapes: no recogniser saw
       its pattern) on a property that also has a recognised cause is listed under that cause: the
       same property failing where the pattern could not be seen (low precision, a size the bug
       cannot cut) is not a second bug until shown otherwise.

    5. an unclear refusal of a non-divisible case (``divisibility-unchecked``: every rank raised an
       error that does not name the sizes) whose error is the very error an ``exception`` cause
       raised on a divisible case is listed under that cause: the layer raises whatever the sizes,
       one bug, not two.

    Nothing is dropped: folded failures stay in their cause's ``consequences``.
    """
    order = {p: i for i, p in enumerate(PROPERTIES)}
    primary: dict[tuple[str, str], Failure] = {}
    extra: dict[tuple[str, str], Failure] = {}
    for exc in found:
        for f in exc.failures:
            key = (f.property, f.diagnosis)
            if key == exc.key:
                primary.setdefault(key, f)
            else:
                extra.setdefault(key, f)
    covered = {p for p, _ in primary}
    chosen = list(primary.values())
    for key, f in extra.items():
        if key not in primary and f.property not in covered:
            chosen.append(f)
            covered.add(f.property)
    chosen.sort(key=lambda f: (f.diagnosis in _FALLBACKS, order.get(f.property, len(order)),
                               first_seen.get((f.property, f.diagnosis), 0)))
    causes: list[Failure] = []
    for f in chosen:
        owner = next((c for c in causes if (f.property, f.diagnosis) in {(x.property, x.diagnosis) for x in c.consequences}), None)
        if owner is None and f.diagnosis not in _FALLBACKS:  # rule 3: the same diagnosis, a property it explains
            owner = next((c for c in causes if c.diagnosis == f.diagnosis and follows_from(c, f)), None)
        if owner is None and f.diagnosis in _FALLBACKS:
            owner = next((c for c in causes if c.property == f.property and c.diagnosis not in _FALLBACKS), None)
        if owner is None and f.diagnosis == DIVISIBILITY_UNCHECKED:  # rule 5
            owner = next((c for c in causes if _raises_whatever_the_sizes(c, f)), None)
        if owner is None:
            causes.append(f)
            continue
        f.details = dict(f.details, folded_under=f"{owner.property}: {owner.label}")
        owner.consequences.append(f)
        owner.consequences.extend(f.consequences)
        f.consequences = []
    for f in causes:
        for g in (f, *f.consequences):
            g.case = g.case.replace(property=g.property) if isinstance(g.case, Case) else g.case
            g.found_after = first_seen.get((g.property, g.diagnosis))
    causes.sort(key=lambda f: (order.get(f.property, len(order)), f.found_after or 0))
    return causes


def _raises_whatever_the_sizes(cause: Failure, refusal: Failure) -> bool:
    """Whether ``cause`` is an ``exception`` on a divisible case whose error (``Type: message`` as its
    report quotes it) is the one the unclear refusal ``refusal`` quotes (rule 5 of :func:`_merge`)."""
    if cause.diagnosis != EXCEPTION or "raised during " not in cause.message:
        return False
    _, _, quoted = cause.message.split("raised during ", 1)[1].partition(": ")
    error = quoted.split("\n", 1)[0].strip()
    return bool(error) and f": {error}" in refusal.message
