"""The console blocks of the README and docs, run as shown: each ``$`` command, its output compared.

A console block is a fenced ``console`` block whose lines starting with ``$ `` are commands and the
lines after each, its output. HTML comments right before the fence steer the run (they are
invisible on the rendered page):

- ``<!-- console: slow -->``: the block takes long (tests mark it ``slow``; every block's test is in
  the thorough tier, and a block that runs ``--backend gloo`` is marked ``gloo``);
- ``<!-- console-setup: COMMAND -->``: run COMMAND first, its output ignored (e.g. the check
  that writes the case file a block replays);
- ``<!-- console: skip REASON -->``: never run (e.g. a command that needs GPUs).

A fenced ``python`` block with ``title="NAME.py"`` is a file the page's commands use: it is
written into the workspace before any block runs.

Every block runs in a fresh temporary workspace holding a copy of ``examples/``, ``tests/wild/`` and those files,
commands in order through ``bash`` (``$?`` is the previous command's exit code), stdout and stderr
together. Output is compared modulo what varies from run to run (:func:`normalise`): durations,
the example counts of a failed search, temporary paths, the repository root. In the expected output a line ``...`` stands for any lines,
and a line ending in ``...`` for any line starting with what precedes it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

__all__ = ["Block", "blocks", "matches", "normalise", "run_block", "update_pages"]

#: Pages whose console blocks are run, relative to the repository root.
#: (docs/bugs.md shows docs/_found_in_libraries.md in a generated region: its blocks are run at their source,
#: and ``python -m tools.docs --examples`` copies the region again afterwards.)
PAGES = ("README.md", "docs/cli.md", "docs/_found_in_libraries.md", "docs/bugs.md", "docs/design.md", "docs/dtensor.md")
#: Seconds one command may take before the block fails.
COMMAND_TIMEOUT = 600

_FENCE = re.compile(r"^```(?P<info>[^\n]*)\n(?P<body>.*?)^```$", re.S | re.M)
_DIRECTIVE = re.compile(r"<!-- console(?P<kind>-setup)?: (?P<text>.*?) -->")
_TITLE = re.compile(r'title="(?P<name>[^"]+)"')


@dataclass
class Block:
    """One console block: where it is, its commands with their expected output, and directives."""

    page: str
    line: int
    commands: list[tuple[str, str]]
    setup: list[str] = field(default_factory=list)
    slow: bool = False
    skip: str | None = None
    files: dict[str, str] = field(default_factory=dict)
    span: tuple[int, int] = (0, 0)  # character offsets of the block's body in the page

    @property
    def id(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str, text: str) -> list[Block]:
    """The console blocks of one page (with the page's titled files attached to each)."""
    files = {}
    for m in _FENCE.finditer(text):
        title = _TITLE.search(m.group("info"))
        if m.group("info").startswith("python") and title:
            files[title.group("name")] = m.group("body")
    out = []
    for m in _FENCE.finditer(text):
        if m.group("info").strip() != "console" or _in_generated_region(text, m.start()):
            continue
        before = text[: m.start()].rstrip("\n").splitlines()
        directives = []
        while before and _DIRECTIVE.fullmatch(before[-1].strip()):
            directives.insert(0, _DIRECTIVE.fullmatch(before.pop().strip()))
        block = Block(page, text.count("\n", 0, m.start()) + 1, _commands(m.group("body")), files=dict(files),
                      span=(m.start("body"), m.end("body")))
        for d in directives:
            if d.group("kind"):
                block.setup.append(d.group("text"))
            elif d.group("text") == "slow":
                block.slow = True
            elif d.group("text").startswith("skip"):
                block.skip = d.group("text")[4:].strip() or "skipped"
        out.append(block)
    return out


def _in_generated_region(text: str, at: int) -> bool:
    """Whether offset ``at`` lies inside a generated region (a copy of another page's text)."""
    begin = text.rfind("<!-- BEGIN GENERATED", 0, at)
    return begin >= 0 and text.rfind("<!-- END GENERATED", begin, at) < 0


def _commands(body: str) -> list[tuple[str, str]]:
    commands: list[tuple[str, str]] = []
    for line in body.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], ""))
        elif commands:
            command, output = commands[-1]
            commands[-1] = (command, output + line + "\n")
    return commands


def normalise(text: str, *, workspace: str | None = None, root: str | None = None) -> str:
    """What may differ between two runs of the same command, made equal: durations (``3.1s``,
    ``(0.4s)``, ``12 s``), the example counts of a search that failed (:func:`_example_counts`),
    traceback line numbers and directories, the ``workspace`` and any other temporary directory
    (``<tmp>``), and the repository ``root`` (paths relative to it).

    Everything else is the output's substance and must match: verdicts, variants, diagnoses and
    their messages, minimal cases, case files, the lines themselves and their order."""
    if workspace:
        for path in dict.fromkeys((workspace, os.path.realpath(workspace))):
            text = text.replace(path, "<tmp>")
    if root:
        text = _relative(text, root)
    text = re.sub(r"/tmp/[^/\s'\":]+", "<tmp>", text)
    text = re.sub(r" *\b\d+(?:\.\d+)?(?: ?s)\b", " <T>s", text)
    # A traceback's line numbers move with every edit of the file they point into; the frames
    # (file and function) are what a reader follows.
    # The directory a frame's file lies in differs between checkouts and Python installations.
    text = re.sub(r'File "[^"]*?([^"/]+/[^"/]+)", line \d+', r'File ".../\1", line <N>', text)
    text = "\n".join(_example_counts(line) for line in text.splitlines())
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines())


#: ``17 examples`` (with the padding that right-aligns it in a column).
_EXAMPLES = re.compile(r" *\b\d+ examples\b")


def _example_counts(line: str) -> str:
    """``line`` with the example counts of a failed search as ``<N> examples``.

    After its first failure Hypothesis goes on generating for a while (how many examples depends
    on the machine's speed) and then shrinks (its steps change between its versions): a ``FAIL``
    line's count and the failure summary's total vary from run to run. A passing search
    runs exactly its budget, and the header states the budget: those counts are kept.
    """
    if line.startswith(("PASS ", "all properties hold:")) or not _EXAMPLES.search(line):
        return line
    return _EXAMPLES.sub(lambda m: m.group(0) if line[: m.start()].endswith(" up to") else " <N> examples", line)


def _relative(text: str, root: str) -> str:
    """``text`` with the repository ``root`` left out of its paths (``tpsim/variant.py``), so that a page
    reads the same from any checkout."""
    return text.replace(root.rstrip(os.sep) + os.sep, "").replace(root, ".")


def matches(expected: str, actual: str) -> bool:
    """``actual`` fits ``expected`` (both normalised), ``...`` lines and line ends as wildcards."""
    parts = []
    for line in expected.splitlines():
        if line.strip() == "...":
            parts.append(r"(?:[^\n]*\n)*?")
        elif line.endswith("..."):
            parts.append(re.escape(line[:-3].rstrip()) + r"[^\n]*\n")
        else:
            parts.append(re.escape(line) + r"\n")
    return re.fullmatch("".join(parts), actual + "\n" if actual else "") is not None


def _workspace(root: str, block: Block) -> str:
    where = tempfile.mkdtemp(prefix="tpsim-docs-")
    # examples/, and the fresh targets in the styles of real libraries the docs point at (tests/wild/).
    for sub in ("examples", os.path.join("tests", "wild")):
        if os.path.isdir(os.path.join(root, sub)):
            shutil.copytree(os.path.join(root, sub), os.path.join(where, sub), ignore=shutil.ignore_patterns("__pycache__"))
    for name, body in block.files.items():
        with open(os.path.join(where, name), "w", encoding="utf-8") as fh:
            fh.write(body)
    return where


def _run(command: str, cwd: str, last: int) -> tuple[int, str]:
    env = dict(os.environ)
    env.pop("COLUMNS", None)
    # `tpsim` (and `python`) are the ones installed beside the interpreter running this, as in an
    # activated venv: not whichever other installation comes first on PATH.
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    done = subprocess.run(["bash", "-c", f"(exit {last}); {command}"], cwd=cwd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=COMMAND_TIMEOUT)
    return done.returncode, done.stdout


def run_block(root: str, block: Block) -> list[tuple[str, str, str, str]]:
    """Run ``block``; ``[(command, expected, actual, workspace)]``, outputs raw."""
    where = _workspace(root, block)
    try:
        last = 0
        for command in block.setup:
            last, _ = _run(command, where, last)
        out = []
        for command, expected in block.commands:
            last, actual = _run(command, where, last)
            out.append((command, expected, actual, where))
        return out
    finally:
        shutil.rmtree(where, ignore_errors=True)


def _fits(root: str, expected: str, actual: str, where: str) -> bool:
    return matches(normalise(expected, workspace=where, root=root), normalise(actual, workspace=where, root=root))


def update_pages(root: str, *, check: bool = False) -> list[str]:
    """Run every console block of :data:`PAGES` (skipped ones aside); write the output of each
    command whose shown output no longer fits into its page (``check``: write nothing). Returns
    the pages that were (or would be) changed."""
    changed = []
    for page in PAGES:
        path = os.path.join(root, page)
        if not os.path.isfile(path):
            continue
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        new = text
        for block in reversed(blocks(page, text)):  # from the end: earlier spans stay valid
            if block.skip:
                continue
            results = run_block(root, block)
            if all(_fits(root, expected, actual, where) for _, expected, actual, where in results):
                continue
            body = "".join(f"$ {command}\n" + (expected if _fits(root, expected, actual, where)
                                                else _relative(actual.replace(where, "/tmp/tpsim-docs"), root))
                           for command, expected, actual, where in results)
            new = new[: block.span[0]] + body + new[block.span[1]:]
        if new != text:
            changed.append(page)
            if not check:
                with open(path, "w", encoding="utf-8") as fh:
                    fh.write(new)
                print(f"wrote the console output of {page}")
    return changed
