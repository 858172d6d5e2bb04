"""``python -m bench [--quick] [--out DIR] [--only SECTION ...]``: run the benchmark, write
``DIR/bench.md``, ``DIR/bench.json`` and ``DIR/bench_*.png`` (default DIR: ``docs``), print the
headline ratios. See :mod:`bench` for the sections."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import warnings

from bench import report, sections


def _load() -> float:
    """The 1-minute load average (the machine is shared: the doc reports it); -1 where unknown."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return -1.0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny configuration (seconds): proves the scripts run")
    parser.add_argument("--out", default=os.path.join(sections.ROOT, "docs"), help="output folder (default: docs/)")
    parser.add_argument("--only", nargs="+", choices=sorted(sections.SECTIONS),
                        help="run only these sections; the others are kept from DIR/bench.json when it exists")
    parser.add_argument("--render", action="store_true",
                        help="measure nothing: re-render DIR/bench.md, the plots and the README's Performance "
                        "section from DIR/bench.json (after a change to the report's wording or plots)")
    args = parser.parse_args(argv)
    if args.render:
        with open(os.path.join(args.out, "bench.json"), encoding="utf-8") as fh:
            rendered = json.load(fh)
        _write(rendered, args.out)
        return 0
    cfg = sections.QUICK if args.quick else sections.FULL
    os.makedirs(args.out, exist_ok=True)
    warnings.simplefilter("ignore")
    started = time.perf_counter()
    load_start = _load()
    result: dict = {}
    previous = os.path.join(args.out, "bench.json")
    if args.only and os.path.exists(previous):
        with open(previous, encoding="utf-8") as fh:
            result = json.load(fh)
        if result.get("quick") != args.quick:
            result = {}  # never mix a quick run's sections into a full one
    # Sections kept from an earlier run keep its date and load; the sections re-run are listed with theirs.
    kept = bool(args.only and result)
    now = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    result.update({"quick": args.quick, "machine": report.machine()})
    if not kept:
        result["date"] = now
        result.pop("reruns", None)
    for name, fn in sections.SECTIONS.items():
        if args.only and name not in args.only:
            continue
        t0 = time.perf_counter()
        print(f"[bench] {name} ...", flush=True)
        result[name] = fn(cfg)
        print(f"[bench] {name} done in {time.perf_counter() - t0:.1f} s", flush=True)
    result["total_s"] = result.get("total_s", 0.0) * bool(args.only) + time.perf_counter() - started
    if kept:
        for name in args.only:
            result.setdefault("reruns", {})[name] = {"date": now, "load": {"start": load_start, "end": _load()}}
    else:
        result["load"] = {"start": load_start, "end": _load()}
    result["headline"] = report.headline(result)
    with open(os.path.join(args.out, "bench.json"), "w", encoding="utf-8") as fh:
        json.dump(result, fh, indent=1, default=str)
    _write(result, args.out)
    for h in result["headline"]:
        print(f"[bench] ws={h['world_size']}: inproc/floor={h['inproc_over_floor']}, "
              f"threaded/inproc={h['threaded_over_inproc']}")
    for t in report.targets(result):
        if t["measured"] is not None:
            print(f"[bench] {t['target']}: {t['measured_text']} (goal {t['goal']})")
    print(f"[bench] wrote {os.path.join(args.out, 'bench.md')} in {result['total_s']:.0f} s")
    return 0


def _write(result: dict, out: str) -> None:
    """Plots, bench.md and (for the full run into docs/) the README's Performance section."""
    images = report.plots(result, out, "bench")
    with open(os.path.join(out, "bench.md"), "w", encoding="utf-8") as fh:
        fh.write(report.markdown(result, images))
    readme = os.path.join(sections.ROOT, "README.md")
    if os.path.abspath(out) == os.path.join(sections.ROOT, "docs") and not result.get("quick") and os.path.exists(readme):
        # the README's performance section quotes docs/bench.md: regenerate them together
        with open(readme, encoding="utf-8") as fh:
            text = fh.read()
        with open(readme, "w", encoding="utf-8") as fh:
            fh.write(report.update_readme(text, report.markdown(result, images)))
        print(f"[bench] updated the Performance section of {readme}")


if __name__ == "__main__":
    sys.exit(main())
