"""The docs say what the code does: generated pages are current, every console block runs as shown,
and nothing cites a tracker a reader cannot see."""

from __future__ import annotations

import difflib
import pathlib
import re
import subprocess

import pytest

from tpsim.docs import generated
from tpsim.docs.examples import PAGES, blocks, matches, normalise, run_block
from tpsim.docs.regions import RegionError, fill

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("page", ["README.md", "docs/cli.md", "docs/bugs.md"])
def test_generated_regions_are_current(page: str) -> None:
    old, new = generated(str(ROOT))[page]
    diff = "".join(difflib.unified_diff(old.splitlines(True), new.splitlines(True), page, "generated"))
    assert old == new, f"{page} is stale; regenerate with: python -m tpsim.docs\n{diff}"


def test_every_generated_page_has_its_regions() -> None:
    # A page that lost its markers would pass the test above while nothing is generated in it.
    expected = {"README.md": ["diagnoses"], "docs/cli.md": ["cli-check-options", "cli-exit-codes", "cli-replay-options"],
                "docs/bugs.md": ["bugs-catch-table", "bugs-diagnoses", "bugs-found-in-libraries"]}
    from tpsim.docs.regions import region_names

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
    from tpsim.cli import build_parser
    from tpsim.docs.reference import _subparser

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


def test_there_are_console_blocks_to_run() -> None:
    assert len(BLOCKS) >= 8 and any(b.page == "README.md" for b in BLOCKS)


@pytest.mark.parametrize(
    "block",
    [pytest.param(b, marks=[pytest.mark.slow] if b.slow else [], id=b.id) for b in BLOCKS],
)
def test_console_block_runs_as_shown(block) -> None:
    if block.skip:
        pytest.skip(block.skip)
    for command, expected, actual, where in run_block(str(ROOT), block):
        want = normalise(expected, workspace=where, root=str(ROOT))
        got = normalise(actual, workspace=where, root=str(ROOT))
        assert matches(want, got), (
            f"{block.id}: `{command}` printed something else than the page shows "
            f"(regenerate with: python -m tpsim.docs --examples)\n"
            + "".join(difflib.unified_diff((want + "\n").splitlines(True), (got + "\n").splitlines(True),
                                           "shown", "printed"))
        )


# --- honest references --------------------------------------------------------------------------


def _tracked_text_files() -> list[pathlib.Path]:
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, text=True, check=True).stdout.splitlines()
    suffixes = {".py", ".md", ".toml", ".ini", ".txt", ".cfg", ""}
    return [ROOT / p for p in listed if pathlib.Path(p).suffix in suffixes and (ROOT / p).is_file()]


def test_nothing_cites_the_internal_tracker() -> None:
    # A reader cannot see the project's own tracker: a bare tracker number tells them nothing.
    # Public upstream reports ("Megatron-LM #7452") are fine: they name the project.
    pattern = re.compile(r"\b[Ii]ssues? #?\d+|\([Ii]ssue #?\d+")
    offenders = []
    for path in _tracked_text_files():
        if path.name == "test_docs.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if pattern.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)
