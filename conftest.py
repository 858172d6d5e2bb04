"""Repository-wide pytest configuration: Hypothesis profiles and backend markers.

Profiles (pick one with ``HYPOTHESIS_PROFILE=<name>`` or ``--hypothesis-profile=<name>``):

- ``dev`` (default on a workstation): few examples for fast feedback; the example database
  is on, so a failure found once is replayed first on the next run;
- ``ci`` (default when ``CI`` is set): derandomised (the same examples on every run of the
  same code), prints the ``@reproduce_failure`` blob of a failure, no deadline (shared
  machines are noisy), database still on so a local rerun starts from the failure;
- ``thorough``: many examples and larger world sizes (``TPSIM_THOROUGH=1`` is exported for
  the strategies, which then draw world sizes up to 16).

Tests that run a real gloo or NCCL world get the ``gloo`` / ``nccl`` marker automatically
(from their parameters), so ``-m "not gloo"`` selects the in-process runs and ``tox -e gloo``
the real-process-group ones. A test that starts a gloo world without the marker fails, naming
the marker it lacks (:func:`pytest_runtest_call`).

Two tiers (the README's "Run the property tests"):

- the **fast** tier, what ``python -m pytest`` runs (``-m "not thorough"`` in pyproject.toml's
  addopts): every mutant caught once with its diagnosis, every correct variant searched, the
  property suite, backend-rule and unit tests, and a small gloo smoke set (``smoke``);
- the **thorough** tier, ``python -m pytest -m thorough`` (``tox -e thorough``): every test this
  hook marks ``thorough``: the ``slow`` ones, the ``gloo`` and ``nccl`` ones (less the ``smoke``
  set), the docs' console blocks, and what a test marks ``thorough`` itself (e.g. a second seed).

Together the tiers are the whole suite, each test once; ``-m ""`` runs both in one go.
"""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, settings

# The health checks the project's own Hypothesis tests turn off, each for its reason; the others stay on.
_SLOW_OK = [
    # Hypothesis times data generation by the wall clock: on a loaded machine (CI, the other xdist
    # worker, rank threads winding down) drawing a few cases can take a second, which is no bug.
    HealthCheck.too_slow,
]

settings.register_profile("dev", max_examples=25, deadline=None, suppress_health_check=_SLOW_OK)
settings.register_profile(
    "ci",
    max_examples=50,
    derandomize=True,
    print_blob=True,
    deadline=None,
    suppress_health_check=_SLOW_OK,
)
settings.register_profile(
    "thorough",
    max_examples=1000,
    deadline=None,
    suppress_health_check=_SLOW_OK,
    phases=list(Phase),
)

_default = "ci" if os.environ.get("CI", "").lower() in ("1", "true", "yes") else "dev"
_PROFILE = os.environ.get("HYPOTHESIS_PROFILE", _default)
settings.load_profile(_PROFILE)


def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis's own plugin applies --hypothesis-profile after this module is imported;
    # mirror the final choice for the strategies that scale with it.
    chosen = config.getoption("hypothesis_profile", default=None) or _PROFILE
    if chosen == "thorough":
        os.environ["TPSIM_THOROUGH"] = "1"


def _backend_of(item: pytest.Item) -> set[str]:
    callspec = getattr(item, "callspec", None)
    values = set()
    if callspec is not None:
        values = {v for v in callspec.params.values() if isinstance(v, str)}
    return values & {"gloo", "nccl"}


#: Markers that put a test in the thorough tier (a ``smoke`` test stays in the fast one).
THOROUGH_BECAUSE = ("slow", "gloo", "nccl")


def in_thorough_tier(markers: set[str]) -> bool:
    """Whether a test with these markers belongs to the thorough tier."""
    return "thorough" in markers or (bool(markers & set(THOROUGH_BECAUSE)) and "smoke" not in markers)


@pytest.hookimpl(tryfirst=True)  # before pytest's own -m deselection reads the markers
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen_backend = config.getoption("--tpsim-backend", default="inproc")
    for item in items:
        backends = _backend_of(item)
        if chosen_backend in ("gloo", "nccl") and "tpsim_world" in getattr(item, "fixturenames", ()):
            backends.add(chosen_backend)
        for name in backends:
            item.add_marker(getattr(pytest.mark, name))
        markers = {m.name for m in item.iter_markers()}
        if in_thorough_tier(markers) and "thorough" not in markers:
            item.add_marker(pytest.mark.thorough)


# --- every test that starts a real gloo world says so ---------------------------------------------

_gloo_worlds: list[int] = []  # world sizes of the gloo worlds started during the current test


def _watch_gloo_worlds() -> None:
    """Record every gloo world this process runs or starts. tpsim's process backend gets its
    world's pool from ``procs._pool_for`` on every run (a reused pool included) and on
    ``ensure_pool``, after the call was validated: the one place a real world begins."""
    from tpsim.comm import procs

    if getattr(procs._pool_for, "_watched", False):
        return
    pool_for = procs._pool_for

    def watched(backend: str, world_size: int, *args, **kwargs):
        if backend == "gloo":
            _gloo_worlds.append(world_size)
        return pool_for(backend, world_size, *args, **kwargs)

    watched._watched = True
    procs._pool_for = watched


def pytest_sessionstart(session: pytest.Session) -> None:
    _watch_gloo_worlds()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item):
    # Setup may start worlds too (a fixture): what is recorded by the end of the call counts. A
    # test that failed anyway keeps its own error.
    result = yield
    started, _gloo_worlds[:] = list(_gloo_worlds), []
    if started and item.get_closest_marker("gloo") is None:
        pytest.fail(f"{item.nodeid} started {len(started)} real gloo world(s) (sizes {sorted(set(started))}) "
                    "without the 'gloo' marker: mark it @pytest.mark.gloo (and 'smoke' as well to keep it in "
                    "the fast tier)", pytrace=False)
    return result


def pytest_runtest_setup(item: pytest.Item) -> None:
    _gloo_worlds.clear()  # worlds left over from an earlier test's teardown are not this test's


# --- lab-scale tests give their memory back -------------------------------------------------------


@pytest.fixture(autouse=True)
def _lab_scale_memory_returned(request: pytest.FixtureRequest):
    """After a ``labscale`` test, the memory it freed goes back to the system: its rank threads freed
    GBs in glibc's per-thread arenas, which keep them, so the next lab-scale test in the same process
    started that much higher (seven in a row passed 20 GB and were killed by the OOM killer)."""
    yield
    if request.node.get_closest_marker("labscale") is None:
        return
    import ctypes
    import ctypes.util
    import gc

    gc.collect()
    libc = ctypes.util.find_library("c")
    trim = getattr(ctypes.CDLL(libc), "malloc_trim", None) if libc else None
    if trim is not None:  # glibc only
        trim(0)
