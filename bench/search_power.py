"""``python -m bench.search_power [--seeds N] [--examples N] [--mutants a,b,...] [--write]``: how many
examples the search needs to catch each catalogued mutant, over many seeds.

For every mutant of :data:`tpsim.mutants.CATALOG` and every seed, one search of up to ``--examples``
(100) examples that stops at the first failing example (``search(..., shrink=False)``: "caught" is
what a user sees, a FAIL instead of a PASS; the diagnosis of the shrunk case is what
tests/test_mutants.py checks). Prints one row per mutant: the median and the worst number of
examples to catch, and the seeds that missed it (none, when the table holds). ``--write`` stores the
rows in ``docs/search_power.json``, which ``python -m tools.docs`` renders into docs/bugs.md.
tests/test_search_power.py (thorough tier) asserts the same over 20 seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Where ``--write`` stores the table (rendered into docs/bugs.md by tools/docs).
JSON_PATH = os.path.join(ROOT, "docs", "search_power.json")
#: Examples each search may use: a mutant is caught at every seed within this budget.
BUDGET = 100
#: Seeds each mutant is searched at.
SEEDS = 20


def examples_to_catch(mutant: Any, seed: int, max_examples: int = BUDGET) -> int | None:
    """Examples the search (``seed``) checked up to and including the first failing one; None when
    the mutant passed ``max_examples`` examples."""
    from tpsim.props.search import search

    report = search(mutant.variant, max_examples=max_examples, seed=seed, shrink=False)
    if report.passed:
        return None
    return min(f.found_after or report.examples for f in report.failures)


def summarise(name: str, counts: list[int | None]) -> dict[str, Any]:
    """One table row: the median and the worst examples to catch, and the seeds that missed."""
    caught = [c for c in counts if c is not None]
    return {"mutant": name, "seeds": len(counts), "median": statistics.median(caught) if caught else None,
            "worst": max(caught) if caught else None, "missed": [s for s, c in enumerate(counts) if c is None]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.search_power", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=SEEDS)
    parser.add_argument("--examples", type=int, default=BUDGET)
    parser.add_argument("--mutants", default=None, help="comma-separated names (default: the whole catalog)")
    parser.add_argument("--write", action="store_true", help=f"store the rows in {os.path.relpath(JSON_PATH, ROOT)}")
    args = parser.parse_args(argv)
    from tpsim.mutants import CATALOG

    wanted = None if args.mutants is None else set(args.mutants.split(","))
    rows = []
    started = time.monotonic()
    for mutant in CATALOG:
        if wanted is not None and mutant.name not in wanted:
            continue
        counts = [examples_to_catch(mutant, seed, args.examples) for seed in range(args.seeds)]
        row = summarise(mutant.name, counts)
        rows.append(row)
        print(f"{row['mutant']:<44} median {row['median']!s:>5}  worst {row['worst']!s:>4}  missed {row['missed']}",
              flush=True)
    doc = {"seeds": args.seeds, "examples": args.examples, "seconds": round(time.monotonic() - started, 1),
           "command": "python -m bench.search_power --write", "rows": rows}
    if args.write:
        with open(JSON_PATH, "w", encoding="utf-8") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
    print(json.dumps(doc))
    return 1 if any(r["missed"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
