"""Target files (``tpsim check path/to/layers.py:Name``) as modules importable by name, in any process.

A target file is imported under a name that encodes its absolute path (:func:`module_name_of_path`),
and a finder on ``sys.meta_path`` imports such a name from the file it encodes. So a worker process
can import a target file by its module name alone: a rank-local module named ``tpsim_target_...``
(``--rank-local path/to/layers.py``), a class from a target file that is unpickled there.

The finder is installed the first time a process imports a target file (:func:`import_target_module`),
not when tpsim is imported: a process that never checks a target file keeps its import system as it
was. Worker processes resolve the variant they run from its target before its first world (the
engine warms them, :func:`tpsim.props.launch.warm_workers`), which installs it there too. The encoding keeps ASCII letters and digits and writes every other byte of
the UTF-8 path as ``_xx`` (two hex digits), so it is reversible and a valid identifier.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import io
import os
import sys
import warnings
from collections.abc import Iterator
from types import ModuleType
from typing import Any

from tpsim.errors import InvalidArgument
from tpsim.presets import LibraryMissing, presets

__all__ = ["PREFIX", "TargetError", "import_target_file", "import_target_module", "is_target_path", "install_finder", "module_name_of_path", "path_of_module_name"]

PREFIX = "tpsim_target_"


def module_name_of_path(path: str) -> str:
    """The module name a target file is imported under (stable per absolute path, reversible)."""
    full = os.path.abspath(path)
    parts = []
    for byte in full.encode("utf-8"):
        char = chr(byte)
        parts.append(char if char.isascii() and char.isalnum() else f"_{byte:02x}")
    return PREFIX + "".join(parts)


def path_of_module_name(name: str) -> str | None:
    """The file a :func:`module_name_of_path` name encodes (None for any other name)."""
    if not name.startswith(PREFIX) or "." in name:
        return None
    encoded = name[len(PREFIX):]
    try:
        raw = bytearray()
        i = 0
        while i < len(encoded):
            if encoded[i] == "_":
                raw.append(int(encoded[i + 1 : i + 3], 16))
                i += 3
            else:
                raw.append(ord(encoded[i]))
                i += 1
        return raw.decode("utf-8")
    except (ValueError, IndexError):
        return None


class _QuietLoader(importlib.machinery.SourceFileLoader):
    """Runs a target file with what its imports print and warn captured (libraries warn about
    optional accelerators they did not find; each worker process imports the file again): hidden
    when the import works, quoted in the error when it does not."""

    def exec_module(self, module: Any) -> None:
        printed = io.StringIO()
        with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
            warnings.simplefilter("always")
            try:
                super().exec_module(module)
            except Exception as err:
                noise = printed.getvalue() + "".join(f"{w.category.__name__}: {w.message}\n" for w in caught)
                if noise.strip():
                    err.add_note(f"while importing it printed:\n{noise.strip()}")
                raise


class _TargetFileFinder(importlib.abc.MetaPathFinder):
    """Imports a ``tpsim_target_...`` name from the file it encodes."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        file = path_of_module_name(fullname)
        if file is None or not os.path.isfile(file):
            return None
        return importlib.util.spec_from_file_location(fullname, file, loader=_QuietLoader(fullname, file))


def install_finder() -> None:
    """Put the finder on ``sys.meta_path`` (idempotent)."""
    if not any(isinstance(f, _TargetFileFinder) for f in sys.meta_path):
        sys.meta_path.append(_TargetFileFinder())


# --- importing the module part of a TARGET ----------------------------------------------------------

class TargetError(InvalidArgument):
    """A TARGET string cannot be imported or does not name something checkable."""


@contextlib.contextmanager
def _import_noise() -> Iterator[list[str]]:
    """Capture what importing a target prints and warns (libraries warn about optional accelerators
    they did not find, and every gloo worker imports the target again): hidden when the import
    works; the caller quotes it when it fails."""
    printed = io.StringIO()
    noise: list[str] = []
    with warnings.catch_warnings(record=True) as caught, contextlib.redirect_stdout(printed):
        warnings.simplefilter("always")
        try:
            yield noise
        finally:
            noise.extend([printed.getvalue()] + [f"{w.category.__name__}: {w.message}\n" for w in caught])


def is_target_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or "/" in spec


def import_target_file(path: str) -> ModuleType:
    full = os.path.abspath(path)
    if not os.path.isfile(full):
        raise TargetError(f"target file {path!r} does not exist")
    # Imported by its name, through the finder of tpsim._target_files (installed the first time a
    # target file is imported, here or in a worker process): the same name imports the same file in a
    # worker process (and importing it twice reuses the module).
    install_finder()
    mod_name = module_name_of_path(full)
    try:
        return importlib.import_module(mod_name)
    except Exception as err:
        sys.modules.pop(mod_name, None)
        notes = "".join(f"\n{n}" for n in getattr(err, "__notes__", ()))
        raise TargetError(f"importing {path!r} failed: {type(err).__name__}: {err}{notes}") from err


def _import_module_part(module_part: str) -> ModuleType:
    if is_target_path(module_part):
        return import_target_file(module_part)
    try:
        with _import_noise():
            return importlib.import_module(module_part)
    except ImportError as err:
        library = _library_of(module_part)
        if library is not None and not _installed(module_part.split(".")[0]):
            raise LibraryMissing(library, err) from err
        raise TargetError(f"cannot import module {module_part!r}: {err}") from err
    except Exception as err:
        raise TargetError(f"importing module {module_part!r} failed: {type(err).__name__}: {err}") from err


def import_target_module(module_part: str) -> ModuleType:
    """Import the module part of a TARGET (``package.module`` or ``path/to/file.py``), once per file:
    the families of :mod:`tpsim.props.family` resolve targets through it, so a file is imported once."""
    return _import_module_part(module_part)


def _library_of(module_part: str) -> Any:
    """The preset whose library ``module_part`` belongs to (same top-level package), or None."""
    root = module_part.split(".")[0]
    return next((p for p in presets() if any(t.split(".")[0] == root for t in p.targets)), None)


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False
