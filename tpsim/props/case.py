"""A case: one concrete example a property is checked on, and its small versioned JSON file.

A case is data (DESIGN.md): world size, tp size, in/out features, batch shape, input memory
layout, dtype, bias, seed, fault plan — plus which variant and property it was found with, so
that ``tpsim replay CASE.json`` re-runs exactly that example. The tensors (master weight, bias,
inputs, upstream grads) are not stored: they are re-drawn from ``seed`` (see
:func:`tpsim.props.world.make_masters`), bit for bit.

File format (``schema_version`` 2)::

    {"format": "tpsim-case", "schema_version": 2, "tpsim_version": "0.1.0", "family": "linear",
     "case": {"world_size": 2, "tp_size": 2, "in_features": 4, ...},
     "found": {"property": "...", "diagnosis": "...", "message": "...", "backend": "inproc"}}

``family`` names the family of targets the case belongs to (:mod:`tpsim.props.family`): ``linear``
(this module's :class:`Case`), ``module`` (:class:`tpsim.props.module.case.ModuleCase`), ...; the
family reads its ``case`` object. Schema 1 files have no ``family``: they are linear cases.
Readers accept files of their own schema version or older and refuse newer ones with a clear
message (:class:`CaseFileError`, exit 2 from the CLI).
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from tpsim._json import jsonable
from tpsim.errors import InvalidArgument

__all__ = [
    "CASES_DIR",
    "DTYPES",
    "INPUT_LAYOUTS",
    "MAX_SEED",
    "MAX_TENSOR_ELEMENTS",
    "SCHEMA_VERSION",
    "Case",
    "CaseFileError",
    "case_file_stem",
    "case_values",
    "load_case",
    "save_case",
    "save_failure",
]

#: Where failing cases are saved unless told otherwise (the CLI's ``--cases-dir`` default).
CASES_DIR = os.path.join(".tpsim", "cases")

#: Version of the case-file schema this code writes; it reads this version and older ones.
SCHEMA_VERSION = 2
FORMAT = "tpsim-case"

#: dtype names a case can carry, widest first (the order strategies shrink in).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

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


def _choice(value: Any, name: str, choices: Any) -> None:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgument(f"{name}={value!r}; expected one of {', '.join(choices)}")


def _elements(shape: tuple[int, ...]) -> int:
    count = 1
    for n in shape:
        count *= n
    return count


def _frozen_option(name: str, value: Any) -> Any:
    """An option value as a case holds it: a JSON scalar, or a list of them as a tuple (hashable:
    resolved targets are cached by their options)."""
    if isinstance(value, (list, tuple)):
        return tuple(_frozen_option(name, v) for v in value)
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    raise InvalidArgument(f"option {name}={value!r} must be a string, a number, a bool, null or a list of them")


def case_values(cls: type, data: Any, *, what: str, required: Sequence[str],
                tuples: Sequence[str] = ("batch_shape",)) -> dict[str, Any]:
    """The constructor arguments of a ``what`` (``case``, ``module case``, ...) of dataclass ``cls`` from its
    JSON ``data``, every family's case file read alike: only known fields, the ``required`` ones present,
    the lists named by ``tuples`` as tuples, ``options`` frozen (:func:`_frozen_option`). Raises
    :class:`tpsim.InvalidArgument` naming the bad field."""
    if not isinstance(data, dict):
        raise InvalidArgument(f"a {what} must be a JSON object, got {type(data).__name__}")
    unknown = set(data) - {f.name for f in dataclasses.fields(cls)}
    if unknown:
        raise InvalidArgument(f"unknown {what} field(s) {sorted(unknown)}")
    missing = [n for n in required if n not in data]
    if missing:
        raise InvalidArgument(f"{what} is missing field(s) {missing}")
    values = dict(data)
    for key in tuples:
        if key in values:
            if not isinstance(values[key], list):
                raise InvalidArgument(f"{key}={values[key]!r} must be a list")
            values[key] = tuple(values[key])
    if "options" in values:
        opts = values["options"] or {}
        if not isinstance(opts, dict):
            raise InvalidArgument(f"options={opts!r} must be an object")
        values["options"] = tuple(sorted((k, _frozen_option(k, v)) for k, v in opts.items()))
    return values


@dataclass(frozen=True)
class Case:
    """One example. ``tp_size`` defaults to ``world_size`` (one tp group spanning the world); a
    smaller ``tp_size`` splits the world into ``world_size // tp_size`` tp groups laid out by
    ``tp_layout`` (``consecutive`` or ``strided``, see :mod:`tpsim.props.groups`); ``input_layout``
    is the memory layout of the inputs and upstream grads (see :mod:`tpsim.props.layouts`)."""

    world_size: int
    in_features: int
    out_features: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    bias: bool = False
    seed: int = 0
    tp_size: int | None = None
    input_layout: str = "contiguous"
    tp_layout: str = "consecutive"
    faults: tuple[Any, ...] = ()
    target: str | None = None
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())
    property: str | None = None

    def __post_init__(self) -> None:
        _int(self.world_size, "world_size", 1)
        _int(self.in_features, "in_features", 1)
        _int(self.out_features, "out_features", 1)
        _int(self.seed, "seed", 0, MAX_SEED)
        tp = self.world_size if self.tp_size is None else _int(self.tp_size, "tp_size", 1)
        if self.world_size % tp:
            raise InvalidArgument(
                f"tp_size={tp} does not divide world_size={self.world_size}: the world is split into tp groups "
                "of tp_size ranks each"
            )
        _choice(self.tp_layout, "tp_layout", TP_LAYOUTS)
        object.__setattr__(self, "tp_size", tp)
        shape = tuple(self.batch_shape)
        if len(shape) > MAX_BATCH_DIMS:
            raise InvalidArgument(f"batch_shape={list(shape)!r} has {len(shape)} dims; at most {MAX_BATCH_DIMS}")
        for s in shape:
            _int(s, "batch_shape entry", 1)
        object.__setattr__(self, "batch_shape", shape)
        for what, dims in (("the master weight [out_features, in_features]", (self.out_features, self.in_features)),
                           ("the input [*batch_shape, in_features]", (*shape, self.in_features)),
                           ("the output [*batch_shape, out_features]", (*shape, self.out_features))):
            if _elements(dims) > MAX_TENSOR_ELEMENTS:
                raise InvalidArgument(
                    f"{what} would have {_elements(dims)} elements (shape {list(dims)}); a case may have at most "
                    f"{MAX_TENSOR_ELEMENTS} per tensor"
                )
        _choice(self.dtype, "dtype", DTYPES)
        if not isinstance(self.bias, bool):
            raise InvalidArgument(f"bias={self.bias!r} must be a bool")
        _choice(self.input_layout, "input_layout", INPUT_LAYOUTS)
        for name in ("target", "variant", "property"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"{name}={value!r} must be a string or null")
        if self.input_layout in ("transposed", "expanded") and not shape:
            raise InvalidArgument(
                f"input_layout={self.input_layout!r} needs at least one batch dim; got batch_shape={list(shape)}"
            )
        object.__setattr__(self, "faults", tuple(self.faults))
        object.__setattr__(self, "options", tuple((str(k), v) for k, v in self.options))

    @builtins.property  # the field ``property`` shadows the builtin inside the class body
    def torch_dtype(self) -> torch.dtype:
        """The case's dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> Case:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        """Short one-line form used in reports (tp groups and memory layout only when not the default;
        a non-contiguous layout shows the input's shape and strides)."""
        text = (
            f"world_size={self.world_size} in_features={self.in_features} out_features={self.out_features} "
            f"batch_shape={list(self.batch_shape)} dtype={self.dtype} bias={self.bias} seed={self.seed}"
        )
        if self.tp_size != self.world_size:
            text += f" tp_size={self.tp_size} tp_layout={self.tp_layout}"
        if self.input_layout != "contiguous":
            from tpsim.props.layouts import layout_info

            info = layout_info((*self.batch_shape, self.in_features), self.input_layout)
            text += f" input_layout={self.input_layout} (input shape {info['shape']} strides {info['strides']})"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (lists for tuples)."""
        return {
            "world_size": self.world_size,
            "tp_size": self.tp_size,
            "in_features": self.in_features,
            "out_features": self.out_features,
            "batch_shape": list(self.batch_shape),
            "input_layout": self.input_layout,
            "tp_layout": self.tp_layout,
            "dtype": self.dtype,
            "bias": self.bias,
            "seed": self.seed,
            "faults": list(self.faults),
            "target": self.target,
            "variant": self.variant,
            "options": {k: v for k, v in self.options},
            "property": self.property,
        }

    @classmethod
    def from_dict(cls, data: Any) -> Case:
        """Inverse of :meth:`to_dict`; raises :class:`tpsim.InvalidArgument` naming a bad field."""
        values = case_values(cls, data, what="case", required=("world_size", "in_features", "out_features"))
        if "faults" in values:
            faults = values["faults"] or []
            if not isinstance(faults, list):
                raise InvalidArgument(f"faults={faults!r} must be a list of faults")
            values["faults"] = tuple(faults)
        case = cls(**values)
        if case.faults:
            # The plan must be one tpsim can inject (kinds, ranks, calls), checked before any run.
            from tpsim.faults import check_plan, parse_plan

            check_plan(parse_plan(case.faults), case.world_size)
        return case

    def key(self) -> str:
        """A short stable hash of the case (names its case file)."""
        text = json.dumps(self.to_dict(), sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]


def _safe(text: str) -> str:
    # ASCII letters, digits, "_" and "." only: the name is the same on every file system.
    return "".join(c if (c.isascii() and c.isalnum()) or c in "_." else "_" for c in text)


def case_file_stem(case: Case) -> str:
    """``<variant>-<property>-<hash>``: the case file's name without ``.json``.

    A variant name longer than :data:`MAX_NAME_CHARS` is cut and followed by ``~`` and a hash of
    the whole name, so two long names sharing a prefix still get different files.
    """
    variant = _safe(case.variant or "case")
    if len(variant) > MAX_NAME_CHARS:
        digest = hashlib.sha256((case.variant or "").encode("utf-8", "surrogatepass")).hexdigest()[:8]
        variant = f"{variant[:MAX_NAME_CHARS]}~{digest}"
    return "-".join((variant, _safe(case.property or "any")[:MAX_NAME_CHARS], case.key()))


def save_case(case: Case, directory: str, *, found: dict[str, Any] | None = None) -> str:
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
    if isinstance(case, Case) and case.input_layout != "contiguous":
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
        "message": failure.message,
        "rank": getattr(failure, "rank", None),
        "backend": backend,
        # Relative file targets are resolved against the directory they were found from.
        "cwd": os.getcwd(),
        "command": command,
    }
    failure.case = case
    failure.case_file = save_case(case, directory, found=jsonable(found))
    return failure.case_file


def load_case(path: str) -> tuple[Case, dict[str, Any]]:
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
