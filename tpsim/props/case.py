"""A case: one concrete example a property is checked on, and its small versioned JSON file.

A case is data (DESIGN.md): world size, tp size, in/out features, batch shape, input memory
layout, dtype, bias, seed, fault plan — plus which variant and property it was found with, so
that ``tpsim replay CASE.json`` re-runs exactly that example. The tensors (master weight, bias,
inputs, upstream grads) are not stored: they are re-drawn from ``seed`` (see
:func:`tpsim.props.linear.world.make_masters`), bit for bit.

File format (``schema_version`` 2)::

    {"format": "tpsim-case", "schema_version": 2, "tpsim_version": "0.1.0", "family": "linear",
     "case": {"world_size": 2, "tp_size": 2, "in_features": 4, ...},
     "found": {"property": "...", "diagnosis": "...", "message": "...", "backend": "inproc"}}

``family`` names the family of targets the case belongs to (:mod:`tpsim.props.family`): ``linear``
(:class:`tpsim.props.linear.case.Case`), ``module`` (:class:`tpsim.props.module.case.ModuleCase`), ...; the
family reads its ``case`` object. Schema 1 files have no ``family``: they are linear cases.
Readers accept files of their own schema version or older and refuse newer ones with a clear
message (:class:`CaseFileError`, exit 2 from the CLI).
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import math
import os
from dataclasses import KW_ONLY, dataclass, field
from typing import Any, ClassVar

import torch

from tpsim._json import jsonable
from tpsim.errors import InvalidArgument
from tpsim.variant import DTYPES as VARIANT_DTYPES

__all__ = [
    "CASES_DIR",
    "CaseBase",
    "DTYPES",
    "INPUT_LAYOUTS",
    "MAX_MICRO_BATCHES",
    "MAX_SEED",
    "MAX_TENSOR_ELEMENTS",
    "SCHEMA_VERSION",
    "CaseFileError",
    "case_file_stem",
    "check_training",
    "describe_training",
    "load_case",
    "save_case",
    "save_failure",
]

#: Where failing cases are saved unless told otherwise (the CLI's ``--cases-dir`` default).
CASES_DIR = os.path.join(".tpsim", "cases")

#: Version of the case-file schema this code writes; it reads this version and older ones.
SCHEMA_VERSION = 2
FORMAT = "tpsim-case"

#: dtype names a case can carry, widest first (the order strategies shrink in): the variant
#: description's (:data:`tpsim.variant.DTYPES`), which variants declare theirs from.
DTYPES = VARIANT_DTYPES

#: Memory layouts of the generated input and upstream grads (see :mod:`tpsim.props.layouts`).
INPUT_LAYOUTS = ("contiguous", "transposed", "strided", "expanded")
#: How tp groups smaller than the world are laid out (see :mod:`tpsim.props.groups`).
TP_LAYOUTS = ("consecutive", "strided")

#: The largest seed: ``torch.manual_seed`` takes 64-bit unsigned values.
MAX_SEED = 2**64 - 1
#: Elements one tensor of a case may have (master weight ``[out, in]``, input ``[*batch, in]``):
#: 2**28 float64 elements are 2 GiB. A case file asking for more is refused before anything is
#: allocated, so a hand-edited or hostile file cannot make the checker run out of memory.
MAX_TENSOR_ELEMENTS = 2**28
#: Leading batch dims a case may have.
MAX_BATCH_DIMS = 8
#: Bytes a case file may have (the files tpsim writes are about 1 KiB).
MAX_CASE_FILE_BYTES = 1 << 20
#: Characters of a variant name kept in a case file's name; longer names are cut and a hash of
#: the whole name keeps them apart (file systems refuse names over 255 bytes).
MAX_NAME_CHARS = 80


class CaseFileError(InvalidArgument):
    """A case file is missing, unreadable, corrupt, or written by a newer tpsim (the message says which)."""


def _int(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name}={value!r} must be an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name}={value!r} must be an int <= {maximum}")
    return value


#: The most micro-batches a case's first optimizer step may accumulate (a case file asking for more
#: is refused: every micro-batch is a forward and a backward of the whole world).
MAX_MICRO_BATCHES = 16


def check_training(case: Any) -> None:
    """Validate the training fields of a family that trains: ``micro_batches`` (an int in
    ``1..MAX_MICRO_BATCHES``) and ``set_to_none`` (a bool)."""
    _int(case.micro_batches, "micro_batches", 1, MAX_MICRO_BATCHES)
    if not isinstance(case.set_to_none, bool):
        raise InvalidArgument(f"set_to_none={case.set_to_none!r} must be a bool (optimizer.zero_grad's mode)")


def describe_training(case: Any) -> list[str]:
    """The training fields as ``describe()`` writes them: only where they differ from the defaults."""
    from tpsim.props.rank import MICRO_BATCHES

    out = [] if case.micro_batches == MICRO_BATCHES else [f"micro_batches={case.micro_batches}"]
    return out + ([] if case.set_to_none else ["set_to_none=False"])


def choice(value: Any, name: str, choices: Any) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(f"{name}={value!r}; expected one of {', '.join(choices)}")


def _frozen_option(name: str, value: Any) -> Any:
    """An option value as a case holds it: a JSON scalar, or a list of them as a tuple (hashable:
    resolved targets are cached by their options)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen_option(name, v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise InvalidArgument(f"option {name}={value!r} must be a string, a number, a bool, null or a list of them")


def _shown(value: Any) -> str:
    """A field's value as :meth:`CaseBase.describe` writes it."""
    if isinstance(value, tuple):
        return str(list(value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


@dataclass(frozen=True)
class CaseBase:
    """What every family's case type shares: the common fields' validation, ``describe()``,
    ``to_dict()``/``from_dict()``, ``key()`` and ``replace()``, written once.

    A family's case is a frozen dataclass deriving from this class. Every case has the fields
    ``world_size``, ``batch_shape``, ``dtype``, ``seed``, ``tp_size`` and ``tp_layout`` (declared by
    the family, in the order its positional constructor takes them) and, keyword-only, declared here:
    ``target``, ``variant`` and ``options`` (which variant it was found with), ``property`` (which
    property) and ``faults`` (a fault plan, see :mod:`tpsim.faults`). A family adds its sizes and
    flags and says, in class attributes, how they are read:

    - ``family``: the family's name (written into case files);
    - ``SIZES``: the int fields that size the tensors (at least 1; those in ``MAY_BE_ZERO`` at least
      0, and left out of ``describe()`` when 0); ``SHOWN``: what ``describe()`` writes before the
      batch shape (default: the sizes), ``FLAGS`` after the dtype, ``MORE`` at the end;
    - ``REQUIRED``: the fields its JSON must have (default: ``world_size`` and the sizes);
    - ``TUPLES``: the list fields of its JSON read back as tuples;
    - ``WRITTEN_WHEN_SET``: fields written to its file only when they differ from their default
      (fields added after files of the family were written: the older files keep their names).

    Hooks: ``_check()`` validates the family's own fields, ``_largest()`` gives the elements of the
    case's largest tensor (a case file asking for more than :data:`MAX_TENSOR_ELEMENTS` is refused
    before anything is allocated).
    """

    _: KW_ONLY
    target: str | None = None
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())
    property: str | None = None
    faults: tuple[Any, ...] = ()

    family: ClassVar[str] = "linear"
    SIZES: ClassVar[tuple[str, ...]] = ()
    MAY_BE_ZERO: ClassVar[tuple[str, ...]] = ()
    SHOWN: ClassVar[tuple[str, ...] | None] = None
    FLAGS: ClassVar[tuple[str, ...]] = ()
    MORE: ClassVar[tuple[str, ...]] = ()
    REQUIRED: ClassVar[tuple[str, ...] | None] = None
    TUPLES: ClassVar[tuple[str, ...]] = ("batch_shape",)
    WRITTEN_WHEN_SET: ClassVar[tuple[str, ...]] = ("faults",)

    def __post_init__(self) -> None:
        _int(self.world_size, "world_size", 1)  # type: ignore[attr-defined]
        for name in self.SIZES:
            _int(getattr(self, name), name, 0 if name in self.MAY_BE_ZERO else 1)
        _int(self.seed, "seed", 0, MAX_SEED)  # type: ignore[attr-defined]
        ws = self.world_size  # type: ignore[attr-defined]
        tp = ws if self.tp_size is None else _int(self.tp_size, "tp_size", 1)  # type: ignore[attr-defined]
        if ws % tp:
            raise InvalidArgument(f"tp_size={tp} does not divide world_size={ws}: the world is split into tp groups "
                                  "of tp_size ranks each")
        object.__setattr__(self, "tp_size", tp)
        choice(self.tp_layout, "tp_layout", TP_LAYOUTS)  # type: ignore[attr-defined]
        shape = tuple(self.batch_shape)  # type: ignore[attr-defined]
        if len(shape) > MAX_BATCH_DIMS:
            raise InvalidArgument(f"batch_shape={list(shape)!r} has {len(shape)} dims; at most {MAX_BATCH_DIMS}")
        for s in shape:
            _int(s, "batch_shape entry", 1)
        object.__setattr__(self, "batch_shape", shape)
        self._check()
        self._check_tensors()
        choice(self.dtype, "dtype", DTYPES)  # type: ignore[attr-defined]
        for name in ("target", "variant", "property"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"{name}={value!r} must be a string or null")
        object.__setattr__(self, "faults", tuple(self.faults))  # type: ignore[attr-defined]
        object.__setattr__(self, "options", tuple((str(k), v) for k, v in self.options))  # type: ignore[attr-defined]

    # --- hooks ------------------------------------------------------------------------------------

    def _check(self) -> None:
        """Validate (and normalise) the family's own fields; raise :class:`tpsim.InvalidArgument`."""

    def _largest(self) -> int:
        """The number of elements of the case's largest tensor."""
        raise NotImplementedError

    def _check_tensors(self) -> None:
        if self._largest() > MAX_TENSOR_ELEMENTS:
            raise InvalidArgument(f"{self.describe()} would need tensors of more than {MAX_TENSOR_ELEMENTS} elements")

    def _describe_sizes(self) -> list[str]:
        shown = self.SIZES if self.SHOWN is None else self.SHOWN
        return [f"{n}={_shown(getattr(self, n))}" for n in shown if not (n in self.MAY_BE_ZERO and not getattr(self, n))]

    def _describe_more(self) -> list[str]:
        return [f"{n}={_shown(getattr(self, n))}" for n in self.MORE]

    # --- what every case has ---------------------------------------------------------------------

    @builtins.property  # a family's field ``property`` shadows the builtin inside the class body
    def torch_dtype(self) -> torch.dtype:
        """The case's dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]  # type: ignore[attr-defined]

    @builtins.property
    def rows(self) -> int:
        """The number of input rows, or token positions (the product of the batch shape)."""
        return math.prod(self.batch_shape)  # type: ignore[attr-defined]

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def describe(self) -> str:
        """Short one-line form used in reports (tp groups only when not the default)."""
        parts = [f"world_size={self.world_size}", *self._describe_sizes(),  # type: ignore[attr-defined]
                 f"batch_shape={list(self.batch_shape)}", f"dtype={self.dtype}",  # type: ignore[attr-defined]
                 *(f"{n}={_shown(getattr(self, n))}" for n in self.FLAGS), f"seed={self.seed}"]  # type: ignore[attr-defined]
        if self.tp_size != self.world_size:  # type: ignore[attr-defined]
            parts.append(f"tp_size={self.tp_size} tp_layout={self.tp_layout}")  # type: ignore[attr-defined]
        return " ".join([*parts, *self._describe_more()])

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (lists for tuples, an object for the options): the family's fields, then the
        common keyword-only ones."""
        out: dict[str, Any] = {}
        common = {f.name for f in dataclasses.fields(CaseBase)}
        fields = dataclasses.fields(self)  # type: ignore[arg-type]
        for f in [f for f in fields if f.name not in common] + [f for f in fields if f.name in common]:
            value = getattr(self, f.name)
            if f.name in self.WRITTEN_WHEN_SET and value == (f.default if f.default is not dataclasses.MISSING
                                                             else f.default_factory()):  # type: ignore[misc]
                continue
            if f.name == "options":
                value = {k: v for k, v in value}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Inverse of :meth:`to_dict`; raises :class:`tpsim.InvalidArgument` naming a bad field."""
        if not isinstance(data, dict):
            raise InvalidArgument(f"a {cls._what()} must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
        if unknown:
            raise InvalidArgument(f"unknown {cls._what()} field(s) {sorted(unknown)}")
        required = cls.REQUIRED or ("world_size", *(n for n in cls.SIZES if n not in cls.MAY_BE_ZERO))
        missing = [n for n in required if n not in data]
        if missing:
            raise InvalidArgument(f"{cls._what()} is missing field(s) {missing}")
        values = dict(data)
        for key in (*cls.TUPLES, "faults"):
            if key in values:
                if key == "faults" and values[key] is None:
                    values[key] = []
                if not isinstance(values[key], list):
                    raise InvalidArgument(f"{key}={values[key]!r} must be a list"
                                          + (" of faults" if key == "faults" else ""))
                values[key] = tuple(values[key])
        if "options" in values:
            opts = values["options"] or {}
            if not isinstance(opts, dict):
                raise InvalidArgument(f"options={opts!r} must be an object")
            values["options"] = tuple(sorted((k, _frozen_option(k, v)) for k, v in opts.items()))
        case = cls(**values)
        if case.faults:
            # The plan must be one tpsim can inject (kinds, ranks, calls), checked before any run.
            from tpsim.faults import check_plan, parse_plan

            check_plan(parse_plan(case.faults), case.world_size)
        return case

    @classmethod
    def _what(cls) -> str:
        return "case" if cls.family == "linear" else f"{cls.family} case"

    def key(self) -> str:
        """A short stable hash of the case (names its case file): of its dict and its family (linear
        cases, the first family, hash their dict alone, so their files keep the names they had)."""
        data = self.to_dict() if self.family == "linear" else {"family": self.family, **self.to_dict()}
        return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:10]


def _safe(text: str) -> str:
    # ASCII letters, digits, "_" and "." only: the name is the same on every file system.
    return "".join(c if (c.isascii() and c.isalnum()) or c in "_." else "_" for c in text)


def case_file_stem(case: CaseBase) -> str:
    """``<variant>-<property>-<hash>``: the case file's name without ``.json``.

    A variant name longer than :data:`MAX_NAME_CHARS` is cut and followed by ``~`` and a hash of
    the whole name, so two long names sharing a prefix still get different files.
    """
    variant = _safe(case.variant or "case")
    if len(variant) > MAX_NAME_CHARS:
        digest = hashlib.sha256((case.variant or "").encode("utf-8", "surrogatepass")).hexdigest()[:8]
        variant = f"{variant[:MAX_NAME_CHARS]}~{digest}"
    return "-".join((variant, _safe(case.property or "any")[:MAX_NAME_CHARS], case.key()))


def save_case(case: CaseBase, directory: str, *, found: dict[str, Any] | None = None) -> str:
    """Write ``case`` as ``DIRECTORY/<variant>-<property>-<hash>.json``; return the path.

    The same case always gets the same file name, so finding the same bug again overwrites it.
    """
    from tpsim import __version__

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{case_file_stem(case)}.json")
    doc = {
        "format": FORMAT,
        "schema_version": SCHEMA_VERSION,
        "tpsim_version": __version__,
        "family": getattr(case, "family", "linear"),
        "case": case.to_dict(),
        "found": found or {},
    }
    if case.family == "linear" and case.input_layout != "contiguous":
        # Informational (readers ignore it): the memory layout the case's tensors had.
        from tpsim.props.layouts import layout_info

        doc["layout"] = {
            "input": layout_info((*case.batch_shape, case.in_features), case.input_layout),
            "upstream_grad": layout_info((*case.batch_shape, case.out_features), case.input_layout),
        }
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as fh:
        json.dump(doc, fh, indent=2, sort_keys=True)
        fh.write("\n")
    os.replace(tmp, path)  # atomic: a reader never sees half a file
    return path



#: Characters of a failure's message and traceback a case file keeps (a report shows fewer); the
#: file stays well under :data:`MAX_CASE_FILE_BYTES`, so it can always be replayed.
CASE_TEXT_CHARS = 200_000


def _kept(text: Any) -> Any:
    if not isinstance(text, str) or len(text) <= CASE_TEXT_CHARS:
        return text
    half = CASE_TEXT_CHARS // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} more characters] ...\n{text[-half:]}"


def save_failure(failure: Any, variant: Any, directory: str = CASES_DIR, *, backend: str, command: str) -> str:
    """Save ``failure``'s minimal case (completed with its variant's target) and return the path.

    Used by ``tpsim check`` and by :func:`tpsim.props.suite.property_tests`, so a failure found
    either way replays with ``tpsim replay PATH``. Sets ``failure.case`` and ``failure.case_file``.
    """
    case = failure.case
    changes: dict[str, Any] = {"property": failure.property}
    if case.target is None:
        changes["target"] = variant.target
    if case.variant is None:
        changes["variant"] = variant.name
    if not case.options:
        changes["options"] = variant.options
    case = case.replace(**changes)
    found = {
        "property": failure.property,
        "diagnosis": failure.diagnosis,
        "sublayer": getattr(failure, "sublayer", None),
        "message": _kept(failure.message),
        "traceback": _kept(getattr(failure, "traceback", None)),
        "rank": getattr(failure, "rank", None),
        "backend": backend,
        # Relative file targets are resolved against the directory they were found from.
        "cwd": os.getcwd(),
        "command": command,
    }
    failure.case = case
    failure.case_file = save_case(case, directory, found=jsonable(found))
    return failure.case_file


def load_case(path: str) -> tuple[CaseBase, dict[str, Any]]:
    """Read a case file; return ``(case, found)``. Raises :class:`CaseFileError` with the reason."""
    try:
        with open(path, "rb") as fh:
            data = fh.read(MAX_CASE_FILE_BYTES + 1)
    except FileNotFoundError:
        raise CaseFileError(f"case file {path!r} does not exist") from None
    except OSError as err:
        raise CaseFileError(f"cannot read case file {path!r}: {err.strerror or err}") from None
    if len(data) > MAX_CASE_FILE_BYTES:
        raise CaseFileError(f"case file {path!r} is larger than {MAX_CASE_FILE_BYTES} bytes; tpsim writes about 1 KiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise CaseFileError(f"case file {path!r} is not UTF-8 text (byte {err.start}: {err.reason})") from None
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as err:
        raise CaseFileError(f"case file {path!r} is not valid JSON (line {err.lineno}: {err.msg})") from None
    except RecursionError:
        raise CaseFileError(f"case file {path!r} is nested too deeply to be a case file") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise CaseFileError(f"{path!r} is not a tpsim case file (no \"format\": \"{FORMAT}\")")
    version = doc.get("schema_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise CaseFileError(f"case file {path!r} has schema_version={version!r}; expected an int >= 1")
    if version > SCHEMA_VERSION:
        raise CaseFileError(
            f"case file {path!r} has schema_version={version}, newer than this tpsim reads ({SCHEMA_VERSION}); "
            "upgrade tpsim to replay it"
        )
    try:
        # Schema 1 knew linear cases only; from schema 2 the file names its family.
        from tpsim.props.family import family_named

        case = family_named(doc.get("family", "linear") if version >= 2 else "linear").case_from_dict(doc.get("case"))
    except InvalidArgument as err:
        raise CaseFileError(f"case file {path!r} is corrupt: {err}") from None
    found = doc.get("found") or {}
    if not isinstance(found, dict):
        raise CaseFileError(f"case file {path!r} is corrupt: \"found\" must be an object")
    return case, found
