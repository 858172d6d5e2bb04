"""The module variant: how a whole tensor-parallel module (an MLP, a block) is built and sharded.

A :class:`ModuleVariant` describes an ``nn.Module`` that is built from integer sizes and a tp group,
such as ``MyMLP(hidden, ffn, process_group=group)``. Unlike a linear :class:`~tpsim.variant.Variant`
it needs no description of the maths: **the dense reference is the same module on a tp group of
one rank**, in float64 (every collective over one rank is the identity, so it *is* the dense
module). The harness builds it, draws full master values for its parameters, and gives every rank
of the real tp group its shard of each parameter. Which dim of a parameter is sharded is read from
the shapes: the parameter at tp size 1 and at tp size N differ in exactly one dim, by a factor N
(equal shapes: replicated). Where shapes alone are ambiguous — a packed weight whose parts (gate/up,
Q/K/V) are each sharded on their own has the shape of a contiguous split — declare the parameter::

    from tpsim import ModuleVariant, ParamSpec, Shard

    def build(hidden, ffn, *, group, dtype):
        return MyGatedMLP(hidden, ffn, process_group=group, dtype=dtype)

    my_mlp = ModuleVariant(
        name="MyGatedMLP", build=build, sizes=("hidden", "ffn"),
        params=(ParamSpec("fc1.weight", "weight", Shard(0, parts=(1, 1))),   # [gate; up], each sharded
                ParamSpec("fc1.bias", "bias", Shard(0, parts=(1, 1)))),
    )

A layer that describes its own sharding with the attributes of :mod:`tpsim.layers.linear`
(``parts``: the full sizes of its packed parts) needs no declaration: a parameter whose sharded dim
has the size of those parts is sharded per part.

Fields:

- ``build(*sizes, group, dtype) -> nn.Module``: one rank's module on its tp ``group`` (sizes by
  position, in the order of ``sizes``), in ``dtype``. Built on a group of one rank it must be the
  dense module (or give ``dense``).
- ``sizes``: the names of the integer sizes, in order; the input is ``[..., first size]``.
- ``dense(*sizes, dtype) -> nn.Module`` (optional): the dense reference instead of ``build`` on a
  one-rank group; its parameters must have the same dotted names and the unsharded shapes.
- ``params``: :class:`~tpsim.variant.ParamSpec` overrides by dotted name. ``placement`` is in the
  coordinates of the parameter as the dense module stores it (``transposed=True``: in the
  transposed coordinates of a 2-D parameter); ``master`` (``"weight"`` or ``"bias"``) says which
  property its grad counts under. Parameters without a spec are inferred. A declaration describes how
  the pieces are laid out; it never changes what a library loaded (see ``load``).
- ``input``: ``"replicated"`` (default; every rank gets the whole input), ``"sharded"`` (its slice
  of the last dim) or ``"sequence-sharded"`` (its slice of ``sequence_dim``, sequence parallelism).
- ``output``: ``"replicated"`` (default; ``"reduced"`` and ``"gathered"`` mean the same), ``"partial"``
  (a summand: the caller reduces), ``"sharded"`` (the last dim) or ``"sequence-sharded"``.
- ``input_grad``: ``"complete"`` (every rank holds the whole grad of a replicated input) or
  ``"partial"`` (each rank a summand).
- ``forward(module, x)``: replaces ``module(x)`` when the module needs another call.
- ``min_sizes``: the smallest value of every size (default 1).
- ``size_strategy(tp_size, divisible)``: optional; a Hypothesis strategy of size tuples, for sizes
  that constrain each other (heads dividing the hidden size). ``divisible`` False asks for a tuple
  with at least one sharded size that does not divide by ``tp_size``.
- ``rank_local``: modules whose globals are per rank (see :func:`tpsim.run`).
- ``tp``: ``"world"`` when the module's tp group is always the whole world (a DTensor mesh over every
  rank, torchtitan's ``world_mesh``): no smaller tp groups are drawn. None (the default): the module
  uses the group it is given, so tp groups smaller than the world are checked too.
- ``min_batch_dims``/``max_batch_dims``: the fewest and most leading batch dims of an input (None:
  no upper limit beyond the strategies' own), e.g. ``max_batch_dims=1`` for styles that take 2-D inputs.
- ``initialised``: whether the builder initialises the parameters (the default). A builder that
  leaves them empty because the harness loads every one anyway (fast at large sizes) says False:
  replicated parameters are then not compared right after construction.
- ``load``: how the library puts the case's weights into each rank's module (tpsim never writes a
  parameter the library loaded; it reads each rank's piece back and compares the pieces, assembled,
  with the dense weights right after construction):

  - ``"build"``: the builder takes them: ``build(*sizes, group, dtype, masters)`` gets ``masters``,
    every dense parameter's full value by dotted name, and returns the module holding its pieces
    (a builder that slices them, a dense module parallelised by a plan: :mod:`tpsim.props.module.plans`).
    Building the dense reference (on one rank, before the weights are drawn from its shapes), it
    gets ``masters=None``: its own init then;
  - a callable ``load(module, masters)`` or the name of a method of the module called with
    ``masters`` (``"load_weights"``, or ``"load_state_dict"`` for a module whose load hooks slice);
  - None (the default): a parameter with a ``weight_loader`` attribute (vLLM's convention) loads its
    own piece, ``param.weight_loader(param, full)``; tpsim writes the others' pieces (the module has
    no loader: its layout is declared or read from the shapes).

- ``unsharded``: names of sizes no rank splits — a config's counts and switches (experts, top-k, a
  bias switch drawn 0 or 1) rather than dims a tp group divides: no divisibility is asked of them,
  and a case may draw them 0.
- ``dtypes``: the dtypes the variant is checked in (None: every dtype the family checks), e.g. the
  float64 and float32 only of a module whose forward takes discrete decisions on its activations (an
  MoE router's top-k), where a bfloat16 rounding difference flips a decision (give the reason in
  ``notes``).
- ``forward_only``: an inference module (weights with ``requires_grad=False``, collectives outside
  autograd, e.g. vLLM's): its forward runs once per case under ``torch.no_grad()`` (the dense
  reference and its twin likewise), with no backward and no SGD steps, and only forward
  equivalence, replica consistency and divisibility are checked (a refusal by ``assert`` on every
  rank counts: vLLM's ``divide()``; ``python -O`` strips it). ``tpsim check --kind module --forward-only``.
- ``clip(parameters, max_norm) -> total_norm``: the library's gradient clipping by global norm, where
  it has one (Megatron's ``get_grad_norm_fp32`` + ``clip_grad_by_total_norm_fp32``, torchtitan's
  ``clip_grad_norm_``, or your own distributed clip, adapted to this signature): called on every rank
  with the module's parameters (after the trainer's sum of partial grads) at each optimizer step of
  training equivalence, with a ``max_norm`` of half the dense total norm of the first step (so that
  clipping happens), and must clip the grads in place and return the total norm over the whole tp
  group (a tensor, a DTensor or a float) like ``torch.nn.utils.clip_grad_norm_``, which the dense
  reference uses in float64. The returned norm and the trained parameters are compared; a norm that
  counts a replicated parameter once per rank is ``norm-counts-replicas``. Not used forward-only.

:func:`module_from_class` makes one from a plain class whose constructor takes the sizes and a group
keyword (``process_group``, ``group``, ``tp_group`` or nanotron's ``pg``): ``tpsim check FILE:Class --kind module``.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
from torch import nn

from tpsim.conventions import GROUP_KEYWORDS as CONVENTION_GROUP_KEYWORDS
from tpsim.errors import InvalidArgument
from tpsim.placement import Placement, Shard
from tpsim.variant import DTYPES, INPUT_GRADS, ParamSpec

__all__ = [
    "GROUP_KEYWORDS",
    "LOAD_IN_BUILD",
    "MODULE_INPUTS",
    "MODULE_KIND",
    "MODULE_OUTPUTS",
    "ModuleVariant",
    "SizeCatalog",
    "constructor_sizes",
    "parameters_of",
    "module_from_class",
]

#: The ``--kind`` that selects whole-module targets.
MODULE_KIND = "module"
#: Inputs a module variant can declare.
MODULE_INPUTS = ("replicated", "sharded", "sequence-sharded")
#: Outputs a module variant can declare (``reduced``/``gathered`` are read as ``replicated``).
MODULE_OUTPUTS = ("replicated", "partial", "sharded", "sequence-sharded")
_OUTPUT_ALIASES = {"reduced": "replicated", "gathered": "replicated"}
#: Constructor keywords that take the tp group, in the order they are looked for: the same ones as a
#: single layer's (nanotron's ``pg`` included).
GROUP_KEYWORDS = CONVENTION_GROUP_KEYWORDS


#: ``ModuleVariant.load`` of a builder that takes the dense weights (``masters=``) and loads them itself.
LOAD_IN_BUILD = "build"


def _positive_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(f"{what}={value!r}; expected an int >= 1")
    return value


@dataclass(frozen=True)
class ModuleVariant:
    """How one tensor-parallel module is built and sharded (see the module docstring)."""

    name: str
    build: Callable[..., nn.Module]
    sizes: tuple[str, ...]
    dense: Callable[..., nn.Module] | None = None
    params: tuple[ParamSpec, ...] = ()
    input: str = "replicated"
    output: str = "replicated"
    input_grad: str = "complete"
    sequence_dim: int = -2
    forward: Callable[[nn.Module, torch.Tensor], torch.Tensor] | None = None
    min_sizes: tuple[int, ...] | None = None
    size_strategy: Callable[[int, bool], Any] | None = None
    rank_local: tuple[str, ...] = ()
    initialised: bool = True
    forward_only: bool = False
    tp: str | None = None
    min_batch_dims: int = 0
    max_batch_dims: int | None = None
    description: str = ""
    notes: tuple[str, ...] = ()
    target: str | None = None
    options: tuple[tuple[str, Any], ...] = field(default=())
    #: The dense module's parameter names, read once by building it (:func:`parameters_of`; None: not
    #: read): what the properties that apply depend on (no bias, no bias grads to check).
    parameters: tuple[str, ...] | None = None
    load: Callable[[nn.Module, dict[str, torch.Tensor]], Any] | str | None = None
    unsharded: tuple[str, ...] = ()
    dtypes: tuple[str, ...] | None = None
    #: Parameters the dense module itself keeps in a dtype of its own whatever the case's dtype
    #: (``(name, "float32")``: an MoE router created in float32): judged in that dtype, not the case's.
    own_dtypes: tuple[tuple[str, str], ...] = ()
    #: The library's clip by global norm, ``clip(parameters, max_norm) -> total_norm`` (see the module docstring).
    clip: Callable[..., Any] | None = None

    #: What ``--report json`` lists as the variant's kind; a module has no single bias switch.
    kind: ClassVar[str] = MODULE_KIND
    bias: ClassVar[None] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise InvalidArgument(f"ModuleVariant(name={self.name!r}): expected a non-empty string")
        if not callable(self.build):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: build={self.build!r}; expected a callable builder")
        if self.dense is not None and not callable(self.dense):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: dense={self.dense!r}; expected a callable or None")
        sizes = (self.sizes,) if isinstance(self.sizes, str) else tuple(self.sizes)
        if not sizes or not all(isinstance(s, str) and s.isidentifier() for s in sizes) or len(set(sizes)) != len(sizes):
            raise InvalidArgument(
                f"ModuleVariant {self.name!r}: sizes={self.sizes!r}; expected the distinct names of the integer "
                "sizes the builder takes, e.g. ('hidden', 'ffn')"
            )
        object.__setattr__(self, "sizes", sizes)
        minimum = (1,) * len(sizes) if self.min_sizes is None else tuple(self.min_sizes)
        if len(minimum) != len(sizes):
            raise InvalidArgument(
                f"ModuleVariant {self.name!r}: min_sizes={self.min_sizes!r} has {len(minimum)} entries for "
                f"{len(sizes)} sizes {list(sizes)}"
            )
        for size, low in zip(sizes, minimum, strict=True):
            _positive_int(low, f"ModuleVariant {self.name!r}: min_sizes entry for {size!r}")
        object.__setattr__(self, "min_sizes", minimum)
        unsharded = (self.unsharded,) if isinstance(self.unsharded, str) else tuple(self.unsharded)
        if any(n not in sizes[1:] for n in unsharded):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: unsharded={self.unsharded!r}; expected names of sizes "
                                  f"{list(sizes[1:])} (not the input's feature size {sizes[0]!r})")
        object.__setattr__(self, "unsharded", unsharded)
        if self.dtypes is not None:
            dtypes = (self.dtypes,) if isinstance(self.dtypes, str) else tuple(self.dtypes)
            if not dtypes or any(d not in DTYPES for d in dtypes):
                raise InvalidArgument(f"ModuleVariant {self.name!r}: dtypes={self.dtypes!r}; expected None or some of "
                                      f"{', '.join(DTYPES)}")
            object.__setattr__(self, "dtypes", dtypes)
        output = _OUTPUT_ALIASES.get(self.output, self.output)
        object.__setattr__(self, "output", output)
        for attr, allowed in (("input", MODULE_INPUTS), ("output", MODULE_OUTPUTS), ("input_grad", INPUT_GRADS)):
            value = getattr(self, attr)
            if value not in allowed:
                raise InvalidArgument(
                    f"ModuleVariant {self.name!r}: {attr}={value!r}; expected one of {', '.join(allowed)}"
                )
        seq = self.sequence_dim
        if isinstance(seq, bool) or not isinstance(seq, int) or seq == -1:
            raise InvalidArgument(
                f"ModuleVariant {self.name!r}: sequence_dim={seq!r}; expected an int naming a dim before the "
                "feature dim (default -2; -1 is the feature dim)"
            )
        self._check_params()
        if self.size_strategy is not None and not callable(self.size_strategy):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: size_strategy={self.size_strategy!r}; expected a callable")
        if self.tp not in (None, "world"):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: tp={self.tp!r}; expected 'world' (the tp group is "
                                  "the whole world) or None (the group the builder is given)")
        low = self.min_batch_dims
        if isinstance(low, bool) or not isinstance(low, int) or low < 0:
            raise InvalidArgument(f"ModuleVariant {self.name!r}: min_batch_dims={low!r}; expected an int >= 0")
        high = self.max_batch_dims
        if high is not None and (isinstance(high, bool) or not isinstance(high, int) or high < low):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: max_batch_dims={high!r}; expected None or an int >= "
                                  f"min_batch_dims={low}")
        if not isinstance(self.initialised, bool):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: initialised={self.initialised!r}; expected a bool")
        if not isinstance(self.forward_only, bool):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: forward_only={self.forward_only!r}; expected a bool "
                                  "(True: an inference module, checked forward only)")
        if self.load is not None and not callable(self.load) and not (isinstance(self.load, str) and (
                self.load == LOAD_IN_BUILD or self.load.isidentifier())):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: load={self.load!r}; expected 'build' (the builder "
                                  "takes masters=), a callable load(module, masters) or the name of a method of the "
                                  "module that takes masters")
        if self.clip is not None and not callable(self.clip):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: clip={self.clip!r}; expected None or a callable "
                                  "clip(parameters, max_norm) -> total_norm")
        names = (self.rank_local,) if isinstance(self.rank_local, str) else tuple(self.rank_local)
        if not all(isinstance(n, str) and n for n in names):
            raise InvalidArgument(f"ModuleVariant {self.name!r}: rank_local={self.rank_local!r}; expected module names")
        object.__setattr__(self, "rank_local", names)
        object.__setattr__(self, "notes", tuple(self.notes))
        object.__setattr__(self, "options", tuple(self.options))

    def _check_params(self) -> None:
        specs = tuple(self.params)
        for spec in specs:
            if not isinstance(spec, ParamSpec):
                raise InvalidArgument(
                    f"ModuleVariant {self.name!r}: params holds {spec!r}; expected tpsim.ParamSpec entries"
                )
            if not spec.load:
                raise InvalidArgument(
                    f"ModuleVariant {self.name!r}: ParamSpec({spec.name!r}, load=False) is not supported for a "
                    "module: a module's own loader is named by ModuleVariant(load=...), which loads every parameter "
                    "(its builder, a loader method, or each parameter's weight_loader)"
                )
        names = [s.name for s in specs]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise InvalidArgument(f"ModuleVariant {self.name!r}: params names {dupes[0]!r} twice")
        object.__setattr__(self, "params", specs)

    # -- what reports and the harness read ------------------------------------------------------
    def param(self, name: str) -> ParamSpec | None:
        """The declared spec of parameter ``name`` (None: inferred from shapes)."""
        return next((s for s in self.params if s.name == name), None)

    def stored_placement(self, spec: ParamSpec, ndim: int) -> Placement:
        """``spec``'s placement in the coordinates the parameter is stored in."""
        placement = spec.placement
        if spec.transposed and ndim == 2 and isinstance(placement, Shard):
            return Shard(1 - placement.dim % 2, parts=placement.parts)
        return placement

    def sequence_dim_of(self, ndim: int) -> int | None:
        """The non-negative sequence dim of an ``ndim``-dim input (None: the input has no such dim)."""
        d = self.sequence_dim if self.sequence_dim >= 0 else ndim + self.sequence_dim
        return d if 0 <= d < ndim - 1 else None

    def describe(self) -> str:
        """One line: the sizes, the placements, what is declared."""
        text = f"{self.name}: module({', '.join(self.sizes)}), input {self.input}, output {self.output}"
        if self.input_grad != "complete":
            text += f", input grad {self.input_grad}"
        if self.forward_only:
            text += ", forward only"
        elif self.clip is not None:
            text += ", clips grads by global norm"
        if self.params:
            text += "; declared " + ", ".join(s.describe() for s in self.params)
        text += "; dense reference: " + ("its dense builder" if self.dense is not None else "itself on one rank")
        return text

    def replace(self, **changes: Any) -> ModuleVariant:
        """A copy with ``changes`` applied (validation runs again)."""
        return dataclasses.replace(self, **changes)

    # -- building -------------------------------------------------------------------------------
    def instantiate(self, sizes: tuple[int, ...], *, group: Any, dtype: torch.dtype,
                    masters: dict[str, torch.Tensor] | None = None) -> nn.Module:
        """One rank's module on ``group`` (the builder's result, checked to be an ``nn.Module``);
        ``masters`` reach a builder that loads them (``load="build"``)."""
        if self.load == LOAD_IN_BUILD:
            return self._checked(self.build(*sizes, group=group, dtype=dtype, masters=masters), "build")
        return self._checked(self.build(*sizes, group=group, dtype=dtype), "build")

    @property
    def library_loads(self) -> bool:
        """Whether the library loads every parameter itself (``load`` is given)."""
        return self.load is not None

    def reference(self, sizes: tuple[int, ...], *, group: Any, dtype: torch.dtype) -> nn.Module:
        """The dense reference: ``dense(*sizes, dtype)`` when given, else the module on ``group``
        (a group of one rank)."""
        if self.dense is not None:
            return self._checked(self.dense(*sizes, dtype=dtype), "dense")
        return self.instantiate(sizes, group=group, dtype=dtype)

    def _checked(self, module: Any, which: str) -> nn.Module:
        if not isinstance(module, nn.Module):
            raise InvalidArgument(
                f"the {which} function of module variant {self.name!r} returned {type(module).__name__}; "
                "expected an nn.Module"
            )
        return module

    def call(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """Run the module forward on ``x``."""
        return self.forward(module, x) if self.forward is not None else module(x)


@dataclass(frozen=True)
class SizeCatalog:
    """A variant's ``size_strategy`` as data: the size tuples it drew for each ``(tp size, divisible)``,
    smallest first. The judge of ``tpsim check`` never runs the checked code's own functions (its
    strategies included: :mod:`tpsim.props.described`), so the worker that resolves the target draws
    them once; cases then sample from these tuples and shrink toward the first. Called like the
    strategy it stands for: ``catalog(tp, divisible)``."""

    #: ``((tp, divisible), (sizes, ...))`` pairs.
    drawn_by: tuple[tuple[tuple[int, bool], tuple[tuple[int, ...], ...]], ...]

    #: Examples drawn from the strategy per ``(tp, divisible)``.
    EXAMPLES: ClassVar[int] = 60

    def __call__(self, tp: int, divisible: bool) -> Any:
        from hypothesis import strategies as st

        found = dict(self.drawn_by).get((tp, bool(divisible)), ())
        return st.sampled_from(found) if found else st.nothing()

    @classmethod
    def drawn(cls, variant: ModuleVariant, tp_sizes: tuple[int, ...]) -> SizeCatalog:
        """Draw ``variant.size_strategy`` for every tp size of ``tp_sizes``, divisible or not
        (derandomised: the same tuples every time)."""
        strategy = variant.size_strategy
        if strategy is None:
            raise InvalidArgument(f"ModuleVariant {variant.name!r} has no size_strategy to draw")
        out = []
        for tp in tp_sizes:
            for divisible in (True, False):
                if not divisible and tp == 1:
                    continue
                out.append(((tp, divisible), cls._draw(strategy(tp, divisible))))
        return cls(tuple(out))

    @classmethod
    def _draw(cls, strategy: Any) -> tuple[tuple[int, ...], ...]:
        from hypothesis import HealthCheck, Phase, given, settings

        found: list[tuple[int, ...]] = []

        @settings(max_examples=cls.EXAMPLES, database=None, derandomize=True, phases=[Phase.generate],
                  deadline=None, suppress_health_check=list(HealthCheck))
        @given(strategy)
        def collect(sizes: Any) -> None:
            found.append(tuple(int(s) for s in sizes))

        try:
            collect()
        except Exception:  # noqa: BLE001 - no valid tuple at this tp size: none drawn there
            return ()
        return tuple(sorted(set(found), key=lambda t: (sum(t), t)))


def _probe(payload: tuple[ModuleVariant, tuple[int, ...]]) -> tuple[str, ...]:
    import torch.distributed as dist

    variant, sizes = payload
    return tuple(n for n, _ in variant.reference(sizes, group=dist.group.WORLD, dtype=torch.float32).named_parameters())


def parameters_of(variant: ModuleVariant) -> tuple[str, ...] | None:
    """The names of ``variant``'s dense parameters, read by building it once on a one-rank world at
    its smallest sizes (the first its size strategy draws); None when it cannot be built so."""
    from tpsim.runner import run

    sizes: Any = tuple(variant.min_sizes or (1,) * len(variant.sizes))
    if variant.size_strategy is not None:
        drawn = variant.size_strategy.drawn_by if isinstance(variant.size_strategy, SizeCatalog) else \
            SizeCatalog.drawn(variant, (1,)).drawn_by
        sizes = next((found[0] for (tp, divisible), found in drawn if tp == 1 and found), None)
        if sizes is None:
            return None
    try:
        return run(_probe, 1, args=((variant, sizes),), rank_local=variant.rank_local)[0]
    except Exception:  # noqa: BLE001 - a module that cannot be built alone: every property stays
        return None


def _signature(cls: type) -> inspect.Signature:
    try:
        return inspect.signature(cls.__init__)
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"cannot read the constructor signature of {cls.__qualname__}: {err}") from err


def group_keyword(cls: type) -> str | None:
    """The constructor keyword of ``cls`` that takes the tp group (None: it has none)."""
    names = [n for n in _signature(cls).parameters if n != "self"]
    return next((k for k in GROUP_KEYWORDS if k in names), None)


def constructor_sizes(cls: type, *, skip: tuple[str, ...] = ()) -> list[str]:
    """The integer sizes a module class's constructor takes: its required parameters other than ``skip``
    and ``dtype``, in order (an int annotation is honoured; anything else annotated, or a required
    keyword-only parameter, is refused: tpsim passes the sizes by position)."""
    sizes = []
    for p in [p for n, p in _signature(cls).parameters.items() if n != "self"]:
        if p.name in (*skip, "dtype") or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is not p.empty:
            continue
        if p.kind is p.KEYWORD_ONLY:
            raise InvalidArgument(
                f"{cls.__qualname__}: the keyword-only parameter {p.name!r} has no default; tpsim passes the sizes by "
                "position and only the group (and dtype) by keyword: describe it with a tpsim ModuleVariant"
            )
        if p.annotation not in (p.empty, int, "int"):
            raise InvalidArgument(
                f"{cls.__qualname__}: parameter {p.name!r} is annotated {p.annotation!r}, not int; the sizes of a "
                "module target are its required int parameters: describe it with a tpsim ModuleVariant"
            )
        sizes.append(p.name)
    return sizes


def module_from_class(
    cls: type,
    *,
    input: str | None = None,
    output: str | None = None,
    input_grad: str | None = None,
    sequence_dim: int | None = None,
    name: str | None = None,
) -> ModuleVariant:
    """A module variant for a plain ``nn.Module`` class whose constructor takes integer sizes and a
    group keyword (``process_group``, ``group``, ``tp_group`` or ``pg``).

    The sizes are the constructor's required parameters other than the group, in order (an int
    annotation is honoured; anything else annotated is refused); parameters with defaults keep them.
    A ``dtype`` parameter gets the case's dtype; otherwise the module is converted with ``.to(dtype)``.
    """
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgument(f"{cls!r} is not an nn.Module class")
    sig = _signature(cls)
    params = [p for n, p in sig.parameters.items() if n != "self"]
    names = [p.name for p in params]
    keyword = group_keyword(cls)
    if keyword is None:
        raise InvalidArgument(
            f"{cls.__qualname__}({', '.join(names)}) takes no tp group: a whole-module target needs a constructor "
            f"keyword {' / '.join(GROUP_KEYWORDS)} (the harness builds it on each rank's tp group and on a one-rank "
            "group for the dense reference); or describe it with a tpsim ModuleVariant"
        )
    sizes = constructor_sizes(cls, skip=(keyword,))
    if not sizes:
        raise InvalidArgument(
            f"{cls.__qualname__}({', '.join(names)}) takes no integer sizes; expected e.g. (hidden, ffn, *, "
            f"{keyword}=None)"
        )
    takes_dtype = "dtype" in names

    def build(*values: int, group: Any, dtype: torch.dtype) -> nn.Module:
        kwargs: dict[str, Any] = {keyword: group}
        if takes_dtype:
            kwargs["dtype"] = dtype
        module = cls(*values, **kwargs)
        # Converted either way: a module that ignores its dtype argument still runs in the case's dtype.
        return module.to(dtype) if isinstance(module, nn.Module) else module

    return ModuleVariant(
        name=name or cls.__qualname__,
        build=build,
        sizes=tuple(sizes),
        input=input or "replicated",
        output=output or "replicated",
        input_grad=input_grad or "complete",
        sequence_dim=-2 if sequence_dim is None else sequence_dim,
        description=f"{cls.__module__}.{cls.__qualname__}({', '.join(sizes)}, {keyword}=group)",
    )
