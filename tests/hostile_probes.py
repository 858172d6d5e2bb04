"""Hostile targets: layer modules that do what a checker must survive, and how to run them.

Each :class:`Probe` is a target file (written to a temporary directory) and the ``tpsim`` command
that checks it. :func:`run_probe` runs ``python -m tpsim ...`` as a subprocess with a marker in its
environment, so every process it started (forks, grandchildren, processes that left its process
group) can be found afterwards by that marker: those still alive are the orphans.

Used by tests/test_hostile.py and by ``python tests/hostile_probes.py`` (the probe table).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import hostile_imports  # noqa: E402 - beside this file

__all__ = ["PROBES", "Probe", "ProbeRun", "kill_marked", "marked_pids", "run_probe"]

#: Fast search settings: one or two small worlds, float64 only.
FAST = ["--world-sizes", "1,2", "--dtypes", "float64", "--seed", "0"]

_GOOD = "from tpsim.mutants.row import CorrectRow as Row\n"
#: A layer whose forward always raises: a failure (diagnosis ``exception``) on the first example.
_BAD = _GOOD + """
class Bad(Row):
    def forward(self, x):
        raise ValueError("the layer is broken")
"""
_ROW = ["--kind", "row", "--output", "reduced"]


@dataclass(frozen=True)
class Probe:
    """A target file's source, the target (``{file}`` is its path) and the extra command-line flags."""

    name: str
    source: str
    target: str = "{file}:Row"
    args: tuple[str, ...] = ()
    backend: str = "inproc"
    stdin: str | None = None
    shell_suffix: str = ""  # e.g. "| head -c 10": run through sh with this after the command
    max_examples: int = 5
    extra_files: dict[str, str] = field(default_factory=dict)


PROBES: dict[str, Probe] = {p.name: p for p in [
    Probe("system-exit-0-at-import", _GOOD + "raise SystemExit(0)\n", args=tuple(_ROW)),
    Probe("os-exit-0-at-import", _GOOD + "import os\nos._exit(0)\n", args=tuple(_ROW)),
    Probe("sys-exit-1-at-import", _GOOD + "import sys\nsys.exit(1)\n", args=tuple(_ROW)),
    Probe("keyboard-interrupt-at-import", _GOOD + "raise KeyboardInterrupt\n", args=tuple(_ROW)),
    Probe("atexit-os-exit-0-after-fail", _BAD + "import atexit, os\natexit.register(lambda: os._exit(0))\n",
          target="{file}:Bad", args=tuple(_ROW)),
    Probe("non-daemon-thread-at-import",
          _GOOD + "import threading, time\nthreading.Thread(target=time.sleep, args=(3600,)).start()\n",
          args=tuple(_ROW)),
    Probe("chdir-at-import", _BAD + "import os, tempfile\nos.chdir(tempfile.mkdtemp())\n", target="{file}:Bad",
          args=tuple(_ROW)),
    Probe("stdout-replaced-at-import", _BAD + "import sys, io\nsys.stdout = io.StringIO()\nsys.stderr = io.StringIO()\n",
          target="{file}:Bad", args=tuple(_ROW)),
    Probe("signal-handlers-at-import",
          _GOOD + "import signal, os\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
          "signal.signal(signal.SIGINT, signal.SIG_IGN)\nsignal.signal(signal.SIGCHLD, signal.SIG_IGN)\n",
          args=tuple(_ROW)),
    Probe("env-vars-at-import", _GOOD + "import os\nos.environ['TPSIM_PROBE_EXTRA'] = '1'\n"
          "os.environ['RANK'] = '3'\nos.environ['WORLD_SIZE'] = '7'\n", args=tuple(_ROW)),
    Probe("fork-child-in-forward", _GOOD + """
import os, time
class Forks(Row):
    def forward(self, x):
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
        return super().forward(x)
""", target="{file}:Forks", args=tuple(_ROW)),
    Probe("fork-child-in-forward-gloo", _GOOD + """
import os, time
class Forks(Row):
    def forward(self, x):
        if os.fork() == 0:
            time.sleep(3600)
            os._exit(0)
        return super().forward(x)
""", target="{file}:Forks", args=tuple(_ROW), backend="gloo", max_examples=3),
    Probe("setsid-grandchild-in-forward", _GOOD + """
import os, time
class Escapes(Row):
    def forward(self, x):
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                time.sleep(3600)
            os._exit(0)
        return super().forward(x)
""", target="{file}:Escapes", args=tuple(_ROW)),
    Probe("recursion-limit-in-forward", _GOOD + """
import sys
class Deep(Row):
    def forward(self, x):
        sys.setrecursionlimit(50)
        return super().forward(x)
""", target="{file}:Deep", args=tuple(_ROW)),
    Probe("unprintable-exception", _GOOD + """
class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")
    def __repr__(self):
        raise RuntimeError("no repr for you")
class Hostile(Row):
    def forward(self, x):
        raise Unprintable()
""", target="{file}:Hostile", args=tuple(_ROW)),
    Probe("unprintable-exception-no-isolate", _GOOD + """
class Unprintable(Exception):
    def __str__(self):
        raise RuntimeError("no str for you")
    def __repr__(self):
        raise RuntimeError("no repr for you")
class Hostile(Row):
    def forward(self, x):
        raise Unprintable()
""", target="{file}:Hostile", args=(*_ROW, "--no-isolate")),
    Probe("metaclass-raises-on-mro", """
from torch import nn
class Meta(type(nn.Module)):
    def __getattribute__(cls, name):
        if name in ("__mro__", "__bases__"):
            raise RuntimeError("no mro for you")
        return super().__getattribute__(name)
class Weird(nn.Module, metaclass=Meta):
    def __init__(self, in_features, out_features, bias, master_weight):
        super().__init__()
""", target="{file}:Weird"),
    Probe("huge-exception-message", _GOOD + """
class Huge(Row):
    def forward(self, x):
        raise ValueError("spam " * (1 << 21))
""", target="{file}:Huge", args=tuple(_ROW)),
    Probe("refused-variant-among-others", """
from tpsim.builtin_variants import _row
from tpsim.mutants.vocab import cross_entropy_gathered_logits
from tpsim.variant import Variant
from tpsim.vocab_variant import CrossEntropyVariant

def _raises(*args, **kwargs):
    raise ValueError("the layer is broken")

TPSIM_VARIANTS = [Variant(name="Buggy", kind="row", build=_raises, input="sharded", output="reduced")]
TPSIM_VOCAB = [CrossEntropyVariant(name="Refused", fn=cross_entropy_gathered_logits, dtypes=("bfloat16",))]
""", target="{file}", args=("--report", "json")),
    Probe("os-exit-in-forward-no-isolate", _GOOD + """
import os
class Exits(Row):
    def forward(self, x):
        os._exit(0)
""", target="{file}:Exits", args=(*_ROW, "--no-isolate", "--report", "json")),
    Probe("stdout-head-c-10", _BAD, target="{file}:Bad", args=tuple(_ROW), shell_suffix="| head -c 10"),
    Probe("stdout-dev-full", _BAD, target="{file}:Bad", args=tuple(_ROW), shell_suffix="> /dev/full"),
    Probe("stdout-closed", _BAD, target="{file}:Bad", args=tuple(_ROW), shell_suffix=">&-"),
    # tests/hostile_imports.py's targets, their buggy twins (tests/test_hostile_imports.py runs them all)
    Probe("daemon-thread-at-import-buggy", hostile_imports.THREAD["daemon"], target="{file}:Twice", args=tuple(_ROW)),
    Probe("daemon-thread-at-import-buggy-gloo", hostile_imports.THREAD["daemon"], target="{file}:Twice",
          args=tuple(_ROW), backend="gloo", max_examples=3),
    Probe("launcher-env-at-import-gloo", hostile_imports.LAUNCHER_ENV, args=tuple(_ROW), backend="gloo",
          max_examples=3),
    Probe("metaclass-dict-raises", hostile_imports.INTROSPECTION["metaclass-dict-raises"][0], args=tuple(_ROW)),
    Probe("lru-cache-workspace", hostile_imports.CACHES["lru-cache-workspace"][0], args=tuple(_ROW)),
    Probe("cache-in-a-default-argument", hostile_imports.CACHE_IN_A_DEFAULT, args=tuple(_ROW)),
]}


@dataclass
class ProbeRun:
    probe: str
    code: int
    out: str
    err: str
    orphans: list[int]
    cwd: Path
    file: Path
    cases: list[Path]


def marked_pids(marker: str) -> list[int]:
    """Live processes whose environment holds ``TPSIM_PROBE_MARK=marker`` (not zombies)."""
    found = []
    needle = f"TPSIM_PROBE_MARK={marker}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as fh:
                env = fh.read()
            with open(f"/proc/{entry}/stat", encoding="ascii", errors="replace") as fh:
                state = fh.read().rpartition(")")[2].split()[0]
        except OSError:
            continue
        if needle in env.split(b"\0") and state != "Z":
            found.append(int(entry))
    return found


def kill_marked(marker: str) -> None:
    for pid in marked_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_probe(probe: Probe, tmp: Path, *, timeout: float = 240.0, python: str = sys.executable,
              settle: float = 1.0) -> ProbeRun:
    """Run ``python -m tpsim check`` on ``probe`` in ``tmp``; the orphans are counted ``settle`` seconds
    after it exits, then killed."""
    cwd = tmp / "work"
    cwd.mkdir(parents=True, exist_ok=True)
    file = cwd / "layer.py"
    file.write_text(probe.source)
    for name, text in probe.extra_files.items():
        (cwd / name).write_text(text)
    marker = uuid.uuid4().hex
    env = dict(os.environ, TPSIM_PROBE_MARK=marker, PYTHONUNBUFFERED="")
    env.pop("PYTHONUNBUFFERED")
    argv = [python, "-m", "tpsim", "check", probe.target.format(file="layer.py"), *FAST, "--max-examples",
            str(probe.max_examples), "--backend", probe.backend, *probe.args]
    try:
        if probe.shell_suffix:
            import shlex

            command = " ".join(shlex.quote(a) for a in argv) + " " + probe.shell_suffix + "; echo \"rc=${PIPESTATUS[0]}\" >&2"
            proc = subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True,
                                  timeout=timeout)
            rc_line = [ln for ln in proc.stderr.splitlines() if ln.startswith("rc=")]
            code = int(rc_line[-1][3:]) if rc_line else proc.returncode
            err = "\n".join(ln for ln in proc.stderr.splitlines() if not ln.startswith("rc="))
            out = proc.stdout
        else:
            proc = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
            code, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        code = -1
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = "TIMEOUT\n" + (exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
    time.sleep(settle)
    orphans = marked_pids(marker)
    kill_marked(marker)
    cases = sorted(cwd.glob(".tpsim/cases/*.json"))
    return ProbeRun(probe.name, code, out, err, orphans, cwd, file, cases)


def _summary(text: str, limit: int = 90) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    keep = [ln for ln in lines if ln.startswith(("FAIL", "PASS", "tpsim", "all properties", "FAILED"))] or lines[-1:]
    joined = " / ".join(keep[:3])
    return (joined[:limit] + "...") if len(joined) > limit else joined


if __name__ == "__main__":
    import tempfile

    names = sys.argv[1:] or list(PROBES)
    rows = []
    for name in names:
        with tempfile.TemporaryDirectory() as tmp:
            run = run_probe(PROBES[name], Path(tmp))
            printed = _summary(run.out + "\n" + run.err)
            rows.append((name, run.code, len(run.orphans), len(run.cases), printed))
            print(json.dumps({"probe": name, "rc": run.code, "orphans": len(run.orphans), "cases": len(run.cases),
                              "printed": printed}), flush=True)
