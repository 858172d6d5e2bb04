"""Vocab-parallel variants: how an embedding or a cross-entropy over a sharded vocabulary is built and called.

Two kinds of target, each its own family of checks (:mod:`tpsim.props.vocab`):

- an **embedding** (``--kind embedding``): a module holding rows of the ``[vocab, dim]`` table,
  taking replicated token ids and returning the replicated ``[..., dim]`` embeddings; its dense
  twin is ``nn.Embedding``. :class:`EmbeddingVariant`.
- a **cross-entropy** (``--kind cross-entropy``): a function of this rank's vocabulary shard of
  the logits (``input="logits"``), or of the replicated hidden states and this rank's rows of the
  classifier (``input="hidden"``: the output layer fused with its loss), and the replicated target
  ids; its dense twin is ``F.cross_entropy`` with the same ``label_smoothing``, ``ignore_index``
  and ``reduction``. :class:`CrossEntropyVariant`.

How the vocabulary is split is read from the shapes, never assumed: a rank holding ``n`` rows
(columns) of a vocabulary of ``V`` ids owns ids ``[r*n, (r+1)*n)`` when every rank holds ``n``
(the vocabulary padded to ``ws*n >= V`` the way Megatron pads it: zero rows at the end), or the
``torch.tensor_split`` pieces when the ranks' sizes differ by one (uneven, no padding). A layer
that refuses a vocabulary that does not divide must refuse it on every rank with an error naming
the sizes (the ``divisibility`` property).

:func:`embedding_from_class` and :func:`cross_entropy_from_function` make variants of a user's own
class or function (``tpsim check FILE:Name --kind embedding`` / ``--kind cross-entropy``).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.module_variant import GROUP_KEYWORDS, group_keyword

__all__ = [
    "CROSS_ENTROPY_INPUTS",
    "CROSS_ENTROPY_KIND",
    "EMBEDDING_KIND",
    "CrossEntropyVariant",
    "EmbeddingVariant",
    "cross_entropy_from_function",
    "embedding_from_class",
]

#: The ``--kind`` that selects embedding targets.
EMBEDDING_KIND = "embedding"
#: The ``--kind`` that selects cross-entropy targets.
CROSS_ENTROPY_KIND = "cross-entropy"
#: What a cross-entropy takes: its logits shard, or hidden states and its classifier rows.
CROSS_ENTROPY_INPUTS = ("logits", "hidden")


def _name_ok(name: Any, what: str) -> None:
    if not isinstance(name, str) or not name:
        raise InvalidArgument(f"{what}(name={name!r}): expected a non-empty string")


def _multiple(value: Any, owner: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{owner}: padding_multiple={value!r}; expected an int >= 1")
    return value


@dataclass(frozen=True)
class EmbeddingVariant:
    """How one vocab-parallel embedding is built (see the module docstring).

    - ``build(num_embeddings, embedding_dim, *, group, dtype, weight) -> nn.Module``: one rank's
      module on its tp ``group``; ``weight`` is the full ``[num_embeddings, embedding_dim]`` master
      table in ``dtype`` (a ``from_dense``-style builder slices it itself: its slicing is under test).
    - ``weight``: the dotted name of the table parameter (default ``"weight"``).
    - ``load``: True when the harness copies this rank's rows of the master table into ``weight``
      after building (a builder that draws its own init); the rows are read from its shape.
    - ``padding_multiple``: Megatron's ``make_vocab_size_divisible_by``, if the layer pads to a
      multiple of it times the tp size: only used to put the shard boundaries among the ids drawn.
    - ``forward(module, ids)``: replaces ``module(ids)``.
    - ``min_batch_dims``/``max_batch_dims``: how many dims the ids have (default 0 to 2);
      ``sequence_dim``: an ids dim whose size the tp size must divide (a layer that scatters its
      output along it, e.g. Megatron's ``reduce_scatter_embeddings``; its ``forward`` gathers it back).
    """

    name: str
    build: Callable[..., nn.Module]
    weight: str = "weight"
    load: bool = False
    padding_multiple: int = 1
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    min_batch_dims: int = 0
    max_batch_dims: int = 2
    sequence_dim: int | None = None
    rank_local: tuple[str, ...] = ()
    description: str = ""
    notes: tuple[str, ...] = ()
    target: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())

    kind: ClassVar[str] = EMBEDDING_KIND
    input: ClassVar[str] = "replicated"
    output: ClassVar[str] = "replicated"
    input_grad: ClassVar[str] = "none"
    bias: ClassVar[None] = None

    def __post_init__(self) -> None:
        _name_ok(self.name, "EmbeddingVariant")
        if not callable(self.build):
            raise InvalidArgument(f"EmbeddingVariant {self.name!r}: build={self.build!r}; expected a callable builder")
        if not isinstance(self.weight, str) or not self.weight:
            raise InvalidArgument(f"EmbeddingVariant {self.name!r}: weight={self.weight!r}; expected a parameter name")
        _multiple(self.padding_multiple, f"EmbeddingVariant {self.name!r}")
        if self.forward is not None and not callable(self.forward):
            raise InvalidArgument(f"EmbeddingVariant {self.name!r}: forward={self.forward!r}; expected a callable")
        low, high, seq = self.min_batch_dims, self.max_batch_dims, self.sequence_dim
        if any(isinstance(n, bool) or not isinstance(n, int) for n in (low, high)) or not 0 <= low <= high <= 2:
            raise InvalidArgument(f"EmbeddingVariant {self.name!r}: min_batch_dims={low!r}, max_batch_dims={high!r}; "
                                  "expected ints with 0 <= min_batch_dims <= max_batch_dims <= 2")
        if seq is not None and (isinstance(seq, bool) or not isinstance(seq, int) or not 0 <= seq < low):
            raise InvalidArgument(f"EmbeddingVariant {self.name!r}: sequence_dim={seq!r}; expected None or an ids dim "
                                  f"every case has (0 <= sequence_dim < min_batch_dims={low})")
        object.__setattr__(self, "rank_local", (self.rank_local,) if isinstance(self.rank_local, str)
                           else tuple(self.rank_local))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "options", tuple(self.options))

    def describe(self) -> str:
        """One line: what it is and how its table is loaded."""
        how = "the harness loads its rows" if self.load else "its builder slices the table"
        return f"{self.name}: embedding, table {self.weight!r} sharded by rows ({how})"

    def replace(self, **changes: Any) -> EmbeddingVariant:
        """A copy with ``changes`` applied (validation runs again)."""
        return dataclasses.replace(self, **changes)

    def call(self, module: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """Run the embedding on ``ids``."""
        return self.forward(module, ids) if self.forward is not None else module(ids)


@dataclass(frozen=True)
class CrossEntropyVariant:
    """How one vocab-parallel cross-entropy is called (see the module docstring).

    ``fn`` takes ``(logits, target)`` (``input="logits"``: this rank's ``[..., n]`` columns) or
    ``(hidden, weight, target)`` (``input="hidden"``: replicated ``[..., D]`` hidden states and
    this rank's ``[n, D]`` classifier rows), then the keywords it ``accepts`` out of
    ``label_smoothing``, ``ignore_index``, ``vocab_size``, ``reduction`` and ``group``. It returns
    the per-token loss ``[...]`` (or the reduced scalar). Cases use only what it accepts: without
    ``label_smoothing`` none, without ``ignore_index`` no ignored targets, without ``vocab_size``
    only vocabularies that divide by the tp size, without ``reduction`` per-token losses, without
    ``group`` tp groups as large as the world. ``dtypes``: the case dtypes it is checked in (empty:
    all), e.g. not float64 for one that computes in float32 whatever its input is.
    """

    name: str
    fn: Callable[..., torch.Tensor]
    input: str = "logits"
    accepts: tuple[str, ...] = ("label_smoothing", "ignore_index", "vocab_size", "reduction", "group")
    group_keyword: str = "group"
    dtypes: tuple[str, ...] = ()
    rank_local: tuple[str, ...] = ()
    description: str = ""
    notes: tuple[str, ...] = ()
    target: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())

    kind: ClassVar[str] = CROSS_ENTROPY_KIND
    output: ClassVar[str] = "replicated"
    bias: ClassVar[None] = None

    #: Every keyword a cross-entropy may accept.
    KEYWORDS: ClassVar[tuple[str, ...]] = ("label_smoothing", "ignore_index", "vocab_size", "reduction", "group")

    def __post_init__(self) -> None:
        _name_ok(self.name, "CrossEntropyVariant")
        if not callable(self.fn):
            raise InvalidArgument(f"CrossEntropyVariant {self.name!r}: fn={self.fn!r}; expected a callable")
        if self.input not in CROSS_ENTROPY_INPUTS:
            raise InvalidArgument(
                f"CrossEntropyVariant {self.name!r}: input={self.input!r}; expected one of {', '.join(CROSS_ENTROPY_INPUTS)}"
            )
        accepts = (self.accepts,) if isinstance(self.accepts, str) else tuple(self.accepts)
        unknown = [a for a in accepts if a not in self.KEYWORDS]
        if unknown:
            raise InvalidArgument(
                f"CrossEntropyVariant {self.name!r}: accepts={accepts!r} names {unknown}; expected some of "
                f"{', '.join(self.KEYWORDS)}"
            )
        object.__setattr__(self, "accepts", accepts)
        dtypes = (self.dtypes,) if isinstance(self.dtypes, str) else tuple(self.dtypes)
        if not all(isinstance(d, str) for d in dtypes):
            raise InvalidArgument(f"CrossEntropyVariant {self.name!r}: dtypes={dtypes!r}; expected dtype names "
                                  "such as 'float32'")
        object.__setattr__(self, "dtypes", dtypes)
        object.__setattr__(self, "rank_local", (self.rank_local,) if isinstance(self.rank_local, str)
                           else tuple(self.rank_local))
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "options", tuple(self.options))

    @property
    def input_grad(self) -> str:
        """The logits' grad is sharded like the logits; the hidden states' must be complete on every rank."""
        return "sharded" if self.input == "logits" else "complete"

    def describe(self) -> str:
        """One line: its input and the keywords it takes."""
        what = "its vocab shard of the logits" if self.input == "logits" else "hidden states and its classifier rows"
        return f"{self.name}: cross-entropy of {what}; takes {', '.join(self.accepts) or 'no keywords'}"

    def replace(self, **changes: Any) -> CrossEntropyVariant:
        """A copy with ``changes`` applied (validation runs again)."""
        return dataclasses.replace(self, **changes)

    def call(self, tensors: tuple[torch.Tensor, ...], target: torch.Tensor, *, label_smoothing: float,
             ignore_index: int, vocab_size: int, reduction: str, group: Any) -> torch.Tensor:
        """``fn(*tensors, target, **the keywords it accepts)``."""
        values = {"label_smoothing": label_smoothing, "ignore_index": ignore_index, "vocab_size": vocab_size,
                  "reduction": reduction}
        kwargs = {k: v for k, v in values.items() if k in self.accepts}
        if "group" in self.accepts:
            kwargs[self.group_keyword] = group
        return self.fn(*tensors, target, **kwargs)


def embedding_from_class(cls: type, *, name: str | None = None) -> EmbeddingVariant:
    """An embedding variant for a class built as ``cls(num_embeddings, embedding_dim, *, <group>=...)``
    (``process_group``, ``group`` or ``tp_group``; a ``dtype`` keyword gets the case's dtype). A class
    with a ``from_dense(nn.Embedding, group=...)`` classmethod is built through it (its own slicing
    is checked); otherwise the harness loads its rows into ``weight``."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgument(f"{cls!r} is not an nn.Module class; an embedding target is a module class")
    keyword = group_keyword(cls)
    if keyword is None:
        raise InvalidArgument(
            f"{cls.__qualname__} takes no tp group: an embedding target needs a constructor keyword "
            f"{' / '.join(GROUP_KEYWORDS)}; or describe it with a tpsim EmbeddingVariant"
        )
    takes_dtype = "dtype" in inspect.signature(cls.__init__).parameters
    from_dense = getattr(cls, "from_dense", None)
    if callable(from_dense):

        def build(num_embeddings: int, embedding_dim: int, *, group: Any, dtype: torch.dtype,
                  weight: torch.Tensor) -> nn.Module:
            dense = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device="meta").to_empty(device="cpu")
            with torch.no_grad():
                dense.weight.copy_(weight)
            return from_dense(dense, **{keyword: group})

        load = False
    else:

        def build(num_embeddings: int, embedding_dim: int, *, group: Any, dtype: torch.dtype,
                  weight: torch.Tensor) -> nn.Module:
            kwargs: dict[str, Any] = {keyword: group}
            if takes_dtype:
                kwargs["dtype"] = dtype
            return cls(num_embeddings, embedding_dim, **kwargs).to(dtype)

        load = True
    return EmbeddingVariant(name=name or cls.__name__, build=build, load=load,
                            description=" ".join((cls.__doc__ or "").strip().split("\n\n")[0].split()))


def cross_entropy_from_function(fn: Callable[..., Any], *, name: str | None = None,
                                input: str | None = None) -> CrossEntropyVariant:
    """A cross-entropy variant for a function ``fn(logits, target, ...)`` (or ``fn(hidden, weight,
    target, ...)`` with ``input="hidden"``; read from the names ``hidden``/``weight`` otherwise),
    taking the keywords of :class:`CrossEntropyVariant` it has parameters for (the group as
    ``group``, ``process_group`` or ``tp_group``)."""
    if not callable(fn) or isinstance(fn, type):
        raise InvalidArgument(f"{fn!r} is not a function; a cross-entropy target is a function (or callable)")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"cannot read the signature of {fn!r}: {err}") from err
    names = list(sig.parameters)
    positional = [p for p in sig.parameters.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
                  and p.default is p.empty]
    if input is None:
        input = "hidden" if len(positional) >= 3 and {"hidden", "weight"} & set(names[:2]) else "logits"
    needed = 3 if input == "hidden" else 2
    if len(positional) < needed:
        shape = "(hidden, weight, target, ...)" if input == "hidden" else "(logits, target, ...)"
        raise InvalidArgument(f"{getattr(fn, '__qualname__', fn)}{sig} does not take {shape}")
    keyword = next((k for k in GROUP_KEYWORDS if k in names), None)
    accepts = [k for k in CrossEntropyVariant.KEYWORDS[:-1] if k in names] + (["group"] if keyword else [])
    return CrossEntropyVariant(name=name or getattr(fn, "__name__", "cross_entropy"), fn=fn, input=input,
                               accepts=tuple(accepts), group_keyword=keyword or "group",
                               description=" ".join((fn.__doc__ or "").strip().split("\n\n")[0].split()))
