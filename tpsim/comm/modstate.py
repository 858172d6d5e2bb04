"""Module globals on the in-process backend: exact per rank where declared, watched elsewhere.

In a real job every rank is its own process, so a library's module globals (fairscale's
``initialize._MODEL_PARALLEL_GROUP``, Megatron-core's ``parallel_state``) exist once per rank. On
``inproc`` the ranks are threads of one process and share them. Two remedies, both applied at the
scheduler's hand-offs (only one rank runs at a time, so swapping there is exact, as it is for the
per-rank RNG):

* **rank-local modules** (``tpsim.run(..., rank_local=("pkg.module",))``): each rank gets its own
  copy of the module's globals, starting from the module as it was when the world started; the
  copies are swapped in and out at every hand-off and the module is put back as it was afterwards.
  Plain containers (dict, list, set) are copied per rank too, as each process would hold its own.
* **the watch** (always on): for the modules the rank function's code comes from (and their
  packages) tpsim notes, once per process, which globals their functions rebind with a ``global``
  statement, and compares only those at hand-offs. A global rebound by one rank and then rebound
  by another, or seen by another rank before the world failed, raises
  :class:`tpsim.errors.SharedModuleState` naming the module, the global and the fix. A global
  rebound once and then only read (a lazily built cache, a warn-once flag) is never reported on a
  run that succeeds: on a correct program that sharing changes nothing.

Globals rebound from outside their module (``mod.X = ...``) are not watched.
"""

from __future__ import annotations

import dataclasses
import dis
import importlib
import operator
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from tpsim.errors import InvalidArgument, SharedModuleState

__all__ = ["ModuleGlobals", "rebound_names", "resolve_modules", "watched_modules"]

#: Values whose equality is their identity for our purposes: rebinding to an equal one is no change.
_SCALARS = (type(None), bool, int, float, complex, str, bytes)
#: Top-level packages whose globals are never watched: the interpreter, torch and the harness.
_NOT_WATCHED = frozenset({
    "builtins", "torch", "torchgen", "functorch", "numpy", "hypothesis", "tpsim", "pytest", "_pytest",
    "pluggy", "xdist", "execnet", "sortedcontainers", "attr", "attrs", "typing_extensions", "sympy",
    "mpmath", "networkx", "jinja2", "markupsafe", "filelock", "fsspec", "packaging", "setuptools",
    "pkg_resources", "_distutils_hack", "coverage", "tqdm", "yaml",
})
_MISSING = object()
_STORE_OPS = frozenset({dis.opmap["STORE_GLOBAL"], dis.opmap["DELETE_GLOBAL"]})


def resolve_modules(items: Any, argument: str) -> tuple[types.ModuleType, ...]:
    """Module objects for ``items`` (names or modules), importing names; InvalidArgument if one fails."""
    if items is None:
        return ()
    if isinstance(items, (str, types.ModuleType)):
        items = (items,)
    try:
        seq = list(items)
    except TypeError:
        raise InvalidArgument(f"{argument}={items!r} must be a sequence of module names, "
                              f"e.g. {argument}=('mypkg.parallel_state',)") from None
    out: list[types.ModuleType] = []
    for item in seq:
        if isinstance(item, types.ModuleType):
            module = item
        elif isinstance(item, str) and item:
            try:
                module = importlib.import_module(item)
            except Exception as exc:
                raise InvalidArgument(f"{argument}: module {item!r} cannot be imported "
                                      f"({type(exc).__name__}: {exc}); give an importable dotted name") from exc
        else:
            raise InvalidArgument(f"{argument}: {item!r} must be a module name (a non-empty str) or a module")
        if module not in out:
            out.append(module)
    return tuple(out)


# -- which modules to watch --------------------------------------------------------------------------

def _stdlib(top: str) -> bool:
    return top in sys.stdlib_module_names or top.startswith("_")


def _globals_used(code: types.CodeType) -> set[str]:
    """Names a code object (and the functions nested in it) may read from its module's globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _globals_used(const)
    return names


def _module_names_of(obj: Any, found: set[str], seen: set[int], depth: int) -> None:
    """Collect the modules ``obj``'s code and classes come from (a bounded walk of what it uses)."""
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, types.ModuleType):
        found.add(obj.__name__)
        return
    if isinstance(obj, _SCALARS):
        return
    if isinstance(obj, (types.FunctionType, type)):
        module = getattr(obj, "__module__", None)
        if isinstance(module, str):
            found.add(module)
        if isinstance(obj, types.FunctionType):
            # What the function reaches through its module's globals: ``import pkg.state as st``,
            # ``from pkg.layers import Linear``.
            scope = obj.__globals__
            for name in sorted(_globals_used(obj.__code__)):
                if name in scope:
                    _module_names_of(scope[name], found, seen, depth - 1)
            for cell in obj.__closure__ or ():
                try:
                    _module_names_of(cell.cell_contents, found, seen, depth - 1)
                except ValueError:  # an empty cell
                    pass
        return
    if isinstance(obj, types.MethodType):
        _module_names_of(obj.__func__, found, seen, depth)
        _module_names_of(obj.__self__, found, seen, depth - 1)
        return
    func = getattr(obj, "func", None)  # functools.partial
    if callable(func) and hasattr(obj, "args"):
        _module_names_of(func, found, seen, depth)
        for item in (*getattr(obj, "args", ()), *getattr(obj, "keywords", {}).values()):
            _module_names_of(item, found, seen, depth - 1)
        return
    _module_names_of(type(obj), found, seen, depth)
    if isinstance(obj, Mapping):
        items: Iterable[Any] = list(obj.values())[:64]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        items = list(obj)[:64]
    elif dataclasses.is_dataclass(obj):
        items = [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    else:
        state = getattr(obj, "__dict__", None)
        items = list(state.values())[:64] if isinstance(state, dict) else []
    for item in items:
        _module_names_of(item, found, seen, depth - 1)


_PACKAGE_MODULES: dict[frozenset[str], tuple[int, tuple[types.ModuleType, ...]]] = {}


def _loaded_under(tops: frozenset[str]) -> tuple[types.ModuleType, ...]:
    """Every loaded module of the top-level packages ``tops`` (cached until a module is imported)."""
    count = len(sys.modules)
    cached = _PACKAGE_MODULES.get(tops)
    if cached is not None and cached[0] == count:
        return cached[1]
    chosen = tuple(m for name, m in list(sys.modules.items())
                   if isinstance(m, types.ModuleType) and name.split(".")[0] in tops)
    _PACKAGE_MODULES[tops] = (count, chosen)
    return chosen


def watched_modules(fn: Any, args: Sequence[Any], kwargs: Mapping[str, Any], extra: Sequence[types.ModuleType] = (),
                    exclude: Sequence[types.ModuleType] = ()) -> tuple[types.ModuleType, ...]:
    """The modules whose globals a world of ``fn(*args, **kwargs)`` watches.

    The modules ``fn`` and the objects it is given come from, found by a bounded walk, widened to
    every loaded module of their top-level packages (a layer class in ``pkg.layers`` keeps its
    state in ``pkg.initialize``); the standard library, torch, numpy, Hypothesis and tpsim itself are
    left out. ``extra`` modules are always watched, ``exclude`` ones (rank-local) never.
    """
    found: set[str] = set()
    _module_names_of((fn, tuple(args), dict(kwargs)), found, set(), depth=4)
    tops = frozenset(t for t in (name.split(".")[0] for name in found)
                     if t not in _NOT_WATCHED and (t == "__main__" or not _stdlib(t)))
    chosen = list(_loaded_under(tops))
    for module in extra:
        if module not in chosen:
            chosen.append(module)
    skip = {id(m) for m in exclude}
    return tuple(m for m in chosen if id(m) not in skip)


_REBOUND: dict[tuple[str, int], tuple[str, ...]] = {}


def _code_objects(obj: Any, module_dict: dict[str, Any], out: list[types.CodeType], seen: set[int]) -> None:
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if isinstance(obj, (staticmethod, classmethod)):
        _code_objects(obj.__func__, module_dict, out, seen)
    elif isinstance(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                _code_objects(f, module_dict, out, seen)
    elif isinstance(obj, types.FunctionType):
        if obj.__globals__ is module_dict:
            out.append(obj.__code__)
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            _code_objects(wrapped, module_dict, out, seen)
    elif isinstance(obj, type) and obj.__module__ == module_dict.get("__name__"):
        for value in list(vars(obj).values()):
            _code_objects(value, module_dict, out, seen)


def rebound_names(module: types.ModuleType) -> tuple[str, ...]:
    """The globals of ``module`` that its functions rebind or delete (``global X; X = ...``).

    Found once per module per process from the bytecode of the module's functions and of its
    classes' methods (nested functions included).
    """
    key = (module.__name__, id(module))
    names = _REBOUND.get(key)
    if names is not None:
        return names
    module_dict = vars(module)
    codes: list[types.CodeType] = []
    seen: set[int] = set()
    for value in list(module_dict.values()):
        _code_objects(value, module_dict, codes, seen)
    found: set[str] = set()
    while codes:
        code = codes.pop()
        for ins in dis.get_instructions(code):
            if ins.opcode in _STORE_OPS:
                found.add(ins.argval)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    names = _REBOUND[key] = tuple(sorted(found))
    return names


# -- the per-world state -------------------------------------------------------------------------------

_CONTAINERS = (tuple, list, dict, set, frozenset)


def _plain(value: Any, depth: int = 3) -> bool:
    """Scalars, and small containers of them: values whose ``==`` is cheap and means "the same"."""
    if isinstance(value, _SCALARS):
        return True
    if depth == 0 or type(value) not in _CONTAINERS or len(value) > 64:
        return False
    items = list(value.items()) if isinstance(value, dict) else list(value)
    flat = [x for item in items for x in (item if isinstance(value, dict) else (item,))]
    return all(_plain(x, depth - 1) for x in flat)


def _same_value(a: Any, b: Any) -> bool:
    """Whether rebinding a global from ``b`` to ``a`` changes nothing a reader could tell.

    Identity, or equal plain values (every rank setting ``_MODE = "train"`` or ``_SIZES = (2, 4)``);
    other objects (a group, a buffer, a tensor) are the same only if they are the same object.
    """
    if a is b:
        return True
    if type(a) is not type(b) or not (_plain(a) and _plain(b)):
        return False
    try:
        return bool(a == b)
    except Exception:
        return False


def _own_copy(value: Any) -> Any:
    """A rank's own copy of a global's starting value: plain containers are copied, the rest shared."""
    t = type(value)
    if t is dict or t is list or t is set:
        return value.copy()
    return value


class ModuleGlobals:
    """The rank-local modules and the watched globals of one in-process world."""

    def __init__(self, rank_local: Sequence[types.ModuleType], watched: Sequence[types.ModuleType]) -> None:
        self.local_modules = tuple(rank_local)
        self._local = tuple(vars(m) for m in self.local_modules)
        #: The rank-local modules' globals when the world started (also what they return to after).
        self.start = tuple(d.copy() for d in self._local)
        keys: list[tuple[str, dict[str, Any], str]] = []
        for module in watched:
            for name in rebound_names(module):
                keys.append((module.__name__, vars(module), name))
        self._keys = keys
        self._start_watched = [d.get(n, _MISSING) for _, d, n in keys]
        self._values_in: list[Any] = []
        self._handed_over: list[Any] | None = None  # the watched values at the last hand-off
        self._writer: dict[int, int] = {}  # watched global -> the rank that rebound it last
        #: The first conflict (two ranks rebound one global), raised at once by the scheduler.
        self.conflict: SharedModuleState | None = None
        #: The first time a rank ran while a (non-scalar) global another rank had rebound was visible.
        self.exposure: tuple[int, int, int] | None = None  # (watched global, writer, seer)

    @property
    def active(self) -> bool:
        """Whether there is anything to do at hand-offs."""
        return self.has_local or self.has_watch

    @property
    def has_local(self) -> bool:
        """Whether rank-local modules are swapped at hand-offs."""
        return bool(self._local)

    @property
    def has_watch(self) -> bool:
        """Whether watched globals are compared at hand-offs."""
        return bool(self._keys)

    @property
    def watched(self) -> list[tuple[str, str]]:
        """``(module, global)`` pairs the watch compares at hand-offs."""
        return [(m, n) for m, _, n in self._keys]

    # -- rank-local modules ------------------------------------------------------------------
    def fresh(self) -> tuple[dict[str, Any], ...] | None:
        """A new rank's own copy of the rank-local modules' starting globals."""
        if not self._local:
            return None
        return tuple({k: (v if k.startswith("__") else _own_copy(v)) for k, v in d.items()} for d in self.start)

    def save(self) -> tuple[dict[str, Any], ...] | None:
        """The running rank's rank-local globals, to restore when it runs again."""
        if not self._local:
            return None
        return tuple(d.copy() for d in self._local)

    def restore(self, saved: tuple[dict[str, Any], ...] | None) -> None:
        """Make ``saved`` (from :meth:`save` or :meth:`fresh`) the rank-local modules' globals."""
        if saved is None:
            return
        for d, s in zip(self._local, saved, strict=True):
            d.update(s)
            if len(d) != len(s) or d.keys() != s.keys():
                for k in d.keys() - s.keys():
                    del d[k]

    def restore_start(self) -> None:
        """Put the rank-local modules back as they were when the world started."""
        self.restore(self.start)

    # -- the watch ----------------------------------------------------------------------------
    def restore_watched(self) -> None:
        """Put the watched globals back as they were when the world started.

        Used when the world fails on shared state: the ranks' rebindings (their groups, their
        buffers) would otherwise outlive the run in this process, where no real rank's would.
        """
        for (_, d, n), value in zip(self._keys, self._start_watched, strict=True):
            if value is _MISSING:
                d.pop(n, None)
            else:
                d[n] = value

    def enter(self, rank: int) -> None:
        """``rank`` got the baton: note what it sees, and whether that is another rank's rebinding."""
        keys = self._keys
        if not keys:
            return
        # The previous hand-off's snapshot is what this rank sees (nothing ran in between).
        values = self._handed_over
        if values is None:  # the world's first hand-in
            values = [d.get(n, _MISSING) for _, d, n in keys]
        self._handed_over = None
        self._values_in = values
        if self.exposure is None and self._writer:
            for i, writer in self._writer.items():
                if writer != rank and not isinstance(values[i], _SCALARS) and values[i] is not _MISSING:
                    self.exposure = (i, writer, rank)
                    break

    def leave(self, rank: int) -> SharedModuleState | None:
        """``rank`` hands the baton on: record what it rebound; return a conflict found now, if any."""
        keys = self._keys
        if not keys or not self._values_in:
            return None
        before = self._values_in
        values = [d.get(n, _MISSING) for _, d, n in keys]
        self._handed_over = values
        if all(map(operator.is_, values, before)):  # the common case: nothing rebound (C speed)
            return None
        for i, now in enumerate(values):
            if now is before[i] or _same_value(now, before[i]):
                continue
            previous = self._writer.get(i)
            self._writer[i] = rank
            if previous is not None and previous != rank and self.conflict is None:
                self.conflict = self.error(i, previous, rank, None, rebound_by_both=True)
                return self.conflict
        return None

    def error(self, index: int, first: int, second: int, cause: BaseException | None, *,
              rebound_by_both: bool) -> SharedModuleState:
        """The :class:`SharedModuleState` for watched global ``index``, shared by ranks ``first`` and ``second``."""
        module, _, name = self._keys[index]
        if rebound_by_both:
            what = (f"rank {first} rebound the module global {module}.{name}, then rank {second} rebound it "
                    "again")
        else:
            what = (f"rank {second} ran while the module global {module}.{name} held the value rank {first} had "
                    f"rebound it to, and the run then failed")
            if cause is not None:
                lines = str(getattr(cause, "summary", cause)).strip().splitlines()
                what += f": {lines[0] if lines else type(cause).__name__}"
        return SharedModuleState(
            f"{what}. On the inproc backend every rank is a thread of one process, so a module global that "
            f"a real job keeps once per process is shared by all ranks here. Make {module} rank-local: "
            f"tpsim.run(..., rank_local=({module!r},)) or --rank-local {module}; "
            "or run on --backend gloo (one process per rank).",
            module=module, attribute=name, ranks=(first, second), cause=cause)

    def exposure_error(self, cause: BaseException) -> SharedModuleState | None:
        """The failure ``cause`` as a :class:`SharedModuleState`, when a rank saw another's rebinding first."""
        if self.exposure is None:
            return None
        index, writer, seer = self.exposure
        return self.error(index, writer, seer, cause, rebound_by_both=False)
