"""The project's generated documentation: ``python -m tools.docs`` regenerates it, ``--check`` compares.

What is generated, and from what:

- ``docs/cli.md``: the option tables and exit codes, from the ``tpsim`` argument parser;
- ``docs/bugs.md``: the catch table (the mutant catalog, with timings from ``docs/bench.json``),
  the diagnoses with their evidence (the diagnosis registry), and the "Found in released
  libraries" section (``docs/_found_in_libraries.md``, written by hand);
- ``README.md``: the diagnoses table (the registry);
- with ``--bench``: ``docs/bench.md``, its plots and the README's Performance section, re-rendered
  from ``docs/bench.json`` by ``python -m bench --render`` (nothing is measured again);
- with ``--examples``: the output shown under every ``$`` command of the console blocks of the
  README and docs, by running the commands (:mod:`tools.docs.examples`).

Hand-written prose stays hand-written: only the generated regions (:mod:`tools.docs.regions`) of
a page are replaced. ``python -m tools.docs --bench --examples`` regenerates everything at once.

This is repository tooling, not part of the installed ``tpsim`` package: run it from a checkout's root.
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys
from collections.abc import Callable

from tools.docs import reference
from tools.docs.regions import fill

__all__ = ["generated", "main"]

#: The hand-written file docs/bugs.md includes as its "Found in released libraries" section.
FOUND_IN_LIBRARIES = os.path.join("docs", "_found_in_libraries.md")


def renderers(root: str) -> dict[str, Callable[[], str]]:
    """Every generated region's renderer, by region name."""
    return {
        "cli-check-options": lambda: reference.cli_options("check"),
        "cli-replay-options": lambda: reference.cli_options("replay"),
        "cli-exit-codes": reference.cli_exit_codes,
        "diagnoses": reference.diagnoses_table,
        "bugs-catch-table": lambda: reference.catch_table(os.path.join(root, "docs", "bench.json")),
        "bugs-search-power": lambda: reference.search_power_table(os.path.join(root, "docs", "search_power.json")),
        "bugs-diagnoses": reference.diagnoses_evidence,
        "bugs-claims": reference.diagnoses_claims,
        "bugs-found-in-libraries": lambda: reference.found_in_libraries(os.path.join(root, FOUND_IN_LIBRARIES)),
    }


#: The pages with generated regions, relative to the repository root.
PAGES = ("README.md", os.path.join("docs", "cli.md"), os.path.join("docs", "bugs.md"))


def generated(root: str) -> dict[str, tuple[str, str]]:
    """``{page: (committed text, generated text)}`` for every page of :data:`PAGES` under ``root``."""
    found = renderers(root)
    out = {}
    for page in PAGES:
        path = os.path.join(root, page)
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
        out[page] = (text, fill(text, found, where=page))
    return out


def _root() -> str:
    # The repository this tooling lies in (tools/docs/ is not installed: it runs from a checkout).
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs", description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="the repository root (default: the checkout this tooling lies in)")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 and show the difference when "
                        "the committed pages differ from the generated ones")
    parser.add_argument("--bench", action="store_true", help="also re-render docs/bench.md, the plots and the "
                        "README's Performance section from docs/bench.json (python -m bench --render)")
    parser.add_argument("--examples", action="store_true", help="also run every console block's commands and "
                        "write their output into the pages (minutes)")
    args = parser.parse_args(argv)
    root = os.path.abspath(args.root or _root())
    stale = []
    for page, (old, new) in generated(root).items():
        if old == new:
            continue
        stale.append(page)
        if args.check:
            sys.stdout.writelines(difflib.unified_diff(old.splitlines(True), new.splitlines(True), page, page + " (generated)"))
        else:
            with open(os.path.join(root, page), "w", encoding="utf-8") as fh:
                fh.write(new)
            print(f"wrote {page}")
    if args.bench and not args.check:
        subprocess.run([sys.executable, "-m", "bench", "--render"], cwd=root, check=True)
    if args.examples:
        from tools.docs.examples import update_pages

        stale += update_pages(root, check=args.check)
        if not args.check:  # the regions that copy a page whose console output was just written
            for page, (old, new) in generated(root).items():
                if old != new:
                    with open(os.path.join(root, page), "w", encoding="utf-8") as fh:
                        fh.write(new)
                    print(f"wrote {page}")
    if args.check and stale:
        print(f"\nstale: {', '.join(stale)}; regenerate with: python -m tools.docs", file=sys.stderr)
        return 1
    return 0
