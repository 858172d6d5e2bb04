"""The variant description: how a tensor-parallel linear layer is sharded and how to build it.

A :class:`Variant` is data about a layer implementation, written once per implementation:

- ``kind``: ``"column"`` (output features sharded) or ``"row"`` (input features sharded);
- ``input``: what each rank is given — ``"replicated"`` (the full input on every rank),
  ``"sharded"`` (rank ``r`` gets the ``r``-th slice of the last dim) or ``"sequence-sharded"``
  (a column layer under sequence parallelism: rank ``r`` gets the ``r``-th slice of the sequence
  dim ``sequence_dim``, by default -2, the dim before the features; dim 0 of a 2-D input);
- ``output``: what each rank returns — ``"sharded"`` (its slice of the output features),
  ``"gathered"`` (the full output, gathered by the layer), ``"partial"`` (a summand: the harness
  sums the ranks' outputs, as the caller's all-reduce would), ``"reduced"`` (the full output,
  reduced by the layer) or ``"sequence-sharded"`` (a row layer under sequence parallelism: the
  reduced output's ``r``-th slice of the sequence dim, as a reduce-scatter returns it);
- ``packed``: a column weight made of several packed parts (gate/up: ``(1, 1)``; grouped-query
  Q/K/V: e.g. ``(8, 2, 2)``), sizes or proportions of ``out_features``: each part is sharded on its
  own, rank ``r`` holding shard ``r`` of every part (sets the weight and bias placements to
  ``Shard(0, parts=packed)`` and the sharded output's layout likewise);
- ``head_size``: with ``packed`` Q/K/V proportions (query heads first), the rows per attention head:
  the placements become ``Shard(0, parts=packed, head_size=head_size)``, whose key/value parts are
  replicated in groups when they have fewer heads than ranks, as vLLM's ``QKVParallelLinear`` holds
  them (see :mod:`tpsim.placement`; the search then draws fewer, as many and more key/value heads
  than ranks);
- ``input_grad``: for a replicated input, ``"complete"`` (Megatron's rule, the default: every rank
  holds the full input gradient after backward) or ``"partial"`` (each rank holds a summand and
  the caller reduces it);
- ``params``: one :class:`ParamSpec` per parameter: which master tensor it comes from, its
  placement in master coordinates (weight ``[out_features, in_features]``), whether it is stored
  transposed, and whether the harness loads master values into it after construction;
- ``build``: the builder ``build(in_features, out_features, bias, *, group, rank, world_size,
  master_weight, master_bias, dtype) -> nn.Module`` that constructs the layer on one rank.

:meth:`Variant.instantiate` calls the builder and then the generic loader (:func:`load_master`),
which copies the master values into every parameter whose spec says ``load=True``, by its
placement (a column bias gets its shard, a row bias the full bias). Parameters the builder filled
itself (``load=False``, e.g. a constructor that slices ``master_weight``) are never written by tpsim:
they are read back as the layer holds them right after construction and judged against the
masters (a mis-slice is named there).

Defaults follow Megatron-LM: column = replicated input, sharded output, weight ``S(0)``, bias
``S(0)``; row = sharded input, reduced output, weight ``S(1)``, bias ``R``.

Describing your own layer (a module-level variant is a ``tpsim check`` target, e.g.
``tpsim check mypkg/layers.py:my_row``)::

    from tpsim.placement import Replicate, Shard
    from tpsim.variant import ParamSpec, Variant

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight,
              master_bias, dtype):
        return MyRow(in_features, out_features, tp_size=world_size, tp_rank=rank,
                     group=group, bias=bias).to(dtype)   # its own init is overwritten

    my_row = Variant(
        name="my_row", kind="row", build=build,
        output="reduced",                     # MyRow all-reduces itself
        params=(ParamSpec("weight", "weight", Shard(1), transposed=True),   # stored [in/ws, out]
                ParamSpec("bias", "bias", Replicate())),
    )

:mod:`tpsim.mutants` and :mod:`tpsim.builtin_variants` are worked examples.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.placement import Partial, Placement, Replicate, Shard, shard_shape, shard_tensor

#: dtype names a case can carry (and a variant declare), widest first (the order strategies shrink in).
DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

__all__ = [
    "INPUTS",
    "HELD_BY",
    "INPUT_GRADS",
    "KINDS",
    "OUTPUTS",
    "PARAM_GRADS",
    "Builder",
    "LayoutError",
    "ParamSpec",
    "Variant",
    "load_master",
]

KINDS = ("column", "row")
#: Input placements a variant can declare.
INPUTS = ("replicated", "sharded", "sequence-sharded")
#: Output placements a variant can declare.
OUTPUTS = ("sharded", "gathered", "partial", "reduced", "sequence-sharded")
INPUT_GRADS = ("complete", "partial")
#: Who completes a replicated parameter's grad (see :class:`ParamSpec`): the layer, or the trainer.
PARAM_GRADS = ("complete", "partial")
#: Which tp ranks hold a parameter (see :class:`ParamSpec`): every rank, tp rank 0 only, or read from the built layers.
HELD_BY = ("all", "rank0", "detect")

_VALID_IO = {
    "column": {"input": ("replicated", "sequence-sharded"), "output": ("sharded", "gathered")},
    "row": {"input": ("sharded", "replicated"), "output": ("partial", "reduced", "sequence-sharded")},
}


class Builder(Protocol):
    """Constructs the layer of one rank. ``master_weight`` is ``[out, in]`` in ``dtype``;
    ``master_bias`` is ``[out]`` or None when ``bias`` is False; ``group`` is the tp group."""

    def __call__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        group: Any,
        rank: int,
        world_size: int,
        master_weight: torch.Tensor,
        master_bias: torch.Tensor | None,
        dtype: torch.dtype,
    ) -> nn.Module: ...


class LayoutError(InvalidArgument):
    """A parameter of a built layer does not have the shape its :class:`ParamSpec` implies.

    ``param`` names the parameter, ``shape`` is what the layer holds, ``expected`` the stored
    shape its placement and layout imply (the harness uses these to diagnose, e.g.,
    ``wrong-shard-dim``).
    """

    def __init__(self, message: str, *, param: str, shape: tuple[int, ...] | None, expected: tuple[int, ...]):
        super().__init__(message)
        self.param = param
        self.shape = shape
        self.expected = expected

    def __reduce__(self):  # keep the fields when a gloo worker sends this back
        return (_rebuild_layout_error, (str(self), self.param, self.shape, self.expected))


def _rebuild_layout_error(message, param, shape, expected):
    return LayoutError(message, param=param, shape=shape, expected=expected)


@dataclass(frozen=True)
class ParamSpec:
    """One parameter of a variant.

    ``name`` is its attribute path on the module (``"weight"``, ``"proj.bias"``); ``master`` is
    ``"weight"`` or ``"bias"``; ``placement`` is in master coordinates (weight ``[out, in]``);
    ``transposed`` means the module stores the 2-D shard transposed (e.g. ``[in, out/ws]``);
    ``load`` means the harness copies master values into it after construction.

    ``grad`` says who completes a *replicated* parameter's gradient: ``"complete"`` (the default:
    the layer reduces it, every rank holds the whole dense grad after backward) or ``"partial"``
    (each rank holds its summand and the trainer sums them over the tp group, as Megatron's
    ``finalize_model_grads`` does for parameters marked ``sequence_parallel``). For a partial grad
    the harness checks that the rank-order sum of the summands equals the dense grad, applies that
    sum before each SGD step (so training equivalence sees what the trainer does) and checks that
    the replicas agree after it. A parameter the built module marks ``param.sequence_parallel =
    True`` (Megatron's marker) is partial without a declaration. The replicated key/value heads of a
    head-packed Q/K/V weight (``Shard(0, parts=..., head_size=...)`` with fewer key/value heads than
    ranks) follow the same rule among the ranks sharing a head: ``"complete"``, every replica holds
    the head's whole grad (the layer sums its replicas' shares, as tpsim's own ``QKVParallelLinear``
    does); ``"partial"``, each holds its own query heads' share and the trainer sums them over the
    head's replicas before each step (vLLM's ``QKVParallelLinear``; see
    :func:`tpsim.props.linear.world.expanded_out_features`).

    ``held_by`` says which tp ranks hold the parameter: ``"all"`` (the default), ``"rank0"`` (tp rank
    0 only: nanotron's row bias, which rank 0 adds before the all-reduce so the sum holds it once; the
    other ranks' layers have no tensor there, ``None`` or no attribute) or ``"detect"`` (every rank, or
    rank 0 only, read from the built layers: what the plain-class conventions declare). Only a
    replicated parameter with a complete grad can be held by rank 0 only. Rank 0 gets the master value
    and its grad is compared with the dense grad; the other ranks must hold none (``"rank0"``: a tensor
    there is a ``shape-error``, declare ``"all"`` for it).
    """

    name: str
    master: str
    placement: Placement
    transposed: bool = False
    load: bool = True
    grad: str = "complete"
    held_by: str = "all"

    def __post_init__(self) -> None:
        if self.master not in ("weight", "bias"):
            raise InvalidArgument(f"ParamSpec(master={self.master!r}): expected 'weight' or 'bias'")
        if not isinstance(self.placement, Placement):
            raise InvalidArgument(
                f"ParamSpec(placement={self.placement!r}): expected Shard(dim), Replicate() or Partial()"
            )
        if self.transposed and self.master != "weight":
            raise InvalidArgument(f"ParamSpec(name={self.name!r}): only a weight can be stored transposed")
        if self.grad not in PARAM_GRADS:
            raise InvalidArgument(
                f"ParamSpec(name={self.name!r}, grad={self.grad!r}): expected one of {', '.join(PARAM_GRADS)}"
            )
        heads = isinstance(self.placement, Shard) and self.placement.head_size is not None
        if self.grad == "partial" and not isinstance(self.placement, Replicate) and not heads:
            raise InvalidArgument(
                f"ParamSpec(name={self.name!r}, grad='partial') with placement {self.placement}: only a replicated "
                "parameter's grad can be left partial for the trainer to sum, or the replicated key/value heads of a "
                "head-packed one (Shard(..., head_size=...)); a sharded one is complete on its rank"
            )
        if self.held_by not in HELD_BY:
            raise InvalidArgument(
                f"ParamSpec(name={self.name!r}, held_by={self.held_by!r}): expected one of {', '.join(HELD_BY)}"
            )
        if self.held_by != "all" and (not isinstance(self.placement, Replicate) or self.grad != "complete"):
            raise InvalidArgument(
                f"ParamSpec(name={self.name!r}, held_by={self.held_by!r}) with placement {self.placement} and "
                f"grad={self.grad!r}: only a replicated parameter with a complete grad can be held by rank 0 only "
                "(expected placement Replicate() and grad='complete')"
            )

    def describe(self) -> str:
        """Short form, e.g. ``weight S(0)``, ``weight S(1) stored transposed`` or ``bias R grad partial``."""
        text = f"{self.name} {self.placement}"
        text += " stored transposed" if self.transposed else ""
        text += " on tp rank 0 only" if self.held_by == "rank0" else ""  # "detect": either is right
        return text + (" grad partial" if self.grad == "partial" else "")

    def absent_ok(self, rank: int) -> bool:
        """Whether tp rank ``rank``'s layer may hold no tensor for this parameter (rank 0 always holds it)."""
        return rank != 0 and self.held_by != "all"


def _default_params(kind: str, has_bias: bool) -> tuple[ParamSpec, ...]:
    if kind == "column":
        specs = [ParamSpec("weight", "weight", Shard(0))]
        bias = ParamSpec("bias", "bias", Shard(0))
    else:
        specs = [ParamSpec("weight", "weight", Shard(1))]
        bias = ParamSpec("bias", "bias", Replicate())
    return tuple(specs + ([bias] if has_bias else []))


@dataclass(frozen=True)
class Variant:
    """How one tensor-parallel linear layer is sharded and built (see the module docstring).

    Only ``name``, ``kind`` and ``build`` are required; everything else defaults to Megatron's
    conventions for the kind. ``bias`` says whether the layer supports a bias at all (False: the
    harness only generates bias-free cases). ``forward(module, x)`` replaces ``module(x)`` when
    the layer needs a different call. ``target`` and ``options`` are filled in when the variant
    was resolved from a target string, so that worker processes can resolve it again.
    """

    name: str
    kind: str
    build: Callable[..., nn.Module]
    input: str | None = None
    output: str | None = None
    input_grad: str = "complete"
    params: tuple[ParamSpec, ...] | None = None
    bias: bool = True
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    description: str = ""
    notes: tuple[str, ...] = ()
    #: Restrictions of the implementation (documented upstream limits, not bugs tpsim should report;
    #: cite the limit where the variant is declared): generated cases have at least ``min_batch_dims`` leading batch
    #: dims and feature dims of at least ``min_features``; ``divisible_only`` generates divisible
    #: cases only, so the divisibility property does not apply (reports say so).
    min_batch_dims: int = 0
    min_features: int = 1
    divisible_only: bool = False
    #: Sequence parallelism: the dim of the input (``input="sequence-sharded"``) or output
    #: (``output="sequence-sharded"``) that is sharded; must come before the feature dim.
    sequence_dim: int = -2
    #: Packed parts of a column weight's output features (sizes or proportions), see above.
    packed: tuple[int, ...] | None = None
    #: Rows per attention head of a packed Q/K/V weight (see above; None: parts sharded evenly).
    head_size: int | None = None
    #: Whether the layer can shard over a tp group smaller than the world (it uses the ``group``
    #: its builder is given). False for layers that read their rank from the default group (the
    #: master-weight convention): only ``tp_size == world_size`` cases are generated, and reports say so.
    subgroups: bool = True
    #: The most leading batch dims an input may have (None: no limit beyond the strategies' own, 3).
    #: A library that takes only 2-D and 3-D inputs (Megatron-core) declares ``min_batch_dims=1,
    #: max_batch_dims=2``.
    max_batch_dims: int | None = None
    #: The smallest tp group the layer supports: smaller tp sizes (and worlds that only they divide)
    #: are not drawn. Megatron-core's config refuses sequence parallelism without tensor
    #: parallelism, so its sequence-parallel layers declare 2.
    min_tp_size: int = 1
    #: The layer always has a bias (its constructor cannot leave it out): biased cases only. Set by
    #: the conventions when a class without a ``bias`` flag builds a ``bias`` parameter.
    always_bias: bool = False
    #: The layer's documented precondition that its input is contiguous (cite it where the variant is
    #: declared): only contiguous inputs and upstream grads are drawn, and reports say so. For a layer
    #: that hands its input to a collective as given, which NCCL refuses for a non-contiguous tensor,
    #: when its callers always pass contiguous activations.
    contiguous_inputs: bool = False
    #: Modules whose globals are per rank, as in a real job where every rank is a process: passed to
    #: :func:`tpsim.run` as ``rank_local`` (on inproc each rank thread sees its own copy of their
    #: globals; process backends have this already). Module names, e.g. ``("fairscale.nn.model_parallel.initialize",)``.
    rank_local: tuple[str, ...] = ()
    #: An inference layer (weights without grads, collectives outside autograd: vLLM's style, DeepSpeed
    #: AutoTP's inference mode): only the forward runs, under ``torch.no_grad()``, once per case; the
    #: properties are forward equivalence, replica consistency of the output and divisibility (a refusal
    #: by ``assert`` on every rank counts there, with a note that ``python -O`` strips it).
    forward_only: bool = False
    target: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgument(f"Variant(kind={self.kind!r}): expected one of {', '.join(KINDS)}")
        if not callable(self.build):
            raise InvalidArgument(f"Variant(build={self.build!r}): expected a callable builder")
        defaults = {"column": ("replicated", "sharded"), "row": ("sharded", "reduced")}[self.kind]
        # Frozen dataclass: fill kind-dependent defaults once, here.
        if self.input is None:
            object.__setattr__(self, "input", defaults[0])
        if self.output is None:
            object.__setattr__(self, "output", defaults[1])
        if self.params is None:
            object.__setattr__(self, "params", _default_params(self.kind, self.bias))
        else:
            object.__setattr__(self, "params", tuple(self.params))
        self._init_sequence_and_packing()
        valid = _VALID_IO[self.kind]
        if self.input not in valid["input"]:
            raise InvalidArgument(
                f"Variant {self.name!r}: input={self.input!r} is not valid for a {self.kind} layer; "
                f"expected one of {', '.join(valid['input'])}"
            )
        if self.output not in valid["output"]:
            raise InvalidArgument(
                f"Variant {self.name!r}: output={self.output!r} is not valid for a {self.kind} layer; "
                f"expected one of {', '.join(valid['output'])}"
            )
        for name, low in (("min_batch_dims", 0), ("min_features", 1)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise InvalidArgument(f"Variant {self.name!r}: {name}={value!r}; expected an int >= {low}")
        self._check_batch_and_tp_limits()
        if not isinstance(self.forward_only, bool):
            raise InvalidArgument(f"Variant {self.name!r}: forward_only={self.forward_only!r}; expected a bool")
        if not isinstance(self.divisible_only, bool):
            raise InvalidArgument(f"Variant {self.name!r}: divisible_only={self.divisible_only!r}; expected a bool")
        if self.input_grad not in INPUT_GRADS:
            raise InvalidArgument(
                f"Variant {self.name!r}: input_grad={self.input_grad!r}; expected one of {', '.join(INPUT_GRADS)}"
            )
        masters = [p.master for p in self.params]  # type: ignore[union-attr]
        if masters.count("weight") != 1:
            raise InvalidArgument(f"Variant {self.name!r}: params must name exactly one weight, got {masters}")
        if self.bias and masters.count("bias") != 1:
            raise InvalidArgument(
                f"Variant {self.name!r}: bias=True but params name {masters.count('bias')} biases; "
                "add a ParamSpec for the bias or pass bias=False"
            )

    def _check_batch_and_tp_limits(self) -> None:
        low = self.max_batch_dims
        if low is not None and (isinstance(low, bool) or not isinstance(low, int) or low < self.min_batch_dims):
            raise InvalidArgument(
                f"Variant {self.name!r}: max_batch_dims={low!r}; expected None or an int >= min_batch_dims "
                f"({self.min_batch_dims})"
            )
        if low is not None and low < self.min_sequence_batch_dims():
            raise InvalidArgument(
                f"Variant {self.name!r}: max_batch_dims={low} leaves no room for the sequence dim "
                f"(sequence_dim={self.sequence_dim} needs {self.min_sequence_batch_dims()} batch dim(s))"
            )
        if not isinstance(self.always_bias, bool) or (self.always_bias and not self.bias):
            raise InvalidArgument(
                f"Variant {self.name!r}: always_bias={self.always_bias!r} with bias={self.bias!r}; expected a bool, "
                "and True only for a variant with a bias"
            )
        tp = self.min_tp_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InvalidArgument(f"Variant {self.name!r}: min_tp_size={tp!r}; expected an int >= 1")
        names = self.rank_local
        if isinstance(names, str):
            names = (names,)  # one module name: a tuple of one, not a tuple of characters
        names = tuple(names)
        bad = [n for n in names if not isinstance(n, str) or not n or n.strip() != n]
        if bad:
            raise InvalidArgument(
                f"Variant {self.name!r}: rank_local={self.rank_local!r}; expected module names such as "
                "('mypkg.parallel_state',)"
            )
        object.__setattr__(self, "rank_local", tuple(dict.fromkeys(names)))

    def _init_sequence_and_packing(self) -> None:
        if isinstance(self.sequence_dim, bool) or not isinstance(self.sequence_dim, int) or self.sequence_dim == -1:
            raise InvalidArgument(
                f"Variant {self.name!r}: sequence_dim={self.sequence_dim!r}; expected an int naming a dim before "
                "the feature dim (default -2; -1 is the feature dim)"
            )
        if self.packed is None:
            # A packed placement declared on the weight's ParamSpec is the variant's packing too.
            weight = self.param("weight")
            parts = getattr(weight.placement, "parts", None) if weight is not None else None
            if self.kind == "column" and parts is not None and weight.placement.dim % 2 == 0:  # type: ignore[union-attr]
                object.__setattr__(self, "packed", tuple(parts))
                if self.head_size is None and getattr(weight.placement, "head_size", None) is not None:
                    object.__setattr__(self, "head_size", weight.placement.head_size)  # type: ignore[union-attr]
                    self._pack_params(tuple(parts))
            elif self.head_size is not None:
                raise InvalidArgument(
                    f"Variant {self.name!r}: head_size={self.head_size!r} needs packed Q/K/V proportions, e.g. "
                    "packed=(4, 1, 1)"
                )
            return
        packed = self.packed
        if isinstance(packed, int) and not isinstance(packed, bool):
            packed = (1,) * packed  # K equal parts
        try:
            packed = tuple(packed)
            Shard(0, parts=packed)
        except (TypeError, InvalidArgument):
            raise InvalidArgument(
                f"Variant {self.name!r}: packed={self.packed!r}; expected K (equal parts) or part sizes/proportions "
                "such as (8, 2, 2)"
            ) from None
        if self.kind != "column":
            raise InvalidArgument(f"Variant {self.name!r}: packed={packed} applies to column layers only")
        if self.head_size is not None:
            try:
                Shard(0, parts=packed, head_size=self.head_size)
            except InvalidArgument as err:
                raise InvalidArgument(f"Variant {self.name!r}: {err}") from None
        object.__setattr__(self, "packed", packed)
        self._pack_params(packed)

    def _pack_params(self, packed: tuple[int, ...]) -> None:
        specs = []
        for spec in self.params or ():
            if isinstance(spec.placement, Shard) and spec.placement.dim % 2 == 0:
                spec = dataclasses.replace(spec, placement=Shard(spec.placement.dim, parts=packed,
                                                                 head_size=self.head_size))
            specs.append(spec)
        object.__setattr__(self, "params", tuple(specs))

    # -- placements -------------------------------------------------------------------------
    @property
    def input_placement(self) -> Placement:
        """Placement of the layer input over the tp group."""
        if self.input == "sequence-sharded":
            return Shard(self.sequence_dim)
        return Shard(-1) if self.input == "sharded" else Replicate()

    @property
    def output_placement(self) -> Placement:
        """Placement of the layer output over the tp group (a packed column's shards are per part)."""
        if self.output == "sequence-sharded":
            return Shard(self.sequence_dim)
        if self.output == "sharded":
            return Shard(-1, parts=self.packed, head_size=self.head_size) if self.packed else Shard(-1)
        return {"partial": Partial()}.get(self.output or "", Replicate())

    def sequence_dim_of(self, ndim: int) -> int | None:
        """The (non-negative) sequence dim of an ``ndim``-dim input, when the variant is
        sequence-parallel and the input has one (None otherwise)."""
        if "sequence-sharded" not in (self.input, self.output):
            return None
        d = self.sequence_dim + ndim if self.sequence_dim < 0 else self.sequence_dim
        return d if 0 <= d < ndim - 1 else None

    def min_sequence_batch_dims(self) -> int:
        """How many leading batch dims an input needs to have a sequence dim (0: not sequence-parallel)."""
        if "sequence-sharded" not in (self.input, self.output):
            return 0
        # sequence_dim -2 needs one batch dim (a 2-D input), -3 two; d >= 0 needs d + 1.
        return -self.sequence_dim - 1 if self.sequence_dim < 0 else self.sequence_dim + 1

    def layout_kwargs(self, out_features: int) -> dict[str, Any]:
        """Extra builder keywords of a packed or sequence-parallel variant, for builders that take them:
        ``parts`` (the packed part sizes for ``out_features``) and ``sequence_dim``. A builder gets
        each one only when its signature names it (or takes ``**kwargs``), so plain builders keep working."""
        extra: dict[str, Any] = {}
        if self.packed:
            from tpsim.placement import part_sizes

            try:
                extra["parts"] = part_sizes(out_features, Shard(0, parts=self.packed))
            except InvalidArgument:
                pass  # out_features is no multiple of the proportions: the builder decides alone
            if self.head_size is not None:
                extra["head_size"] = self.head_size
        if "sequence-sharded" in (self.input, self.output):
            extra["sequence_dim"] = self.sequence_dim
        if not extra:
            return extra
        import inspect

        try:
            params = inspect.signature(self.build).parameters.values()
        except (TypeError, ValueError):
            return {}
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
            return extra
        names = {p.name for p in params}
        return {k: v for k, v in extra.items() if k in names}

    def param(self, master: str) -> ParamSpec | None:
        """The spec of the ``"weight"`` or ``"bias"`` parameter (None when there is none)."""
        for spec in self.params or ():
            if spec.master == master:
                return spec
        return None

    def sharded_features(self) -> tuple[str, ...]:
        """Which of ``in_features``/``out_features`` must divide by the tp size."""
        out: set[str] = set()
        weight = self.param("weight")
        if weight is not None and isinstance(weight.placement, Shard):
            out.add("out_features" if weight.placement.dim % 2 == 0 else "in_features")
        if self.input == "sharded":
            out.add("in_features")
        if self.output == "sharded":
            out.add("out_features")
        return tuple(sorted(out))

    def describe(self) -> str:
        """One line: kind, input → output, params, input-grad semantics."""
        params = ", ".join(p.describe() for p in self.params or ())
        text = (
            f"{self.name}: {self.kind}, input {self.input} {self.input_placement} -> output "
            f"{self.output} {self.output_placement}; {params}; input grad {self.input_grad}"
        )
        if not self.bias:
            text += "; no bias (bias-free cases only)"
        restrictions = self.restrictions()
        if restrictions:
            text += "; " + "; ".join(restrictions)
        return text

    def restrictions(self) -> tuple[str, ...]:
        """The declared case restrictions in words (empty when there are none), for reports."""
        out = []
        if self.min_batch_dims:
            out.append(f"inputs with at least {self.min_batch_dims} batch dim(s) only")
        if self.always_bias:
            out.append("biased cases only (the layer always has a bias)")
        if self.max_batch_dims is not None:
            out.append(f"inputs with at most {self.max_batch_dims} batch dim(s) only")
        if self.min_tp_size > 1:
            out.append(f"tp groups of at least {self.min_tp_size} ranks only")
        if self.min_features > 1:
            out.append(f"feature sizes of at least {self.min_features} only")
        if self.divisible_only:
            out.append("divisible cases only: the divisibility property does not apply")
        if self.forward_only:
            out.append("forward only (an inference layer): the grad and training properties do not apply")
        if self.contiguous_inputs:
            out.append("contiguous inputs only (a precondition of the layer: it hands its input to a collective as "
                       "given, and NCCL refuses a non-contiguous tensor)")
        if not self.subgroups:
            out.append("tp groups spanning the whole world only (subgroups=False: it does not take a tp group)")
        return tuple(out)

    def replace(self, **changes: Any) -> Variant:
        """A copy with ``changes`` applied (validation runs again)."""
        return dataclasses.replace(self, **changes)

    def with_param_grads(self, grads: Mapping[str, str]) -> Variant:
        """A copy whose parameters' ``grad`` semantics are overridden, e.g. ``{"bias": "partial"}``
        (``tpsim check --param-grad bias=partial``). Keys are parameter names (``ParamSpec.name``) or
        master names (``"weight"``/``"bias"``); values ``"complete"`` or ``"partial"``."""
        if not isinstance(grads, Mapping):
            raise InvalidArgument(f"with_param_grads(grads={grads!r}): expected a mapping such as {{'bias': 'partial'}}")
        specs = list(self.params or ())
        for key, value in grads.items():
            hits = [i for i, s in enumerate(specs) if key in (s.name, s.master)]
            if not hits:
                names = sorted({s.name for s in specs} | {s.master for s in specs})
                raise InvalidArgument(
                    f"variant {self.name!r} has no parameter {key!r} to set grad={value!r} on; expected one of {names}"
                )
            for i in hits:
                # A grad the trainer sums lives on every rank: a detected holding becomes "all".
                held = "all" if value == "partial" and specs[i].held_by == "detect" else specs[i].held_by
                specs[i] = dataclasses.replace(specs[i], grad=value, held_by=held)
        return self.replace(params=tuple(specs))

    # -- building ---------------------------------------------------------------------------
    def instantiate(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        *,
        group: Any,
        rank: int,
        world_size: int,
        master_weight: torch.Tensor,
        master_bias: torch.Tensor | None,
        dtype: torch.dtype,
        on_built: Callable[[nn.Module], None] | None = None,
    ) -> nn.Module:
        """Build the layer of ``rank`` and load the master values into it (see :func:`load_master`).

        ``on_built(module)`` runs between construction and loading (the harness reads the layer's own
        initialisation there, e.g. to check that replicated parameters agree across ranks)."""
        if bias and not self.bias:
            raise InvalidArgument(f"variant {self.name!r} has no bias; bias=True cannot be built")
        module = self.build(
            in_features,
            out_features,
            bias,
            group=group,
            rank=rank,
            world_size=world_size,
            master_weight=master_weight,
            master_bias=master_bias,
            dtype=dtype,
            **self.layout_kwargs(out_features),
        )
        if not isinstance(module, nn.Module):
            raise InvalidArgument(
                f"the builder of variant {self.name!r} returned {type(module).__name__}; expected an nn.Module"
            )
        if on_built is not None:
            on_built(module)
        load_master(module, self, rank=rank, world_size=world_size, masters={"weight": master_weight, "bias": master_bias})
        return module

    def call(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run the layer forward on ``x``."""
        return self.forward(module, x) if self.forward is not None else module(x)


def get_param(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor at attribute path ``name`` (None when absent or None).

    A DTensor parameter (``torch.distributed.tensor.parallel``) reports its *global* shape, while a
    :class:`ParamSpec` describes what one rank stores: for one, this returns its local shard (an
    alias: writes go through to the parameter) with the local shard of its grad as ``.grad``.
    """
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    if not isinstance(obj, torch.Tensor):
        return None
    return _local_shard(obj) if _is_dtensor(obj) else obj


def _is_dtensor(tensor: torch.Tensor) -> bool:
    # A DTensor exists only once torch.distributed.tensor was imported: never import it here (it pulls
    # in sympy, seconds per process, for every plain layer's first case).
    dtensor = sys.modules.get("torch.distributed.tensor")
    cls = getattr(dtensor, "DTensor", None)
    return cls is not None and isinstance(tensor, cls)


def _local_shard(param: Any) -> torch.Tensor:
    with torch.no_grad():
        # detach(): a new tensor object over the same storage, so setting its .grad below leaves the
        # DTensor's own local tensor untouched.
        local = param.to_local().detach()
    grad = param.grad
    if grad is not None:
        local.grad = (grad.to_local() if _is_dtensor(grad) else grad).detach()
    return local


def stored_shape(spec: ParamSpec, master_shape: tuple[int, ...], world_size: int,
                 rank: int | None = None) -> tuple[int, ...]:
    """The shape a rank stores for ``spec`` given the master tensor's shape (``rank``'s, where the
    pieces are uneven: see :func:`tpsim.placement.uneven_pieces`)."""
    shape = shard_shape(master_shape, spec.placement, world_size, rank)
    return tuple(reversed(shape)) if spec.transposed else shape


def load_master(
    module: nn.Module,
    variant: Variant,
    *,
    rank: int,
    world_size: int,
    masters: Mapping[str, torch.Tensor | None],
) -> None:
    """Copy master values into every parameter of ``module`` by its spec (the generic loader).

    Specs with ``load=True`` get ``shard_tensor(master, placement, rank, world_size)``
    (transposed when stored transposed); every spec's stored shape is checked, raising
    :class:`LayoutError` on a mismatch or a missing parameter. A parameter held by tp rank 0 only
    (``held_by``) may be missing on the other ranks; declared ``"rank0"``, it must be.
    """
    for spec in variant.params or ():
        master = masters.get(spec.master)
        if master is None:
            continue  # e.g. the bias of a bias-free case
        expected = stored_shape(spec, tuple(master.shape), world_size, rank)
        param = get_param(module, spec.name)
        if param is None and spec.absent_ok(rank):
            continue  # held by tp rank 0 only
        if param is None:
            hint = "fix the ParamSpec name"
            if rank != 0 and isinstance(spec.placement, Replicate) and spec.grad == "complete":
                hint += (f", or, if only tp rank 0 holds it (nanotron's row bias), declare "
                         f"ParamSpec({spec.name!r}, ..., held_by='rank0')")
            raise LayoutError(
                f"variant {variant.name!r}: the built layer has no tensor at {spec.name!r} on tp rank {rank} "
                f"(expected shape {list(expected)}); {hint}",
                param=spec.name,
                shape=None,
                expected=expected,
            )
        if rank != 0 and spec.held_by == "rank0":
            raise LayoutError(
                f"variant {variant.name!r}: parameter {spec.name!r} is declared held by tp rank 0 only "
                f"(held_by='rank0'), but tp rank {rank} holds one of shape {list(param.shape)}; declare "
                "held_by='all' if every rank holds it",
                param=spec.name,
                shape=tuple(param.shape),
                expected=expected,
            )
        if tuple(param.shape) != expected:
            layout = " stored transposed" if spec.transposed else ""
            raise LayoutError(
                f"variant {variant.name!r}: parameter {spec.name!r} has shape {list(param.shape)}, "
                f"expected {list(expected)} ({spec.placement} of the master {spec.master} "
                f"{list(master.shape)} over world_size={world_size}{layout})",
                param=spec.name,
                shape=tuple(param.shape),
                expected=expected,
            )
        if spec.load:
            value = shard_tensor(master, spec.placement, rank, world_size)
            if spec.transposed:
                value = value.t()
            with torch.no_grad():
                param.copy_(value)
