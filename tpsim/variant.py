"""The variant description: how a tensor-parallel linear layer is sharded and how to build it.

A :class:`Variant` is data about a layer implementation, written once per implementation:

- ``kind``: ``"column"`` (output features sharded) or ``"row"`` (input features sharded);
- ``input``: what each rank is given — ``"replicated"`` (the full input on every rank) or
  ``"sharded"`` (rank ``r`` gets the ``r``-th slice of the last dim);
- ``output``: what each rank returns — ``"sharded"`` (its slice of the output features),
  ``"gathered"`` (the full output, gathered by the layer), ``"partial"`` (a summand: the harness
  sums the ranks' outputs, as the caller's all-reduce would) or ``"reduced"`` (the full output,
  reduced by the layer);
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
itself (``load=False``, e.g. a constructor that slices ``master_weight``) are only shape-checked.

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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.placement import Partial, Placement, Replicate, Shard, shard_shape, shard_tensor

__all__ = [
    "INPUTS",
    "INPUT_GRADS",
    "KINDS",
    "OUTPUTS",
    "Builder",
    "LayoutError",
    "ParamSpec",
    "Variant",
    "load_master",
]

KINDS = ("column", "row")
#: Input placements a variant can declare (issue 12 adds "sequence-sharded").
INPUTS = ("replicated", "sharded")
#: Output placements a variant can declare.
OUTPUTS = ("sharded", "gathered", "partial", "reduced")
INPUT_GRADS = ("complete", "partial")

_VALID_IO = {
    "column": {"input": ("replicated",), "output": ("sharded", "gathered")},
    "row": {"input": ("sharded", "replicated"), "output": ("partial", "reduced")},
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
    """

    name: str
    master: str
    placement: Placement
    transposed: bool = False
    load: bool = True

    def __post_init__(self) -> None:
        if self.master not in ("weight", "bias"):
            raise InvalidArgument(f"ParamSpec(master={self.master!r}): expected 'weight' or 'bias'")
        if not isinstance(self.placement, Placement):
            raise InvalidArgument(
                f"ParamSpec(placement={self.placement!r}): expected Shard(dim), Replicate() or Partial()"
            )
        if self.transposed and self.master != "weight":
            raise InvalidArgument(f"ParamSpec(name={self.name!r}): only a weight can be stored transposed")

    def describe(self) -> str:
        """Short form, e.g. ``weight S(0)`` or ``weight S(1) stored transposed``."""
        text = f"{self.name} {self.placement}"
        return text + (" stored transposed" if self.transposed else "")


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

    # -- placements -------------------------------------------------------------------------
    @property
    def input_placement(self) -> Placement:
        """Placement of the layer input over the tp group."""
        return Shard(-1) if self.input == "sharded" else Replicate()

    @property
    def output_placement(self) -> Placement:
        """Placement of the layer output over the tp group."""
        return {"sharded": Shard(-1), "partial": Partial()}.get(self.output or "", Replicate())

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
        return text

    def replace(self, **changes: Any) -> Variant:
        """A copy with ``changes`` applied (validation runs again)."""
        return dataclasses.replace(self, **changes)

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
    ) -> nn.Module:
        """Build the layer of ``rank`` and load the master values into it (see :func:`load_master`)."""
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
        )
        if not isinstance(module, nn.Module):
            raise InvalidArgument(
                f"the builder of variant {self.name!r} returned {type(module).__name__}; expected an nn.Module"
            )
        load_master(module, self, rank=rank, world_size=world_size, masters={"weight": master_weight, "bias": master_bias})
        return module

    def call(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run the layer forward on ``x``."""
        return self.forward(module, x) if self.forward is not None else module(x)


def get_param(module: nn.Module, name: str) -> torch.Tensor | None:
    """The tensor at attribute path ``name`` (None when absent or None)."""
    obj: Any = module
    for part in name.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj if isinstance(obj, torch.Tensor) else None


def stored_shape(spec: ParamSpec, master_shape: tuple[int, ...], world_size: int) -> tuple[int, ...]:
    """The shape a rank stores for ``spec`` given the master tensor's shape."""
    shape = shard_shape(master_shape, spec.placement, world_size)
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
    :class:`LayoutError` on a mismatch or a missing parameter.
    """
    for spec in variant.params or ():
        master = masters.get(spec.master)
        if master is None:
            continue  # e.g. the bias of a bias-free case
        expected = stored_shape(spec, tuple(master.shape), world_size)
        param = get_param(module, spec.name)
        if param is None:
            raise LayoutError(
                f"variant {variant.name!r}: the built layer has no tensor at {spec.name!r} "
                f"(expected shape {list(expected)}); fix the ParamSpec name",
                param=spec.name,
                shape=None,
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
