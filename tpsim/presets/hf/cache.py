"""Discoveries kept on disk: a check's every worker resolves a family's variants from the same one.

A check resolves its target in several processes (the worker that describes it, the forker (tpsim.comm.forker), the
reference and rank workers); the discovery of a config class (:mod:`tpsim.presets.hf.discovery`) builds
and runs its tiny model several times, so each process would repeat seconds of work, and all must
find the same modules. The first process to describe a config class writes the result to
``$TPSIM_CACHE_DIR/hf`` (default ``~/.cache/tpsim/hf``; an empty ``TPSIM_CACHE_DIR`` turns the cache
off), and the others read it. The file's key is every input of the discovery: the transformers
version, the files that define the config class and its modeling code (path, size and modification
time: a patched installation is a new key), and tpsim's own discovery code (the hash of its source),
so a stale entry is never read: it is simply not found.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import sys
import tempfile
from collections.abc import Callable
from typing import Any

__all__ = ["cache_dir", "cached"]


def cache_dir() -> str | None:
    """Where discoveries are kept (None: nowhere)."""
    root = os.environ.get("TPSIM_CACHE_DIR")
    if root == "":
        return None
    return os.path.join(root or os.path.join(os.path.expanduser("~"), ".cache", "tpsim"), "hf")


def _file_stamp(module_name: str) -> str:
    module = sys.modules.get(module_name)
    path = getattr(module, "__file__", None)
    if not path:
        return module_name
    try:
        st = os.stat(path)
    except OSError:
        return path
    return f"{path}:{st.st_size}:{st.st_mtime_ns}"


def _own_source() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha256()
    for name in sorted(os.listdir(here)):
        if name.endswith(".py"):
            with open(os.path.join(here, name), "rb") as f:
                digest.update(name.encode() + f.read())
    return digest.hexdigest()


def _key(config_cls: type) -> str:
    import transformers

    from tpsim.presets.hf.configs import model_class

    model = model_class(config_cls)
    parts = [transformers.__version__, config_cls.__module__, config_cls.__qualname__, _file_stamp(config_cls.__module__),
             _own_source()]
    if model is not None:
        parts += [model.__module__, model.__qualname__, _file_stamp(model.__module__)]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:24]


def cached(config_cls: type, describe: Callable[[type], Any]) -> Any:
    """``describe(config_cls)``, read from the cache when it holds it, else computed and written."""
    root = cache_dir()
    if root is None:
        return describe(config_cls)
    path = os.path.join(root, f"{config_cls.__qualname__}-{_key(config_cls)}.pickle")
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, ImportError):
        pass
    found = describe(config_cls)
    try:
        os.makedirs(root, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=root, suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            pickle.dump(found, f)
        os.replace(tmp, path)  # atomic: a reader sees the whole file or none
    except OSError:
        pass  # a cache that cannot be written is only slower
    return found
