"""A module case: one concrete example a whole module is checked on (pure data, replays exactly).

The sizes are the module's constructor sizes in the order its variant names them (``hidden``,
``ffn``); the input is ``[*batch_shape, sizes[0]]``. Everything else — parameters, inputs, upstream
grads — is drawn from ``seed`` inside the run (see :mod:`tpsim.props.module.world`), bit for bit.
In a case file it sits under ``"family": "module"``.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tpsim.errors import InvalidArgument
from tpsim.props.case import DTYPES, MAX_SEED, MAX_TENSOR_ELEMENTS, TP_LAYOUTS, case_values

__all__ = ["ModuleCase"]

_MAX_BATCH_DIMS = 8


def _int(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name}={value!r} must be an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name}={value!r} must be an int <= {maximum}")
    return value


@dataclass(frozen=True)
class ModuleCase:
    """One example for a :class:`~tpsim.module_variant.ModuleVariant`. ``tp_size`` defaults to
    ``world_size``; a smaller one splits the world into tp groups laid out by ``tp_layout`` (see
    :mod:`tpsim.props.groups`), each with its own inputs and the same parameters."""

    world_size: int
    sizes: tuple[int, ...]
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"
    target: str | None = None
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())
    property: str | None = None
    #: The variant's names of the sizes (``hidden``, ``ffn``): reports and case files read better.
    size_names: tuple[str, ...] = ()

    #: The family this case belongs to (written into case files).
    family: ClassVar[str] = "module"

    def __post_init__(self) -> None:
        _int(self.world_size, "world_size", 1)
        _int(self.seed, "seed", 0, MAX_SEED)
        tp = self.world_size if self.tp_size is None else _int(self.tp_size, "tp_size", 1)
        if self.world_size % tp:
            raise InvalidArgument(
                f"tp_size={tp} does not divide world_size={self.world_size}: the world is split into tp groups "
                "of tp_size ranks each"
            )
        object.__setattr__(self, "tp_size", tp)
        if self.tp_layout not in TP_LAYOUTS:
            raise InvalidArgument(f"tp_layout={self.tp_layout!r}; expected one of {', '.join(TP_LAYOUTS)}")
        sizes = tuple(self.sizes)
        if not sizes:
            raise InvalidArgument("sizes=() must name at least one size (the input's feature size)")
        for s in sizes:
            _int(s, "sizes entry", 1)
        object.__setattr__(self, "sizes", sizes)
        names = tuple(self.size_names)
        if names and (len(names) != len(sizes) or not all(isinstance(n, str) for n in names)):
            raise InvalidArgument(f"size_names={list(names)!r} must name each of the {len(sizes)} sizes")
        object.__setattr__(self, "size_names", names)
        shape = tuple(self.batch_shape)
        if len(shape) > _MAX_BATCH_DIMS:
            raise InvalidArgument(f"batch_shape={list(shape)!r} has {len(shape)} dims; at most {_MAX_BATCH_DIMS}")
        for s in shape:
            _int(s, "batch_shape entry", 1)
        object.__setattr__(self, "batch_shape", shape)
        # A size product bounds every 2-D parameter: refuse absurd files before anything is allocated.
        biggest = max(sizes) * max(sizes)
        rows = 1
        for s in shape:
            rows *= s
        if biggest > MAX_TENSOR_ELEMENTS or rows * max(sizes) > MAX_TENSOR_ELEMENTS:
            raise InvalidArgument(
                f"sizes={list(sizes)} with batch_shape={list(shape)} would need tensors of more than "
                f"{MAX_TENSOR_ELEMENTS} elements"
            )
        if self.dtype not in DTYPES:
            raise InvalidArgument(f"dtype={self.dtype!r}; expected one of {', '.join(DTYPES)}")
        for name in ("target", "variant", "property"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"{name}={value!r} must be a string or null")
        object.__setattr__(self, "options", tuple((str(k), v) for k, v in self.options))

    @builtins.property  # the field ``property`` shadows the builtin inside the class body
    def torch_dtype(self) -> torch.dtype:
        """The case's dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]

    @builtins.property
    def rows(self) -> int:
        """The number of input rows (the product of the batch shape)."""
        n = 1
        for s in self.batch_shape:
            n *= s
        return n

    def replace(self, **changes: Any) -> ModuleCase:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)

    def describe(self, names: tuple[str, ...] | None = None) -> str:
        """Short one-line form used in reports (sizes by name when the case or ``names`` has them)."""
        names = names or self.size_names or None
        if names is not None and len(names) == len(self.sizes):
            sizes = " ".join(f"{n}={s}" for n, s in zip(names, self.sizes, strict=True))
        else:
            sizes = f"sizes={list(self.sizes)}"
        text = (f"world_size={self.world_size} {sizes} batch_shape={list(self.batch_shape)} dtype={self.dtype} "
                f"seed={self.seed}")
        if self.tp_size != self.world_size:
            text += f" tp_size={self.tp_size} tp_layout={self.tp_layout}"
        return text

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (lists for tuples)."""
        return {
            "world_size": self.world_size,
            "tp_size": self.tp_size,
            "tp_layout": self.tp_layout,
            "sizes": list(self.sizes),
            "size_names": list(self.size_names),
            "batch_shape": list(self.batch_shape),
            "dtype": self.dtype,
            "seed": self.seed,
            "target": self.target,
            "variant": self.variant,
            "options": {k: v for k, v in self.options},
            "property": self.property,
        }

    @classmethod
    def from_dict(cls, data: Any) -> ModuleCase:
        """Inverse of :meth:`to_dict`; raises :class:`tpsim.InvalidArgument` naming a bad field."""
        values = case_values(cls, data, what="module case", required=("world_size", "sizes"),
                             tuples=("sizes", "batch_shape", "size_names"))
        return cls(**values)

    def key(self) -> str:
        """A short stable hash of the case (names its case file)."""
        text = json.dumps({"family": self.family, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]
