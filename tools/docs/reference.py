"""Reference tables rendered from the code: the CLI's options and exit codes (from the argparse
parser), the diagnoses (from the registry) and the bug gallery (from the mutant catalog).

Each renderer is a pure function of the code (and, for the gallery's timings, of the benchmark's
last ``docs/bench.json``), so a test can compare the committed docs with a fresh rendering.
"""

from __future__ import annotations

import argparse
import json
import os
import re
from typing import Any

__all__ = ["catch_table", "cli_exit_codes", "cli_options", "diagnoses_evidence", "diagnoses_table", "found_in_libraries",
           "public_reports"]

#: A public report cited in a mutant's docstring: ``project #123`` or ``owner/project #123``.
_REPORT = re.compile(r"((?:[A-Za-z][\w.-]*/)?[A-Za-z][\w.-]* #\d+)")
_DEFAULT_NOTE = re.compile(r"\s*\(default: [^()]*(?:\([^()]*\)[^()]*)*\)")


def _cell(text: Any) -> str:
    """Text for one markdown table cell (pipes escaped, on one line)."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _subparser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    for action in parser._actions:  # argparse keeps sub-commands here; there is no public accessor
        if isinstance(action, argparse._SubParsersAction) and command in action.choices:
            return action.choices[command]
    raise ValueError(f"the tpsim parser has no command {command!r}")


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "—"
    metavar = action.metavar if action.metavar is not None else action.dest.upper()
    return f"`{metavar}`"


def _default(action: argparse.Action) -> str:
    if action.nargs == 0 or action.default is None or action.default is argparse.SUPPRESS:
        return "—"
    value = action.default
    if isinstance(value, (list, tuple)):
        value = ",".join(map(str, value))
    elif isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def cli_options(command: str) -> str:
    """The options of ``tpsim COMMAND`` as markdown tables, one per option group, in the parser's
    order: option, value, default, what it does (the help text, less its "(default: ...)")."""
    from tpsim.cli import build_parser

    sub = _subparser(build_parser(), command)
    out: list[str] = []
    for group in sub._action_groups:
        actions = [a for a in group._group_actions if a.option_strings and a.help is not argparse.SUPPRESS]
        if not actions:
            continue
        if group.title not in ("options", "optional arguments"):
            out += [f"**{group.title[0].upper()}{group.title[1:]}**", ""]
        out += ["| option | value | default | what it does |", "|---|---|---|---|"]
        for action in actions:
            names = ", ".join(f"`{o}`" for o in action.option_strings)
            # A default the help text states (e.g. one the command derives) wins over the raw value.
            stated = _DEFAULT_NOTE.search(action.help or "")
            default = _cell(stated.group(0).strip()[len("(default: "):-1]) if stated else _default(action)
            what = _DEFAULT_NOTE.sub("", action.help or "")
            out.append(f"| {names} | {_value(action)} | {default} | {_cell(what)} |")
        out.append("")
    return "\n".join(out).rstrip("\n")


def cli_exit_codes() -> str:
    """The exit codes of ``tpsim`` and what each means."""
    from tpsim.cli import EXIT_CODES

    rows = ["| code | meaning |", "|---|---|"]
    rows += [f"| {code} | {_cell(text)} |" for code, (_, text) in EXIT_CODES.items()]
    return "\n".join(rows)


def diagnoses_table() -> str:
    """Every registered diagnosis and what tpsim saw when it names it."""
    from tpsim.diagnosis import diagnosis_table

    rows = ["| diagnosis | what tpsim saw (and the usual cause) |", "|---|---|"]
    rows += [f"| `{name}` | {_cell(doc)} |" for name, doc in diagnosis_table()]
    return "\n".join(rows)


def public_reports(text: str) -> list[str]:
    """The public reports (``project #N``) a mutant's description cites, in order, once each."""
    return list(dict.fromkeys(_REPORT.findall(text)))


def _bench_rows(bench_json: str | None) -> tuple[dict[str, dict[str, Any]], str | None]:
    if not bench_json or not os.path.isfile(bench_json):
        return {}, None
    with open(bench_json, encoding="utf-8") as fh:
        result = json.load(fh)
    mutants = result.get("mutants") or {}
    rows = {r["mutant"]: r for r in mutants.get("rows", []) if isinstance(r, dict) and "mutant" in r}
    where = f"the benchmark run of {result.get('date', 'unknown date')}"
    if mutants.get("max_examples"):
        where += f" (`search(mutant.variant, max_examples={mutants['max_examples']}, seed=0, database=None)` on inproc)"
    return rows, where


def _number(value: Any, digits: int = 3) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        return f"{value:.{digits}g}"
    return str(value)


def catch_table(bench_json: str | None = None) -> str:
    """Every catalogued mutant once: mechanism, public reports, diagnosis, what a case needs, and
    (from the benchmark's ``bench_json``) how fast the search caught it."""
    from tpsim.mutants import CATALOG

    timings, where = _bench_rows(bench_json)
    out = [
        "*needs*: what a case must have for the bug to show. *examples to catch*: the example at which",
        "the search first failed with the intended diagnosis (`Failure.found_after`); *seconds*: the",
        "whole search including shrinking to the minimal case"
        + (f", both from {where}; a dash: not measured in that run." if where else
           "; a dash: not measured yet (`python -m bench` measures them)."),
        "",
        "| mutant | mechanism | public reports | diagnosis | needs | examples to catch | seconds |",
        "|---|---|---|---|---|---:|---:|",
    ]
    for m in CATALOG:
        t = timings.get(m.name, {})
        reports = ", ".join(public_reports(m.description)) or "—"
        caught = t.get("found_after") if t.get("caught", True) else None
        out.append(f"| `{m.name}` | {_cell(m.description)} | {_cell(reports)} | `{m.diagnosis}` | "
                   f"{_cell(m.needs or '—')} | {_number(caught)} | {_number(t.get('seconds'), 2)} |")
    return "\n".join(out)


def search_power_table(power_json: str) -> str:
    """Examples to catch each catalogued mutant over many seeds (median and worst), from the file
    ``python -m bench.search_power --write`` records."""

    if not os.path.exists(power_json):
        return "Not measured yet: `python -m bench.search_power --write` measures it."
    with open(power_json, encoding="utf-8") as fh:
        doc = json.load(fh)
    out = [
        f"Each mutant searched at seeds 0 to {doc['seeds'] - 1} with a budget of {doc['examples']} examples; "
        "*median* and *worst*: the",
        "example at which the search first failed (`search(..., shrink=False)`), over the seeds; *missed*: seeds at",
        f"which it passed. Measured by `{doc['command']}` ({doc['seconds']:.0f} s in all); "
        "tests/test_search_power.py asserts it.",
        "",
        "| mutant | median | worst | missed |",
        "|---|---:|---:|---|",
    ]
    for row in doc["rows"]:
        missed = ", ".join(str(s) for s in row["missed"]) or "none"
        out.append(f"| {row['mutant']} | {_number(row['median'])} | {_number(row['worst'])} | {missed} |")
    if doc.get("not_measured"):
        out += ["", "Not measured in that run: " + ", ".join(f"`{name}`" for name in doc["not_measured"]) + "."]
    return "\n".join(out)


def diagnoses_evidence() -> str:
    """Every registered diagnosis: the properties it explains, its evidence, its mutant."""
    from tpsim.diagnosis import REGISTRY

    out = ["| diagnosis | properties | evidence | mutant |", "|---|---|---|---|"]
    for spec in REGISTRY.values():
        props = ", ".join(f"`{p}`" for p in spec.properties)
        out.append(f"| `{spec.name}` | {props} | {_cell(spec.evidence)} | "
                   f"{f'`{spec.mutant}`' if spec.mutant else '—'} |")
    return "\n".join(out)


#: Where the recognisers of each module run: a family's own, or (the shared ones) every family's verdict.
_RECOGNISED_IN = {
    "tpsim.props.linear": "linear",
    "tpsim.props.module": "module",
    "tpsim.props.vocab": "embedding, cross-entropy",
    "tpsim.props.attention": "attention",
    "tpsim.props.groups": "linear",  # the wrong-group recognisers: the linear family's hook calls them
}


def _recognised_in() -> dict[str, list[str]]:
    """For each diagnosis name, the modules whose source marks a recogniser of it (``@recogniser(NAME)``,
    read from the source: a recogniser made inside a check is registered only when the check runs)."""
    import ast
    import pathlib

    import tpsim
    from tpsim import diagnosis

    constants = {k: v for k, v in vars(diagnosis).items() if isinstance(v, str) and v in diagnosis.REGISTRY}
    root = pathlib.Path(tpsim.__file__).resolve().parent
    found: dict[str, list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        module = "tpsim." + ".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or getattr(node.func, "id", None) != "recogniser":
                continue
            for arg in node.args:
                name = constants.get(arg.id) if isinstance(arg, ast.Name) else (
                    arg.value if isinstance(arg, ast.Constant) else None)
                if name in diagnosis.REGISTRY:
                    found.setdefault(name, []).append(module)
    return found


def diagnoses_claims() -> str:
    """How every registered diagnosis is confirmed, and the families that can name it: a legend of the
    rules, then one row per name (registration order)."""
    from tpsim.diagnosis import CONFIRMATIONS, REGISTRY

    recognised = _recognised_in()
    out = ["| rule | what is confirmed, and how |", "|---|---|"]
    out += [f"| {rule.value} | {_cell(words)} |" for rule, words in CONFIRMATIONS.items()]
    out += ["", "| diagnosis | named in | confirmed by |", "|---|---|---|"]
    for spec in REGISTRY.values():
        where = [next((v for k, v in _RECOGNISED_IN.items() if module == k or module.startswith(k + ".")),
                      "every family") for module in recognised.get(spec.name, ())]
        shown = "every family" if not where or "every family" in where else ", ".join(dict.fromkeys(where))
        out.append(f"| `{spec.name}` | {shown} | {spec.confirmed_by.value} |")
    return "\n".join(out)


def found_in_libraries(path: str) -> str:
    """The hand-written list of bugs found in released libraries (its own heading dropped: the page
    that includes it gives the section its heading)."""
    if not os.path.isfile(path):
        return ""
    with open(path, encoding="utf-8") as fh:
        text = fh.read().strip()
    return re.sub(r"\A#+ [^\n]*\n+", "", text)
