"""What a target does at import, and what its classes and caches are, cannot mislead a check.

The targets are tests/hostile_imports.py's: threads started at import, a launcher's environment set
at import, classes whose introspection raises, and process-level caches (``functools`` caches, a
``cached_property`` of a module-level object, a module-level tensor) used as an all-reduce workspace.
Each correct twin passes and each buggy twin fails with its diagnosis on inproc (isolated, the
default) and on gloo, or the check exits 2 naming the cause; never exit 3, never a false failure.

The fast tier checks each mechanism in this process (``tpsim.run`` on inproc, the resolver, the
launcher variables); the thorough tier runs ``python -m tpsim check`` on every target, both backends.
"""

from __future__ import annotations

import importlib
import os
import sys
import uuid
from pathlib import Path
from typing import Any

import hostile_imports as hi
import pytest
import torch
import torch.distributed as dist
from hostile_probes import Probe, run_probe

import tpsim
from tpsim._target_files import PREFIX, TargetError, import_target_file, install_finder, module_name_of_path
from tpsim.comm import _torchrun, isolate, modstate
from tpsim.props.launch import watched
from tpsim.target import resolve_target

ROW = ("--kind", "row", "--output", "reduced")
EPS = torch.finfo(torch.float64).eps


@pytest.fixture(autouse=True, scope="module")
def _no_worker_left() -> Any:
    """Tests elsewhere in the session count this process's children: leave no worker behind."""
    yield
    isolate.shutdown()


def _target_file(tmp_path: Path, source: str, extra: dict[str, str] | None = None) -> Path:
    """``source`` as a target file of its own (a fresh name: modules are imported once per process),
    with the files beside it; helper modules get fresh names too."""
    where = tmp_path / f"d{uuid.uuid4().hex[:8]}"
    where.mkdir()
    for name, text in (extra or {}).items():
        fresh = f"{Path(name).stem}_{where.name}"
        source = source.replace(f"from {Path(name).stem} import", f"from {fresh} import")
        (where / f"{fresh}.py").write_text(text)
    file = where / "layer.py"
    file.write_text(source)
    return file


# --- the rank function: a row layer of a target file against its dense result -------------------------


def rank_row(module: str, name: str) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Build ``module.name`` (a master-weight row layer), run it on this rank's shard; return its output,
    the dense ``x Wᵀ`` and the rounding bound of that sum (float64 eps x the reduction length x the
    sum of magnitudes)."""
    ws, rank = dist.get_world_size(), dist.get_rank()
    gen = torch.Generator().manual_seed(5)
    w = torch.randn(3, 2 * ws, dtype=torch.float64, generator=gen)
    x = torch.randn(4, 2 * ws, dtype=torch.float64, generator=gen)
    layer = getattr(sys.modules[module], name)(2 * ws, 3, False, w)
    y = layer(x.chunk(ws, dim=1)[rank])
    bound = float(2 * ws * EPS * (x.abs() @ w.abs().T).max())
    return y.detach(), x @ w.T, bound


def _run_twins(file: Path, world_size: int = 3) -> tuple[list[Any], list[Any]]:
    """Both twins of a target file on inproc, as ``tpsim check`` runs them: the file's module rank-local,
    the modules beside it that it uses watched."""
    module = import_target_file(str(file))
    options = {"rank_local": (module.__name__,), "watch": watched((module.__name__,))}
    row = tpsim.run(rank_row, world_size, args=(module.__name__, "Row"), **options)
    twice = tpsim.run(rank_row, world_size, args=(module.__name__, "Twice"), **options)
    return row, twice


def _assert_twins(row: list[Any], twice: list[Any], world_size: int) -> None:
    for y, dense, bound in row:  # the correct twin: the dense result on every rank
        assert float((y - dense).abs().max()) <= bound
    for y, dense, bound in twice:  # the buggy one: reduced twice (double-reduction), on every rank alike
        assert float((y - world_size * dense).abs().max()) <= world_size * bound
        assert float((y - dense).abs().max()) > 100 * bound


# --- process-level caches: each rank its own --------------------------------------------------------


@pytest.mark.parametrize("name", sorted(hi.CACHES))
def test_an_all_reduce_through_a_process_level_cache_is_per_rank_on_inproc(name: str, tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    source, extra = hi.CACHES[name]
    file = _target_file(tmp_path, source, extra)
    monkeypatch.syspath_prepend(str(file.parent))  # the helper beside it (tpsim check runs from there)
    row, twice = _run_twins(file)
    _assert_twins(row, twice, 3)


def test_the_caches_and_tensors_are_the_processs_own_again_after_the_world(tmp_path: Path) -> None:
    file = _target_file(tmp_path, hi.CACHES["lru-cache-workspace"][0])
    module = import_target_file(str(file))
    cache = module.workspace
    _run_twins(file)
    assert module.workspace is cache and cache.cache_info().currsize == 0  # never called: each rank had its own
    file = _target_file(tmp_path, hi.CACHES["module-level-tensor"][0])
    module = import_target_file(str(file))
    buffer = module._BUFFER
    _run_twins(file)
    assert module._BUFFER is buffer and buffer._version == 0 and not buffer.any()  # each rank wrote its copy


def test_each_rank_gets_its_own_cache_tensor_and_cached_property(tmp_path: Path) -> None:
    file = _target_file(tmp_path, hi.CACHES["module-level-tensor"][0] + """

@functools.lru_cache(maxsize=4, typed=True)
def scratch(n):
    return torch.zeros(n)


scratch.note = "kept"
_VIEW = _BUFFER[2:6]


class _Holder:
    @functools.cached_property
    def table(self):
        return torch.zeros(2)


HOLDER = _Holder()
HOLDER.table  # computed before the world: each rank computes its own all the same
""")
    module = import_target_file(str(file))
    world = modstate.ModuleGlobals((module,), ())
    first, second = world.fresh(), world.fresh()
    (d1,), attrs1, _ = first
    (d2,), attrs2, _ = second
    assert d1["scratch"] is not d2["scratch"] and d1["scratch"] is not module.scratch
    assert d1["scratch"].cache_parameters() == {"maxsize": 4, "typed": True} and d1["scratch"].note == "kept"
    assert d1["_BUFFER"] is not d2["_BUFFER"] and d1["_BUFFER"] is not module._BUFFER
    # A view of the buffer stays a view of that rank's copy.
    assert d1["_VIEW"].untyped_storage().data_ptr() == d1["_BUFFER"].untyped_storage().data_ptr()
    assert d1["_VIEW"].storage_offset() == 2
    assert ("_Holder", "table") in world.rank_local_attributes
    assert "table" in vars(module.HOLDER) and attrs1[-1] is attrs2[-1] is modstate._MISSING


def test_a_cache_reached_through_a_default_argument_is_refused_as_shared_state(tmp_path: Path) -> None:
    file = _target_file(tmp_path, hi.CACHE_IN_A_DEFAULT)
    module = import_target_file(str(file))
    with pytest.raises(tpsim.SharedModuleState) as info:
        tpsim.run(rank_row, 2, args=(module.__name__, "Row"), rank_local=(module.__name__,))
    err = info.value
    assert (err.module, err.attribute, err.ranks) == (module.__name__, "workspace", (0, 1))
    assert f"rank 0 called the functools cache {module.__name__}.workspace, then rank 1 called it too" in str(err)
    assert "--backend gloo" in str(err)


def test_a_cache_of_an_installed_library_is_left_as_it_is() -> None:
    import transformers.utils.import_utils as library

    found = modstate._process_level((library,), ())
    assert found.renew == {} and found.slots == []


# --- threads started at import ------------------------------------------------------------------------

THREAD_MODULE = """import threading

STARTED = threading.Event()
threading.Thread(target=STARTED.wait, args=(60,), daemon=True, name="started-at-import").start()


def rank_value():
    return 7
"""


def rank_imports_and_answers(name: str) -> int:
    return int(importlib.import_module(name).rank_value())


def test_a_thread_a_rank_local_module_starts_at_import_is_the_workers_own(tmp_path: Path) -> None:
    # The isolated worker imports the rank-local module before the world (by its target-file name,
    # which needs the finder there): the thread it starts is the process's, not an abandoned rank's,
    # so the worker is not replaced after each run.
    file = tmp_path / f"threads_{uuid.uuid4().hex[:8]}.py"
    file.write_text(THREAD_MODULE)
    name = module_name_of_path(str(file))
    install_finder()
    try:
        assert tpsim.run(rank_imports_and_answers, 2, args=(name,), rank_local=(name,), isolate=True) == [7, 7]
        first = isolate.live_worker_pid()
        assert tpsim.run(rank_imports_and_answers, 2, args=(name,), rank_local=(name,), isolate=True) == [7, 7]
        assert isolate.live_worker_pid() == first
    finally:
        module = sys.modules.get(name)
        if module is not None:
            module.STARTED.set()


def test_a_target_file_is_importable_by_name_where_no_target_file_was_imported(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    assert modstate._TARGET_PREFIX == PREFIX
    file = tmp_path / f"plain_{uuid.uuid4().hex[:8]}.py"
    file.write_text("VALUE = 3\n")
    monkeypatch.setattr(sys, "meta_path", [f for f in sys.meta_path if type(f).__name__ != "_TargetFileFinder"])
    [module] = modstate.resolve_modules((module_name_of_path(str(file)),), "rank_local")
    assert module.VALUE == 3 and module.__file__ == str(file)


# --- a launcher's environment set by the target ----------------------------------------------------------


@pytest.fixture
def pinned() -> Any:
    yield
    _torchrun._PINNED[0] = None


def test_the_launcher_environment_is_the_one_tpsim_started_with(pinned: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in _torchrun.LAUNCHER_ENV:
        monkeypatch.delenv(name, raising=False)
    _torchrun.pin_launcher_env()
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "7")
    monkeypatch.setenv("MASTER_ADDR", "10.255.255.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    assert _torchrun.launched_world() is None  # what the target set is not a launched world
    assert tpsim.run(rank_world_size, 2, backend="inproc") == [2, 2]
    with _torchrun._launcher_environment():  # torch's env:// reads what tpsim was started with
        assert "RANK" not in os.environ
    assert os.environ["RANK"] == "3"


def test_a_launched_world_is_still_one_when_pinned(pinned: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29511", "LOCAL_RANK": "1"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    _torchrun.pin_launcher_env()
    monkeypatch.setenv("WORLD_SIZE", "9")  # the target changed it: the launcher's still counts
    assert _torchrun.launched_world() == (1, 2)
    assert _torchrun._launcher("LOCAL_RANK") == "1"


def rank_world_size() -> int:
    return dist.get_world_size()


# --- classes whose introspection raises -------------------------------------------------------------------


@pytest.mark.parametrize("name", sorted(hi.INTROSPECTION))
def test_a_class_whose_introspection_raises_resolves_or_is_refused_naming_why(name: str, tmp_path: Path) -> None:
    source, verdict = hi.INTROSPECTION[name]
    file = _target_file(tmp_path, source)
    if verdict == "check":
        [variant] = resolve_target(f"{file}:Row", kind="row", output="reduced")
        assert variant.name == "Row"
        return
    with pytest.raises(TargetError) as info:
        resolve_target(f"{file}:Row", kind="row", output="reduced")
    assert verdict in str(info.value)


@pytest.mark.parametrize("name", sorted(n for n, (_, v) in hi.INTROSPECTION.items() if v == "check"))
def test_a_checkable_class_with_a_hostile_metaclass_gets_its_verdict_on_inproc(name: str, tmp_path: Path) -> None:
    file = _target_file(tmp_path, hi.INTROSPECTION[name][0])
    row, twice = _run_twins(file, world_size=2)
    _assert_twins(row, twice, 2)


def test_the_world_set_up_reads_classes_without_running_their_metaclass() -> None:
    # The watch's scan of a module's classes must not call a metaclass's __getattribute__, __eq__, __hash__.
    calls: list[str] = []

    class Meta(type):
        def __getattribute__(cls, name: str) -> Any:
            calls.append(name)
            raise RuntimeError(f"no {name}")

        def __eq__(cls, other: object) -> bool:
            raise RuntimeError("no ==")

        __hash__ = None  # type: ignore[assignment]

    module = type(sys)("tpsim_test_hostile_classes")
    namespace: dict[str, Any] = {"__module__": module.__name__}
    exec("def touch(self):\n    type(self).seen = 1\n", vars(module), namespace)  # a method of the module's code
    module.Hostile = Meta("Hostile", (), namespace)
    calls.clear()
    world = modstate.ModuleGlobals((), (module,))
    assert calls == [] and world.rank_local_attributes == [("Hostile", "seen")]


# --- the thorough tier: the command, both backends ------------------------------------------------------

BACKENDS = ["inproc", pytest.param("gloo", marks=pytest.mark.gloo)]


def _check(tmp_path: Path, source: str, target: str, backend: str, extra: dict[str, str] | None = None):
    run = run_probe(Probe("hostile-import", source, target="{file}:" + target, args=ROW, backend=backend,
                          extra_files=extra or {}), tmp_path)
    assert run.orphans == [], run
    assert "internal error" not in run.out + run.err and run.code != 3, run
    assert "cannot be imported" not in run.err, run  # never a misleading import error
    return run


def _assert_verdicts(tmp_path: Path, source: str, backend: str, extra: dict[str, str] | None = None) -> None:
    good = _check(tmp_path / "good", source, "Row", backend, extra)
    assert good.code == 0 and "all properties hold: 1 variant" in good.out, good
    bad = _check(tmp_path / "bad", source, "Twice", backend, extra)
    assert bad.code == 1 and "FAILED forward-equivalence: double-reduction" in bad.out, bad


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", sorted(hi.THREAD))
def test_a_thread_started_at_import_changes_no_verdict(kind: str, backend: str, tmp_path: Path) -> None:
    _assert_verdicts(tmp_path, hi.THREAD[kind], backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_launcher_environment_set_at_import_changes_no_verdict(backend: str, tmp_path: Path) -> None:
    _assert_verdicts(tmp_path, hi.LAUNCHER_ENV, backend)


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(hi.INTROSPECTION))
def test_a_hostile_class_gets_its_verdict_or_a_usage_error_naming_why(name: str, backend: str, tmp_path: Path) -> None:
    source, verdict = hi.INTROSPECTION[name]
    if verdict == "check":
        _assert_verdicts(tmp_path, source, backend)
        return
    run = _check(tmp_path, source, "Row", backend)
    assert run.code == 2 and run.out == "", run
    assert run.err.startswith("tpsim check: error: cannot check 'layer.py:Row': ") and verdict in run.err, run.err


@pytest.mark.slow
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(hi.CACHES))
def test_an_all_reduce_through_a_process_level_cache_gets_its_verdict(name: str, backend: str, tmp_path: Path) -> None:
    source, extra = hi.CACHES[name]
    _assert_verdicts(tmp_path, source, backend, extra)


@pytest.mark.slow
def test_a_cache_tpsim_cannot_make_per_rank_is_refused_on_inproc_and_checked_on_gloo(tmp_path: Path) -> None:
    for target in ("Row", "Twice"):
        run = _check(tmp_path / target, hi.CACHE_IN_A_DEFAULT, target, "inproc")
        assert run.code == 2, run
        assert ("tpsim: error: rank 0 called the functools cache layer.py:workspace, then rank 1 called it too"
                in run.err), run.err
        assert "--backend gloo" in run.err


@pytest.mark.slow
@pytest.mark.gloo
def test_the_cache_tpsim_cannot_make_per_rank_passes_and_fails_on_gloo(tmp_path: Path) -> None:
    _assert_verdicts(tmp_path, hi.CACHE_IN_A_DEFAULT, "gloo")


@pytest.mark.slow
def test_an_import_that_leaves_a_thread_in_the_forker_is_not_tried_again(tmp_path: Path) -> None:
    # Preloading it retires the forker (a thread makes forking unsafe) for a fresh one without it; a
    # second try would cost another fresh forker (an interpreter importing torch) for nothing.
    from tpsim.comm import _payload, forker

    file = tmp_path / f"threads_{uuid.uuid4().hex[:8]}.py"
    file.write_text(THREAD_MODULE)
    hints = {file.stem: str(file)}
    try:
        forker.shared().wait_ready()
        first = forker.pid()
        assert forker.preload(_payload.import_hinted, (hints,), 120) is None
        fresh = forker.shared()
        fresh.wait_ready()
        assert fresh.safe and forker.pid() not in (None, first)
        assert forker.preload(_payload.import_hinted, (hints,), 120) is None
        assert forker.shared() is fresh and fresh.safe  # not tried again: the fresh forker serves on
    finally:
        forker.shutdown()
