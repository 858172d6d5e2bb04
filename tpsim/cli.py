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
import json
import os
import shlex
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

__all__ = ["DEFAULT_CASES_DIR", "EXIT_FAILED", "EXIT_INTERNAL", "EXIT_OK", "EXIT_USAGE", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_INTERNAL = 3

#: Where failing cases are saved unless ``--cases-dir`` says otherwise.
DEFAULT_CASES_DIR = os.path.join(".tpsim", "cases")

BACKEND_CHOICES = ("inproc", "gloo", "nccl")
CONVENTION_CHOICES = ("master-weight", "tp-rank")
KIND_CHOICES = ("column", "row")
INPUT_CHOICES = ("replicated", "sharded", "sequence-sharded")
OUTPUT_CHOICES = ("sharded", "gathered", "partial", "reduced", "sequence-sharded")
INPUT_GRAD_CHOICES = ("complete", "partial")
REPORT_CHOICES = ("text", "json")
DTYPE_CHOICES = ("float64", "float32", "bfloat16", "float16")

DEFAULT_WORLD_SIZES = (1, 2, 3, 4, 8)
_WS_TEXT = ",".join(map(str, DEFAULT_WORLD_SIZES))
DEFAULT_MAX_EXAMPLES = 100
DEFAULT_TIMEOUT = 10.0


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


def _choice(choices: Sequence[str]) -> Callable[[str], str]:
    # Our own check instead of argparse's ``choices``: argparse names the option, this names the
    # value and every choice, on one line.
    def parse(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"invalid value {text!r}; expected one of {', '.join(choices)}")
        return text

    return parse


def _build_parser() -> _Parser:
    from tpsim import __version__

    parser = _Parser(
        prog="tpsim",
        description="Check tensor-parallel layer variants against the dense nn.Linear; replay failing cases.",
        epilog="Exit codes: 0 all properties hold, 1 a property failed, 2 usage/import error, 3 internal error. "
        "See docs/cli.md.",
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
    adapt.add_argument("--convention", type=_choice(CONVENTION_CHOICES), metavar="{master-weight,tp-rank}",
                       help="constructor convention (detected from the signature when unambiguous)")
    adapt.add_argument("--kind", type=_choice(KIND_CHOICES), metavar="{column,row}",
                       help="column- or row-parallel (detected from the class name when it says)")
    adapt.add_argument("--input", type=_choice(INPUT_CHOICES), metavar="{replicated,sharded,sequence-sharded}",
                       help="what each rank is given (default: column replicated, row sharded)")
    adapt.add_argument("--output", type=_choice(OUTPUT_CHOICES),
                       metavar="{sharded,gathered,partial,reduced,sequence-sharded}",
                       help="what each rank returns; partial: the harness sums the ranks' outputs, as the "
                       "caller's all-reduce would")
    adapt.add_argument("--input-grad", dest="input_grad", type=_choice(INPUT_GRAD_CHOICES),
                       metavar="{complete,partial}",
                       help="complete (default): every rank holds the full grad of a replicated input; "
                       "partial: the caller reduces it")
    adapt.add_argument("--packed", type=_packed, default=None, metavar="K|P,P,...",
                       help="a column weight packing K equal parts (gate/up: 2) or parts in these proportions "
                       "(grouped-query QKV: 8,2,2), each sharded on its own: rank r holds shard r of every part")
    adapt.add_argument("--sequence-dim", dest="sequence_dim", type=_sequence_dim, default=None, metavar="D",
                       help="the sequence dim of a sequence-sharded input/output (default -2, the dim before the "
                       "features; dim 0 of a 2-D input)")
    run = check.add_argument_group("the search")
    run.add_argument("--backend", type=_choice(BACKEND_CHOICES), default="inproc",
                     metavar="{inproc,gloo,nccl}", help="where ranks run (default: inproc)")
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
    run.add_argument("--seed", type=_bounded_int(0), default=None, metavar="N",
                     help="seed of the search (default: random); the same seed generates the same cases")
    run.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                     help=f"seconds any collective wait may block (default: {DEFAULT_TIMEOUT:g})")
    run.add_argument("--faults", type=_fault_kinds, default=None, metavar="KIND,...",
                     help="also inject faults of these kinds (drop, crash, delay, corrupt, mismatch) beneath the "
                     "process group and check that the variant reports them (see docs/cli.md)")
    out = check.add_argument_group("output")
    out.add_argument("--report", type=_choice(REPORT_CHOICES), default="text", metavar="{text,json}",
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
                        metavar="{inproc,gloo,nccl}", help="where ranks run (default: inproc)")
    replay.add_argument("--timeout", type=_seconds, default=DEFAULT_TIMEOUT, metavar="S",
                        help=f"seconds any collective wait may block (default: {DEFAULT_TIMEOUT:g})")
    replay.add_argument("--report", type=_choice(REPORT_CHOICES), default="text", metavar="{text,json}",
                        help="json: a JSON report on stdout (default: text)")
    return parser


# --- output helpers ------------------------------------------------------------------------------


def _replay_command(path: str, backend: str | None = None) -> str:
    cmd = f"tpsim replay {shlex.quote(path)}"
    return cmd + (f" --backend {backend}" if backend else "")


def _case_dict(case: Any) -> Any:
    return case.to_dict() if hasattr(case, "to_dict") else case


def _failure_dict(failure: Any) -> dict[str, Any]:
    """A failure as the JSON report lists it (``property``, ``diagnosis``, ``message``, ``case``,
    ``case_file`` first; then ``variant``, ``rank``, ``replay``, ``details``)."""
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
        "message": failure.message,
        "case": _case_dict(failure.case),
        "case_file": getattr(failure, "case_file", None),
        "variant": getattr(failure, "variant", None),
        "rank": getattr(failure, "rank", None),
    }
    tb = getattr(failure, "traceback", None)
    if tb:
        out["traceback"] = tb
    for key, value in base.items():
        out.setdefault(key, value)
    if out["case_file"]:
        out["replay"] = _replay_command(out["case_file"])
    return _jsonable(out)


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, float) and (value != value or value in (float("inf"), float("-inf"))):
        return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _indent(text: str, prefix: str) -> str:
    return "\n".join(prefix + line if line else line for line in text.splitlines())


def _describe_case(case: Any) -> str:
    describe = getattr(case, "describe", None)
    return describe() if describe is not None else str(case)


def _failure_block(failure: Any, out: TextIO, *, replaying: bool = False) -> None:
    """What a person reads: property, diagnosis, message, minimal case, case file, replay
    (when replaying, the case and its file are already in the heading)."""
    print(f"  FAILED {failure.property}: {failure.diagnosis}", file=out)
    message = failure.message
    tb = getattr(failure, "traceback", None)
    if tb and tb.strip() not in message:
        message = f"{message}\n--- traceback on rank {failure.rank} ---\n{tb.rstrip()}"
    print(_indent(message, "    "), file=out)
    if replaying:
        return
    print(f"    minimal case: {_describe_case(failure.case)}", file=out)
    case_file = getattr(failure, "case_file", None)
    if case_file:
        print(f"    case file:    {case_file}", file=out)
        print(f"    replay:       {_replay_command(case_file)}", file=out)
        print(f"    on gloo:      {_replay_command(case_file, 'gloo')}", file=out)


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


def _nccl_check(world_size: int, prog: str) -> None:
    from tpsim.comm.procs import nccl_unavailable_reason

    reason = nccl_unavailable_reason(world_size)
    if reason is not None:
        raise UsageError(f"backend nccl cannot run here: {reason}; use --backend gloo or inproc", prog=prog)


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
FAULT_PROPERTY = "fault-detection"
FAULT_DIAGNOSIS = "fault-not-surfaced"


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


def _save(failure: Any, variant: Any, cases_dir: str, backend: str, argv: Sequence[str]) -> None:
    from tpsim.props.case import save_failure

    command = "tpsim " + " ".join(shlex.quote(a) for a in argv)
    save_failure(failure, variant, cases_dir, backend=backend, command=command)


def _declared_mlps(args: argparse.Namespace, options: dict[str, Any]) -> list[Any]:
    """The MLPs a bare module target declares (none when options adapt the linear variants)."""
    if any(v is not None for v in options.values()) or getattr(args, "tp_sizes", None):
        return []
    from tpsim.props.sequence import declared_mlps

    return declared_mlps(args.target)


def _check_mlps(args: argparse.Namespace, mlps: list[Any], out: TextIO, width: int) -> list[_VariantResult]:
    """The MLPs a bare module target declares (``TPSIM_MLPS``; ``tpsim.layers``: the gated
    ``ParallelMLP``, with and without sequence parallelism), checked against the dense MLP on a
    few small cases each (:func:`tpsim.props.sequence.search_mlp`). Skipped when options adapt the
    linear variants or tp sizes are given. Their cases are not saved (``tpsim replay`` replays
    linear-layer cases)."""
    from tpsim.props.sequence import MLP_MAX_EXAMPLES, search_mlp

    results = []
    for mlp in mlps:
        report = search_mlp(mlp, world_sizes=args.world_sizes, dtypes=args.dtypes,
                            max_examples=min(args.max_examples, MLP_MAX_EXAMPLES), seed=args.seed,
                            backend=args.backend, timeout=args.timeout)
        result = _VariantResult(mlp, report.passed, report.examples, report.seconds, list(report.failures),
                                list(report.notes))
        results.append(result)
        if args.report == "text":
            status = "PASS" if result.passed else "FAIL"
            print(f"{status} {mlp.name:<{width}}  {result.examples:>4} examples  {result.seconds:6.1f}s", file=out)
            for note in result.notes:
                print(f"     note: {note}", file=out)
            for failure in result.failures:
                _failure_block(failure, out)
            out.flush()
    return results


def _check(args: argparse.Namespace, argv: Sequence[str], out: TextIO, err: TextIO) -> int:
    from tpsim.comm._torchrun import launched_world
    from tpsim.errors import InvalidArgument
    from tpsim.target import resolve_target

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
    if args.backend == "nccl":
        _nccl_check(max(args.world_sizes), "tpsim check")
    options = {k: getattr(args, k) for k in ("convention", "kind", "input", "output", "input_grad", "packed",
                                             "sequence_dim")}
    try:
        variants = resolve_target(args.target, **options)
    except InvalidArgument as e:
        raise UsageError(f"cannot check {args.target!r}: {e}", prog="tpsim check") from None

    from tpsim.props.search import search

    settings = {
        "backend": args.backend,
        "world_sizes": list(args.world_sizes),
        "tp_sizes": list(args.tp_sizes) if args.tp_sizes else None,
        "dtypes": list(args.dtypes),
        "max_examples": args.max_examples,
        "seed": args.seed,
        "timeout": args.timeout,
        "faults": list(args.faults) if args.faults else None,
        "cases_dir": args.cases_dir,
    }
    text = args.report == "text"
    mlps = _declared_mlps(args, options)
    total = len(variants) + len(mlps)
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
    width = max(len(v.name) for v in [*variants, *mlps])
    results: list[_VariantResult] = []
    start = time.monotonic()
    for variant in variants:
        progress = _Progress(variant.name, args.max_examples, err)
        started_v = time.monotonic()
        kwargs: dict[str, Any] = dict(
            world_sizes=args.world_sizes,
            tp_sizes=args.tp_sizes,
            dtypes=args.dtypes,
            max_examples=args.max_examples,
            seed=args.seed,
            backend=args.backend,
            timeout=args.timeout,
            on_example=progress,
        )
        try:
            report = search(variant, **kwargs)
            failures, examples = list(report.failures), int(report.examples)
            if args.faults:
                fault_failures, fault_examples = _fault_failures(variant, args)
                failures += fault_failures
                examples += fault_examples
        except InvalidArgument as e:
            raise UsageError(f"cannot check {variant.name!r}: {e}", prog="tpsim check") from None
        finally:
            progress.close()
        for failure in failures:
            if getattr(failure, "variant", None) is None:
                failure.variant = variant.name
            _save(failure, variant, args.cases_dir, args.backend, argv)
        notes = list(dict.fromkeys([*variant.notes, *getattr(report, "notes", ())]))
        seconds_v = time.monotonic() - started_v
        result = _VariantResult(variant, not failures, examples, seconds_v, failures, notes)
        results.append(result)
        if text:
            status = "PASS" if result.passed else "FAIL"
            print(f"{status} {variant.name:<{width}}  {result.examples:>4} examples  {result.seconds:6.1f}s", file=out)
            for note in notes:
                print(f"     note: {note}", file=out)
            for failure in failures:
                _failure_block(failure, out)
            out.flush()
    results += _check_mlps(args, mlps, out, width)
    seconds = time.monotonic() - start
    passed = all(r.passed for r in results)
    examples = sum(r.examples for r in results)
    all_failures = [f for r in results for f in r.failures]
    if text:
        if passed:
            print(f"all properties hold: {len(results)} variant{'s' if len(results) != 1 else ''}, "
                  f"{examples} examples, {seconds:.1f}s", file=out)
        else:
            bad = sum(1 for r in results if not r.passed)
            print(f"{len(all_failures)} failing propert{'ies' if len(all_failures) != 1 else 'y'} in {bad} of "
                  f"{len(results)} variant{'s' if len(results) != 1 else ''} ({examples} examples, {seconds:.1f}s); "
                  f"replay a case with the command above", file=out)
    else:
        doc = {
            "tpsim_version": _version(),
            "command": "check",
            "target": args.target,
            "settings": settings,
            "passed": passed,
            "examples": examples,
            "seconds": round(seconds, 3),
            "failures": [_failure_dict(f) for f in all_failures],
            "variants": [
                {
                    "name": r.variant.name,
                    "target": r.variant.target,
                    "description": r.variant.describe(),
                    "kind": r.variant.kind,
                    "input": r.variant.input,
                    "output": r.variant.output,
                    "input_grad": r.variant.input_grad,
                    "bias": r.variant.bias,
                    "passed": r.passed,
                    "examples": r.examples,
                    "seconds": round(r.seconds, 3),
                    "notes": r.notes,
                    # The full failures are listed once, above; here what identifies each.
                    "failures": [
                        {"property": f.property, "diagnosis": f.diagnosis, "case_file": f.case_file}
                        for f in r.failures
                    ],
                }
                for r in results
            ],
        }
        json.dump(doc, out, indent=2)
        out.write("\n")
    return EXIT_OK if passed else EXIT_FAILED


# --- replay --------------------------------------------------------------------------------------


def _replay_target(case: Any, found: dict[str, Any]) -> str:
    """The case's target, with a relative file path made absolute when it only exists relative to
    the directory the case was found from."""
    target = case.target
    module_part, sep, attr = target.partition(":")
    is_path = module_part.endswith(".py") or "/" in module_part or os.sep in module_part
    if is_path and not os.path.isabs(module_part) and not os.path.exists(module_part):
        origin = found.get("cwd")
        if isinstance(origin, str) and os.path.exists(os.path.join(origin, module_part)):
            return os.path.join(origin, module_part) + sep + attr
    return target


def _replay_faults(variant: Any, case: Any, backend: str, timeout: float) -> list[Any]:
    """The fault-detection property on a case that carries its fault plan."""
    from tpsim.diagnosis import Failure
    from tpsim.props.faults import FaultNotSurfaced, fault_detection

    try:
        fault_detection(variant, case, backend=backend, timeout=min(timeout, FAULT_TIMEOUT))
    except FaultNotSurfaced as e:
        plan = ", ".join(str(f) for f in e.report.plan)
        return [Failure(FAULT_PROPERTY, FAULT_DIAGNOSIS, f"under the fault plan [{plan}]: {e.report.message}",
                        case=case, variant=variant.name, details={"outcome": e.report.outcome})]
    return []


def _replay(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from tpsim.errors import InvalidArgument
    from tpsim.props.case import load_case
    from tpsim.props.checks import check_case
    from tpsim.target import resolve_variant

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
    if backend == "nccl":
        _nccl_check(case.world_size, "tpsim replay")
    target = _replay_target(case, found)
    try:
        variant = resolve_variant(target, case.variant, case.options)
    except InvalidArgument as e:
        raise UsageError(f"cannot replay {args.case_file!r}: {e}", prog="tpsim replay") from None
    start = time.monotonic()
    if case.faults or case.property == FAULT_PROPERTY:
        failures = _replay_faults(variant, case, backend, args.timeout)
    else:
        failures = check_case(variant, case, backend=backend, timeout=args.timeout)
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
            "variant": case.variant,
            "backend": backend,
            "passed": not failures,
            "examples": 1,
            "seconds": round(seconds, 3),
            "recorded": _jsonable(found),
            "reproduced": reproduced,
            "failures": [_failure_dict(f) for f in failures],
        }
        json.dump(doc, out, indent=2)
        out.write("\n")
        return EXIT_FAILED if failures else EXIT_OK
    where = f" on {found['backend']}" if found.get("backend") else ""
    print(f"tpsim replay {args.case_file}: {case.variant} ({case.target}) on {backend}", file=out)
    print(f"  case:     {case.describe()}", file=out)
    if recorded[0]:
        print(f"  recorded: {recorded[0]}: {recorded[1]}{where}", file=out)
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
        print(f"  on real process groups: {_replay_command(args.case_file, 'gloo')}", file=out)
    return EXIT_FAILED


# --- entry point ---------------------------------------------------------------------------------


def _version() -> str:
    from tpsim import __version__

    return __version__


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``tpsim`` command with ``argv`` (default: ``sys.argv[1:]``); return the exit code."""
    from tpsim.errors import BackendUnavailable

    argv = list(sys.argv[1:] if argv is None else argv)
    out, err = sys.stdout, sys.stderr
    # Like ``python -m``: modules in the working directory are importable as targets, also from
    # the console script (whose sys.path[0] is its bin directory). Worker processes inherit it.
    if os.getcwd() not in sys.path and "" not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        parser = _build_parser()
        try:
            args = parser.parse_args(argv)
        except SystemExit as exit_:  # --help / --version
            return int(exit_.code or 0)
        if args.command is None:
            parser.print_usage(err)
            print("tpsim: error: name a command: check or replay (see 'tpsim --help')", file=err)
            return EXIT_USAGE
        if args.command == "check":
            return _check(args, argv, out, err)
        return _replay(args, out, err)
    except UsageError as e:
        print(f"{e.prog}: error: {e}", file=err)
        return EXIT_USAGE
    except BackendUnavailable as e:  # e.g. a process group that cannot start here
        print(f"tpsim: error: {e}", file=err)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("tpsim: interrupted", file=err)
        return 130
    except Exception:
        print("tpsim: internal error (a bug in tpsim; please report it with this traceback):", file=err)
        traceback.print_exc(file=err)
        return EXIT_INTERNAL
