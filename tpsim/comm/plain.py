"""Plain data for the judge: what worker processes ship to a process that never imports user code.

The process that judges a check (``tpsim check``'s session worker) never imports the checked code:
targets are imported, built and run only in worker processes (the isolated inproc worker, gloo/NCCL
ranks). What those workers send back must therefore load without importing anything of the user's,
and must say what the ranks computed, not what the checked code claims:

- **on the worker's side** (:func:`dumps`) every tensor is shipped as a plain ``torch.Tensor`` of
  its own storage, read with ``__torch_function__`` disabled (:func:`plain_tensor`): a subclass
  whose ``__torch_function__`` lies about its values, or whose ``__reduce_ex__`` does, ships what it
  holds; a functional collective's pending result is waited for first, and a DTensor ships its local
  piece. Every object of a module the judge may not import — a user's function, class, object or
  exception — is replaced by a :class:`Foreign` (or :class:`ForeignError`) that keeps its module,
  name and text, so reports still name it.
- **on the judge's side** (:func:`loads`) nothing is imported but the standard library, torch,
  numpy and tpsim (:func:`may_import`): a reference to anything else is an error, never an import.

Only the runs the property engine launches ship plain data (``tpsim.run(..., plain=True)``); a
user's own ``tpsim.run`` keeps returning their objects as they are.
"""

from __future__ import annotations

import functools
import importlib
import io
import pickle
import sys
import types
from typing import Any

import torch

from tpsim.comm._wire import Pickler

__all__ = ["Foreign", "ForeignError", "dumps", "loads", "may_import", "plain_tensor"]

#: Top-level packages besides the standard library whose modules the judge may import.
_TRUSTED = frozenset({"torch", "numpy", "tpsim", "builtins", "__future__"})
_STDLIB = frozenset(getattr(sys, "stdlib_module_names", ()))


def may_import(module: Any) -> bool:
    """Whether the judge may import ``module`` (a module name): the standard library, torch, numpy
    and tpsim only (``tpsim_target_…``, the names of target files, are the user's)."""
    if not isinstance(module, str) or not module:
        return False
    root = module.partition(".")[0]
    return root in _TRUSTED or root in _STDLIB or (root.startswith("_") and root.lstrip("_") in _STDLIB)


class Foreign:
    """Stands in for an object of a module the judge may not import: its ``module``, qualified name
    and text (``repr``). It can be named and compared, never called: what it did is the workers'."""

    def __init__(self, module: str, qualname: str, text: str) -> None:
        # Instance attributes: reports read ``__module__``/``__qualname__``/``__name__`` as of the original.
        self.__module__ = module
        self.__qualname__ = qualname
        self.text = text

    @property
    def __name__(self) -> str:  # type: ignore[override]
        return self.__qualname__.rpartition(".")[2]

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Foreign) and (self.__module__, self.__qualname__, self.text) == (
            other.__module__, other.__qualname__, other.text)

    def __hash__(self) -> int:
        return hash((self.__module__, self.__qualname__, self.text))

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self.text} is the checked code's ({self.__module__}): it runs in worker processes "
                           "only, never in the process that judges (a bug in tpsim: please report it)")

    def __reduce__(self) -> tuple[Any, ...]:
        return (Foreign, (self.__module__, self.__qualname__, self.text))

    @classmethod
    def of(cls, obj: Any) -> Foreign:
        """The stand-in of ``obj`` (a function, a class or any object). Its text carries no address, so
        the same object is described alike in every process (search keys derive from it)."""
        reference = isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                                     types.ModuleType))
        target = obj if reference else type(obj)
        module = str(getattr(target, "__module__", None) or getattr(target, "__name__", "?"))
        qualname = str(getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or "?")
        if isinstance(obj, types.ModuleType):
            return cls(obj.__name__, obj.__name__, f"<module {obj.__name__}>")
        kind = "class" if isinstance(obj, type) else "function" if reference else f"{module}.{qualname} object"
        return cls(module, qualname, f"<{kind} {module}.{qualname}>" if reference else f"<{kind}>")


class ForeignError(RuntimeError):
    """Stands in for an exception whose class the judge may not import: ``type_name`` (module and
    qualified name), the text it printed and the builtin exception classes it derives from."""

    def __init__(self, type_name: str, text: str, bases: tuple[str, ...] = ()) -> None:
        super().__init__(f"{type_name}: {text}" if text else type_name)
        self.type_name = type_name
        self.text = text
        self.bases = bases

    def __reduce__(self) -> tuple[Any, ...]:
        return (ForeignError, (self.type_name, self.text, self.bases))

    @classmethod
    def of(cls, exc: BaseException) -> ForeignError:
        from tpsim.comm.scheduler import text_of

        kind = type(exc)
        bases = tuple(b.__name__ for b in kind.__mro__ if b.__module__ == "builtins" and b is not object)
        return cls(f"{kind.__module__}.{kind.__qualname__}", text_of(exc), bases)


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t``, a pending functional collective's result (torch's ``AsyncCollectiveTensor``) waited for:
    any op on it waits (its dispatch unwraps the result), and a copy keeps its autograd history."""
    fc = sys.modules.get("torch.distributed._functional_collectives")
    act = getattr(fc, "AsyncCollectiveTensor", None)
    return t.clone() if act is not None and isinstance(t, act) else t


def _pending(t: torch.Tensor) -> torch.Tensor:
    """``t`` with a pending functional collective waited for, a DTensor as its local piece."""
    t = _waited(t)
    tensor_module = sys.modules.get("torch.distributed.tensor")
    dtensor = getattr(tensor_module, "DTensor", None)
    if dtensor is not None and isinstance(t, dtensor):
        t = _waited(t.to_local())
    return t


def plain_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a plain ``torch.Tensor`` sharing its storage (and its autograd history), read with every
    ``__torch_function__`` override disabled, so a subclass cannot change what it is made to say; a
    pending collective's result is waited for and a DTensor gives its local piece. A plain tensor is
    returned as it is."""
    if type(t) is torch.Tensor:
        return t
    t = _pending(t)
    if type(t) is torch.Tensor:
        return t
    with torch._C.DisableTorchFunction():
        return torch.Tensor.as_subclass(t, torch.Tensor)


_REFERENCE_TYPES = (types.FunctionType, types.BuiltinFunctionType, types.MethodType, types.ModuleType, type,
                    functools.partial, staticmethod, classmethod, property)


def _importable(obj: Any) -> bool:
    """Whether ``obj`` (a function or class of a module the judge may import) pickles by reference:
    its module is loaded and its qualified name leads back to it (not a closure or a lambda)."""
    module = sys.modules.get(getattr(obj, "__module__", None) or "")
    if module is None:
        return False
    found: Any = module
    for part in (getattr(obj, "__qualname__", None) or "").split("."):
        found = getattr(found, part, None)
        if found is None:
            return False
    return found is obj


class PlainPickler(Pickler):
    """The worker's pickler for the judge (see the module docstring)."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if type(obj) is not torch.Tensor and type(obj) is not torch.nn.Parameter:
                obj = plain_tensor(obj)
                return (_identity, (obj,)) if type(obj) is torch.Tensor else NotImplemented
            return super().reducer_override(obj)
        if isinstance(obj, _REFERENCE_TYPES):
            if isinstance(obj, types.ModuleType):
                return (importlib.import_module, (obj.__name__,)) if may_import(obj.__name__) else Foreign.of(obj).__reduce__()
            if isinstance(obj, (types.FunctionType, type, types.BuiltinFunctionType)) and may_import(
                    getattr(obj, "__module__", None)) and _importable(obj):
                return NotImplemented
            return Foreign.of(obj).__reduce__()
        reduced = super().reducer_override(obj)
        if reduced is not NotImplemented:
            return reduced
        if not may_import(type(obj).__module__):
            if isinstance(obj, BaseException):
                return ForeignError.of(obj).__reduce__()
            return Foreign.of(obj).__reduce__()
        return NotImplemented


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def dumps(obj: Any) -> bytes:
    """Pickle ``obj`` as plain data for the judge (see the module docstring)."""
    buf = io.BytesIO()
    PlainPickler(buf).dump(obj)
    return buf.getvalue()


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if not may_import(module):
            raise pickle.UnpicklingError(
                f"a worker sent an object of {module}.{name}: the process that judges never imports the checked "
                "code (a bug in tpsim: the worker should have sent plain data)")
        return super().find_class(module, name)


def loads(data: bytes) -> Any:
    """Unpickle what a worker sent with :func:`dumps`, importing nothing but the standard library,
    torch, numpy and tpsim."""
    return _SafeUnpickler(io.BytesIO(data)).load()
