"""``python -m bench.compare OTHER [--rounds R] [--examples N] [--targets T,...] [--search]``: property
examples per second of this checkout beside another one (e.g. the commit a change started from, unpacked with
``git archive BASE | tar -x -C OTHER``), measured side by side so both see the same machine load.

Each round runs :mod:`bench.props` (plain inproc and isolated, fresh processes) once per checkout and
target, alternating which checkout goes first; the fastest round of each is kept (a busy machine
only ever slows a round down). ``--search``: whole searches instead, ``tpsim check TARGET --seed S
--max-examples N --no-isolate`` (each checkout drawing its own cases: what a change to the strategies
or the search costs), examples/s being the report's examples over its seconds; ``--seeds`` (default 0)
are summed per round. Prints one line per target and checkout and the change in examples/s
(negative: this checkout is slower), then one JSON line with every number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGETS = ("tpsim.layers:ColumnParallelLinear", "tpsim.layers:RowParallelLinear")


def _props(root: str, target: str, examples: int, sizes: str) -> dict[str, Any]:
    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=root)
    done = subprocess.run([sys.executable, "-m", "bench.props", "inproc", str(examples), sizes, target], cwd=root,
                          env=env, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"bench.props in {root} exited {done.returncode}:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _search(root: str, target: str, examples: int, sizes: str, seeds: str) -> float:
    """Seconds per example of whole searches (``tpsim check``, not isolated) in ``root``, summed over ``seeds``."""
    import tempfile

    env = dict(os.environ, PYTHONWARNINGS="ignore", PYTHONPATH=root)
    total_s, total_n = 0.0, 0
    with tempfile.TemporaryDirectory(prefix="tpsim-compare-") as cases:
        for seed in seeds.split(","):
            done = subprocess.run([sys.executable, "-m", "tpsim", "check", target, "--seed", seed, "--max-examples",
                                   str(examples), "--world-sizes", sizes, "--no-isolate", "--report", "json",
                                   "--cases-dir", cases], cwd=root, env=env, capture_output=True, text=True,
                                  timeout=1800)
            doc = json.loads(done.stdout)
            total_s += doc["seconds"]
            total_n += doc["examples"]
    return total_s / total_n


def _per_example(result: dict[str, Any]) -> tuple[float, float]:
    """(plain inproc, isolated) seconds per example: each case's fastest of the worker's rounds."""
    iso = result.get("also", {}).get("inproc isolated", {})
    return (result.get("fastest_per_example_s") or result["per_example_s"],
            iso.get("fastest_per_example_s") or iso.get("per_example_s"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.splitlines()[0])
    parser.add_argument("other", help="the other checkout's root (its bench/ and tpsim/ are used for it)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--examples", type=int, default=30)
    parser.add_argument("--sizes", default="1,2,3,4")
    parser.add_argument("--targets", default=",".join(TARGETS))
    parser.add_argument("--search", action="store_true", help="whole searches (tpsim check) instead of fixed cases")
    parser.add_argument("--seeds", default="0", help="with --search: the seeds searched each round (S,S,...)")
    args = parser.parse_args(argv)
    roots = {"this": HERE, "other": os.path.abspath(args.other)}
    best: dict[tuple[str, str], list[float]] = {}
    for rnd in range(args.rounds):
        for target in args.targets.split(","):
            order = ["this", "other"] if rnd % 2 == 0 else ["other", "this"]
            for name in order:
                if args.search:
                    plain = iso = _search(roots[name], target, args.examples, args.sizes, args.seeds)
                else:
                    plain, iso = _per_example(_props(roots[name], target, args.examples, args.sizes))
                got = best.setdefault((target, name), [plain, iso])
                got[0], got[1] = min(got[0], plain), min(got[1], iso)
    out: dict[str, Any] = {"rounds": args.rounds, "examples": args.examples, "sizes": args.sizes, "targets": {},
                           "search": args.search, "seeds": args.seeds if args.search else None}
    modes = (("search, inproc", 0),) if args.search else (("inproc", 0), ("inproc isolated", 1))
    for target in args.targets.split(","):
        row = {}
        for mode, i in modes:
            this, other = best[(target, "this")][i], best[(target, "other")][i]
            change = other / this - 1.0  # examples/s of this checkout over the other's, minus one
            row[mode] = {"this_examples_per_s": 1.0 / this, "other_examples_per_s": 1.0 / other, "change": change}
            print(f"{target:<36} {mode:<16} this {1.0 / this:7.2f} ex/s   other {1.0 / other:7.2f} ex/s   "
                  f"change {change:+.1%}")
        out["targets"][target] = row
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
