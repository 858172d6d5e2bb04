"""Vocab-parallel cases: one concrete example an embedding or a cross-entropy is checked on.

Pure data that replays exactly: the tensors (table or logits, ids, upstream grads) are drawn from
``seed`` inside the run (:mod:`tpsim.props.vocab.world`). In a case file a case sits under
``"family": "embedding"`` or ``"family": "cross-entropy"``.
"""

from __future__ import annotations

import builtins
import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from tpsim.errors import InvalidArgument
from tpsim.props.case import DTYPES, MAX_BATCH_DIMS, MAX_SEED, MAX_TENSOR_ELEMENTS, TP_LAYOUTS, case_values

__all__ = ["REDUCTIONS", "CrossEntropyCase", "EmbeddingCase", "SizedCase"]

#: The reductions a cross-entropy case can ask for (``F.cross_entropy``'s).
REDUCTIONS = ("none", "mean", "sum")


def _int(value: Any, name: str, minimum: int, maximum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise InvalidArgument(f"{name}={value!r} must be an int >= {minimum}")
    if maximum is not None and value > maximum:
        raise InvalidArgument(f"{name}={value!r} must be an int <= {maximum}")
    return value


class SizedCase:
    """What the vocab and attention case types share: validation of the common fields (world and tp
    size, layout, dtype, batch shape, the positive sizes named by ``_SIZES``, seed), dicts, hashes, copies."""

    family: ClassVar[str]
    _SIZES: ClassVar[tuple[str, ...]]
    #: Sizes that may be 0 (a cross-entropy's ``hidden``: 0 means logits are given).
    _MAY_BE_ZERO: ClassVar[tuple[str, ...]] = ()

    def _validate(self) -> None:
        _int(self.world_size, "world_size", 1)  # type: ignore[attr-defined]
        _int(self.seed, "seed", 0, MAX_SEED)  # type: ignore[attr-defined]
        ws = self.world_size  # type: ignore[attr-defined]
        tp = ws if self.tp_size is None else _int(self.tp_size, "tp_size", 1)  # type: ignore[attr-defined]
        if ws % tp:
            raise InvalidArgument(f"tp_size={tp} does not divide world_size={ws}: the world is split into tp groups "
                                  "of tp_size ranks each")
        object.__setattr__(self, "tp_size", tp)
        if self.tp_layout not in TP_LAYOUTS:  # type: ignore[attr-defined]
            raise InvalidArgument(f"tp_layout={self.tp_layout!r}; expected one of {', '.join(TP_LAYOUTS)}")  # type: ignore[attr-defined]
        if self.dtype not in DTYPES:  # type: ignore[attr-defined]
            raise InvalidArgument(f"dtype={self.dtype!r}; expected one of {', '.join(DTYPES)}")  # type: ignore[attr-defined]
        shape = tuple(self.batch_shape)  # type: ignore[attr-defined]
        if len(shape) > MAX_BATCH_DIMS:
            raise InvalidArgument(f"batch_shape={list(shape)!r} has {len(shape)} dims; at most {MAX_BATCH_DIMS}")
        for s in shape:
            _int(s, "batch_shape entry", 1)
        object.__setattr__(self, "batch_shape", shape)
        for n in self._SIZES:
            _int(getattr(self, n), n, 0 if n in self._MAY_BE_ZERO else 1)
        # Refuse absurd files before anything is allocated.
        if self._largest() > MAX_TENSOR_ELEMENTS:
            raise InvalidArgument(f"{self.describe()} would need tensors of more than {MAX_TENSOR_ELEMENTS} elements")
        for name in ("target", "variant", "property"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(f"{name}={value!r} must be a string or null")
        object.__setattr__(self, "options", tuple((str(k), v) for k, v in self.options))  # type: ignore[attr-defined]

    def _largest(self) -> int:
        """The number of elements of the case's largest tensor."""
        raise NotImplementedError

    @builtins.property
    def torch_dtype(self) -> torch.dtype:
        """The case's dtype as a ``torch.dtype``."""
        return DTYPES[self.dtype]  # type: ignore[attr-defined]

    @builtins.property
    def tokens(self) -> int:
        """The number of token positions (the product of the batch shape)."""
        return math.prod(self.batch_shape)  # type: ignore[attr-defined]

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes``."""
        return dataclasses.replace(self, **changes)  # type: ignore[type-var]

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (lists for tuples, an object for the options)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "options":
                value = {k: v for k, v in value}
            elif isinstance(value, tuple):
                value = list(value)
            out[f.name] = value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Any:
        """Inverse of :meth:`to_dict`; raises :class:`tpsim.InvalidArgument` naming a bad field."""
        values = case_values(cls, data, what=f"{cls.family} case",  # type: ignore[arg-type]
                             required=[n for n in ("world_size", *cls._SIZES) if n not in cls._MAY_BE_ZERO])
        return cls(**values)

    def key(self) -> str:
        """A short stable hash of the case (names its case file)."""
        text = json.dumps({"family": self.family, **self.to_dict()}, sort_keys=True)
        return hashlib.sha256(text.encode()).hexdigest()[:10]

    def _tail(self) -> str:
        text = f"batch_shape={list(self.batch_shape)} dtype={self.dtype} seed={self.seed}"  # type: ignore[attr-defined]
        if self.tp_size != self.world_size:  # type: ignore[attr-defined]
            text += f" tp_size={self.tp_size} tp_layout={self.tp_layout}"  # type: ignore[attr-defined]
        return text


@dataclass(frozen=True)
class EmbeddingCase(SizedCase):
    """One example for an :class:`~tpsim.vocab_variant.EmbeddingVariant`: a ``[vocab_size,
    embedding_dim]`` table, ids of ``batch_shape`` (the shard boundaries first), upstream grads.
    ``tp_size`` defaults to ``world_size``; a smaller one splits the world into tp groups laid out
    by ``tp_layout`` (:mod:`tpsim.props.groups`), each with its own ids and the same table."""

    world_size: int
    vocab_size: int
    embedding_dim: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"
    target: str | None = None
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())
    property: str | None = None

    family: ClassVar[str] = "embedding"
    _SIZES: ClassVar[tuple[str, ...]] = ("vocab_size", "embedding_dim")

    def __post_init__(self) -> None:
        self._validate()

    def _largest(self) -> int:
        # the table and the output
        return max(self.vocab_size, math.prod(self.batch_shape)) * self.embedding_dim

    def describe(self) -> str:
        """Short one-line form used in reports."""
        return (f"world_size={self.world_size} vocab_size={self.vocab_size} embedding_dim={self.embedding_dim} "
                + self._tail())


@dataclass(frozen=True)
class CrossEntropyCase(SizedCase):
    """One example for a :class:`~tpsim.vocab_variant.CrossEntropyVariant`: logits over
    ``vocab_size`` ids (padded to the tp size as the variant's layout says) or ``hidden``-sized
    hidden states and a classifier (``hidden > 0``), targets of ``batch_shape`` (the shard
    boundaries first, the last position ``ignore_index`` when there are two or more), and
    ``label_smoothing``, ``ignore_index`` and ``reduction`` as ``F.cross_entropy`` takes them."""

    world_size: int
    vocab_size: int
    batch_shape: tuple[int, ...] = ()
    dtype: str = "float64"
    seed: int = 0
    label_smoothing: float = 0.0
    ignore_index: int = -100
    reduction: str = "none"
    hidden: int = 0
    tp_size: int | None = None
    tp_layout: str = "consecutive"
    target: str | None = None
    variant: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())
    property: str | None = None

    family: ClassVar[str] = "cross-entropy"
    _SIZES: ClassVar[tuple[str, ...]] = ("vocab_size", "hidden")
    _MAY_BE_ZERO: ClassVar[tuple[str, ...]] = ("hidden",)

    def __post_init__(self) -> None:
        ls = self.label_smoothing
        if isinstance(ls, bool) or not isinstance(ls, (int, float)) or not 0.0 <= ls <= 1.0:
            raise InvalidArgument(f"label_smoothing={ls!r} must be a number in [0, 1]")
        object.__setattr__(self, "label_smoothing", float(ls))
        if isinstance(self.ignore_index, bool) or not isinstance(self.ignore_index, int):
            raise InvalidArgument(f"ignore_index={self.ignore_index!r} must be an int")
        if self.reduction not in REDUCTIONS:
            raise InvalidArgument(f"reduction={self.reduction!r}; expected one of {', '.join(REDUCTIONS)}")
        self._validate()

    def _largest(self) -> int:
        # the (padded) logits, the classifier and the hidden states
        tokens, padded = math.prod(self.batch_shape), self.vocab_size + self.world_size
        return max(tokens * padded, self.vocab_size * self.hidden, tokens * self.hidden)

    def describe(self) -> str:
        """Short one-line form used in reports."""
        text = f"world_size={self.world_size} vocab_size={self.vocab_size}"
        if self.hidden:
            text += f" hidden={self.hidden}"
        text += f" {self._tail()} label_smoothing={self.label_smoothing:g} ignore_index={self.ignore_index}"
        return text + f" reduction={self.reduction}"
