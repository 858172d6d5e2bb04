"""What ``torch.distributed`` says a tpsim group's backend is: the real backend's name.

tpsim's process groups are registered with torch under backends of their own (``inproc``,
``tpsim_gloo``, ``tpsim_nccl``), but code under test asks ``dist.get_backend() == "gloo"`` to pick a
device or an op, and torch itself refuses ``dist.monitored_barrier()`` on anything but gloo. So the
name torch records for each tpsim group (what ``dist.get_backend`` returns) is the backend it stands
for: ``gloo`` for ``tpsim_gloo``, ``nccl`` for ``tpsim_nccl``, and ``gloo`` for ``inproc`` (a CPU
backend: code asking "is this gloo?" takes its CPU path, the one inproc runs). And a group the code
asks for by that name inside a tpsim world (``dist.new_group(backend="gloo")``, or a ``new_group``
inheriting the default group's backend) is made with tpsim's backend again, so every group of the
world is traced (on inproc: exists at all).

Installed once per process by the backends' registration (:func:`present_as`); it changes nothing for
groups that are not tpsim's.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

import torch.distributed.distributed_c10d as c10d

__all__ = ["present_as", "shown_name"]

#: tpsim's backend -> the name torch code sees.
_SHOWN: dict[str, str] = {}
#: (the default group's tpsim backend, a backend torch code asks for) -> tpsim's backend to make it with.
_ALIASES: dict[tuple[str, str], str] = {}
_lock = threading.Lock()
_installed: list[Any] = []


def shown_name(backend: str) -> str:
    """The name ``dist.get_backend()`` returns for a group of tpsim's ``backend``."""
    return _SHOWN.get(backend, backend)


def present_as(backend: str, shown: str, *, aliases: dict[str, str] | None = None) -> None:
    """Make ``dist.get_backend()`` return ``shown`` for groups of tpsim's ``backend``; inside a world whose
    default group is ``backend``'s, a group asked for by a name in ``aliases`` is made with the tpsim
    backend it maps to (idempotent; installs the hook once per process)."""
    with _lock:
        _SHOWN[backend] = shown
        for asked, made in (aliases or {}).items():
            _ALIASES[(backend, asked)] = made
        if not _installed:
            original = c10d._new_process_group_helper
            _installed.append(original)
            c10d._new_process_group_helper = functools.wraps(original)(_helper)


def _default_backend() -> str | None:
    """The tpsim backend of the calling thread's default group (None: not a tpsim world)."""
    default = c10d._world.default_pg
    return getattr(default, "tpsim_backend", None) if default is not None else None


def _helper(group_size: Any, group_rank: Any, global_ranks_in_group: Any, backend: Any, store: Any,
            group_name: Any, *args: Any, **kwargs: Any) -> Any:
    requested = str(backend)
    ours = _default_backend()
    if ours is not None:
        backend = _ALIASES.get((ours, requested.lower()), backend)
    pg, prefix_store = _installed[0](group_size, group_rank, global_ranks_in_group, backend, store, group_name,
                                     *args, **kwargs)
    shown = _SHOWN.get(str(backend))
    entry = c10d._world.pg_map.get(pg) if shown is not None else None
    if entry is not None:
        c10d._world.pg_map[pg] = (shown, entry[1])
    return pg, prefix_store
