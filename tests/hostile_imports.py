"""Hostile targets, second set: what a target does at import and what its classes and caches are.

Each entry is a target file (a correct twin and a buggy one where the target is checkable) for
tests/test_hostile_imports.py, which checks it with ``python -m tpsim check`` on inproc (isolated,
the default) and on gloo (:func:`hostile_probes.run_probe`), and for the in-process checks of the
fast tier. The buggy twins are catalogued mutants with a known diagnosis: ``RowReduceTwice``
(``double-reduction``), or a layer of the file that reduces twice the same way.

- **threads at import**: a thread (daemon or not) started when the module is imported;
- **a launcher's environment at import**: ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``,
  ``LOCAL_RANK`` set by the module itself;
- **classes whose introspection raises**: metaclass ``__getattr__``/``__getattribute__``, ``__signature__``,
  ``__instancecheck__``, ``__dict__``, ``__module__``/``__mro__`` that raise or lie;
- **process-level caches**: an all-reduce through a workspace kept by ``functools.lru_cache``,
  ``functools.cache`` (in a helper module beside the target), a ``staticmethod`` cache, a
  ``cached_property`` of a module-level object, a module-level tensor; one reached through a default
  argument (which tpsim cannot give each rank its own of: refused on inproc as shared state).
"""

from __future__ import annotations

_ROW = """from tpsim.mutants.row import CorrectRow, RowReduceTwice


class Row(CorrectRow):
    pass


class Twice(RowReduceTwice):
    pass
"""

#: A thread the module starts when imported (daemon or not), then the twins.
THREAD = {
    "daemon": "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,), daemon=True).start()\n" + _ROW,
    "non-daemon": "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n" + _ROW,
}

#: What a launcher sets for each rank, set by the module itself (as a script copied from a torchrun job would).
LAUNCHER_ENV = """import os

os.environ["RANK"] = "3"
os.environ["WORLD_SIZE"] = "7"
os.environ["MASTER_ADDR"] = "10.255.255.1"
os.environ["MASTER_PORT"] = "1"
os.environ["LOCAL_RANK"] = "3"
""" + _ROW

_META = "from torch import nn\n\nM = type(nn.Module)\n"
_TWINS = """

class Row(CorrectRow, metaclass=Meta):
    pass


class Twice(RowReduceTwice, metaclass=Meta):
    pass
"""
_IMPORTS = "from tpsim.mutants.row import CorrectRow, RowReduceTwice\n"

#: Classes whose introspection runs hostile code, each with the verdict it must get: ``"check"`` (the
#: class is checkable: the twins pass and fail) or the words of the usage error (exit 2) naming the cause.
INTROSPECTION: dict[str, tuple[str, str]] = {
    "metaclass-getattr-raises": (_IMPORTS + _META + """
class Meta(M):
    def __getattr__(cls, name):
        raise RuntimeError(f"no {name} for you")
""" + _TWINS, "check"),
    "metaclass-dict-raises": (_IMPORTS + _META + """
class Meta(M):
    def __getattribute__(cls, name):
        if name == "__dict__":
            raise RuntimeError("no __dict__ for you")
        return super().__getattribute__(name)
""" + _TWINS, "check"),
    "metaclass-instancecheck-raises": (_IMPORTS + _META + """
class Meta(M):
    def __instancecheck__(cls, obj):
        raise RuntimeError("no isinstance for you")

    def __subclasscheck__(cls, sub):
        raise RuntimeError("no issubclass for you")
""" + _TWINS, "check"),
    "metaclass-signature-raises": (_IMPORTS + _META + """
class Meta(M):
    @property
    def __signature__(cls):
        raise RuntimeError("no signature for you")
""" + _TWINS, "check"),
    "metaclass-eq-hash-raise": (_IMPORTS + _META + """
class Meta(M):
    def __eq__(cls, other):
        raise RuntimeError("no == for you")

    def __hash__(cls):
        raise RuntimeError("no hash for you")
""" + _TWINS, "check"),
    "metaclass-module-raises": (_IMPORTS + _META + """
class Meta(M):
    def __getattribute__(cls, name):
        if name == "__module__":
            raise RuntimeError("no __module__ for you")
        return super().__getattribute__(name)
""" + _TWINS, "reading __module__ of class Row raised RuntimeError at layer.py:9: no __module__ for you"),
    "metaclass-mro-raises": (_IMPORTS + _META + """
class Meta(M):
    def __getattribute__(cls, name):
        if name in ("__mro__", "mro"):
            raise RuntimeError("no __mro__ for you")
        return super().__getattribute__(name)
""" + _TWINS, "reading __mro__ of class Row raised RuntimeError at layer.py:9: no __mro__ for you"),
    "metaclass-module-not-str": (_IMPORTS + _META + """
class Meta(M):
    def __getattribute__(cls, name):
        if name == "__module__":
            return 42
        return super().__getattribute__(name)
""" + _TWINS, "__module__ of class Row is of type int, not str"),
    "init-descriptor-raises": (_IMPORTS + """

class _Raises:
    def __get__(self, obj, owner):
        raise RuntimeError("no __init__ for you")


class Row(CorrectRow):
    __init__ = _Raises()


class Twice(RowReduceTwice):
    __init__ = _Raises()
""", "reading __init__ of class Row raised RuntimeError at layer.py:6: no __init__ for you"),
}

# --- process-level caches ---------------------------------------------------------------------------

_CACHE_HEAD = """import functools

import torch
import torch.distributed as dist

from tpsim.mutants.row import CorrectRow
"""
#: The all-reduce every cache layer uses: copy into ``buffer``, all-reduce it in place (``times``
#: times: 2 is the buggy twin, ``double-reduction``), return a copy. Correct only if ``buffer`` is
#: this rank's own, as it is in each process of a real job.
_REDUCE = """

class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, buffer, times):
        buffer.copy_(x.reshape(-1))
        for _ in range(times):
            dist.all_reduce(buffer, group=group)  # another rank runs meanwhile (inproc's baton)
        return buffer.reshape(x.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None, None
"""
_CACHE_TWINS = """

class Row(CorrectRow):
    times = 1

    def reduce(self, y):
        return _Reduce.apply(y, self.group, {buffer}, self.times)


class Twice(Row):
    times = 2
"""


def _cache_layer(prelude: str, buffer: str) -> str:
    return _CACHE_HEAD + prelude + _REDUCE + _CACHE_TWINS.format(buffer=buffer)


#: name -> (target file source, files beside it): each a correct ``Row`` and a buggy ``Twice``.
CACHES: dict[str, tuple[str, dict[str, str]]] = {
    "lru-cache-workspace": (_cache_layer("""

@functools.lru_cache(maxsize=None)
def workspace(n, dtype):
    return torch.empty(n, dtype=dtype)
""", "workspace(y.numel(), y.dtype)"), {}),
    "cache-in-a-helper-module": (_cache_layer("""
from helpers import workspace_for
""", "workspace_for(y)"), {"helpers.py": """import functools

import torch


@functools.cache
def workspace(n, dtype):
    return torch.empty(n, dtype=dtype)


def workspace_for(y):
    return workspace(y.numel(), y.dtype)
"""}),
    "staticmethod-lru-cache": (_CACHE_HEAD + _REDUCE + """

class Row(CorrectRow):
    times = 1

    @staticmethod
    @functools.lru_cache(maxsize=8)
    def workspace(n, dtype):
        return torch.empty(n, dtype=dtype)

    def reduce(self, y):
        return _Reduce.apply(y, self.group, self.workspace(y.numel(), y.dtype), self.times)


class Twice(Row):
    times = 2
""", {}),
    "cached-property-of-a-module-object": (_cache_layer("""

class _Workspaces:
    @functools.cached_property
    def buffers(self):
        return {}


WORKSPACES = _Workspaces()
""", "WORKSPACES.buffers.setdefault((y.numel(), y.dtype), torch.empty(y.numel(), dtype=y.dtype))"), {}),
    "module-level-tensor": (_cache_layer("""

_BUFFER = torch.zeros(1 << 14, dtype=torch.float64)
""", "_BUFFER[: y.numel()]"), {}),
    "list-holding-a-cache": (_cache_layer("""

@functools.lru_cache(maxsize=None)
def workspace(n, dtype):
    return torch.empty(n, dtype=dtype)


_FACTORIES = [workspace]
""", "_FACTORIES[0](y.numel(), y.dtype)"), {}),
}

#: A cache reached through a default argument: the function holds the process's cache itself, which
#: tpsim cannot give each rank its own of; inproc refuses it as shared state (gloo passes it).
CACHE_IN_A_DEFAULT = _CACHE_HEAD + """

@functools.lru_cache(maxsize=None)
def workspace(n, dtype):
    return torch.empty(n, dtype=dtype)


def _buffer(y, make=workspace):
    return make(y.numel(), y.dtype)
""" + _REDUCE + _CACHE_TWINS.format(buffer="_buffer(y)")
