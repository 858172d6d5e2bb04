"""``tpsim zoo LIBRARY``: every model family of a library checked module by module, and the published table.

``tpsim zoo transformers`` checks every ``transformers.models.<family>`` whose config classes define a
tp plan (:mod:`tpsim.presets.transformers`); ``tpsim zoo torchtitan`` every torchtitan model package,
of which the torchtitan preset (:mod:`tpsim.presets.torchtitan`) builds Llama 3 (the others are rows
not checked, with the reason). Each family is what ``tpsim check <target>`` checks — the
same variants, cases and judge — at the zoo's example count, and the result is one row per module:

- **PASS**: every property held on every example;
- **FAIL**: the cause (property, diagnosis) and the sublayer it names, and the case file, saved under
  the zoo's cases directory so that ``tpsim replay CASE`` (and ``--backend gloo``) replays it;
- **not checked**: the feature tpsim lacks to check it (named by the preset: a module the model never
  calls on token ids, one called without ``[batch, seq, hidden]`` hidden states, ...).

How it runs: the parent (this process, which never imports the library) lists the families in an
isolated worker, then starts ``--jobs`` shard processes (``tpsim zoo LIBRARY --shard DIR``), each a
supervised session like ``tpsim check`` whose judge runs the families it claims (a family is claimed
by creating ``DIR/claims/<family>``: the shards balance themselves) one after another with warm
workers, writing one JSON line per family; the parent prints their progress, merges the lines and
writes the table (``--out``, default ``docs/zoo.md``) and its JSON twin (``--json``, default
``docs/zoo.json``).
"""

from __future__ import annotations

import datetime
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping
from typing import Any, TextIO

__all__ = ["DEFAULT_CASES_DIR", "DEFAULT_JSON", "DEFAULT_MAX_EXAMPLES", "DEFAULT_OUT", "DEFAULT_WORLD_SIZES", "LIBRARIES",
           "check_family", "render", "run_parent", "run_shard"]

#: Examples per module at the zoo's default (``--max-examples``).
DEFAULT_MAX_EXAMPLES = 4
#: World sizes the zoo draws (``--world-sizes``): tp groups of 1, 2 and 4 ranks.
DEFAULT_WORLD_SIZES = (1, 2, 4)
#: Where a whole run writes the table, its JSON twin and the failing cases (``--out``, ``--json``, ``--cases-dir``).
DEFAULT_OUT = os.path.join("docs", "zoo.md")
DEFAULT_JSON = os.path.join("docs", "zoo.json")
DEFAULT_CASES_DIR = os.path.join("docs", "zoo_cases")
#: The libraries the zoo knows: library -> (distribution, module target prefix).
LIBRARIES = {"transformers": ("transformers", "transformers.models."),
             "torchtitan": ("torchtitan", "torchtitan.models.")}


# --- in workers (import the library) --------------------------------------------------------------


def _families(library: str) -> list[str]:
    """Every family of ``library`` with a tp plan (run in an isolated worker)."""
    if library == "transformers":
        from tpsim.presets.hf.configs import families_with_plans

        return families_with_plans()
    return _titan_families()


def _inventory(library: str, family: str) -> dict[str, Any]:
    """The modules of ``family`` as plain data: the checked ones (variant name, path, class) and the
    ones not checked, with the reason (run in an isolated worker)."""
    if library == "transformers":
        from tpsim.presets.transformers import family_inventory

        return family_inventory(family)
    return _titan_inventory(family)


#: The torchtitan models the torchtitan preset builds (tpsim.presets.torchtitan): Llama 3's feed-forward,
#: attention and block. The others are listed, not checked.
_TITAN_CHECKED = ("llama3",)


def _titan_families() -> list[str]:
    """Every model package of torchtitan (``torchtitan.models.<name>``; ``common`` is their shared code)."""
    import pkgutil

    import torchtitan.models as models

    return sorted(m.name for m in pkgutil.iter_modules(models.__path__) if m.ispkg and m.name != "common")


def _titan_inventory(family: str) -> dict[str, Any]:
    if family in _TITAN_CHECKED:
        return {"configs": [], "modules": [], "not_checked": [], "notes": []}
    return {"configs": [], "modules": [], "notes": [], "skip": True, "not_checked": [{
        "name": "(all)", "path": f"torchtitan.models.{family}", "config": "",
        "reason": "not checked: the torchtitan preset builds only Llama 3's modules (feed-forward, attention, "
                  f"block) under torchtitan's sharding; {family}'s modules and sharding are not built by it yet"}]}


def _version(distribution: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return "not installed"


# --- one family (in a shard's judge) --------------------------------------------------------------


def _first_line(text: str | None, limit: int = 300) -> str:
    line = (text or "").strip().splitlines()[0] if (text or "").strip() else ""
    return line if len(line) <= limit else line[:limit - 3] + "..."


def check_family(library: str, family: str, settings: Mapping[str, Any], saver: Any,
                 err: TextIO | None = None) -> dict[str, Any]:
    """Check ``family`` as ``tpsim check`` checks its target; the family's record (plain data)."""
    from tpsim.comm import isolate
    from tpsim.errors import InvalidArgument
    from tpsim.props.described import describe_target
    from tpsim.props.search import search

    target = LIBRARIES[library][1] + family
    started = time.monotonic()
    record: dict[str, Any] = {"family": family, "target": target, "modules": [], "error": None}
    try:
        inventory = isolate.call(_inventory, library, family, timeout=600.0)
    except Exception as e:  # noqa: BLE001 - the family is not checked, with the reason
        inventory = {"modules": [], "not_checked": [], "error": f"{type(e).__name__}: {e}"}
    record["configs"] = inventory.get("configs", [])
    record["notes"] = inventory.get("notes", [])
    for item in inventory.get("not_checked", []):
        record["modules"].append({**item, "status": "not checked"})
    if inventory.get("error"):
        record["error"] = inventory["error"]
    try:
        variants = [] if inventory.get("skip") else describe_target(
            target, {}, world_sizes=settings["world_sizes"], timeout=600.0)[0]
    except InvalidArgument as e:
        record["error"] = record["error"] or str(e)
        variants = []
    where = {m["name"]: m for m in inventory.get("modules", [])}
    for variant in variants:
        info = where.get(variant.name, {"name": variant.name, "path": "", "cls": ""})
        began = time.monotonic()
        row: dict[str, Any] = {**info, "name": variant.name}
        try:
            report = search(variant, world_sizes=settings["world_sizes"], dtypes=settings["dtypes"],
                            max_examples=settings["max_examples"], seed=settings["seed"], timeout=settings["timeout"],
                            isolate=True)
        except InvalidArgument as e:
            row.update(status="not checked", reason=str(e), examples=0)
        else:
            row["examples"] = int(report.examples)
            row["status"] = "PASS" if report.passed else "FAIL"
            row["failures"] = []
            for failure in report.failures:
                saver.save(failure, variant)
                row["failures"].append({
                    "property": failure.property, "diagnosis": failure.diagnosis,
                    "sublayer": getattr(failure, "sublayer", None), "message": _first_line(failure.message, 600),
                    "case": failure.case.describe(), "case_file": getattr(failure, "case_file", None),
                })
            # the plan's uneven-size note is every module's; "not checked" notes are rows of their own
            row["notes"] = [n for n in getattr(report, "notes", ())
                            if not n.startswith(("a plan's DTensor", "not checked", "dtypes "))]
        row["seconds"] = round(time.monotonic() - began, 1)
        record["modules"].append(row)
        if err is not None:
            print(f"  {family}: {row['name']} {row['status']} ({row.get('examples', 0)} examples, {row['seconds']}s)",
                  file=err, flush=True)
    record["seconds"] = round(time.monotonic() - started, 1)
    return record


def run_shard(args: Any, err: TextIO) -> int:
    """A shard's judge: claim families from ``args.shard`` one by one, check each, append its record."""
    from tpsim.case_saver import CaseSaver

    directory = args.shard
    with open(os.path.join(directory, "families.json")) as f:
        todo = [tuple(item) for item in json.load(f)]
    settings = {"world_sizes": tuple(args.world_sizes), "dtypes": tuple(args.dtypes), "max_examples": args.max_examples,
                "seed": args.seed, "timeout": args.timeout}
    out_path = os.path.join(directory, f"results-{os.getpid()}.jsonl")
    claims = os.path.join(directory, "claims")
    os.makedirs(claims, exist_ok=True)
    for library, family in todo:
        try:
            fd = os.open(os.path.join(claims, f"{library}.{family}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            continue
        os.close(fd)
        saver = CaseSaver(os.path.join(args.cases_dir, library), "inproc", ["zoo", library, "--families", family])
        try:
            record = check_family(library, family, settings, saver, err if args.verbose else None)
        except Exception as e:  # noqa: BLE001 - recorded: the other families still run
            record = {"family": family, "modules": [], "error": f"{type(e).__name__}: {e}", "seconds": 0.0}
        record["library"] = library
        with open(out_path, "a") as f:
            f.write(json.dumps(record) + "\n")
        done = sum(1 for _ in os.scandir(claims))
        counts = _counts(record)
        print(f"[{done}/{len(todo)}] {library} {family}: {counts['PASS']} PASS, {counts['FAIL']} FAIL, "
              f"{counts['not checked']} not checked ({record.get('seconds', 0)} s)"
              + (f"; {record['error']}" if record.get("error") and not record["modules"] else ""),
              file=err, flush=True)
    return 0


# --- the parent -----------------------------------------------------------------------------------


def run_parent(args: Any, out: TextIO, err: TextIO) -> int:
    """List the families, run the shards, write the table (see the module docstring); exit 0 when
    every shard ran (the table says what passed)."""
    from tpsim.comm import isolate

    started = time.monotonic()
    todo: list[tuple[str, str]] = []
    for library in dict.fromkeys(args.libraries):
        if args.families:
            families = sorted(dict.fromkeys(args.families))
        else:
            print(f"tpsim zoo: listing the {library} families with a tp plan", file=err, flush=True)
            families = isolate.call(_families, library, timeout=1800.0)
        todo += [(library, f) for f in families]
    jobs = max(1, min(args.jobs, len(todo)))
    print(f"tpsim zoo {' '.join(dict.fromkeys(args.libraries))}: {len(todo)} families, up to {args.max_examples} "
          f"examples per module, world sizes {','.join(map(str, args.world_sizes))}, {jobs} "
          f"job{'s' if jobs != 1 else ''}", file=err, flush=True)
    with tempfile.TemporaryDirectory(prefix="tpsim-zoo-") as directory:
        with open(os.path.join(directory, "families.json"), "w") as f:
            json.dump(todo, f)
        command = [sys.executable, "-m", "tpsim", "zoo", *dict.fromkeys(args.libraries), "--shard", directory,
                   "--max-examples", str(args.max_examples), "--world-sizes", ",".join(map(str, args.world_sizes)),
                   "--dtypes", ",".join(args.dtypes), "--timeout", str(args.timeout), "--cases-dir", args.cases_dir,
                   "--seed", str(args.seed), *(["--verbose"] if args.verbose else [])]
        procs = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=None) for _ in range(jobs)]
        try:
            codes = [p.wait() for p in procs]
        except KeyboardInterrupt:
            for p in procs:
                p.terminate()
            raise
        records = []
        for entry in sorted(os.scandir(directory), key=lambda e: e.name):
            if entry.name.startswith("results-"):
                with open(entry.path) as f:
                    records += [json.loads(line) for line in f if line.strip()]
    seconds = time.monotonic() - started
    seen = {(r["library"], r["family"]) for r in records}
    for library, family in todo:
        if (library, family) not in seen:
            records.append({"library": library, "family": family, "modules": [],
                            "error": "its shard ended before checking it"})
    doc = _load(args.json) if args.json else {"libraries": {}}
    for library in dict.fromkeys(args.libraries):
        mine = sorted((r for r in records if r["library"] == library), key=lambda r: r["family"])
        if args.families and library in doc["libraries"]:  # an update of some families of a whole run
            kept = [r for r in doc["libraries"][library]["families"] if r["family"] not in set(args.families)]
            mine = sorted(kept + mine, key=lambda r: r["family"])
        doc["libraries"][library] = {"meta": {
            "library": library, "version": _version(LIBRARIES[library][0]), "tpsim": _tpsim_version(),
            "command": "tpsim " + " ".join(shlex.quote(a) for a in args.argv), "max_examples": args.max_examples,
            "world_sizes": list(args.world_sizes), "dtypes": list(args.dtypes), "seed": args.seed, "jobs": jobs,
            "seconds": round(seconds, 1), "date": datetime.date.today().isoformat(), "cases_dir": args.cases_dir,
        }, "families": mine}
    markdown = render(doc)
    if args.out:
        _write(args.out, markdown)
    else:
        out.write(markdown)
    if args.json:
        _write(args.json, json.dumps(doc, indent=1, sort_keys=True) + "\n")
    for library in dict.fromkeys(args.libraries):
        c = _summary(doc["libraries"][library])
        print(f"tpsim zoo {library}: {c['PASS']} PASS, {c['FAIL']} FAIL, {c['not checked']} not checked "
              f"({c['families']} families, {seconds:.0f} s)" + (f"; table in {args.out}" if args.out else ""), file=err)
    return 0 if all(c == 0 for c in codes) else 3


def _load(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except (OSError, ValueError):
        return {"libraries": {}}
    return doc if isinstance(doc, dict) and isinstance(doc.get("libraries"), dict) else {"libraries": {}}


def _tpsim_version() -> str:
    from tpsim import __version__

    return __version__


def _write(path: str, text: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _counts(record: Mapping[str, Any]) -> dict[str, int]:
    counts = {"PASS": 0, "FAIL": 0, "not checked": 0}
    for module in record["modules"]:
        counts[module["status"] if module["status"] in counts else "not checked"] += 1
    if not record["modules"]:
        counts["not checked"] += 1
    return counts


# --- the table ------------------------------------------------------------------------------------


def _summary(section: Mapping[str, Any]) -> dict[str, int]:
    counts = {"PASS": 0, "FAIL": 0, "not checked": 0, "families": len(section["families"])}
    for record in section["families"]:
        for key, value in _counts(record).items():
            counts[key] += value
    return counts


def _cell(text: Any) -> str:
    return str(text).replace("|", "\\|").replace("\n", " ")


def render(doc: Mapping[str, Any]) -> str:
    """The markdown of a zoo run (``doc``: its JSON twin, one section per library)."""
    lines = [
        "# The zoo: every model family with a tp plan, checked module by module against its dense twin",
        "",
        "<!-- Generated by `tpsim zoo` (tpsim/zoo.py) from docs/zoo.json; do not edit. -->",
        "",
        "A module is **PASS** when every property held on every example; **FAIL** names the cause and the sublayer,",
        "and its case file replays (`tpsim replay CASE`, and `--backend gloo`); **not checked** names what tpsim",
        "lacks to check it. Every FAIL is a defect of the released plan, listed in docs/bugs.md (\"Found in released",
        "libraries\") with a reproduction that runs without tpsim.",
    ]
    for library, section in doc["libraries"].items():
        meta = section["meta"]
        c = _summary(section)
        lines += [
            "", f"## {library} {meta['version']}", "",
            f"Generated by `{meta['command']}` on {meta['date']} (tpsim {meta['tpsim']}): up to {meta['max_examples']} "
            f"examples per module, world sizes {', '.join(map(str, meta['world_sizes']))}, dtypes "
            f"{', '.join(meta['dtypes'])}, seed {meta['seed']}, {meta['jobs']} job(s), {meta['seconds']:.0f} s in all.",
            "", f"**{c['PASS']} PASS, {c['FAIL']} FAIL, {c['not checked']} not checked** ({c['families']} families).",
            "", "| family | module | path | status | examples | time | detail |", "|---|---|---|---|---|---|---|",
        ]
        failing = []
        for record in section["families"]:
            family = record["family"]
            for note in record.get("notes") or ():
                lines.append(f"| {family} | (config) | | note | | | {_cell(note)} |")
            if not record["modules"]:
                lines.append(f"| {family} | (all) | | not checked | 0 | | {_cell(record.get('error') or 'no module')} |")
                continue
            for m in record["modules"]:
                status, detail = m["status"], ""
                if status == "FAIL":
                    parts = []
                    for f in m.get("failures", []):
                        failing.append((family, m, f))
                        where = f" at `{f['sublayer']}`" if f.get("sublayer") else ""
                        parts.append(f"{f['property']}: {f['diagnosis']}{where}")
                    detail = "; ".join(parts)
                elif status == "not checked":
                    detail = m.get("reason", "")
                elif m.get("notes"):
                    detail = "; ".join(m["notes"])
                seconds = f"{m['seconds']:.0f} s" if isinstance(m.get("seconds"), (int, float)) else ""
                lines.append(f"| {family} | {_cell(m['name'])} | `{_cell(m.get('path', ''))}` | {status} | "
                             f"{m.get('examples', 0)} | {seconds} | {_cell(detail)} |")
        if failing:
            lines += ["", f"### {library}: the failures", ""]
            for family, m, f in failing:
                lines += [f"#### {family}: {m['name']} — {f['property']}: {f['diagnosis']}", "",
                          f"- sublayer: `{f.get('sublayer')}`", f"- minimal case: {f['case']}",
                          f"- what was measured: {_cell(f['message'])}"]
                if f.get("case_file"):
                    lines.append(f"- replay: `tpsim replay {f['case_file']}` (and `--backend gloo`)")
                lines.append("")
    return "\n".join(lines).rstrip() + "\n"
