"""The ``tpsim`` command (also ``python -m tpsim``): check layer variants, replay saved cases.

::

    tpsim check TARGET [options]      # search for cases where a variant differs from nn.Linear
    tpsim replay CASE.json [options]  # re-run one saved case, e.g. on gloo

The contract (options, exit codes, JSON report, case files) is documented in docs/cli.md:

- exit 0: every property holds (check) / the case passes now (replay);
- exit 1: a property fails — including an exception raised inside the variant on any rank
  (diagnosis ``exception``); every failure's minimal case is saved and its replay command printed;
- exit 2: a usage error, a target that cannot be imported, a backend that cannot run here, or a
  missing/corrupt/newer-schema case file, with a one-line reason on stderr;
- exit 3: an internal error of tpsim itself (with a traceback; please report it).

:func:`main` takes ``argv`` and returns the exit code, so tests call it directly.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

from tpsim import diagnosis
from tpsim._json import jsonable
from tpsim.case_saver import CaseSaver
from tpsim.conventions import CONVENTIONS
from tpsim.faults import FAULT_KINDS
from tpsim.module_variant import MODULE_OUTPUTS
from tpsim.props.case import CASES_DIR, DTYPES
from tpsim.props.family import kind_choices
from tpsim.props.faults import FAULT_DETECTION
from tpsim.props.search import DEFAULT_MAX_EXAMPLES, DEFAULT_MAX_SIZE, DEFAULT_WORLD_SIZES, HANG_BUDGET
from tpsim.runner import BACKENDS, DEFAULT_TIMEOUT
from tpsim.variant import INPUT_GRADS, INPUTS, OUTPUTS, PARAM_GRADS
from tpsim.zoo import DEFAULT_CASES_DIR as ZOO_CASES_DIR
from tpsim.zoo import DEFAULT_JSON as ZOO_JSON
from tpsim.zoo import DEFAULT_MAX_EXAMPLES as ZOO_MAX_EXAMPLES
from tpsim.zoo import DEFAULT_OUT as ZOO_OUT
from tpsim.zoo import DEFAULT_WORLD_SIZES as ZOO_WORLD_SIZES
from tpsim.zoo import LIBRARIES as ZOO_LIBRARY_TARGETS

__all__ = ["DEFAULT_CASES_DIR", "EXIT_CODES", "EXIT_FAILED", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK",
           "EXIT_USAGE", "build_parser", "main", "run_command"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

EXIT_INTERRUPTED = 130
#: What each exit code means, short and in full (the help's epilog and docs/cli.md come from it).
EXIT_CODES: dict[int, tuple[str, str]] = {
    EXIT_OK: ("all properties hold", "every property holds (check) / the case passes now (replay)"),
    EXIT_FAILED: ("a property failed", "a property failed; an exception raised inside the variant, on any rank, is "
                  "a failure (diagnosis `exception`, with the rank and its traceback), not a usage error"),
    EXIT_USAGE: ("usage, import or environment error", "usage error, a target that cannot be imported or resolved, "
                 "a backend that cannot run here, a world too large for this machine, a missing/corrupt/newer-schema "
                 "case file: one line on stderr, nothing on stdout"),
    EXIT_INTERNAL: ("internal error", "internal error of tpsim itself (a traceback on stderr; please report it)"),
    EXIT_INTERRUPTED: ("interrupted", "interrupted (Ctrl-C): what was found so far is reported and its cases are "
                       "saved"),
}

# Every choice list and default below comes from the library module that owns it, so the
# command line can never disagree with what the library accepts or does by default.
#: Where failing cases are saved unless ``--cases-dir`` says otherwise.
DEFAULT_CASES_DIR = CASES_DIR
BACKEND_CHOICES = BACKENDS
CONVENTION_CHOICES = CONVENTIONS
KIND_CHOICES = kind_choices()
INPUT_CHOICES = INPUTS
OUTPUT_CHOICES = tuple(dict.fromkeys((*OUTPUTS, *MODULE_OUTPUTS)))
INPUT_GRAD_CHOICES = INPUT_GRADS
DTYPE_CHOICES = tuple(DTYPES)
REPORT_CHOICES = ("text", "json")
_WS_TEXT = ",".join(map(str, DEFAULT_WORLD_SIZES))
ZOO_LIBRARIES = tuple(ZOO_LIBRARY_TARGETS)


class UsageError(Exception):
    """A command line tpsim cannot act on; the message is the one-line reason (exit 2).

    ``prog`` is the command the reason is printed for (``tpsim``, ``tpsim check``, ...).
    """

    def __init__(self, message: str, prog: str = "tpsim") -> None:
        super().__init__(message)
        self.prog = prog


# --- option parsing ------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    """argparse, but errors raise :class:`UsageError` (one line, exit 2) instead of exiting."""

    def error(self, message: str) -> Any:  # type: ignore[override]
        raise UsageError(f"{message} (see '{self.prog} --help')", prog=self.prog)


def _int_list(minimum: int) -> Callable[[str], tuple[int, ...]]:
    def parse(text: str) -> tuple[int, ...]:
        items = [s.strip() for s in text.split(",")]
        values = []
        for item in items:
            try:
                value = int(item)
            except ValueError:
                value = None
            if value is None or value < minimum:
                raise argparse.ArgumentTypeError(
                    f"invalid value {text!r}: {item!r} is not an int >= {minimum}; expected a comma-separated "
                    "list, e.g. 1,2,4,8"
                )
            values.append(value)
        return tuple(sorted(set(values)))

    return parse


def _dtype_list(text: str) -> tuple[str, ...]:
    names = [s.strip() for s in text.split(",")]
    bad = [n for n in names if n not in DTYPE_CHOICES]
    if bad:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: {bad[0]!r} is not a dtype tpsim checks; expected a comma-separated "
            f"list of {', '.join(DTYPE_CHOICES)}"
        )
    return tuple(n for n in DTYPE_CHOICES if n in names)


def _bounded_int(minimum: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = None
        if value is None or value < minimum:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected an int >= {minimum}")
        return value

    return parse


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (value > 0 and value != float("inf")):
        raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected a positive number of seconds")
    return value


def _braces(choices: Sequence[str]) -> str:
    return "{" + ",".join(choices) + "}"


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    # Our own check instead of argparse's ``choices``: argparse names the option, this names the
    # value and every choice, on one line.
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected one of {', '.join(choices)}")
        return text

    return parse


_NO_ISOLATE_HELP = (
    "accepted for compatibility, changes nothing: the checked code always runs in supervised worker processes "
    "(a rank that exits, segfaults, aborts, runs out of memory or hangs in native code is reported as "
    "rank-exited or rank-crashed, with its case), never in the process that judges it and sets the exit code "
    "(see docs/design.md)"
)


def build_parser() -> _Parser:
    """The ``tpsim`` argument parser (docs/cli.md's option tables are generated from it)."""
    from tpsim import __version__

    parser = _Parser(
        prog="tpsim",
        description="Check tensor-parallel layer variants against the dense nn.Linear; replay failing cases.",
        epilog="Exit codes: " + ", ".join(f"{code} {short}" for code, (short, _) in EXIT_CODES.items())
        + ". See docs/cli.md.",
    )
    parser.add_argument("--version", action="version", version=f"tpsim {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    check = sub.add_parser(
        "check",
        help="search for cases where a variant differs from the dense layer",
        description="Generate cases with Hypothesis, check every property on each, shrink failures to a "
        "minimal case, save it and print the command that replays it.",
    )
    check.add_argument(
        "target",
        metavar="TARGET",
        help="package.module:Name, path/to/file.py:Name, or a module (checks every variant it declares; "
        "tpsim.layers checks tpsim's own layers)",
    )
    adapt = check.add_argument_group("how a plain nn.Module class is sharded (see docs/cli.md)")
    adapt.add_argument("--convention", type=_choice(CONVENTION_CHOICES), metavar=_braces(CONVENTION_CHOICES),
                       help="constructor convention, detected from the signature when unambiguous: master-weight "
                       "(in_features, out_features, bias, master_weight), tp-rank (in_features, out_features, tp_size, "
                       "tp_rank[, tp_group]), group (Megatron style: input_size, output_size, *, bias, gather_output, "
                       "skip_bias_add, process_group|group|tp_group|pg; forward may return (output, bias)) or "
                       "implicit-group (vLLM style: the same without a group keyword, reduce_results too; the layer "
                       "reads its tp group itself, the world); a forced "
                       "convention that does not fit the constructor is a usage error (README: Check your own layer)")
    adapt.add_argument("--kind", type=_choice(KIND_CHOICES), metavar=_braces(KIND_CHOICES),
                       help="column- or row-parallel (detected from the class name when it says); module: a "
                       "whole module; embedding / cross-entropy: a vocab-parallel embedding class or loss function")
    adapt.add_argument("--input", type=_choice(INPUT_CHOICES), metavar=_braces(INPUT_CHOICES),
                       help="what each rank is given (default: column replicated, row sharded)")
    adapt.add_argument("--output", type=_choice(OUTPUT_CHOICES),
                       metavar=_braces(OUTPUT_CHOICES),
                       help="what each rank returns; partial: the harness sums the ranks' outputs, as the "
                       "caller's all-reduce would")
    adapt.add_argument("--input-grad", dest="input_grad", type=_choice(INPUT_GRAD_CHOICES),
                       metavar=_braces(INPUT_GRAD_CHOICES),
                       help="complete (default): every rank holds the full grad of a replicated input; "
                       "partial: the caller reduces it")
    adapt.add_argument("--packed", type=_packed, default=None, metavar="K|P,P,...",
                       help="a column weight packing K equal parts (gate/up: 2) or parts in these proportions "
                       "(grouped-query QKV: 8,2,2), each sharded on its own: rank r holds shard r of every part")
    adapt.add_argument("--head-size", dest="head_size", type=_positive_int("--head-size"), default=None, metavar="D",
                       help="with --packed Q,K,V proportions (query heads first): rows per attention head; a key/value "
                       "part with fewer heads than ranks is replicated, rank r holding head r*heads//tp (vLLM's "
                       "QKVParallelLinear), and the search draws fewer, as many and more key/value heads than ranks")
    adapt.add_argument("--sequence-dim", dest="sequence_dim", type=_sequence_dim, default=None, metavar="D",
                       help="the sequence dim of a sequence-sharded input/output (default -2, the dim before the "
                       "features; dim 0 of a 2-D input)")
    adapt.add_argument("--plan", default=None, metavar="MODULE:PLAN",
                       help="check the dense nn.Module class TARGET against itself parallelised by this plan: a "
                       "parallelize_module dict of DTensor styles, a Hugging Face dict of style strings (colwise, "
                       "rowwise, sequence_parallel, ...) or a function (module, mesh) -> module; sizes come from the "
                       "class's constructor (docs/cli.md: Plans)")
    adapt.add_argument("--forward-only", dest="forward_only", action="store_const", const=True, default=None,
                       help="an inference layer or module (weights without grads, collectives outside autograd): "
                       "run the forward only, under torch.no_grad(), and check forward equivalence, replica "
                       "consistency and divisibility (a refusal by assert on every rank counts; python -O strips "
                       "it); with --kind module the dense reference and its twin run forward only too, and a "
                       "failure is named by its sublayer")
    adapt.add_argument("--ctor-arg", dest="ctor_arg", action="append", type=_ctor_arg, default=None,
                       metavar="NAME=VALUE",
                       help="a constructor keyword of a plain class, fixed for every case (repeatable): a Python "
                       "literal (skip_bias_add=True, 8, 'text'), or an enum member's name for an enum parameter "
                       "(mode=ALL_REDUCE); the keywords tpsim passes itself (sizes, bias, the tp group, options that "
                       "follow --input/--output) are refused")
    real = check.add_argument_group("what a real job does per process or in its trainer (any target)")
    real.add_argument("--rank-local", dest="rank_local", action="append", default=None, metavar="MODULE",
                      help="make MODULE's globals per rank on inproc, as they are per process in a real job (a "
                      "library's parallel state); repeatable; a target file is named by its path "
                      "(--rank-local path/to/layers.py). Automatic for the module that defines a checked class, "
                      "the module a declared variant comes from, and the library presets; without it a module "
                      "global that ranks share is reported (exit 2) with this fix")
    real.add_argument("--param-grad", dest="param_grad", action="append", type=_param_grad, default=None,
                      metavar="NAME=partial",
                      help="the grad of the replicated parameter NAME is left as per-rank summands for the trainer to "
                      "sum (Megatron's sequence-parallel bias and norms; a parameter marked "
                      "param.sequence_parallel = True is partial without this): the ranks' grads must add up to "
                      "the dense grad, training applies that sum, and replicas must agree after it; repeatable")
    run = check.add_argument_group("the search")
    run.add_argument("--backend", type=_choice(BACKEND_CHOICES), default="inproc",
                     metavar=_braces(BACKEND_CHOICES), help="where ranks run (default: inproc)")
    run.add_argument("--world-sizes", dest="world_sizes", type=_int_list(1),
                     default=DEFAULT_WORLD_SIZES, metavar="N,N,...",
                     help=f"world sizes to draw from (default: {_WS_TEXT})")
    run.add_argument("--tp-sizes", dest="tp_sizes", type=_int_list(1), default=None, metavar="T,T,...",
                     help="tensor-parallel group sizes: each world of W ranks is split into W/T tp groups of "
                     "T ranks (consecutive and strided layouts), each with its own data (default: the whole "
                     "world half the time, a smaller divisor otherwise)")
    run.add_argument("--dtypes", type=_dtype_list, default=DTYPE_CHOICES, metavar="D,D,...",
                     help=f"dtypes to draw from (default: {','.join(DTYPE_CHOICES)})")
    run.add_argument("--max-examples", dest="max_examples", type=_bounded_int(1),
                     default=DEFAULT_MAX_EXAMPLES, metavar="N",
                     help=f"examples per variant (default: {DEFAULT_MAX_EXAMPLES})")
    run.add_argument("--max-size", dest="max_size", type=_bounded_int(1), default=DEFAULT_MAX_SIZE, metavar="N",
                     help=f"the largest size per rank a sharded dim draws (default: {DEFAULT_MAX_SIZE}); tiny sizes "
                     "(1-3) half the time, otherwise any size up to N with powers of two and tile multiples ± 1 "
                     "(15, 16, 17, ...) on purpose; a failure still shrinks to the smallest size that fails")
    run.add_argument("--seed", type=_bounded_int(0), default=None, metavar="N",
                     help="seed of the search (default: random); the same seed generates the same cases")
    run.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                     help=f"seconds any collective wait may block (default: {DEFAULT_TIMEOUT:g}); a failure that "
                     f"hangs is shrunk until its hung runs took {HANG_BUDGET} timeouts, then reported on the smallest "
                     "case found by then")
    run.add_argument("--no-isolate", dest="isolate", action="store_false", help=_NO_ISOLATE_HELP)
    run.add_argument("--faults", type=_fault_kinds, default=None, metavar="KIND,...",
                     help=f"also inject faults of these kinds ({', '.join(FAULT_KINDS)}) beneath the "
                     "process group and check that the variant reports them (see docs/cli.md)")
    out = check.add_argument_group("output")
    out.add_argument("--report", type=_choice(REPORT_CHOICES), default="text", metavar=_braces(REPORT_CHOICES),
                     help="json: a JSON report on stdout (default: text)")
    out.add_argument("--cases-dir", dest="cases_dir", default=DEFAULT_CASES_DIR, metavar="DIR",
                     help=f"where failing cases are saved (default: {DEFAULT_CASES_DIR})")

    replay = sub.add_parser(
        "replay",
        help="re-run one saved case",
        description="Re-run exactly the case in CASE.json (on any backend: a case found on inproc replays on gloo) "
        "and print its diagnosis (exit 1), or say that it passes now (exit 0).",
    )
    replay.add_argument("case_file", metavar="CASE.json", help="a case file written by tpsim check")
    replay.add_argument("--backend", type=_choice(BACKEND_CHOICES), default=None,
                        metavar=_braces(BACKEND_CHOICES), help="where ranks run (default: inproc)")
    replay.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds any collective wait may block (default: {DEFAULT_TIMEOUT:g})")
    replay.add_argument("--no-isolate", dest="isolate", action="store_false", help=_NO_ISOLATE_HELP)
    replay.add_argument("--report", type=_choice(REPORT_CHOICES), default="text", metavar=_braces(REPORT_CHOICES),
                        help="json: a JSON report on stdout (default: text)")
    replay.add_argument("--allow-outside-target", dest="allow_outside_target", action="store_true",
                        help="import a target file outside the current directory and the case file's directory "
                        "(a case file is data: by default it cannot make tpsim import code from elsewhere)")
    zoo = sub.add_parser(
        "zoo",
        help="check every model family of a library that has a tp plan, and write the table",
        description="Check every model family of LIBRARY with a tp plan (transformers: every transformers.models "
        "family whose config defines a base_model_tp_plan; torchtitan: every model with a tp plan) module by module, "
        "as tpsim check checks each, and write the table of PASS, FAIL (diagnosis, sublayer, a case file that "
        "replays) and not checked (the feature it needs) per family and module (docs/zoo.md).",
    )
    zoo.add_argument("libraries", nargs="+", choices=ZOO_LIBRARIES, metavar="LIBRARY",
                     help=f"{' and/or '.join(ZOO_LIBRARIES)}")
    zoo.add_argument("--families", type=_name_list, default=None, metavar="NAME,NAME,...",
                     help="these families only (e.g. llama,qwen3_moe); without --out the table goes to stdout and "
                     "docs are left alone")
    zoo.add_argument("--max-examples", dest="max_examples", type=_bounded_int(1), default=ZOO_MAX_EXAMPLES,
                     metavar="N", help=f"examples per module (default: {ZOO_MAX_EXAMPLES})")
    zoo.add_argument("--jobs", type=_bounded_int(1), default=1, metavar="J",
                     help="families checked at once, each job a process of its own (default: 1)")
    zoo.add_argument("--world-sizes", dest="world_sizes", type=_int_list(1), default=ZOO_WORLD_SIZES,
                     metavar="N,N,...", help=f"world sizes to draw from (default: {','.join(map(str, ZOO_WORLD_SIZES))})")
    zoo.add_argument("--dtypes", type=_dtype_list, default=DTYPE_CHOICES, metavar="D,D,...",
                     help=f"dtypes to draw from (default: {','.join(DTYPE_CHOICES)})")
    zoo.add_argument("--seed", type=_bounded_int(0), default=0, metavar="N", help="seed of every search (default: 0)")
    zoo.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                     help=f"seconds any collective wait may block (default: {DEFAULT_TIMEOUT:g})")
    zoo.add_argument("--cases-dir", dest="cases_dir", default=None, metavar="DIR",
                     help=f"where failing cases are saved, per library (default: {ZOO_CASES_DIR} for a whole run, "
                     f"{DEFAULT_CASES_DIR} with --families)")
    zoo.add_argument("--out", default=None, metavar="FILE.md",
                     help=f"the table (default: {ZOO_OUT} for a whole run, stdout with --families)")
    zoo.add_argument("--json", default=None, metavar="FILE.json",
                     help=f"its JSON twin, merged with the other library's section (default: {ZOO_JSON} for a whole run)")
    zoo.add_argument("--verbose", action="store_true", help="print every module's verdict as it comes")
    zoo.add_argument("--shard", default=None, help=argparse.SUPPRESS)
    return parser


def _name_list(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    if not names or not all(n.replace("_", "").replace(".", "").isalnum() for n in names):
        raise argparse.ArgumentTypeError(f"{text!r}; expected names separated by commas, e.g. llama,qwen3_moe")
    return names


# --- output helpers ------------------------------------------------------------------------------


def _replay_command(path: str, backend: str | None = None, target: str | None = None) -> str:
    """The command that replays the case file ``path``, as the user can paste it where tpsim ran:
    with ``--allow-outside-target`` when ``target`` is a file replay would not import by itself."""
    cmd = f"tpsim replay {shlex.quote(path)}"
    cmd += f" --backend {backend}" if backend else ""
    return cmd + (" --allow-outside-target" if target and _outside_target(target, path) else "")


def _target_file(target: str) -> str | None:
    """The file a target names (a path, or the module name tpsim imports a file under), else None."""
    from tpsim._target_files import path_of_module_name

    module_part = target.partition(":")[0]
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        return module_part
    return path_of_module_name(module_part)


def _outside_target(target: str, case_file: str) -> bool:
    """Whether replaying ``case_file`` from here needs ``--allow-outside-target`` for ``target``."""
    file = _target_file(target)
    if file is None:
        return False
    places = [os.getcwd(), os.path.dirname(os.path.abspath(case_file))]
    candidates = [file] if os.path.isabs(file) else [os.path.join(p, file) for p in places]
    return not any(os.path.isfile(c) and any(_is_inside(c, p) for p in places) for c in candidates)


def _case_dict(case: Any) -> Any:
    return case.to_dict() if hasattr(case, "to_dict") else case


def _failure_dict(failure: Any, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """A failure as the JSON report lists it (``property``, ``diagnosis``, ``message``, ``case``,
    ``case_file`` first; then ``variant``, ``rank``, ``replay``, ``details``; ``extra``: what the
    command adds, e.g. ``output`` (what the ranks printed) and ``case_file_note``)."""
    base: dict[str, Any] = {}
    for method in ("to_dict", "to_json"):
        fn = getattr(failure, method, None)
        if fn is not None:
            value = fn()
            base = json.loads(value) if isinstance(value, str) else dict(value)
            break
    out = {
        "property": failure.property,
        "diagnosis": failure.diagnosis,
        "message": _cut(failure.message, bool(getattr(failure, "case_file", None))),
        "case": _case_dict(failure.case),
        "case_file": getattr(failure, "case_file", None),
        "variant": getattr(failure, "variant", None),
        "rank": getattr(failure, "rank", None),
    }
    tb = getattr(failure, "traceback", None)
    if tb:
        out["traceback"] = _cut(tb, False)
    for key, value in base.items():
        out.setdefault(key, value)
    if out["case_file"]:
        out["replay"] = _replay_command(out["case_file"], target=getattr(failure.case, "target", None))
    out.update(extra or {})
    return jsonable(out)



#: Characters of a failure's message (and of its traceback) a report shows; the case file keeps more
#: (:data:`tpsim.props.case.CASE_TEXT_CHARS`).
MESSAGE_CHARS = 4000


def _cut(text: str, saved: bool = True) -> str:
    """``text`` cut to :data:`MESSAGE_CHARS` (its head and its tail: where it came from and how it ended)."""
    if not isinstance(text, str) or len(text) <= MESSAGE_CHARS:
        return text
    half = MESSAGE_CHARS // 2
    where = "; the case file keeps more of it" if saved else ""
    return f"{text[:half]}\n... [{len(text) - 2 * half} more characters{where}] ...\n{text[-half:]}"


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _describe_case(case: Any) -> str:
    describe = getattr(case, "describe", None)
    return describe() if describe is not None else str(case)


def _failure_block(failure: Any, out: TextIO, *, replaying: bool = False) -> None:
    """What a person reads: property, diagnosis, message, minimal case, then (once saved, see
    :func:`_case_file_block`) case file and replay; when replaying, the case and its file are
    already in the heading."""
    print(f"  FAILED {failure.property}: {getattr(failure, 'label', failure.diagnosis)}", file=out)
    message = _cut(failure.message, bool(getattr(failure, "case_file", None)))
    tb = getattr(failure, "traceback", None)
    if tb and tb.strip() not in failure.message:
        message = f"{message}\n--- traceback on rank {failure.rank} ---\n{_cut(tb.rstrip(), False)}"
    print(_indent(message, "    "), file=out)
    consequences = getattr(failure, "consequences", None) or []
    if consequences:
        # One cause, one report: what failed because of it on the same case.
        print("    consequences of the same cause:", file=out)
        for c in consequences:
            print(f"      {c.property}: {c.label} — {c.message.splitlines()[0]}", file=out)
    if replaying:
        return
    print(f"    minimal case: {_describe_case(failure.case)}", file=out)


def _printed_block(printed: dict[str, str], out: TextIO, keep: int = 20) -> None:
    """What the ranks printed while the failing case ran (its last ``keep`` lines per rank)."""
    printed = {label: text for label, text in printed.items() if text.strip()}
    if not printed:
        return
    print("    printed while the case ran:", file=out)
    for label, text in printed.items():
        lines = text.rstrip().splitlines()
        if len(lines) > keep:
            print(f"      {label} | ... ({len(lines) - keep} lines before)", file=out)
        for line in lines[-keep:]:
            print(f"      {label} | {line}", file=out)


def _case_file_block(failure: Any, note: str | None, out: TextIO) -> None:
    """The saved case file and the commands that replay it (or why there is no file)."""
    if note:
        print(f"    note:         {note}", file=out)
    case_file = getattr(failure, "case_file", None)
    if case_file:
        print(f"    case file:    {case_file}", file=out)
        target = getattr(failure.case, "target", None)
        print(f"    replay:       {_replay_command(case_file, target=target)}", file=out)
        print(f"    on gloo:      {_replay_command(case_file, 'gloo', target=target)}", file=out)


class _Progress:
    """``NAME: 37/100 examples`` on stderr while a search runs, only on a terminal.

    Called once per example by the search (whatever arguments it passes); redraws at most ten
    times a second so a fast search is not slowed by the terminal.
    """

    def __init__(self, name: str, total: int, stream: TextIO) -> None:
        self.name = name
        self.total = total
        self.stream = stream
        self.count = 0
        self.enabled = _isatty(stream)
        self._last = 0.0
        self._drawn = False

    def __call__(self, *args: Any, **kwargs: Any) -> None:
        self.count += 1
        now = time.monotonic()
        if self.enabled and (now - self._last >= 0.1 or self.count == self.total):
            self._last = now
            done = f"{self.count}/{self.total} examples" if self.count <= self.total else f"{self.count} examples (shrinking)"
            self.stream.write(f"\r\x1b[K{self.name}: {done}")
            self.stream.flush()
            self._drawn = True

    def close(self) -> None:
        if self._drawn:
            self.stream.write("\r\x1b[K")
            self.stream.flush()


def _isatty(stream: TextIO) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):
        return False


# --- check ---------------------------------------------------------------------------------------


@dataclass
class _VariantResult:
    variant: Any
    passed: bool
    examples: int
    seconds: float
    failures: list[Any] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    verdicts: dict[str, Any] = field(default_factory=dict)
    #: Why the search refused this variant (a usage error of one variant among several), or None.
    refused: str | None = None


def _nccl_check(world_size: int, prog: str) -> None:
    from tpsim.comm.procs import nccl_unavailable_reason

    reason = nccl_unavailable_reason(world_size)
    if reason is not None:
        raise UsageError(f"backend nccl cannot run here: {reason}; use --backend gloo or inproc", prog=prog)


def _positive_int(flag: str) -> Any:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = 0
        if value < 1:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} for {flag}; expected an int >= 1")
        return value

    return parse


def _packed(text: str) -> tuple[int, ...]:
    items = [s.strip() for s in text.split(",")]
    try:
        values = [int(s) for s in items]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values) or (len(values) == 1 and values[0] < 2):
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected K >= 2 equal parts (e.g. 2 for gate/up) or a comma-separated list "
            "of part proportions (e.g. 8,2,2 for grouped-query Q,K,V)"
        )
    return (1,) * values[0] if len(values) == 1 else tuple(values)


def _ctor_arg(text: str) -> tuple[str, str]:
    name, sep, value = text.partition("=")
    name, value = name.strip(), value.strip()
    if not sep or not name.isidentifier() or not value:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected NAME=VALUE, a constructor keyword and its value (e.g. "
            "skip_bias_add=True, mode=ALL_REDUCE)"
        )
    return name, value


def _param_grad(text: str) -> tuple[str, str]:
    name, sep, mode = text.partition("=")
    name, mode = name.strip(), mode.strip()
    if not sep or not name or mode not in PARAM_GRADS:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected NAME=partial, the attribute path of a parameter (e.g. bias=partial, "
            "norm.weight=partial)"
        )
    return name, mode


def _sequence_dim(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = None
    if value is None or value == -1:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}; expected an int naming a dim before the features (default -2; -1 is the "
            "feature dim)"
        )
    return value


def _fault_kinds(text: str) -> tuple[str, ...]:
    from tpsim.faults import FAULT_KINDS

    kinds = [k.strip() for k in text.split(",")]
    bad = [k for k in kinds if k not in FAULT_KINDS]
    if bad:
        raise argparse.ArgumentTypeError(
            f"invalid value {text!r}: {bad[0]!r} is not a fault kind; expected a comma-separated list of "
            f"{', '.join(FAULT_KINDS)}"
        )
    return tuple(k for k in FAULT_KINDS if k in kinds)


#: A fault run deliberately stalls ranks; these bound what ``--faults`` adds to a check.
FAULT_MAX_EXAMPLES = 20
FAULT_TIMEOUT = 2.0
FAULT_PROPERTY = FAULT_DETECTION
FAULT_DIAGNOSIS = diagnosis.FAULT_NOT_SURFACED


def _fault_failures(variant: Any, args: argparse.Namespace) -> tuple[list[Any], int]:
    """Run ``variant`` under generated fault plans of ``args.faults`` kinds; return the failures
    (one per plan whose fault was not surfaced) and the number of plans run."""
    from tpsim.diagnosis import Failure
    from tpsim.props.faults import check_faults

    sizes = tuple(ws for ws in args.world_sizes if ws >= 2) or (2,)
    reports = check_faults(
        variant,
        kinds=args.faults,
        world_sizes=sizes,
        max_examples=min(args.max_examples, FAULT_MAX_EXAMPLES),
        seed=args.seed or 0,
        backend=args.backend,
        timeout=min(args.timeout, FAULT_TIMEOUT),
        isolate=args.backend == "inproc",
    )
    failures = []
    for report in reports:
        if report.ok:
            continue
        plan = ", ".join(str(f) for f in report.plan)
        failures.append(
            Failure(FAULT_PROPERTY, FAULT_DIAGNOSIS, f"under the fault plan [{plan}]: {report.message}",
                    case=report.case, variant=variant.name, details={"outcome": report.outcome})
        )
    return failures, len(reports)


def _check(args: argparse.Namespace, argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    from tpsim.comm._torchrun import launched_world

    launched = launched_world() if args.backend in ("gloo", "nccl") else None
    if launched is not None:
        # Under torchrun every rank runs this command: the launcher's world is the only world
        # size, and every rank must generate the very same cases (a common seed, no example
        # database), or their collectives would not match. Rank 0 alone reports.
        rank, world_size = launched
        args.world_sizes = [world_size]
        if args.seed is None:
            args.seed = 0
        if rank != 0:
            out = err = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the command
            args.cases_dir = os.path.join(args.cases_dir, f"rank{rank}")
    _check_world_size(max(args.world_sizes), args.backend, "tpsim check", "--world-sizes")
    if args.backend == "nccl":
        _nccl_check(max(args.world_sizes), "tpsim check")
    from tpsim.capture import StdoutCapture

    if args.report != "json":
        # What the checked code prints (a library's init messages, its warnings inside ranks) is
        # captured as well: hidden when the check passes, shown with its rank under a failure.
        with StdoutCapture() as capture:
            return _run_check(args, argv, capture.terminal(out), err, capture)[0]

    # stdout must hold the JSON report alone: whatever the checked code prints (Python, native
    # code, worker processes) is captured meanwhile and attached to the failure it belongs to.
    from tpsim.comm.procs import replacements

    before = replacements()
    with StdoutCapture() as capture:
        code, doc = _run_check(args, argv, out, err, capture)
        outside = capture.outside()
    if outside:
        doc["output"] = outside
    # gloo/nccl worker pools replaced during this check, by reason (none on a correct layer)
    replaced = {why: n - before.get(why, 0) for why, n in replacements().items() if n > before.get(why, 0)}
    doc["pool_replacements"] = {"count": sum(replaced.values()), "by_reason": replaced}
    json.dump(doc, out, indent=2)
    out.write("\n")
    return code


def _case_key(case: Any) -> str:
    """Identifies a case's example in the captured output, whatever the report added to it
    (property, target, variant, options)."""
    data = dict(case.to_dict()) if hasattr(case, "to_dict") else {"case": case}
    for key in ("property", "target", "variant", "options"):
        data.pop(key, None)
    return json.dumps(data, sort_keys=True, default=str)


def _run_check(args: argparse.Namespace, argv: Sequence[str], out: TextIO, err: TextIO,
               capture: Any) -> tuple[int, dict[str, Any]]:
    """Check every variant of the target; return the exit code and the JSON report.

    The text report is printed as results come, each failure before its case is saved (saving
    cannot lose it: :class:`CaseSaver`). Ctrl-C stops the check: what was found so far is
    reported and saved, and the exit code is :data:`EXIT_INTERRUPTED`.
    """
    from tpsim.errors import InvalidArgument
    from tpsim.props.described import describe_target
    from tpsim.props.family import family_of
    from tpsim.props.search import SearchInterrupted, search

    options = {k: getattr(args, k) for k in ("convention", "kind", "input", "output", "input_grad", "packed",
                                             "head_size", "sequence_dim", "plan", "forward_only")}
    options["ctor_arg"] = tuple(args.ctor_arg) if args.ctor_arg else None
    # Repeatable flags as tuples (options must be hashable: they key the resolver's cache).
    options["rank_local"] = tuple(args.rank_local) if args.rank_local else None
    options["param_grad"] = tuple(args.param_grad) if args.param_grad else None
    try:
        # Imported and resolved in a worker process: this one judges, and never runs the checked code.
        variants, _ = describe_target(args.target, options, world_sizes=args.world_sizes, tp_sizes=args.tp_sizes,
                                      timeout=max(args.timeout, 300.0))
    except InvalidArgument as e:
        raise UsageError(f"cannot check {args.target!r}: {e}", prog="tpsim check") from None

    settings = {
        "backend": args.backend,
        "world_sizes": list(args.world_sizes),
        "tp_sizes": list(args.tp_sizes) if args.tp_sizes else None,
        "dtypes": list(args.dtypes),
        "max_examples": args.max_examples,
        "max_size": args.max_size,
        "seed": args.seed,
        "timeout": args.timeout,
        "faults": list(args.faults) if args.faults else None,
        "cases_dir": args.cases_dir,
    }
    text = args.report == "text"
    total = len(variants)
    if text:
        print(
            f"tpsim check {args.target}: {total} variant{'s' if total != 1 else ''} on {args.backend}, "
            f"world sizes {','.join(map(str, args.world_sizes))}, "
            + (f"tp sizes {','.join(map(str, args.tp_sizes))}, " if args.tp_sizes else "")
            + f"dtypes {','.join(args.dtypes)}, "
            f"up to {args.max_examples} examples each"
            + (f", seed {args.seed}" if args.seed is not None else "")
            + (f", faults {','.join(args.faults)}" if args.faults else ""),
            file=out,
        )
        out.flush()
    width = max(len(v.name) for v in variants)
    saver = CaseSaver(args.cases_dir, args.backend, argv)
    results: list[_VariantResult] = []
    extras: dict[int, dict[str, Any]] = {}  # id(failure) -> what the JSON report adds to it
    interrupted = False
    start = time.monotonic()
    try:
        for variant in variants:
            progress = _Progress(variant.name, args.max_examples, err)

            def on_example(n: int, case: Any, progress: _Progress = progress) -> None:
                progress(n, case)
                if capture is not None:
                    capture.next_example(_case_key(case))

            started_v = time.monotonic()
            try:
                report = search(variant, world_sizes=args.world_sizes, tp_sizes=args.tp_sizes, dtypes=args.dtypes,
                                max_examples=args.max_examples, seed=args.seed, backend=args.backend,
                                timeout=args.timeout, on_example=on_example, max_size=args.max_size,
                                isolate=True)
            except SearchInterrupted as stop:
                report, interrupted = stop.report, True
            except InvalidArgument as e:
                if total == 1:
                    raise UsageError(f"cannot check {variant.name!r}: {e}", prog="tpsim check") from None
                # One variant among several: refused in its place; the others are still checked.
                refusal = f"cannot check {variant.name!r}: {e}"
                print(f"tpsim check: error: {refusal}", file=err)
                result = _VariantResult(variant, False, 0, time.monotonic() - started_v, refused=refusal)
                results.append(result)
                _report_variant(result, width, saver, capture, extras, out if text else None)
                continue
            finally:
                progress.close()
                if capture is not None:
                    capture.end_example()
            failures, examples = list(report.failures), int(report.examples)
            if args.faults and not interrupted:
                try:
                    fault_failures, fault_examples = _fault_failures(variant, args)
                    failures += fault_failures
                    examples += fault_examples
                except KeyboardInterrupt:
                    interrupted = True
                except InvalidArgument as e:
                    raise UsageError(f"cannot check {variant.name!r}: {e}", prog="tpsim check") from None
            notes = list(dict.fromkeys([*variant.notes, *getattr(report, "notes", ())]))
            result = _VariantResult(variant, not failures, examples, time.monotonic() - started_v, failures, notes,
                                    dict(getattr(report, "verdicts", None) or {}))
            results.append(result)
            _report_variant(result, width, saver, capture, extras, out if text else None)
            if interrupted:
                break
    except KeyboardInterrupt:
        # Between searches: every result above is already reported and saved.
        interrupted = True
    seconds = time.monotonic() - start
    passed = all(r.passed for r in results)
    examples = sum(r.examples for r in results)
    all_failures = [f for r in results for f in r.failures]
    plural = "s" if len(results) != 1 else ""
    if text:
        if interrupted:
            print(f"interrupted: {len(all_failures)} failing propert{'ies' if len(all_failures) != 1 else 'y'} found "
                  f"so far in {len(results)} of {total} variant{'s' if total != 1 else ''} ({examples} examples, "
                  f"{seconds:.1f}s)" + ("; their cases are saved above" if all_failures else ""), file=out)
        elif passed:
            print(f"all properties hold: {len(results)} variant{plural}, {examples} examples, {seconds:.1f}s", file=out)
        elif not all_failures:
            refused = sum(1 for r in results if r.refused)
            print(f"{refused} of {len(results)} variant{plural} refused (see above); the others hold ({examples} "
                  f"examples, {seconds:.1f}s)", file=out)
        else:
            bad = sum(1 for r in results if r.failures)
            refused = sum(1 for r in results if r.refused)
            # The summary counts causes; the consequences listed under each are not counted again.
            props = len({(id(r), g.property) for r in results for f in r.failures
                         for g in (f, *(getattr(f, "consequences", None) or []))})
            print(f"{len(all_failures)} cause{'s' if len(all_failures) != 1 else ''} of failure ({props} failing "
                  f"propert{'ies' if props != 1 else 'y'}) in {bad} of "
                  f"{len(results)} variant{plural}" + (f" ({refused} refused)" if refused else "")
                  + f" ({examples} examples, {seconds:.1f}s); replay a case with the command above", file=out)
    if interrupted:
        print("tpsim check: interrupted", file=err)
    doc = {
        "tpsim_version": _version(),
        "command": "check",
        "target": args.target,
        "settings": settings,
        "passed": passed and not interrupted,
        "interrupted": interrupted,
        "examples": examples,
        "seconds": round(seconds, 3),
        "failures": [_failure_dict(f, extras.get(id(f))) for f in all_failures],
        "variants": [
            {
                "name": r.variant.name,
                "target": r.variant.target,
                "description": r.variant.describe(),
                "family": family_of(r.variant).name,
                "kind": r.variant.kind,
                "input": r.variant.input,
                "output": r.variant.output,
                "input_grad": r.variant.input_grad,
                "bias": r.variant.bias,
                "passed": r.passed,
                **({"refused": r.refused} if r.refused else {}),
                "examples": r.examples,
                "seconds": round(r.seconds, 3),
                "notes": r.notes,
                # The full failures are listed once, above; here what identifies each.
                "failures": [
                    {"property": f.property, "diagnosis": f.diagnosis, "case_file": f.case_file}
                    for f in r.failures
                ],
                # Every property's verdict (pass / fail / not-applicable, with its diagnoses).
                "verdicts": r.verdicts,
            }
            for r in results
        ],
    }
    if interrupted:
        return EXIT_INTERRUPTED, doc
    if all_failures or passed:
        return (EXIT_OK if passed else EXIT_FAILED), doc
    return EXIT_USAGE, doc  # refused variants, and nothing failed


def _report_variant(result: _VariantResult, width: int, saver: CaseSaver, capture: Any,
                    extras: dict[int, dict[str, Any]], out: TextIO | None) -> None:
    """Save each failure's case, then print the variant's result (``out`` None: the JSON report
    prints it all at the end): a case is on disk before anything is printed, so neither a closed
    pipe nor a full disk on stdout can lose it."""
    for failure in result.failures:
        if getattr(failure, "variant", None) is None:
            failure.variant = result.variant.name
        extra: dict[str, Any] = {}
        if capture is not None:
            printed = capture.output_for(_case_key(failure.case))
            if printed:
                extra["output"] = printed
        note = saver.save(failure, result.variant)
        if note:
            extra["case_file_note"] = note
        extras[id(failure)] = extra
    if out is None:
        return
    status = "PASS" if result.passed else "REFUSED" if result.refused else "FAIL"
    print(f"{status} {result.variant.name:<{width}}  {result.examples:>4} examples  {result.seconds:6.1f}s",
          file=out)
    for note in result.notes:
        print(f"     note: {note}", file=out)
    if result.refused:
        print(f"    {result.refused}", file=out)
        return
    for failure in result.failures:
        extra = extras[id(failure)]
        _failure_block(failure, out)
        if extra.get("output"):
            _printed_block(extra["output"], out)
        _case_file_block(failure, extra.get("case_file_note"), out)
        out.flush()
    out.flush()


# --- replay --------------------------------------------------------------------------------------


def _is_inside(path: str, directory: str) -> bool:
    real, base = os.path.realpath(path), os.path.realpath(directory)
    return real == base or real.startswith(base.rstrip(os.sep) + os.sep)


def _replay_target(case: Any, case_file: str, found: dict[str, Any], allow_outside: bool) -> tuple[str, str | None]:
    """The target to resolve and the file it imports (None when the target cannot be located
    without importing it).

    A case file is data, so it does not decide what code runs: a target *file* is imported only
    from the current directory or the case file's own directory (a relative path is looked up in
    that order; symbolic links are followed before the check). ``allow_outside`` lifts the limit,
    also for a relative path that only exists under the directory the case was found in
    (``found.cwd``, otherwise informational). A dotted module is imported the usual way (the
    current directory, then the installed packages): the case file cannot change where.
    """
    target = case.target
    module_part, sep, attr = target.partition(":")
    from tpsim._target_files import path_of_module_name

    encoded = path_of_module_name(module_part)
    if encoded is not None:  # the name tpsim imports a file under: the file's rule, not a module's
        module_part = encoded
    is_path = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    if not is_path:
        return target, None  # a dotted module: the worker that imports it says which file it is
    cwd, case_dir = os.getcwd(), os.path.dirname(os.path.abspath(case_file))
    places = [cwd, case_dir]
    candidates = [module_part] if os.path.isabs(module_part) else [os.path.join(p, module_part) for p in places]
    existing = [c for c in candidates if os.path.isfile(c)]
    inside = [c for c in existing if any(_is_inside(c, p) for p in places)]
    if inside:
        return os.path.realpath(inside[0]) + sep + attr, os.path.realpath(inside[0])
    origin = found.get("cwd")
    if isinstance(origin, str) and not os.path.isabs(module_part) and os.path.isfile(os.path.join(origin, module_part)):
        existing.append(os.path.join(origin, module_part))
    if existing and allow_outside:
        return os.path.realpath(existing[0]) + sep + attr, os.path.realpath(existing[0])
    if existing:
        raise UsageError(
            f"case file {case_file!r} names the target file {os.path.realpath(existing[0])!r}, outside the current "
            f"directory and the case file's directory; replay imports target files only from there (pass "
            "--allow-outside-target to import it anyway)",
            prog="tpsim replay",
        )
    raise UsageError(
        f"cannot replay {case_file!r}: target file {module_part!r} is in neither the current directory ({cwd}) nor "
        f"the case file's directory ({case_dir})"
        + (f"; the case was found in {origin}" if isinstance(origin, str) else ""),
        prog="tpsim replay",
    )


def _replay_options(case: Any, args: argparse.Namespace, found: dict[str, Any]) -> Any:
    """The case's options, each ``--rank-local`` file held to the rule of a target file (a case file
    is data: it cannot make replay import a file the user did not point at)."""
    from types import SimpleNamespace

    options = dict(case.options)
    specs = options.get("rank_local")
    if specs:
        specs = [specs] if isinstance(specs, str) else list(specs)
        kept = []
        for spec in specs:
            if isinstance(spec, str) and _target_file(spec) is not None:
                spec, _ = _replay_target(SimpleNamespace(target=spec), args.case_file, found, args.allow_outside_target)
            kept.append(spec)
        options["rank_local"] = tuple(kept)
    return options


def _check_world_size(world_size: int, backend: str, prog: str, what: str) -> None:
    """Refuse a world too large for ``backend`` here before any rank starts (exit 2); the limit
    and its override are the backends' (:func:`tpsim.comm.limits.check_world_size`)."""
    from tpsim.comm.limits import check_world_size
    from tpsim.errors import InvalidArgument

    try:
        check_world_size(world_size, backend)
    except InvalidArgument as e:
        raise UsageError(f"{what}: {e}", prog=prog) from None


def _replay_faults(variant: Any, case: Any, backend: str, timeout: float) -> list[Any]:
    """The fault-detection property on a case that carries its fault plan."""
    from tpsim.diagnosis import Failure
    from tpsim.props.faults import FaultNotSurfaced, fault_detection

    try:
        fault_detection(variant, case, backend=backend, timeout=min(timeout, FAULT_TIMEOUT),
                        isolate=backend == "inproc")
    except FaultNotSurfaced as e:
        plan = ", ".join(str(f) for f in e.report.plan)
        return [Failure(FAULT_PROPERTY, FAULT_DIAGNOSIS, f"under the fault plan [{plan}]: {e.report.message}",
                        case=case, variant=variant.name, details={"outcome": e.report.outcome})]
    return []


def _replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from tpsim.errors import InvalidArgument
    from tpsim.props.case import load_case
    from tpsim.props.described import describe_target
    from tpsim.props.family import family_of_case

    try:
        case, found = load_case(args.case_file)
    except InvalidArgument as e:  # CaseFileError is one
        raise UsageError(str(e), prog="tpsim replay") from None
    if not case.target or not case.variant:
        raise UsageError(
            f"case file {args.case_file!r} names no variant (target={case.target!r}, variant={case.variant!r}); "
            "it cannot be replayed",
            prog="tpsim replay",
        )
    backend = args.backend or "inproc"
    _check_world_size(case.world_size, backend, "tpsim replay", f"case file {args.case_file!r}")
    if backend == "nccl":
        _nccl_check(case.world_size, "tpsim replay")
    try:
        target, imports = _replay_target(case, args.case_file, found, args.allow_outside_target)
        # Imported and resolved in a worker process: this one judges, and never runs the checked code.
        variants, origin = describe_target(target, _replay_options(case, args, found), world_sizes=(case.world_size,),
                                           tp_sizes=(case.tp_size or case.world_size,),
                                           timeout=max(args.timeout, 300.0))
        imports = imports or origin
        variant = next((v for v in variants if v.name == case.variant), None)
        if variant is None:
            raise InvalidArgument(f"{target!r} declares no variant named {case.variant!r}")
    except UsageError:
        raise
    except InvalidArgument as e:
        raise UsageError(f"cannot replay {args.case_file!r}: {e}", prog="tpsim replay") from None
    start = time.monotonic()
    capture = None
    if args.report == "json":
        from tpsim.capture import StdoutCapture

        capture = StdoutCapture()  # stdout holds the JSON report alone (see _check)
    with capture or contextlib.nullcontext():
        if getattr(case, "faults", ()) or case.property == FAULT_PROPERTY:
            failures = _replay_faults(variant, case, backend, args.timeout)
        else:
            # The case's family (linear layer, whole module, ...) checks it.
            failures = family_of_case(case).check_case(variant, case, backend=backend, timeout=args.timeout,
                                                       isolate=True)
    printed = capture.outside() if capture is not None else {}
    seconds = time.monotonic() - start
    for failure in failures:
        failure.case_file = args.case_file
        if getattr(failure, "variant", None) is None:
            failure.variant = variant.name
    recorded = (found.get("property"), found.get("diagnosis"))
    reproduced = any((f.property, f.diagnosis) == recorded for f in failures)
    if args.report == "json":
        doc = {
            "tpsim_version": _version(),
            "command": "replay",
            "case_file": args.case_file,
            "target": case.target,
            "target_file": imports,
            "variant": case.variant,
            "backend": backend,
            "passed": not failures,
            "examples": 1,
            "seconds": round(seconds, 3),
            "recorded": jsonable(found),
            "reproduced": reproduced,
            "failures": [_failure_dict(f, {"output": printed} if printed else None) for f in failures],
        }
        if printed and not failures:
            doc["output"] = printed
        json.dump(doc, out, indent=2)
        out.write("\n")
        return EXIT_FAILED if failures else EXIT_OK
    where = f" on {found['backend']}" if found.get("backend") else ""
    print(f"tpsim replay {args.case_file}: {case.variant} ({case.target}) on {backend}", file=out)
    print(f"  imports:  {imports or case.target}", file=out)
    print(f"  case:     {case.describe()}", file=out)
    if recorded[0]:
        label = f"{found['sublayer']}: {recorded[1]}" if found.get("sublayer") else recorded[1]
        print(f"  recorded: {recorded[0]}: {label}{where}", file=out)
    if not failures:
        print(f"PASS every property holds on this case now ({seconds:.1f}s)", file=out)
        return EXIT_OK
    for failure in failures:
        _failure_block(failure, out, replaying=True)
    if not recorded[0]:
        verdict = "the case fails"
    elif reproduced:
        verdict = f"reproduced: {recorded[0]}: {recorded[1]}, as recorded{where}"
    else:
        verdict = f"fails differently from the recorded {recorded[0]}: {recorded[1]}{where}"
    print(f"FAIL {verdict} ({seconds:.1f}s)", file=out)
    if backend != "gloo":
        print(f"  on real process groups: {_replay_command(args.case_file, 'gloo', target=case.target)}", file=out)
    return EXIT_FAILED


# --- entry point ---------------------------------------------------------------------------------


def _version() -> str:
    from tpsim import __version__

    return __version__


def _shared_state_message(err: Exception) -> str:
    """The error's message, naming a target file by its path where it says ``--rank-local``
    (a file is imported under a generated module name the user never typed)."""
    from tpsim._target_files import path_of_module_name

    text = str(err)
    module = getattr(err, "module", "") or ""
    if module.startswith("tpsim_target_"):
        path = path_of_module_name(module)
        if path:
            rel = os.path.relpath(path)
            # ... and its globals as the file names them (layer.py:workspace), not by the generated name.
            text = text.replace(f"--rank-local {module}", f"--rank-local {shlex.quote(rel)}").replace(
                f"{module}.", f"{rel}:")
    return text


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tpsim`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code.

    This process parses the command line and writes the report; the command itself runs in a
    session worker process (:mod:`tpsim.session`), so the checked code cannot change either."""
    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = sys.stdout, sys.stderr
    # Like ``python -m``: modules in the working directory are importable as targets, also from
    # the console script (whose sys.path[0] is its bin directory). Worker processes inherit it.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        parser = build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:  # --help / --version
            return int(exit_.code or 0)
        if args.command is None:
            parser.print_usage(err)
            print("tpsim: error: name a command: check, replay or zoo (see 'tpsim --help')", file=err)
            return EXIT_USAGE
    except UsageError as e:
        print(f"{e.prog}: error: {e}", file=err)
        return EXIT_USAGE
    except Exception:
        print("tpsim: internal error (a bug in tpsim; please report it with this traceback):", file=err)
        traceback.print_exc(file=err)
        return EXIT_INTERNAL
    if args.command == "zoo" and args.shard is None:
        # The parent of a zoo run lists families and starts the shards (each a supervised session); it
        # runs no checked code itself.
        from tpsim import zoo

        _zoo_defaults(args, argv)
        try:
            return zoo.run_parent(args, out, err)
        except KeyboardInterrupt:
            print("tpsim zoo: interrupted", file=err)
            return EXIT_INTERRUPTED
    # --- session: the target is imported and run in a supervised worker, never here (tpsim.session)
    from tpsim import session

    subject = {"check": getattr(args, "target", None), "replay": getattr(args, "case_file", None)}.get(
        args.command) or " ".join(getattr(args, "libraries", ()))
    codes = {"failed": EXIT_FAILED, "usage": EXIT_USAGE, "internal": EXIT_INTERNAL, "interrupted": EXIT_INTERRUPTED}
    return session.supervise(argv, out, err, runner=run_command, codes=codes, version=_version(),
                             command=args.command, subject=subject, json_report=getattr(args, "report", "") == "json")


def _zoo_defaults(args: argparse.Namespace, argv: Sequence[str]) -> None:
    """A whole zoo run writes docs/zoo.md, docs/zoo.json and docs/zoo_cases; a run of some families the
    table to stdout and its cases where tpsim check saves them, unless told otherwise."""
    whole = args.families is None
    args.cases_dir = args.cases_dir or (ZOO_CASES_DIR if whole else DEFAULT_CASES_DIR)
    if whole:
        args.out = args.out or ZOO_OUT
        args.json = args.json or ZOO_JSON
    args.argv = list(argv)


def run_command(argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    """Run a ``check`` or ``replay`` command line here (in the session worker); return its exit code."""
    from tpsim.errors import BackendUnavailable, SharedModuleState

    argv = list(argv)
    try:
        args = build_parser().parse_args(argv)
        if args.command == "check":
            return _check(args, argv, out, err)
        if args.command == "zoo":
            from tpsim.zoo import run_shard

            return run_shard(args, err)
        return _replay(args, out, err)
    except UsageError as e:
        print(f"{e.prog}: error: {e}", file=err)
        return EXIT_USAGE
    except BackendUnavailable as e:  # e.g. a process group that cannot start here
        print(f"tpsim: error: {e}", file=err)
        return EXIT_USAGE
    except SharedModuleState as e:  # inproc ranks shared a module global: the fix is the user's to choose
        print(f"tpsim: error: {_shared_state_message(e)}", file=err)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tpsim: interrupted", file=err)
        return EXIT_INTERRUPTED
    except Exception:
        print("tpsim: internal error (a bug in tpsim; please report it with this traceback):", file=err)
        traceback.print_exc(file=err)
        return EXIT_INTERNAL
