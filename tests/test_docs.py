"""The docs say what the code does: generated pages are current, every console block runs as shown,
and nothing cites a tracker a reader cannot see."""

from __future__ import annotations

import difflib
import pathlib
import re
import subprocess

import pytest
from helpers import tracked_files

from tools.docs import generated
from tools.docs.examples import PAGES, blocks, matches, normalise, run_block
from tools.docs.regions import RegionError, fill

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("page", ["README.md", "docs/cli.md", "docs/bugs.md"])
def test_generated_regions_are_current(page: str) -> None:
    old, new = generated(str(ROOT))[page]
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), page, "generated"))
    assert old == new, f"{page} is stale; regenerate with: python -m tools.docs\n{diff}"


def test_every_generated_page_has_its_regions() -> None:
    # A page that lost its markers would pass the test above while nothing is generated in it.
    expected = {"README.md": ["diagnoses"], "docs/cli.md": ["cli-check-options", "cli-exit-codes", "cli-replay-options"],
                "docs/bugs.md": ["bugs-catch-table", "bugs-search-power", "bugs-diagnoses", "bugs-claims",
                                 "bugs-found-in-libraries"]}
    from tools.docs.regions import region_names

    for page, names in expected.items():
        assert region_names((ROOT / page).read_text()) == names, page


def test_regions_refuse_unknown_and_unclosed_markers() -> None:
    with pytest.raises(RegionError, match="no renderer for the generated region 'x'"):
        fill("<!-- BEGIN GENERATED x -->\nold\n<!-- END GENERATED x -->\n", {})
    with pytest.raises(RegionError, match="has no matching"):
        fill("<!-- BEGIN GENERATED x -->\nold\n", {"x": lambda: "new"})
    assert fill("a\n<!-- BEGIN GENERATED x -->\nold\n<!-- END GENERATED x -->\nb\n", {"x": lambda: "new"}) == (
        "a\n<!-- BEGIN GENERATED x -->\nnew\n<!-- END GENERATED x -->\nb\n")


def test_the_catch_table_lists_every_mutant_once() -> None:
    from tpsim.mutants import CATALOG

    text = (ROOT / "docs" / "bugs.md").read_text()
    rows = [line for line in text.splitlines() if line.startswith("| `") and "`" in line[3:]]
    for m in CATALOG:
        assert sum(1 for row in rows if row.startswith(f"| `{m.name}` |")) == 1, m.name
    assert "## Found in released libraries" in text


def test_cli_reference_tables_name_every_option() -> None:
    from tools.docs.reference import _subparser
    from tpsim.cli import build_parser

    text = (ROOT / "docs" / "cli.md").read_text()
    for command in ("check", "replay"):
        for action in _subparser(build_parser(), command)._actions:
            for option in action.option_strings:
                assert f"`{option}`" in text, (command, option)


# --- console blocks ------------------------------------------------------------------------------


def _all_blocks():
    out = []
    for page in PAGES:
        path = ROOT / page
        if path.is_file():
            out += [b for b in blocks(page, path.read_text()) if b.commands]
    return out


BLOCKS = _all_blocks()


def test_normalise_and_match() -> None:
    assert normalise("PASS x   100 examples     2.8s\nFAIL (3.5s) total 859 s") == \
        "PASS x   100 examples <T>s\nFAIL ( <T>s) total <T>s"
    assert normalise('"cwd": "/tmp/tmp5kv4lokz",') == '"cwd": "<tmp>",'
    assert matches("a\n...\nd", "a\nb\nc\nd") and matches("PASS x ...", "PASS x 100 examples")
    assert not matches("a\nd", "a\nb\nd") and not matches("PASS y ...", "PASS x 1")


def _shown_failure() -> str:
    """A failing search's output as a page shows it (a FAIL line, a diagnosis, a minimal case, the summary)."""
    for block in BLOCKS:
        for _, expected in block.commands:
            if "\nFAIL " in expected and "minimal case:" in expected and "\nPASS " in "\n" + expected:
                return expected
    raise AssertionError("no console block shows a failing search beside a passing one")


def test_normalising_keeps_the_substance() -> None:
    # What legitimately varies (a failed search's example counts, timings) is made equal; a changed
    # verdict, diagnosis, minimal case, budget or line is not.
    shown = _shown_failure()
    want = normalise(shown)

    def fits(text: str) -> bool:
        return matches(want, normalise(text))

    fail = next(line for line in shown.splitlines() if line.startswith("FAIL "))
    summary = next(line for line in shown.splitlines() if "cause" in line and "of failure" in line)
    slower = re.sub(r"\b\d+ examples +\d+\.\ds", "9999 examples  123.4s", fail)
    assert slower != fail
    varied = shown.replace(fail, slower).replace(summary, re.sub(r"\(\d+ examples, [\d.]+s\)", "(9 examples, 0.1s)",
                                                                     summary))
    assert varied != shown and fits(varied)
    assert fits(shown)

    diagnosis = re.search(r"  FAILED [\w-]+: (?:[\w.]+: )?([\w-]+)", shown).group(1)
    case = re.search(r"minimal case: world_size=(\d+)", shown)
    passed = next(line for line in shown.splitlines() if line.startswith("PASS "))
    changed = {
        "verdict": shown.replace(fail, "PASS" + fail[4:]),
        "diagnosis": shown.replace(f": {diagnosis}\n", ": missing-all-reduce\n"),
        "minimal case": shown.replace(case.group(0), f"minimal case: world_size={int(case.group(1)) + 1}"),
        "a passing search's count": shown.replace(passed, re.sub(r"\b(\d+) examples", lambda m: f"{int(m.group(1)) - 1} examples",
                                                                 passed, count=1)),
        "the budget": re.sub(r"up to (\d+) examples", lambda m: f"up to {int(m.group(1)) + 1} examples", shown),
        "a line dropped": "\n".join(line for line in shown.splitlines() if not line.startswith("    minimal case:")),
        "a line added": shown.rstrip("\n") + "\nFAIL AnotherVariant    3 examples     0.1s\n",
        "the cause count": shown.replace(summary, summary.replace("1 cause of failure", "2 causes of failure", 1)
                                         if "1 cause of failure" in summary else "0" + summary),
    }
    for what, text in changed.items():
        assert text != shown, what
        assert not fits(text), f"normalising hid a changed {what}"


def test_there_are_console_blocks_to_run() -> None:
    assert len(BLOCKS) >= 8 and any(b.page == "README.md" for b in BLOCKS)


def _marks(block) -> list[pytest.MarkDecorator]:
    """``slow`` as the page says; ``gloo`` when a command (or the setup) runs on real gloo."""
    commands = [command for command, _ in block.commands] + block.setup
    return ([pytest.mark.slow] if block.slow else []) + (
        [pytest.mark.gloo] if any(re.search(r"--backend[ =]gloo\b", c) for c in commands) else [])


@pytest.mark.thorough  # each block runs real commands (seconds to minutes): the thorough tier
@pytest.mark.parametrize("block", [pytest.param(b, marks=_marks(b), id=b.id) for b in BLOCKS])
def test_console_block_runs_as_shown(block) -> None:
    if block.skip:
        pytest.skip(block.skip)
    for command, expected, actual, where in run_block(str(ROOT), block):
        want = normalise(expected, workspace=where, root=str(ROOT))
        got = normalise(actual, workspace=where, root=str(ROOT))
        assert matches(want, got), (
            f"{block.id}: `{command}` printed something else than the page shows "
            f"(regenerate with: python -m tools.docs --examples)\n"
            + "".join(difflib.unified_diff((want + "\n").splitlines(True), (got + "\n").splitlines(True),
                                           "shown", "printed"))
        )


# --- honest references --------------------------------------------------------------------------


def _tracked_text_files(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    suffixes = {".py", ".md", ".toml", ".ini", ".txt", ".cfg", ""}
    return [p for p in tracked_files(root) if p.suffix in suffixes]


_TRACKER = re.compile(r"\b[Ii]ssues? #?\d+|\([Ii]ssue #?\d+")


def _tracker_citations(root: pathlib.Path = ROOT) -> list[str]:
    offenders = []
    for path in _tracked_text_files(root):
        if path.name == "test_docs.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if _TRACKER.search(line):
                offenders.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    return offenders


def test_nothing_cites_the_internal_tracker() -> None:
    # A reader cannot see the project's own tracker: a bare tracker number tells them nothing.
    # Public upstream reports ("Megatron-LM #7452") are fine: they name the project.
    offenders = _tracker_citations()
    assert not offenders, "\n".join(offenders)


def test_only_tracked_files_are_read(tmp_path: pathlib.Path) -> None:
    # A venv made inside the checkout (`python -m venv venv`, `.venv`) is full of third-party text
    # that cites its own trackers: the project's checks read what git tracks, nothing else.
    def git(*argv: str) -> None:
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *argv], cwd=tmp_path, check=True,
                       capture_output=True)

    citing = "# fixed upstream, " + "issue" + " #9\n"  # composed, so that this file cites nothing itself
    git("init", "-q")
    (tmp_path / "README.md").write_text("ours\n")
    (tmp_path / "tracked.py").write_text(citing)
    git("add", "README.md", "tracked.py")
    git("commit", "-q", "-m", "ours")
    for venv in ("venv", ".venv"):
        (tmp_path / venv / "lib").mkdir(parents=True)
        (tmp_path / venv / "lib" / "third_party.py").write_text(citing)
    (tmp_path / "notes.md").write_text(citing)
    assert _tracked_text_files(tmp_path) == [tmp_path / "README.md", tmp_path / "tracked.py"]
    assert _tracker_citations(tmp_path) == ["tracked.py:1: " + citing.strip()]  # the check still bites


# --- environment knobs ----------------------------------------------------------------------------


def _environment_reads() -> dict[str, str]:
    """``{variable: where}`` for every environment variable tpsim/ reads by a name it spells out:
    ``os.environ.get(NAME)``, ``os.environ[NAME]``, ``os.getenv(NAME)`` or a helper whose name says
    env (``_env_count(NAME, ...)``), NAME a string or a module-level string constant."""
    import ast

    found: dict[str, str] = {}
    for path in sorted((ROOT / "tpsim").rglob("*.py")):
        tree = ast.parse(path.read_text())
        constants = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
                     and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                     for t in node.targets if isinstance(t, ast.Name)}

        def name_of(arg: ast.expr, constants: dict[str, str] = constants) -> str | None:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                return arg.value
            return constants.get(arg.id) if isinstance(arg, ast.Name) else None

        for node in ast.walk(tree):
            arg = None
            if isinstance(node, ast.Call) and node.args:
                func = node.func
                called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
                receiver = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                if (called == "get" and receiver.endswith("environ")) or called == "getenv" or "env" in called.lower():
                    arg = node.args[0]
            elif isinstance(node, ast.Subscript) and ast.unparse(node.value).endswith("environ"):
                arg = node.slice
            name = name_of(arg) if arg is not None else None
            if name and re.fullmatch(r"[A-Z][A-Z0-9_]+", name):
                found.setdefault(name, f"{path.relative_to(ROOT)}:{node.lineno}")
    return found


def test_every_environment_variable_is_documented() -> None:
    reads = _environment_reads()
    # The scanner itself can fail: the knobs known today are among what it finds.
    assert {"TPSIM_CHECKSUM", "TPSIM_MAX_WORLD_SIZE", "TPSIM_WORKER_MEMORY", "TPSIM_VERIFY_COLLECTIVES",
            "TPSIM_MAX_POOLS", "TPSIM_INPROC_PIN", "TPSIM_THOROUGH", "PYTEST_XDIST_WORKER"} <= set(reads), reads
    text = (ROOT / "docs" / "cli.md").read_text()
    section = text[text.index("## Environment variables"):]
    section = section[: section.index("\n## ", 1)]
    missing = {name: where for name, where in reads.items() if f"`{name}`" not in section}
    assert not missing, f"docs/cli.md's Environment variables section does not document {missing}"
