"""tpsim's pytest plugin (registered through the ``pytest11`` entry point).

Cheap to import: nothing heavy (torch, tpsim's backends) is imported until a test uses
the fixture. Options, in one group:

- ``--tpsim-backend inproc|gloo|nccl`` (default inproc): where ``tpsim_world`` runs ranks;
- ``--tpsim-world-sizes 1,2,4``: the world sizes ``tpsim_world_size`` is parametrised over.

Marker:

- ``@pytest.mark.tpsim_spmd(world_size=4)``: the test body itself runs on every rank of a world
  (on the selected backend), with ``torch.distributed`` initialised, as under torchrun; the test
  fails with the failing rank's traceback. With ``world_size`` omitted the test is parametrised
  over ``--tpsim-world-sizes``. On gloo the test function must be importable by the workers
  (a module-level function in an importable test module).

Fixtures:

- ``tpsim_world``: a callable ``tpsim_world(fn, world_size=None, **run_kwargs)`` that runs
  ``fn`` on every rank of a world on the selected backend and returns the per-rank values;
- ``tpsim_world_size``: parametrised over ``--tpsim-world-sizes`` when a test asks for it.
"""

from __future__ import annotations

from typing import Any

import pytest

BACKEND_OPTION = "--tpsim-backend"
WORLD_SIZES_OPTION = "--tpsim-world-sizes"
DEFAULT_WORLD_SIZES = "1,2,4"


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("tpsim", "tensor-parallel layer checks (tpsim)")
    group.addoption(BACKEND_OPTION, action="store", default="inproc", choices=("inproc", "gloo", "nccl"),
                    help="backend the tpsim fixtures run ranks on (default: inproc)")
    group.addoption(WORLD_SIZES_OPTION, action="store", default=DEFAULT_WORLD_SIZES,
                    help="comma-separated world sizes for tpsim_world_size (default: %(default)s)")


def _world_sizes(config: pytest.Config) -> list[int]:
    raw = config.getoption(WORLD_SIZES_OPTION)
    try:
        sizes = [int(s) for s in str(raw).split(",") if s.strip()]
    except ValueError:
        raise pytest.UsageError(f"{WORLD_SIZES_OPTION}={raw!r}: expected comma-separated integers, e.g. 1,2,4") from None
    if not sizes or min(sizes) < 1:
        raise pytest.UsageError(f"{WORLD_SIZES_OPTION}={raw!r}: every world size must be >= 1")
    return sizes


SPMD_MARKER = "tpsim_spmd"


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        f"{SPMD_MARKER}(world_size=None, timeout=None): run the test body on every rank of a tpsim world",
    )
    _world_sizes(config)  # a bad --tpsim-world-sizes is a usage error before collection starts


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker(SPMD_MARKER)
    wants_sizes = "tpsim_world_size" in metafunc.fixturenames
    if marker is not None and marker.kwargs.get("world_size") is None and not wants_sizes:
        metafunc.fixturenames.append("tpsim_world_size")
        wants_sizes = True
    if wants_sizes:
        metafunc.parametrize("tpsim_world_size", _world_sizes(metafunc.config))


def _run_on_ranks(fn: Any, funcargs: dict[str, Any]) -> None:
    # Runs on every rank: the test body with the fixtures pytest resolved in the parent.
    fn(**funcargs)


@pytest.hookimpl(tryfirst=True)
def pytest_pyfunc_call(pyfuncitem: pytest.Function) -> bool | None:
    marker = pyfuncitem.get_closest_marker(SPMD_MARKER)
    if marker is None:
        return None
    import tpsim

    world_size = marker.kwargs.get("world_size") or pyfuncitem.funcargs.get("tpsim_world_size")
    timeout = marker.kwargs.get("timeout") or tpsim.DEFAULT_TIMEOUT
    backend = pyfuncitem.config.getoption(BACKEND_OPTION)
    if backend == "nccl":
        from tpsim.comm.procs import nccl_unavailable_reason

        reason = nccl_unavailable_reason(int(world_size))
        if reason:
            pytest.skip(f"nccl: {reason}")
    names = pyfuncitem._fixtureinfo.argnames
    funcargs = {name: pyfuncitem.funcargs[name] for name in names}
    tpsim.run(_run_on_ranks, int(world_size), backend=backend, args=(pyfuncitem.obj, funcargs), timeout=timeout)
    return True


@pytest.fixture
def tpsim_backend(request: pytest.FixtureRequest) -> str:
    """The backend chosen with ``--tpsim-backend``; NCCL tests skip cleanly without GPUs."""
    backend = request.config.getoption(BACKEND_OPTION)
    if backend == "nccl":
        from tpsim.comm.procs import nccl_unavailable_reason

        reason = nccl_unavailable_reason(1)
        if reason:
            pytest.skip(f"nccl: {reason}")
    return backend


@pytest.fixture
def tpsim_world(tpsim_backend: str) -> Any:
    """Run a function on every rank: ``tpsim_world(fn, world_size, **run_kwargs)``."""
    import tpsim

    def run(fn: Any, world_size: int = 2, **kwargs: Any) -> list[Any]:
        kwargs.setdefault("backend", tpsim_backend)
        return tpsim.run(fn, world_size, **kwargs)

    return run
