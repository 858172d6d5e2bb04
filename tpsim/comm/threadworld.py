"""Per-thread torch.distributed state, so threads can act as ranks of separate processes.

torch.distributed keeps its process-group registry in ``distributed_c10d._world`` (an
explicit extension point) and, in C++, in a name→group registry that has a
thread-isolation mode. While an in-process world runs (:func:`installed`) both are made
per-thread: a thread that enters a rank gets its own empty world, every other thread keeps
seeing torch's original one, so a real gloo world in the main thread is unaffected. When the
last in-process world ends, everything is put back as it was.

A thread that a rank starts (a helper thread, a thread pool's worker) belongs to that rank's
process in a real job: it inherits the rank's world (default group, rank, the groups it made),
as threads of one process share torch.distributed's state.

Some state that separate processes do *not* share is global in one process: the default
CPU generator, the default dtype and, where declared, module globals. :class:`ProcessLocalState`
captures and restores them; the in-process scheduler swaps them whenever the running rank
changes (only one rank runs at a time, so a swap at every hand-off is exact).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed.distributed_c10d as c10d

__all__ = [
    "ProcessLocalState",
    "current_owner",
    "enter_rank_world",
    "install",
    "installed",
    "leave_rank_world",
    "uninstall",
]


class _Local(threading.local):
    """Per-thread: the rank world the thread sees and its owner (None: torch's own world)."""

    world: Any = None
    owner: Any = None


_tls = _Local()
_install_lock = threading.Lock()
_original_world: Any = None


class _RankWorld(c10d._World):
    """The registry one rank thread sees: torch's ``_World`` with its own dicts."""

    #: A plain attribute where torch's ``_World`` has a property over ``_default_pg``: read on every
    #: collective (set on the instance by ``_update_default_pg``; nothing reads ``_default_pg`` itself).
    default_pg = None  # type: ignore[assignment]

    def __init__(self) -> None:
        super().__init__()
        self._pg_map: dict = {}
        self._pg_names: dict = {}
        self._pg_group_ranks: dict = {}
        self._pg_backend_config: dict = {}
        self._group_count = 0
        self._tags_to_pg: dict = {}
        self._pg_to_tag: dict = {}

    pg_map = property(lambda self: self._pg_map)  # type: ignore[assignment]
    pg_names = property(lambda self: self._pg_names)  # type: ignore[assignment]
    pg_group_ranks = property(lambda self: self._pg_group_ranks)  # type: ignore[assignment]
    pg_backend_config = property(lambda self: self._pg_backend_config)  # type: ignore[assignment]
    tags_to_pg = property(lambda self: self._tags_to_pg)  # type: ignore[assignment]
    pg_to_tag = property(lambda self: self._pg_to_tag)  # type: ignore[assignment]

    @property  # type: ignore[override]
    def group_count(self) -> int:
        return self._group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        self._group_count = value


def _current() -> Any:
    world = _tls.world
    return _original_world if world is None else world


class _ThreadRoutedWorld(c10d._World):
    """Installed as ``distributed_c10d._world``: forwards to the calling thread's world."""

    def __init__(self) -> None:  # no state of its own
        pass

    @property  # type: ignore[override]
    def default_pg(self):
        # Read on every collective (twice by torch's _get_default_group): _current, inlined.
        world = _tls.world
        return (_original_world if world is None else world).default_pg

    @default_pg.setter
    def default_pg(self, value) -> None:
        _current().default_pg = value

    @property  # type: ignore[override]
    def group_count(self) -> int:
        return _current().group_count

    @group_count.setter
    def group_count(self, value: int) -> None:
        _current().group_count = value

    pg_map = property(lambda self: _current().pg_map)  # type: ignore[assignment]
    pg_names = property(lambda self: _current().pg_names)  # type: ignore[assignment]
    pg_group_ranks = property(lambda self: _current().pg_group_ranks)  # type: ignore[assignment]
    pg_backend_config = property(lambda self: _current().pg_backend_config)  # type: ignore[assignment]
    tags_to_pg = property(lambda self: _current().tags_to_pg)  # type: ignore[assignment]
    pg_to_tag = property(lambda self: _current().pg_to_tag)  # type: ignore[assignment]
    @property  # type: ignore[override]
    def pg_coalesce_state(self):
        # Read on every collective (torch looks the group up in it): _current, inlined.
        world = _tls.world
        return (_original_world if world is None else world).pg_coalesce_state

    comms = property(lambda self: _current().comms)  # type: ignore[assignment]


_install_depth = 0
_original_start: Any = None
_START_AT_IMPORT = threading.Thread.start


def install() -> None:
    """Route torch.distributed's registries per thread (process-wide until :func:`uninstall`).

    Calls nest: each :func:`install` needs its own :func:`uninstall`; the routing is undone when
    the last one is.
    """
    global _original_world, _install_depth, _original_start
    with _install_lock:
        _install_depth += 1
        if _install_depth > 1:
            return
        _original_world = c10d._world
        c10d._world = _ThreadRoutedWorld()
        # The C++ name→group registry (used by functional collectives and DTensor)
        # becomes thread-local too: every rank thread registers groups under the same names.
        torch._C._distributed_c10d._set_thread_isolation_mode(True)
        _original_start = threading.Thread.start
        threading.Thread.start = _start_in_rank_context  # type: ignore[method-assign]


def uninstall() -> None:
    """Undo one :func:`install`; the last one puts torch.distributed and ``threading`` back as they were."""
    global _original_world, _install_depth, _original_start
    with _install_lock:
        if _install_depth == 0:
            return
        _install_depth -= 1
        if _install_depth > 0:
            return
        c10d._world = _original_world
        _original_world = None
        torch._C._distributed_c10d._set_thread_isolation_mode(False)
        threading.Thread.start = _original_start  # type: ignore[method-assign]
        _original_start = None


@contextlib.contextmanager
def installed() -> Iterator[None]:
    """:func:`install` for the ``with`` body, then :func:`uninstall`."""
    install()
    try:
        yield
    finally:
        uninstall()


def is_installed() -> bool:
    """Whether the per-thread routing is in place (an in-process world is running)."""
    return _install_depth > 0


def enter_rank_world(owner: Any = None) -> None:
    """Give the calling thread a fresh, empty torch.distributed world; ``owner`` is the backend's
    note of which rank of which world the thread is (read back with :func:`current_owner`)."""
    _tls.world = _RankWorld()
    _tls.owner = owner


def leave_rank_world() -> None:
    """Drop the calling thread's world (it falls back to torch's original one)."""
    _tls.world = None
    _tls.owner = None


def current_owner() -> Any:
    """The owner given to :func:`enter_rank_world` by this thread or the rank thread that started it."""
    return _tls.owner


def _start_in_rank_context(self: threading.Thread, *args: Any, **kwargs: Any) -> None:
    """``Thread.start`` while installed: a thread started by a rank joins that rank's world."""
    world = _tls.world
    if world is not None:
        owner = _tls.owner
        run = self.run

        def run_as_rank() -> None:
            _tls.world = world
            _tls.owner = owner
            # The C++ registry is per thread: make the rank's groups resolvable here too, so
            # functional collectives and DTensor find them by name.
            for pg, name in list(world.pg_names.items()):
                with contextlib.suppress(Exception):
                    torch._C._distributed_c10d._register_process_group(name, pg)
            try:
                run()
            finally:
                _tls.world = None
                _tls.owner = None

        self.run = run_as_rank  # type: ignore[method-assign]
    # (a reference to this function may outlive the routing: fall back to the start it replaced)
    (_original_start or _START_AT_IMPORT)(self, *args, **kwargs)


_FRESH_RNG_STATE: torch.Tensor | None = None


class ProcessLocalState:
    """Process-global settings a rank would own alone in its own process.

    Covered: torch's default CPU generator and the default dtype (a swap costs ~5 us), and the
    globals of rank-local modules (``globals``: what
    :meth:`tpsim.comm.modstate.ModuleGlobals.save` returned; None when none are declared).
    Grad mode, autocast and inference mode are already thread-local in torch.
    The scheduler keeps one record per rank and, at every hand-off, writes the outgoing rank's
    settings into its record (``rng``, ``dtype``, ``globals``) rather than make a new one.
    Python's ``random`` and NumPy's legacy global RNG are *not* swapped: saving and
    restoring Python's Mersenne state costs ~25 us per hand-off (more than everything
    else on the hot path) and torch code draws from torch's generator. Code under test
    that needs them per rank should use ``random.Random(seed)`` instances.
    """

    __slots__ = ("dtype", "globals", "rng")

    def __init__(self, rng: torch.Tensor, dtype: torch.dtype, globals: Any = None) -> None:
        self.rng = rng
        self.dtype = dtype
        self.globals = globals

    @classmethod
    def fresh(cls, dtype: torch.dtype, globals: Any = None) -> ProcessLocalState:
        """The state a newly started process would have (generator at torch's default seed)."""
        global _FRESH_RNG_STATE
        if _FRESH_RNG_STATE is None:
            _FRESH_RNG_STATE = torch.Generator().get_state()
        return cls(_FRESH_RNG_STATE, dtype, globals)

    @classmethod
    def capture(cls, globals: Any = None) -> ProcessLocalState:
        """Snapshot the calling process's current settings (``globals``: the caller's own snapshot)."""
        # The generator's own methods: torch.get_rng_state/set_rng_state wrap them (a few us a hand-off).
        return cls(_DEFAULT_GENERATOR.get_state(), torch.get_default_dtype(), globals)

    def restore(self) -> None:
        """Make these settings the process's current ones (the caller restores ``globals``)."""
        _DEFAULT_GENERATOR.set_state(self.rng)
        if torch.get_default_dtype() != self.dtype:
            torch.set_default_dtype(self.dtype)


_DEFAULT_GENERATOR = torch.default_generator
