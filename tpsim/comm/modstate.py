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

* **rank-local attributes and containers** (always on): what the functions of those modules (rank-local
  or watched) write besides their own globals is per rank too, found once per module from their
  bytecode: attributes of classes (``Cls.w = w``, ``type(self).n += 1``, ``cls.x = ...`` in a
  classmethod, ``setattr(Cls, "w", w)``), of functions (``fn.calls += 1``) and of module-level objects
  (``_STATE.group = g``), and the contents of module-level containers mutated in place
  (``_CACHE[k] = v``, ``_HANDLES.append(h)``) in watched modules. Each rank starts from the value the
  world started with and its own writes are swapped in and out at hand-offs (a container keeps its
  identity: its contents are swapped), so a value one rank stores is never what another rank reads,
  as on gloo: rank 0 storing a weight on a class that the other ranks then read fails here too.

* **process-level caches and buffers** (always on): each rank of a real job has its own
  ``functools.lru_cache``/``functools.cache`` contents, ``cached_property`` values and module-level
  tensors. In the rank-local and watched modules (an installed library's watched modules aside), each
  rank gets an empty cache around the same function (a module's function, a class's ``staticmethod``
  or ``classmethod``), starts without the ``cached_property`` values of module-level objects, and gets
  its own copy of each module-level tensor (views of one storage stay views of one copy), wherever
  those modules' globals, plain containers and classes hold them; the objects themselves are watched:
  one that two ranks still reach (a default argument, a closure) raises :class:`SharedModuleState`.
  So an all-reduce through a cached workspace is right on inproc, as it is on gloo.

Globals rebound from outside their module (``mod.X = ...``), attributes set through a name computed at
run time (``setattr(obj, name, v)``) and containers mutated through another name than their module's
are not watched. Classes are read through ``type``'s own fields (``__dict__``, ``__module__``), never
through a metaclass's ``__getattribute__``, ``__eq__`` or ``__hash__``.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import dis
import functools
import importlib
import operator
import os
import sys
import types
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tpsim.errors import InvalidArgument, SharedModuleState

__all__ = ["ModuleGlobals", "Related", "Writes", "expand_watch", "module_writes", "rebound_names", "resolve_modules",
           "watched_modules"]

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
#: How the module names of target files begin (:data:`tpsim._target_files.PREFIX`, imported only when a
#: name has it: most worlds name none).
_TARGET_PREFIX = "tpsim_target_"
_STORE_OPS = frozenset({dis.opmap["STORE_GLOBAL"], dis.opmap["DELETE_GLOBAL"]})
#: A class's own namespace and module, read without running its metaclass's code (a hostile
#: ``__getattribute__`` or ``__getattr__`` must not turn a world's set-up into tpsim's failure).
_class_dict = type.__dict__["__dict__"].__get__
_class_module = type.__dict__["__module__"].__get__
#: The type of a ``functools.lru_cache`` / ``functools.cache`` wrapper.
_CACHE_TYPE = type(functools.lru_cache(maxsize=None)(lambda: None))


def _is(obj: Any, kinds: Any) -> bool:
    """``isinstance`` by the object's real type only: ``isinstance`` falls back on ``obj.__class__``,
    which a hostile ``__getattribute__`` (or its metaclass's) answers with the checked code's own code."""
    return issubclass(type(obj), kinds)


def _module_of_class(cls: type) -> Any:
    try:
        return _class_module(cls)
    except Exception:  # noqa: BLE001 - a class with no readable module is none of the watched ones
        return None


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
            if item.startswith(_TARGET_PREFIX):
                # A target file's module (``--rank-local path/to/layers.py``, the module of a class in a
                # target file): importable by its name through the target-file finder, which a worker
                # process that has not imported a target file yet (forked from a forker that never
                # imported it, or spawned) must install first.
                from tpsim._target_files import install_finder

                install_finder()
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


@dataclass(frozen=True)
class Related:
    """In a ``watch`` list: the loaded modules related to the world's rank-local modules — the other
    modules of their packages (a layer class in ``pkg.layers`` may keep its tp group in ``pkg.state``)
    and the modules beside a rank-local module that it imports (a script's ``import parallel_state as
    pgm``, where picotron- and vLLM-style code keep the tp group) — except the packages in ``skip``
    (a library preset declares its state itself). It is expanded where the world runs, where the
    rank-local modules are imported: a judge's worker, never the judge (:func:`expand_watch`)."""

    skip: tuple[str, ...] = ()

    def modules(self, rank_local: Sequence[str]) -> tuple[str, ...]:
        tops = {name.split(".")[0] for name in rank_local} - set(self.skip)
        found = [name for name in list(sys.modules) if "." in name and name.split(".")[0] in tops]
        found += [name for name in _siblings_used(rank_local) if name not in found and name not in rank_local
                  and name.split(".")[0] not in self.skip]
        return tuple(found)


def _siblings_used(rank_local: Sequence[str]) -> list[str]:
    """The modules a rank-local module imports from beside it (a file in its directory or below: a
    script's ``import parallel_state as pgm``, or ``from helpers import reduce``, whose module keeps
    its own state, a cached workspace)."""
    out = []
    for name in rank_local:
        module = sys.modules.get(name)
        where = os.path.dirname(getattr(module, "__file__", None) or "")
        if not where:
            continue
        for value in list(vars(module).values()):
            kind = type(value)  # not isinstance: it would ask a hostile object for its __class__
            if issubclass(kind, types.ModuleType):
                source = value
            elif issubclass(kind, (types.FunctionType, type)):
                try:
                    home = type.__dict__["__module__"].__get__(value) if issubclass(kind, type) else value.__module__
                except AttributeError:  # a class with no __module__ of its own
                    continue
                source = sys.modules.get(home) if type(home) is str else None
            else:
                continue
            path = getattr(source, "__file__", None)
            if isinstance(path, str) and os.path.dirname(path).startswith(where) and source.__name__ not in out \
                    and source.__name__ != name and source.__name__.split(".")[0] != "tpsim":
                out.append(source.__name__)
    return out


def expand_watch(watch: Any, rank_local: Sequence[str]) -> list[Any]:
    """``watch`` (names, modules and :class:`Related` entries) with each :class:`Related` entry replaced
    by the modules it stands for, given the rank-local module names."""
    if watch is None or isinstance(watch, (str, types.ModuleType)):
        return [] if watch is None else [watch]
    out: list[Any] = []
    for item in watch:
        out.extend(item.modules(tuple(rank_local)) if isinstance(item, Related) else (item,))
    return out


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
    """Collect the modules ``obj``'s code and classes come from (a bounded walk of what it uses).

    An object whose introspection raises (its class's ``__getattr__``, a property, a metaclass hook)
    is left out of the walk: the code it runs is the checked code's, which the world runs anyway."""
    if depth < 0 or id(obj) in seen:
        return
    seen.add(id(obj))
    try:
        _walk(obj, found, seen, depth)
    except Exception:  # noqa: BLE001 - see the docstring
        pass


def _walk(obj: Any, found: set[str], seen: set[int], depth: int) -> None:
    if _is(obj, types.ModuleType):
        found.add(obj.__name__)
        return
    if _is(obj, _SCALARS):
        return
    if _is(obj, (types.FunctionType, type)):
        module = _module_of_class(obj) if _is(obj, type) else obj.__module__
        if _is(module, str):
            found.add(module)
        if _is(obj, types.FunctionType):
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
    if _is(obj, types.MethodType):
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
    if _is(obj, Mapping):
        items: Iterable[Any] = list(obj.values())[:64]
    elif _is(obj, (list, tuple, set, frozenset)):
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
                   if _is(m, types.ModuleType) and name.split(".")[0] in tops)
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
    if _is(obj, (staticmethod, classmethod)):
        _code_objects(obj.__func__, module_dict, out, seen)
    elif _is(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                _code_objects(f, module_dict, out, seen)
    elif _is(obj, types.FunctionType):
        if obj.__globals__ is module_dict:
            out.append(obj.__code__)
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            _code_objects(wrapped, module_dict, out, seen)
    elif _is(obj, type) and _module_of_class(obj) == module_dict.get("__name__"):
        for value in list(_class_dict(obj).values()):
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


# -- attributes and containers a module's functions write ---------------------------------------------

#: Methods that change a container in place.
_MUTATORS = frozenset({
    "append", "extend", "insert", "pop", "popitem", "remove", "clear", "update", "setdefault", "add", "discard",
    "appendleft", "extendleft", "popleft", "sort", "reverse", "intersection_update", "difference_update",
    "symmetric_difference_update", "__setitem__", "__delitem__", "__iadd__", "__ior__",
})
#: Module-level values whose contents are swapped per rank when the module's code mutates them.
_BOXES = (dict, list, set, collections.OrderedDict, collections.defaultdict, collections.deque)
_CLASS = "<the method's class>"  # an attribute written on the class of the method (cls, type(self), __class__)


@dataclasses.dataclass(frozen=True)
class Writes:
    """What a module's functions write besides rebinding globals (:func:`module_writes`).

    ``attributes``: ``(owner, name)`` pairs, ``owner`` a global's name or a class (the class of the
    method that writes ``cls.name``, ``type(self).name``, ``__class__.name``); ``mutated``: globals whose
    value a function changes in place (``X[k] = v``, ``X.append(v)``)."""

    attributes: tuple[tuple[Any, str], ...] = ()
    mutated: tuple[str, ...] = ()


def _functions(obj: Any, module_dict: dict[str, Any], cls: type | None, out: list, seen: set[int]) -> None:
    """``(code, class or None, the classmethod's first argument or None)`` of the module's functions."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if _is(obj, classmethod):
        func = obj.__func__
        if _is(func, types.FunctionType) and func.__globals__ is module_dict:
            code = func.__code__
            out.append((code, cls, code.co_varnames[0] if code.co_argcount else None))
    elif _is(obj, staticmethod):
        _functions(obj.__func__, module_dict, cls, out, seen)
    elif _is(obj, property):
        for f in (obj.fget, obj.fset, obj.fdel):
            if f is not None:
                _functions(f, module_dict, cls, out, seen)
    elif _is(obj, types.FunctionType):
        if obj.__globals__ is module_dict:
            out.append((obj.__code__, cls, None))
        wrapped = getattr(obj, "__wrapped__", None)
        if wrapped is not None:
            _functions(wrapped, module_dict, cls, out, seen)
    elif _is(obj, type) and _module_of_class(obj) == module_dict.get("__name__"):
        for value in list(_class_dict(obj).values()):
            _functions(value, module_dict, obj, out, seen)


def _owner_of(ins: list[dis.Instruction], k: int, cls: type | None, first_arg: str | None) -> Any:
    """The object instruction ``k`` leaves on the stack, when it is one whose attributes matter: a
    global's name, or :data:`_CLASS` (the method's class); None otherwise."""
    if k < 0:
        return None
    op, arg = ins[k].opname, ins[k].argval
    if op in ("LOAD_GLOBAL", "LOAD_NAME"):
        return arg
    if cls is None:
        return None
    if op in ("LOAD_DEREF", "LOAD_CLASSDEREF") and arg == "__class__":
        return _CLASS
    if op == "LOAD_ATTR" and arg == "__class__":
        return _CLASS
    if op.startswith("LOAD_FAST") and first_arg is not None and arg == first_arg:
        return _CLASS
    if op == "CALL":  # type(x): LOAD_GLOBAL type, one LOAD_FAST*, [PRECALL], CALL
        j = k - 1 - (ins[k - 1].opname == "PRECALL")
        if j >= 1 and ins[j].opname.startswith("LOAD_FAST") and ins[j - 1].opname == "LOAD_GLOBAL" \
                and ins[j - 1].argval == "type":
            return _CLASS
    return None


def _scan(code: types.CodeType, cls: type | None, first_arg: str | None, attrs: dict[tuple[Any, str], Any],
          mutated: set[str], depth: int = 0) -> None:
    """Note in ``attrs`` (keyed by the owner's name or the class's id: a metaclass's ``__hash__`` is the
    checked code's) the attributes ``code`` writes, in ``mutated`` the globals it changes in place."""
    ins = list(dis.get_instructions(code))
    for i, x in enumerate(ins):
        if x.opname in ("STORE_ATTR", "DELETE_ATTR"):
            owner = _owner_of(ins, i - 1, cls, first_arg)
            if owner is None:  # X.a += v: X, COPY 1, LOAD_ATTR a, ..., STORE_ATTR a
                for k in range(i - 3, max(i - 24, -1), -1):
                    if ins[k + 1].opname == "COPY" and ins[k + 1].arg == 1 and ins[k + 2].opname == "LOAD_ATTR" \
                            and ins[k + 2].argval == x.argval:
                        owner = _owner_of(ins, k, cls, first_arg)
                        break
            if owner is not None:
                _note(attrs, cls if owner == _CLASS else owner, x.argval)
        elif x.opname == "LOAD_GLOBAL" and x.argval == "setattr" and i + 2 < len(ins):
            owner = _owner_of(ins, i + 1, cls, first_arg)
            name = ins[i + 2]
            if owner is not None and name.opname == "LOAD_CONST" and isinstance(name.argval, str):
                _note(attrs, cls if owner == _CLASS else owner, name.argval)
        if x.opname == "LOAD_GLOBAL" and _mutates(ins, i):
            mutated.add(x.argval)
    if depth < 8:
        for const in code.co_consts:
            if isinstance(const, types.CodeType):
                _scan(const, cls, None, attrs, mutated, depth + 1)


def _note(attrs: dict[tuple[Any, str], Any], owner: Any, name: str) -> None:
    attrs[(owner if _is(owner, str) else id(owner), name)] = (owner, name)


def _mutates(ins: list[dis.Instruction], i: int) -> bool:
    """Whether the value ``ins[i]`` loads is changed in place by what follows (a mutating method
    called on it, or a subscript stored into or deleted while it is still on the stack)."""
    nxt = ins[i + 1] if i + 1 < len(ins) else None
    if nxt is None:
        return False
    if nxt.opname in ("LOAD_METHOD", "LOAD_ATTR") and nxt.argval in _MUTATORS:
        return True
    above = 0  # how many stack items lie above the loaded value
    for x in ins[i + 1:i + 24]:
        if x.opname in ("STORE_SUBSCR", "DELETE_SUBSCR") and above >= 1:
            return True
        if x.opcode in dis.hasjrel or x.opcode in dis.hasjabs:
            return False
        try:
            above += dis.stack_effect(x.opcode, x.arg) if x.opcode >= dis.HAVE_ARGUMENT else dis.stack_effect(x.opcode)
        except ValueError:
            return False
        if above < 0:
            return False
    return False


_WRITES: dict[tuple[str, int], Writes] = {}


def module_writes(module: types.ModuleType) -> Writes:
    """The attributes and containers ``module``'s functions write (see :class:`Writes`); found once per
    module per process from the bytecode of its functions and of its classes' methods."""
    key = (module.__name__, id(module))
    found = _WRITES.get(key)
    if found is not None:
        return found
    module_dict = vars(module)
    functions: list[tuple[types.CodeType, type | None, str | None]] = []
    seen: set[int] = set()
    for value in list(module_dict.values()):
        _functions(value, module_dict, None, functions, seen)
    attrs: dict[tuple[Any, str], Any] = {}
    mutated: set[str] = set()
    for code, cls, first_arg in functions:
        _scan(code, cls, first_arg, attrs, mutated)
    found = _WRITES[key] = Writes(tuple(sorted(attrs.values(), key=lambda a: (_name_of(a[0]), a[1]))),
                                  tuple(sorted(mutated)))
    return found


def _name_of(owner: Any) -> str:
    """A global's name, or a class's qualified name read without running its metaclass's code."""
    if _is(owner, type):
        try:
            return str(_class_qualname(owner))
        except Exception:  # noqa: BLE001
            return "<a class>"
    return str(owner)


_class_qualname = type.__dict__["__qualname__"].__get__


def _not_ours(obj: Any) -> bool:
    """Objects of the interpreter, torch or the harness (never made per rank)."""
    if _is(obj, types.ModuleType):
        return True
    home = obj if _is(obj, type) else type(obj)
    module = obj.__module__ if _is(obj, types.FunctionType) else _module_of_class(home)
    top = str(module or "").split(".")[0] if _is(module, str) else ""
    return top in _NOT_WATCHED or top == "builtins"


def _rank_local_attributes(modules: Sequence[types.ModuleType]) -> list[tuple[Any, str, bool]]:
    """``(owner, name, owner is a class)`` for every attribute the modules' functions write."""
    out: list[tuple[Any, str, bool]] = []
    done: set[tuple[int, str]] = set()
    for module in modules:
        scope = vars(module)
        for owner, name in module_writes(module).attributes:
            if _is(owner, str):
                value = scope.get(owner, _MISSING)
                if value is _MISSING or _is(value, _SCALARS) or _is(value, _BOXES):
                    continue
                owners = [value]
            else:  # the method's class: it and its subclasses (``cls`` may be either)
                owners = _with_subclasses(owner)
            for obj in owners:
                if (id(obj), name) in done or not _has_own_dict(obj) or _not_ours(obj):
                    continue
                done.add((id(obj), name))
                out.append((obj, name, _is(obj, type)))
    return out


def _has_own_dict(obj: Any) -> bool:
    """Whether ``obj`` keeps its attributes in a namespace tpsim can swap values in: a class, or an
    object with a plain ``__dict__`` (read without the object's own ``__getattr__``/``__getattribute__``)."""
    if _is(obj, type):
        return True
    try:
        return type(object.__getattribute__(obj, "__dict__")) is dict
    except Exception:  # noqa: BLE001 - no __dict__, or a descriptor of the checked code that raises
        return False


def _own_dict(owner: Any) -> Any:
    """The namespace of a class or object that :func:`_has_own_dict` accepted."""
    return _class_dict(owner) if _is(owner, type) else object.__getattribute__(owner, "__dict__")


def _with_subclasses(cls: type) -> list[type]:
    found: list[type] = []
    todo = [cls]
    while todo:
        c = todo.pop()
        if all(c is not f for f in found):  # by identity: a metaclass's __eq__ is the checked code's
            found.append(c)
            with contextlib.suppress(TypeError):  # type.__subclasses__ needs the class itself
                todo.extend(type.__subclasses__(c))
    return found


def _rank_local_containers(modules: Sequence[types.ModuleType]) -> list[Any]:
    """The module-level containers the modules' functions mutate in place (each object once)."""
    out: list[Any] = []
    for module in modules:
        scope = vars(module)
        for name in module_writes(module).mutated:
            value = scope.get(name)
            if _is(value, _BOXES) and not name.startswith("__") and all(value is not b for b in out):
                out.append(value)
    return out


def _contents(box: Any) -> Any:
    return box.copy() if not _is(box, collections.deque) else collections.deque(box)


def _load(box: Any, contents: Any) -> None:
    """Make ``box``'s contents ``contents`` (the object stays the same: other names for it see them)."""
    if _is(box, dict):
        box.clear()
        box.update(contents)
    elif _is(box, list):
        box[:] = contents
    else:  # set, deque
        box.clear()
        box.update(contents) if _is(box, set) else box.extend(contents)


def _get_attr(owner: Any, name: str) -> Any:
    return _own_dict(owner).get(name, _MISSING)


def _set_attr(owner: Any, name: str, is_type: bool, value: Any) -> None:
    if is_type:
        if value is _MISSING:
            if name in _class_dict(owner):
                type.__delattr__(owner, name)
        else:
            type.__setattr__(owner, name, value)
    elif value is _MISSING:
        _own_dict(owner).pop(name, None)
    else:
        _own_dict(owner)[name] = value


# -- the per-world state -------------------------------------------------------------------------------

_CONTAINERS = (tuple, list, dict, set, frozenset)


def _plain(value: Any, depth: int = 3) -> bool:
    """Scalars, and small containers of them: values whose ``==`` is cheap and means "the same"."""
    if _is(value, _SCALARS):
        return True
    if depth == 0 or type(value) not in _CONTAINERS or len(value) > 64:
        return False
    items = list(value.items()) if _is(value, dict) else list(value)
    flat = [x for item in items for x in (item if _is(value, dict) else (item,))]
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


def _own_copy(value: Any, renew: dict[int, Any], memo: dict[Any, Any]) -> Any:
    """A rank's own copy of a global's starting value: plain containers are copied, a process-level
    cache or tensor in ``renew`` is made again for the rank (:func:`_renewed`; also one a copied list
    or dict holds), the rest shared."""
    t = type(value)
    if t is dict:
        if renew and any(id(v) in renew for v in value.values()):
            return {k: _renewed(v, memo) if id(v) in renew else v for k, v in value.items()}
        return value.copy()
    if t is list:
        if renew and any(id(v) in renew for v in value):
            return [_renewed(v, memo) if id(v) in renew else v for v in value]
        return value.copy()
    if t is set:
        return value.copy()
    if id(value) in renew:
        return _renewed(value, memo)
    return value


# -- process-level caches and tensors ------------------------------------------------------------------
#
# Each rank of a real job is a process with its own ``functools`` caches and its own module-level
# tensors; on inproc one object would serve every rank (a cached workspace that one rank fills while
# another reads it: a false failure). A rank gets its own: an empty cache around the same function
# (a cache is transparent: it fills again as it would in a fresh process) and a copy of the tensor
# (views of one storage stay views of one copy), made when its world starts and swapped at hand-offs
# wherever the checked code's modules and classes hold them.


def _renewable_tensor(value: Any) -> bool:
    """A plain dense tensor (or parameter) that a rank may own a copy of."""
    torch = sys.modules.get("torch")
    if torch is None or type(value) not in (torch.Tensor, torch.nn.Parameter):
        return False
    return value.layout == torch.strided and value.grad_fn is None and not value.is_meta and not value.is_quantized


def _cache_of(value: Any) -> Any:
    """The ``functools`` cache ``value`` is, or wraps as a ``staticmethod``/``classmethod``; else None."""
    if type(value) is _CACHE_TYPE:
        return value
    if type(value) in (staticmethod, classmethod) and type(value.__func__) is _CACHE_TYPE:
        return value.__func__
    return None


def _renewed(value: Any, memo: dict[Any, Any]) -> Any:
    """A rank's own cache or tensor for ``value`` (one per original per rank: ``memo``)."""
    if id(value) in memo:
        return memo[id(value)]
    if type(value) in (staticmethod, classmethod):
        fresh: Any = type(value)(_renewed(value.__func__, memo))
    elif type(value) is _CACHE_TYPE:
        params = value.cache_parameters()
        fresh = functools.lru_cache(maxsize=params["maxsize"], typed=params["typed"])(value.__wrapped__)
        fresh.__dict__.update(value.__dict__)  # what functools.wraps copied, and what was set on it since
    else:
        torch = sys.modules["torch"]
        storage = value.untyped_storage()
        key = ("storage", storage.data_ptr(), value.device)
        copy = memo.get(key)
        if copy is None:
            copy = memo[key] = storage.clone()
        fresh = torch.empty(0, dtype=value.dtype, device=value.device).set_(
            copy, value.storage_offset(), value.size(), value.stride())
        if type(value) is torch.nn.Parameter:
            fresh = torch.nn.Parameter(fresh, requires_grad=value.requires_grad)
        elif value.requires_grad:
            fresh.requires_grad_(True)
    memo[id(value)] = fresh
    return fresh


def _usage(value: Any) -> int:
    """How often a cache was called (hits and misses), or a tensor written (its version counter)."""
    if type(value) is _CACHE_TYPE:
        info = value.cache_info()
        return int(info.hits + info.misses)
    return int(value._version)


@dataclasses.dataclass
class _ProcessLevel:
    """What each rank owns besides globals and written attributes (:func:`_process_level`).

    ``renew``: by id, the ``functools`` caches around the checked modules' own functions (also as a
    class's ``staticmethod``/``classmethod``) and the module-level tensors, each rank getting its own
    (:func:`_renewed`); ``originals``: ``(module, name, cache or tensor)``, the objects themselves, which
    no rank should reach any more; ``slots``: ``(owner, name, is_type)`` where one of them is held outside the
    rank-local modules' globals (which are copied per rank whole): a watched module's global, a class
    attribute; ``cached``: ``(object, name)`` for the ``functools.cached_property`` values of
    module-level objects (each rank computes its own)."""

    renew: dict[int, Any] = dataclasses.field(default_factory=dict)
    originals: list[tuple[str, str, Any]] = dataclasses.field(default_factory=list)
    slots: list[tuple[Any, str, bool]] = dataclasses.field(default_factory=list)
    cached: list[tuple[Any, str]] = dataclasses.field(default_factory=list)

    def add(self, value: Any, module: str, name: str) -> None:
        if id(value) not in self.renew:
            self.renew[id(value)] = value
            inner = _cache_of(value)
            self.originals.append((module, name, inner if inner is not None else value))


def _installed(module: types.ModuleType) -> bool:
    """Whether ``module`` comes from an installed distribution (``site-packages``), not the checked project."""
    path = getattr(module, "__file__", None)
    return isinstance(path, str) and any(part in ("site-packages", "dist-packages") for part in path.split(os.sep))


def _process_level(modules: Sequence[types.ModuleType], local: Sequence[types.ModuleType]) -> _ProcessLevel:
    """The process-level caches and tensors of ``modules`` (rank-local ``local`` among them), found in
    their globals, the classes they define and the ``__dict__`` of their module-level objects."""
    dicts = {id(vars(m)) for m in modules}
    local_ids = {id(m) for m in local}
    found = _ProcessLevel()

    def own_cache(value: Any) -> bool:
        cache = _cache_of(value)
        wrapped = cache.__dict__.get("__wrapped__") if cache is not None else None
        return isinstance(wrapped, types.FunctionType) and id(wrapped.__globals__) in dicts

    seen_objects: set[int] = set()
    cached: dict[tuple[int, str], tuple[Any, str]] = {}  # by identity: no __hash__ of the checked code's
    for module in modules:
        in_local = id(module) in local_ids
        if not in_local and _installed(module):
            # An installed library's module that is only watched (a test's rank function that calls
            # into it): its many caches (``is_torch_available``...) would cost every hand-off; its
            # state is the preset's rank-local modules' or the library's own.
            continue
        for name, value in list(vars(module).items()):
            if name.startswith("__"):
                continue
            try:
                if own_cache(value) or _renewable_tensor(value):
                    found.add(value, module.__name__, name)
                    if not in_local:
                        found.slots.append((module, name, False))
                elif _is(value, type):
                    if _module_of_class(value) != module.__name__:
                        continue
                    for attr, member in list(_class_dict(value).items()):
                        if own_cache(member):
                            found.add(member, module.__name__, f"{name}.{attr}")
                            found.slots.append((value, attr, True))
                elif id(value) not in seen_objects and not _is(value, (types.ModuleType, types.FunctionType)) \
                        and not _is(value, _SCALARS) and _has_own_dict(value) and not _not_ours(value):
                    seen_objects.add(id(value))
                    for klass in type.__dict__["__mro__"].__get__(type(value)):
                        for member in list(_class_dict(klass).values()):
                            if type(member) is functools.cached_property and isinstance(member.attrname, str):
                                cached[(id(value), member.attrname)] = (value, member.attrname)
            except Exception:  # noqa: BLE001 - an object whose introspection raises is not made per rank
                continue
    found.cached = list(cached.values())
    return found


class ModuleGlobals:
    """The rank-local modules and the watched globals of one in-process world."""

    def __init__(self, rank_local: Sequence[types.ModuleType], watched: Sequence[types.ModuleType]) -> None:
        self.local_modules = tuple(rank_local)
        self._local = tuple(vars(m) for m in self.local_modules)
        #: The rank-local modules' globals when the world started (also what they return to after).
        self.start = tuple(d.copy() for d in self._local)
        # Attributes and containers the modules' functions write: per rank, from their values now.
        self._attrs = _rank_local_attributes((*self.local_modules, *watched))
        # Process-level caches and tensors: each rank its own (see _process_level), also where they are
        # held outside the rank-local modules' globals (appended to the attributes swapped per rank).
        level = _process_level((*self.local_modules, *watched), self.local_modules)
        self._renew = level.renew
        have = {(id(o), n) for o, n, _ in self._attrs}
        self._attrs += [slot for slot in level.slots if (id(slot[0]), slot[1]) not in have]
        #: Indexes into the attributes of cached_property values: each rank starts without one.
        self._uncached = frozenset(range(len(self._attrs), len(self._attrs) + len(level.cached)))
        self._attrs += [(obj, name, False) for obj, name in level.cached]
        #: The caches and tensors ranks got their own of: a rank that still reaches one (through a
        #: reference tpsim could not swap) shares it with the others; two ranks using one is a conflict.
        self._originals = level.originals
        self._usage_in: list[int] = []
        self._user: dict[int, int] = {}  # original -> the rank that used it last
        self._attr_start = tuple(_get_attr(o, n) for o, n, _ in self._attrs)
        self._boxes = _rank_local_containers(watched)  # a rank-local module's containers are copied with it
        self._box_start = tuple(_contents(b) for b in self._boxes)
        keys: list[tuple[str, dict[str, Any], str]] = []
        swapped = {(id(o), n) for o, n, _ in self._attrs}  # a global each rank has its own of: nothing shared
        for module in watched:
            for name in rebound_names(module):
                if (id(module), name) not in swapped:
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
        """Whether rank-local modules, attributes or containers are swapped at hand-offs."""
        return bool(self._local or self._attrs or self._boxes)

    @property
    def rank_local_attributes(self) -> list[tuple[str, str]]:
        """``(owner, attribute)`` of the attributes made per rank (for messages and tests)."""
        return [(o.__qualname__ if _is(o, types.FunctionType) else _name_of(o if _is(o, type) else type(o)),
                 n) for o, n, _ in self._attrs]

    @property
    def has_watch(self) -> bool:
        """Whether watched globals (or the caches and tensors ranks got their own of) are compared at hand-offs."""
        return bool(self._keys or self._originals)

    @property
    def watched(self) -> list[tuple[str, str]]:
        """``(module, global)`` pairs the watch compares at hand-offs."""
        return [(m, n) for m, _, n in self._keys]

    # -- rank-local modules, attributes and containers ---------------------------------------
    def fresh(self) -> tuple[Any, ...] | None:
        """A new rank's own copy of the rank-local state as the world started."""
        if not self.has_local:
            return None
        renew, memo = self._renew, {}  # memo: one cache or tensor per original for this rank
        dicts = tuple({k: (v if k.startswith("__") else _own_copy(v, renew, memo)) for k, v in d.items()}
                      for d in self.start)
        attrs = tuple(_MISSING if i in self._uncached else (_renewed(v, memo) if id(v) in renew else v)
                      for i, v in enumerate(self._attr_start))
        return dicts, attrs, self._box_start

    def save(self) -> tuple[Any, ...] | None:
        """The running rank's rank-local state, to restore when it runs again."""
        if not self.has_local:
            return None
        return (tuple(d.copy() for d in self._local), tuple([_get_attr(o, n) for o, n, _ in self._attrs]),
                tuple([_contents(b) for b in self._boxes]))

    def restore(self, saved: tuple[Any, ...] | None) -> None:
        """Make ``saved`` (from :meth:`save` or :meth:`fresh`) the rank-local state."""
        if saved is None:
            return
        dicts, attrs, boxes = saved
        for d, s in zip(self._local, dicts, strict=True):
            d.update(s)
            if len(d) != len(s) or d.keys() != s.keys():
                for k in d.keys() - s.keys():
                    # Dunder names are the process's, not a rank's: torch.compile installs its compiled
                    # code as __compiled_fn_... / __resume_at_... globals of the compiled function's
                    # module, which every rank runs (its code cache is per process).
                    if not k.startswith("__"):
                        del d[k]
        for (owner, name, is_type), value in zip(self._attrs, attrs, strict=True):
            if _get_attr(owner, name) is not value:
                _set_attr(owner, name, is_type, value)
        for box, contents in zip(self._boxes, boxes, strict=True):
            _load(box, contents)

    def restore_start(self) -> None:
        """Put the rank-local modules, attributes and containers back as they were when the world started."""
        self.restore((self.start, self._attr_start, self._box_start))

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
        if self._originals:
            self._usage_in = [_usage(obj) for _, _, obj in self._originals]
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
                if writer != rank and not _is(values[i], _SCALARS) and values[i] is not _MISSING:
                    self.exposure = (i, writer, rank)
                    break

    def leave(self, rank: int) -> SharedModuleState | None:
        """``rank`` hands the baton on: record what it rebound; return a conflict found now, if any."""
        if self._usage_in:
            shared = self._used_originals(rank)
            if shared is not None:
                return shared
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

    def _used_originals(self, rank: int) -> SharedModuleState | None:
        """Note the caches and tensors ``rank`` reached as they are (not its own copies); the conflict
        when another rank reached the same one before it."""
        for i, (module, name, obj) in enumerate(self._originals):
            if _usage(obj) == self._usage_in[i]:
                continue
            previous = self._user.get(i)
            self._user[i] = rank
            if previous is not None and previous != rank and self.conflict is None:
                label = f"{module}.{name}"
                kind = "functools cache" if type(obj) is _CACHE_TYPE else "module-level tensor"
                verb = "called" if type(obj) is _CACHE_TYPE else "wrote to"
                self.conflict = SharedModuleState(
                    f"rank {previous} {verb} the {kind} {label}, then rank {rank} {verb} it too, through a reference "
                    f"other than {label} itself (which each rank has its own of). On the inproc backend every rank "
                    f"is a thread of one process, so a {kind} a real job keeps once per process is shared by all "
                    f"ranks here. Reach it through its module global or class (tpsim gives each rank its own), or "
                    "run on --backend gloo (one process per rank).",
                    module=module, attribute=name, ranks=(previous, rank))
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
