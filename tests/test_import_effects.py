"""Importing tpsim changes nothing outside tpsim; what a check needs is set up when it is needed.

``import tpsim`` leaves the import system, signal handlers, threads, the environment, warning filters
and torch's global settings as they were (checked in a fresh interpreter). The one piece of global
state a check needs — the finder that imports a target file by its ``tpsim_target_...`` name, in a
worker process too — is installed the first time a target file is imported, and is needed then.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SNAPSHOT = r"""
import json, os, signal, sys, threading, warnings
import torch
import torch.distributed as dist

def snapshot():
    return {
        "meta_path": [type(f).__name__ for f in sys.meta_path],
        "path_hooks": len(sys.path_hooks),
        "path": list(sys.path),
        "threads": threading.active_count(),
        "signals": {s.name: repr(signal.getsignal(s)) for s in
                    (signal.SIGINT, signal.SIGTERM, signal.SIGCHLD, signal.SIGUSR1, signal.SIGUSR2)},
        "environ": sorted(os.environ.items()),
        "warning_filters": len(warnings.filters),
        "excepthook": repr(sys.excepthook),
        "torch": [str(torch.get_default_dtype()), torch.get_num_threads(), torch.is_grad_enabled()],
        "backends": sorted(getattr(dist.Backend, "_plugins", {})),
    }

before = snapshot()
import tpsim
after = snapshot()
print(json.dumps({k: [before[k], after[k]] for k in before if before[k] != after[k]}))
"""

FINDER = r"""
import importlib, sys
import tpsim
from tpsim._target_files import module_name_of_path
from tpsim.target import import_target_module

first, second = sys.argv[1], sys.argv[2]
try:
    importlib.import_module(module_name_of_path(first))
    print("importable by name before any target file")
except ModuleNotFoundError:
    print("not importable by name before any target file")
import_target_module(first)
print("then by name:", importlib.import_module(module_name_of_path(second)).VALUE)
"""


def _run(code: str, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout


def test_importing_tpsim_changes_nothing_global() -> None:
    changed = json.loads(_run(SNAPSHOT).strip().splitlines()[-1])
    assert changed == {}


def test_the_target_file_finder_is_installed_when_a_target_file_is_imported(tmp_path: Path) -> None:
    first, second = tmp_path / "first.py", tmp_path / "second.py"
    first.write_text("VALUE = 1\n")
    second.write_text("VALUE = 2\n")
    out = _run(FINDER, str(first), str(second)).splitlines()
    # Not installed by the import of tpsim; installed (and needed: a worker process imports a target
    # file, a rank-local module or a class unpickled there, by this name) once a target file is imported.
    assert out == ["not importable by name before any target file", "then by name: 2"]
