"""What every library preset is, and the helpers they share.

A preset is an adapter for one tensor-parallel library: it knows the library's layer classes (by
their import path, so nothing is imported until a target needs it), how to build one on a rank
(config objects, the library's parallel state), which of the library's modules keep per-process
state, and every option combination worth checking. :class:`Preset` is the whole interface; each
library is one module in this package that defines ``PRESET``.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import io
import threading
import warnings
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from tpsim.errors import InvalidArgument

__all__ = ["LibraryMissing", "Preset", "option_name", "quiet_import", "route_rank_warnings"]


class Preset(Protocol):
    """An adapter for one library (see the module docstring)."""

    #: The library's distribution name, e.g. ``"megatron-core"``.
    name: str
    #: The pinned, tested requirement, e.g. ``"megatron-core==0.16.1"``.
    requirement: str
    #: Module targets that mean "the library's layers" (``tpsim check megatron.core.tensor_parallel``).
    targets: tuple[str, ...]
    #: The classes it adapts (their subclasses too) and functions, by ``module.QualName``, and their
    #: kind (``column``/``row``, ``embedding``, ``cross-entropy``: the kind picks the family of checks).
    classes: Mapping[str, str]
    #: Modules whose globals are per process in a real job (made rank-local on inproc).
    rank_local: tuple[str, ...]

    def load(self) -> dict[str, Any]:
        """Import the library (quietly) and return what a module target checks (its layer classes
        and functions, keys of :attr:`classes`) by ``module.QualName``; :class:`LibraryMissing` when
        it is not installed."""
        ...

    def variants(self, cls: Any, kind: str) -> list[Any]:
        """Every option combination of ``cls`` (a library class or function of ``kind``, or a
        subclass of such a class) that runs here, as variants of the family of ``kind``."""
        ...


class LibraryMissing(InvalidArgument):
    """A target needs a library that is not installed; the message gives the install command."""

    def __init__(self, preset: Preset, err: BaseException) -> None:
        super().__init__(
            f"{preset.name} is not installed ({type(err).__name__}: {err}); install the tested version with "
            f"pip install -c constraints.txt '{preset.requirement}' (or every library preset: "
            "pip install -c constraints.txt -e '.[libs]')"
        )
        self.preset = preset.name


def quiet_import(preset: Preset, module: str) -> Any:
    """Import ``module`` of ``preset``'s library with its import-time prints and warnings captured:
    hidden when the import works, quoted in the error when it does not. (Libraries warn at import
    about optional accelerators they did not find; on gloo every worker process imports again.)"""
    printed = io.StringIO()
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        try:
            return importlib.import_module(module)
        except ImportError as err:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                raise LibraryMissing(preset, err) from err
            noise = printed.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
            raise InvalidArgument(
                f"importing {module} failed: {type(err).__name__}: {err}" + (f"\nit printed:\n{noise}" if noise else "")
            ) from err


def option_name(cls: type, options: Sequence[tuple[str, Any]], defaults: Mapping[str, Any]) -> str:
    """``Class(opt=value, ...)`` naming the options that differ from ``defaults`` (``Class`` alone when none do)."""
    changed = [f"{k}={v}" for k, v in options if defaults.get(k) != v]
    return f"{cls.__qualname__}({', '.join(changed)})" if changed else cls.__qualname__


# --- warnings raised inside ranks ----------------------------------------------------------------

_hook_lock = threading.Lock()
_original_showwarning: Any = None


def _in_rank() -> bool:
    import torch.distributed as dist

    try:
        return dist.is_available() and dist.is_initialized()
    except Exception:  # noqa: BLE001 - deciding where a warning goes must never fail
        return False


def _showwarning(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001 - warnings' signature
    if file is None and _in_rank():
        import sys

        # Written like a print of the rank: ``tpsim check`` captures a rank's output per example,
        # hides it when the example passes and shows it, with the rank, under a failure.
        sys.stdout.write(warnings.formatwarning(message, category, filename, lineno, line))
        return
    _original_showwarning(message, category, filename, lineno, file, line)


def route_rank_warnings() -> None:
    """Send warnings raised inside a rank (a library's runtime warnings) where the rank's prints go,
    instead of straight to the terminal. Idempotent; warnings outside ranks are untouched."""
    global _original_showwarning
    with _hook_lock:
        if warnings.showwarning is _showwarning:
            return
        _original_showwarning = warnings.showwarning
        warnings.showwarning = _showwarning
