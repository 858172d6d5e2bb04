"""The search engine: Hypothesis generates cases for a variant, every property is checked on each,
and each failure comes back shrunk to its minimal case with a diagnosis.

This is what ``tpsim check`` and :func:`tpsim.props.suite.property_tests` call::

    from tpsim.props.search import search
    report = search(variant, max_examples=200, seed=0)
    for failure in report.failures:
        print(failure.describe())

How it works: one Hypothesis test (``@given(cases(variant, ...))``, run programmatically) checks
every property of each case (:func:`tpsim.props.checks.check_case`: one world run per case). A case
that fails raises an exception whose *type* is specific to the first failing property and its
diagnosis, so Hypothesis treats each ``(property, diagnosis)`` as a distinct bug: it keeps
generating a little longer to find more of them, then shrinks each one on its own to the smallest
case that still fails *that* property with *that* diagnosis (shrinking never trades a
``bias-duplication`` for some other finding). The report lists, for every shrunk bug, the failure
of its property on its minimal case, plus the other properties that fail on those minimal cases.

Determinism: with ``seed`` given the generated examples are a function of the seed (Hypothesis's
``@seed``), so the same call finds and shrinks the same cases every time; with ``seed=None`` the
active Hypothesis settings profile decides (derandomised under tpsim's ``ci`` profile).
``database`` (an ``ExampleDatabase`` or a directory path; None: none) makes Hypothesis replay
previously failing cases first.

Errors of the harness itself (a bad option, a backend that cannot start, a variant that gloo
workers cannot import) are raised, not reported as failures: they abort the search at once.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis
from hypothesis import HealthCheck, Phase, Verbosity, given, settings
from hypothesis.database import DirectoryBasedExampleDatabase, ExampleDatabase

from tpsim.diagnosis import Failure
from tpsim.errors import InvalidArgument
from tpsim.props.case import Case
from tpsim.props.checks import DIVISIBILITY, PROPERTIES, check_case
from tpsim.props.layouts import INPUT_LAYOUTS
from tpsim.props.strategies import cases
from tpsim.variant import Variant

__all__ = ["DEFAULT_DTYPES", "DEFAULT_WORLD_SIZES", "SearchReport", "check_case", "search"]

#: World sizes :func:`search` draws from by default (non-powers of two and > 4 included).
DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)
#: dtypes :func:`search` draws from by default.
DEFAULT_DTYPES = ("float64", "float32", "bfloat16", "float16")
_BACKENDS = ("inproc", "gloo", "nccl")


@dataclass
class SearchReport:
    """The outcome of :func:`search`.

    - ``passed``: every property held on every example;
    - ``examples``: cases checked in all (generated, shrink attempts and final replays);
    - ``failures``: one :class:`~tpsim.diagnosis.Failure` per distinct (property, diagnosis),
      each on its minimal case, in property order;
    - ``seconds``: wall time of the search;
    - ``notes``: remarks a report should show (e.g. "bias-free cases only");
    - ``variant``: the variant's name.
    """

    passed: bool
    examples: int
    failures: list[Failure]
    seconds: float
    notes: list[str] = field(default_factory=list)
    variant: str | None = None

    def to_json(self) -> dict[str, Any]:
        """JSON-ready dict: the fields above, failures as :meth:`Failure.to_json`."""
        return {
            "variant": self.variant,
            "passed": self.passed,
            "examples": self.examples,
            "seconds": round(self.seconds, 3),
            "notes": list(self.notes),
            "failures": [f.to_json() for f in self.failures],
        }


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


class _Abort(BaseException):
    """Carries a harness error out of Hypothesis at once (BaseException: it is neither shrunk nor retried)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(error)
        self.error = error


def _as_variant(variant: Any) -> Variant:
    if isinstance(variant, Variant):
        return variant
    if isinstance(variant, str):
        from tpsim.target import resolve_target

        found = resolve_target(variant)
        if len(found) != 1:
            names = ", ".join(v.name for v in found)
            raise InvalidArgument(
                f"variant={variant!r} names {len(found)} variants ({names}); search checks one: "
                "name it with MODULE:Name, or call search once per variant"
            )
        return found[0]
    raise InvalidArgument(f"variant={variant!r}: expected a tpsim Variant or a target string (module:Name)")


def _database(database: Any) -> ExampleDatabase | None:
    if database is None or isinstance(database, ExampleDatabase):
        return database
    if isinstance(database, str):
        return DirectoryBasedExampleDatabase(database)
    raise InvalidArgument(f"database={database!r}: expected None, a directory path or a hypothesis ExampleDatabase")


def _check_options(max_examples: Any, backend: Any, timeout: Any, properties: Any, seed: Any) -> tuple[str, ...]:
    if isinstance(max_examples, bool) or not isinstance(max_examples, int) or max_examples < 1:
        raise InvalidArgument(f"max_examples={max_examples!r} must be an int >= 1")
    if backend not in _BACKENDS:
        raise InvalidArgument(f"backend={backend!r}; expected one of {', '.join(_BACKENDS)}")
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


def _digest(variant: Variant, *parts: Any) -> bytes:
    # Distinguishes the database entries of different variants and option sets (the test function's
    # source is the same for all of them).
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
    variant: Variant | str,
    *,
    world_sizes: Sequence[int] = DEFAULT_WORLD_SIZES,
    dtypes: Sequence[str] = DEFAULT_DTYPES,
    max_examples: int = 100,
    seed: int | None = None,
    backend: str = "inproc",
    timeout: float = 10.0,
    properties: Sequence[str] | None = None,
    on_example: Callable[[int, Case], None] | None = None,
    database: ExampleDatabase | str | None = None,
    tp_sizes: Sequence[int] | None = None,
    subgroups: bool = True,
    layouts: Sequence[str] = INPUT_LAYOUTS,
) -> SearchReport:
    """Check ``variant`` on up to ``max_examples`` generated cases; return a :class:`SearchReport`.

    ``variant``: a :class:`~tpsim.variant.Variant` (or a target string naming exactly one).
    ``world_sizes``/``dtypes``: what cases draw from. ``seed``: makes the search repeatable.
    ``backend``: ``inproc`` | ``gloo`` | ``nccl`` (gloo/nccl need a variant with a ``target``
    their worker processes can import). ``timeout``: seconds any one world run may block in a
    collective before it counts as stuck. ``properties``: names from
    :data:`tpsim.props.checks.PROPERTIES` (default: all; without ``divisibility`` only divisible
    cases are generated). ``on_example(n, case)`` is called before the n-th case runs (1-based).
    ``database``: see the module docstring. ``tp_sizes``: tp group sizes to split each world into
    (each world size is split into groups of a tp size that divides it; default: the whole world half
    the time, a proper divisor otherwise, as ``subgroups=True``); ``subgroups=False`` (and no
    ``tp_sizes``): one tp group spanning the world. ``layouts``: memory layouts of the inputs and
    upstream grads to draw from (default: all of :data:`tpsim.props.layouts.INPUT_LAYOUTS`).

    Raises :class:`tpsim.InvalidArgument` for bad options and re-raises harness errors (backend
    unavailable, ...); anything the variant does wrong, exceptions included, is a failure.
    """
    started = time.monotonic()
    variant = _as_variant(variant)
    wanted = _check_options(max_examples, backend, timeout, properties, seed)
    if variant.divisible_only:
        # The variant declares divisible cases only (a documented upstream limit): no case could
        # test divisibility, so it is dropped and the report's notes say so.
        if wanted == (DIVISIBILITY,):
            raise InvalidArgument(
                f"properties={list(wanted)!r}: variant {variant.name!r} declares divisible_only=True, "
                "so the divisibility property does not apply; choose other properties"
            )
        wanted = tuple(p for p in wanted if p != DIVISIBILITY)
    strategy = cases(
        variant,
        world_sizes=tuple(world_sizes),
        dtypes=tuple(dtypes),
        non_divisible=DIVISIBILITY in wanted,
        tp_sizes=None if tp_sizes is None else tuple(tp_sizes),
        subgroups=bool(subgroups),
        layouts=tuple(layouts),
    )
    db = _database(database)
    notes = list(variant.notes)
    if not variant.bias and not any("bias" in n for n in notes):
        notes.append(f"{variant.name} has no bias: bias-free cases only")
    notes.extend(f"{variant.name} declares {r}" for r in variant.restrictions())

    calls = 0
    first_seen: dict[tuple[str, str], int] = {}

    def check_one(case: Case) -> None:
        nonlocal calls
        calls += 1
        if on_example is not None:
            on_example(calls, case)
        try:
            failures = check_case(variant, case, backend=backend, timeout=float(timeout), properties=wanted)
        except Exception as err:  # the harness failed, not the variant: stop now
            raise _Abort(err) from err
        if failures:
            for f in failures:
                first_seen.setdefault((f.property, f.diagnosis), calls)
            head = failures[0]
            raise _found_type(head.property, head.diagnosis)(case, failures)

    check_one._hypothesis_internal_add_digest = _digest(  # type: ignore[attr-defined]
        variant, tuple(world_sizes), tuple(dtypes), wanted,
        *(() if tp_sizes is None and subgroups and tuple(layouts) == INPUT_LAYOUTS
          else (tp_sizes, subgroups, tuple(layouts))),
    )
    options: dict[str, Any] = dict(
        max_examples=max_examples,
        deadline=None,
        database=db,
        suppress_health_check=list(HealthCheck),
        verbosity=Verbosity.quiet,
        report_multiple_bugs=True,
        print_blob=False,
        phases=(Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink),
    )
    if seed is not None:
        options["derandomize"] = False  # the seed decides, not the test's source
    test = settings(**options)(given(strategy)(check_one))
    if seed is not None:
        test = hypothesis.seed(seed)(test)

    found: list[_Found] = []
    try:
        test()
    except _Abort as abort:
        raise abort.error from None
    except hypothesis.errors.FlakyFailure as err:
        found = _collect(err)
        notes.append(
            "a failing case did not fail again when replayed (flaky): the variant or the backend is "
            "not deterministic; the failures below are from the first run"
        )
    except BaseException as err:  # noqa: BLE001 - sorted below: ours become failures, the rest propagate
        found = _collect(err)
        if not found:
            raise
    failures = _merge(found, first_seen)
    return SearchReport(
        passed=not failures,
        examples=calls,
        failures=failures,
        seconds=time.monotonic() - started,
        notes=notes,
        variant=variant.name,
    )


def _merge(found: list[_Found], first_seen: dict[tuple[str, str], int]) -> list[Failure]:
    """One failure per shrunk bug, then the other properties failing on those minimal cases."""
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
    out = []
    for f in chosen:
        f.case = f.case.replace(property=f.property) if isinstance(f.case, Case) else f.case
        f.found_after = first_seen.get((f.property, f.diagnosis))
        out.append(f)
    out.sort(key=lambda f: (order.get(f.property, len(order)), f.found_after or 0))
    return out

