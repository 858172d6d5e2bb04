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
the real-process-group ones.
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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    chosen_backend = config.getoption("--tpsim-backend", default="inproc")
    for item in items:
        backends = _backend_of(item)
        if chosen_backend in ("gloo", "nccl") and "tpsim_world" in getattr(item, "fixturenames", ()):
            backends.add(chosen_backend)
        for name in backends:
            item.add_marker(getattr(pytest.mark, name))
