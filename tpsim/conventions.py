"""Adapters that turn a plain ``nn.Module`` class into a :class:`~tpsim.variant.Variant`.

Four constructor conventions are common in the wild and are recognised from the signature:

``master-weight``: ``cls(in_features, out_features, bias, master_weight)``
    The layer reads its rank and world size from the default process group and slices the
    ``[out, in]`` master weight itself (so the harness does *not* overwrite the weight: the
    slicing is part of what is checked); the bias is zero-initialised and the harness loads the
    master bias into it by its placement (column: this rank's shard, row: the whole bias).
    Weight stored ``[out/ws, in]`` (column) / ``[out, in/ws]`` (row). Defaults: column output
    ``sharded``, row output ``partial`` (the caller all-reduces).

``tp-rank``: ``cls(in_features, out_features, tp_size, tp_rank[, tp_group][, bias])``
    The layer initialises its own weights randomly; the harness overwrites them with the master
    shards. Weight stored transposed: ``[in, out/ws]`` (column) / ``[in/ws, out]`` (row).
    Defaults: column output ``sharded``, row output ``reduced`` (its forward all-reduces).

``group`` (Megatron's): ``cls(input_size, output_size, *, bias=True, gather_output=False,
skip_bias_add=False, process_group=None)``
    The tp group is passed by keyword (``process_group``, ``group``, ``tp_group`` or nanotron's ``pg``); the sizes
    are ``input_size``/``output_size`` or ``in_features``/``out_features``. The layer initialises
    its own weights; the harness overwrites them with the master shards, stored ``[out/ws, in]``
    (column) / ``[out, in/ws]`` (row). Megatron's option keywords follow the placements:
    ``gather_output`` is passed as ``output == "gathered"``, ``input_is_parallel`` as
    ``input != "replicated"``, ``sequence_parallel`` as "a placement is sequence-sharded" (whose
    sequence dim is then 0 by default: Megatron's inputs are sequence-first ``[s, b, h]``), nanotron's
    ``mode`` (an enum with ``ALL_REDUCE`` and ``REDUCE_SCATTER``, nanotron's ``TensorParallelLinearMode``)
    as ``REDUCE_SCATTER`` when a placement is sequence-sharded, else ``ALL_REDUCE``; a required
    ``skip_bias_add`` gets False. Defaults come from the signature: column output
    ``gathered`` when ``gather_output`` defaults to True, else ``sharded``; row input ``sharded``
    unless ``input_is_parallel`` defaults to False; row output ``reduced`` (``partial`` when vLLM's
    ``reduce_results`` defaults to False; the keyword follows the row output).

``implicit-group`` (vLLM's): ``cls(input_size, output_size, bias=True, ..., skip_bias_add=False,
params_dtype=None, reduce_results=True)``
    Like ``group`` with no group to pass: the layer reads its tp group itself (the default group, or
    its library's state through a ``get_tp_group()`` over a module global), so the tp group is the
    world (``subgroups=False``). Detected from the sizes and at least one of the option keywords
    (``skip_bias_add``, ``gather_output``, ``input_is_parallel``, ``reduce_results``) with no group
    keyword. ``params_dtype`` gets the case's dtype.

A constructor parameter no convention passes is fixed with ``ctor_args`` (``--ctor-arg NAME=VALUE``,
see :func:`parse_ctor_arg`); a required one left unset is an :class:`~tpsim.InvalidArgument` naming it.

Every convention accepts a ``forward`` that returns ``(output, bias_or_None)`` (Megatron's and vLLM's
``skip_bias_add``: the bias is left to the caller): tpsim adds the returned bias before comparing.

The bias comes from the built module as well as the signature: a constructor with a ``bias`` flag
gets biased and bias-free cases; one without builds a probe layer once (a one-rank world, tp size 1)
and, when the built module has a ``bias`` parameter, runs biased cases only with the master bias
loaded into it (its own init is overwritten), else bias-free cases only. A row layer's (replicated)
bias may be held by tp rank 0 only, as nanotron's row layers keep it (rank 0 adds it before the
all-reduce; the other ranks' ``bias`` is None): the bias is declared ``held_by="detect"``, so rank 0
gets the master bias and its grad is compared with the dense grad, and the other ranks hold none or
all hold one (see :class:`~tpsim.variant.ParamSpec`).

The module that defines the class is rank-local (each inproc rank thread sees its own copy of its
globals, as each rank process does in a real job), so a module-global tp group is not shared.

The kind (column/row) is read from the class name when it contains exactly one of "column" or
"row"; otherwise pass ``kind=``. A convention forced with ``convention=`` must fit the
constructor: the arguments that do not fit are named in an :class:`~tpsim.InvalidArgument`.
"""

from __future__ import annotations

import ast
import enum
import inspect
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.placement import Replicate, Shard
from tpsim.variant import KINDS, ParamSpec, Variant

__all__ = [
    "CONVENTIONS",
    "GROUP_KEYWORDS",
    "HOW_TO_CHECK",
    "add_returned_bias",
    "detect_convention",
    "detect_kind",
    "from_group_class",
    "from_master_weight_class",
    "from_tp_rank_class",
    "own_module_state",
    "returned_bias",
    "variant_from_class",
]

CONVENTIONS = ("master-weight", "tp-rank", "group", "implicit-group")
#: Keywords a ``group``-convention constructor takes its tp group by, in the order they are looked for.
GROUP_KEYWORDS = ("process_group", "group", "tp_group", "pg")
#: The size names of the ``group`` convention (one pair, passed by position).
_SIZE_NAMES = (("input_size", "output_size"), ("in_features", "out_features"))
#: Megatron option keywords the ``group`` convention sets from the placements.
_GROUP_OPTIONS = ("gather_output", "input_is_parallel", "sequence_parallel", "skip_bias_add", "reduce_results")
#: Where users are sent when a class fits no convention.
HOW_TO_CHECK = "README.md, section 'Check your own layer' (three ways in: a plain class, a Variant, a pytest one-liner)"
#: Modules never made rank-local automatically: tpsim's own (stateless) and torch's.
_NOT_RANK_LOCAL = ("tpsim", "torch", "__main__", "builtins")


@dataclass(frozen=True)
class _Signature:
    """What the adapters need to know about a constructor."""

    names: tuple[str, ...]
    positional: int  # how many parameters accept a positional argument
    var_positional: bool
    var_keyword: bool
    required: tuple[str, ...]  # parameters without a default
    defaults: dict[str, Any]

    def has(self, name: str) -> bool:
        return name in self.names

    def render(self) -> str:
        return ", ".join(self.names)


def _signature(cls: type) -> _Signature:
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"cannot read the constructor signature of {cls.__qualname__}: {err}") from err
    params = [p for n, p in sig.parameters.items() if n != "self"]
    kinds = inspect.Parameter
    named = [p for p in params if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    return _Signature(
        names=tuple(p.name for p in named),
        positional=sum(p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD) for p in named),
        var_positional=any(p.kind is kinds.VAR_POSITIONAL for p in params),
        var_keyword=any(p.kind is kinds.VAR_KEYWORD for p in params),
        required=tuple(p.name for p in named if p.default is inspect.Parameter.empty),
        defaults={p.name: p.default for p in named if p.default is not inspect.Parameter.empty},
    )


def _size_names(sig: _Signature) -> tuple[str, str] | None:
    for pair in _SIZE_NAMES:
        if all(sig.has(n) for n in pair):
            return pair
    return None


def _group_keyword(sig: _Signature) -> str | None:
    return next((k for k in GROUP_KEYWORDS if sig.has(k)), None)


def _fitting(sig: _Signature) -> list[str]:
    found = []
    if sig.has("master_weight"):
        found.append("master-weight")
    if sig.has("tp_size") and sig.has("tp_rank"):
        found.append("tp-rank")
    if not found and _group_keyword(sig) is not None and _size_names(sig) is not None:
        found.append("group")
    # No group to pass, but a tensor-parallel layer's option keywords (vLLM's): it finds its group itself.
    if not found and _size_names(sig) is not None and any(sig.has(k) for k in _GROUP_OPTIONS):
        found.append("implicit-group")
    return found


def detect_convention(cls: type) -> str:
    """``"master-weight"``, ``"tp-rank"``, ``"group"`` or ``"implicit-group"`` from the constructor's parameter names.

    Raises :class:`tpsim.InvalidArgument` when the signature fits none or several.
    """
    sig = _signature(cls)
    found = _fitting(sig)
    if len(found) != 1:
        what = "both the master-weight and tp-rank conventions" if found else "no convention"
        raise InvalidArgument(
            f"cannot tell the convention of {cls.__qualname__}({sig.render()}): it fits {what}. "
            "tpsim recognises (in_features, out_features, bias, master_weight) [master-weight], "
            "(in_features, out_features, tp_size, tp_rank[, tp_group]) [tp-rank] and "
            "(input_size, output_size, *, ..., process_group|group|tp_group|pg) [group] and "
            "(input_size, output_size, *, ..., skip_bias_add|gather_output|input_is_parallel|reduce_results), "
            "its tp group read by the layer itself [implicit-group]; "
            f"pass --convention {'|'.join(CONVENTIONS)}, or describe the layer with a tpsim Variant: see {HOW_TO_CHECK}"
        )
    return found[0]


def detect_kind(cls: type) -> str:
    """``"column"`` or ``"row"`` from the class name; raises when the name says neither or both."""
    lowered = cls.__name__.lower()
    found = [k for k in KINDS if k in lowered]
    if len(found) != 1:
        raise InvalidArgument(
            f"cannot tell whether {cls.__qualname__} is column- or row-parallel from its name; pass --kind column|row"
        )
    return found[0]


def _resolve_kind(cls: type, kind: str | None) -> str:
    if kind is None:
        return detect_kind(cls)
    if kind not in KINDS:
        raise InvalidArgument(f"kind={kind!r}; expected one of {', '.join(KINDS)}")
    return kind


def _misfit(sig: _Signature, positional: int, keywords: Iterable[str]) -> list[str]:
    """Why a call ``cls(<positional args>, **keywords)`` does not fit ``sig`` (empty: it fits)."""
    keywords = list(keywords)
    problems = []
    if sig.positional < positional and not sig.var_positional:
        problems.append(f"it takes {sig.positional} positional argument(s), the convention passes {positional} "
                        "(in_features, out_features)")
    unexpected = [k for k in keywords if not sig.has(k) and not sig.var_keyword]
    if unexpected:
        problems.append(f"it has no parameter {', '.join(unexpected)}")
    bound = set(sig.names[: min(positional, sig.positional)]) | set(keywords)
    missing = [n for n in sig.required if n not in bound]
    if missing:
        problems.append(f"it requires {', '.join(missing)}, which the convention does not pass")
    return problems


def _check_fit(cls: type, convention: str, sig: _Signature, keywords: Iterable[str]) -> None:
    problems = _misfit(sig, 2, keywords)
    if problems:
        raise InvalidArgument(
            f"--convention {convention} does not fit {cls.__qualname__}({sig.render()}): {'; '.join(problems)}. "
            f"Drop --convention to detect it, or describe the layer with a tpsim Variant: see {HOW_TO_CHECK}"
        )


#: Whether this thread's last :func:`add_returned_bias` call added a bias the forward returned.
_LAST_CALL = threading.local()


def returned_bias(reset: bool = False, add: bool = True) -> bool:
    """Whether this thread's last :func:`add_returned_bias` call added a bias that the layer's forward
    returned (``skip_bias_add``). ``reset=True`` forgets it before the next forward, and sets whether
    that forward's returned bias is added to this rank's output (``add=False``: a rank other than tp
    rank 0 of a layer whose output is a partial sum: the caller adds the bias once, after its all-reduce,
    so only rank 0's summand gets it, while every rank's bias still receives the whole gradient)."""
    seen = bool(getattr(_LAST_CALL, "returned_bias", False))
    if reset:
        _LAST_CALL.returned_bias = False
        _LAST_CALL.add = add
    return seen


class _AddedAfterTheSum(torch.autograd.Function):
    """Forward: ``output`` as it is (the bias is added once, after the caller's all-reduce, by tp rank
    0's summand). Backward: the output's grad, and its sum over the leading dims for the bias."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.bias_dtype = bias.dtype
        return output.view_as(output)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad, grad.reshape(-1, grad.shape[-1]).sum(0).to(ctx.bias_dtype)


def add_returned_bias(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``module(x)``, accepting Megatron's and vLLM's ``(output, bias_or_None)``: a returned bias (left
    to the caller under ``skip_bias_add``) is added to the output, as the caller would."""
    out = module(x)
    _LAST_CALL.returned_bias = False
    if not isinstance(out, tuple):
        return out
    if len(out) != 2 or not isinstance(out[0], torch.Tensor):
        raise TypeError(
            f"{type(module).__name__}.forward returned a tuple of {len(out)} item(s); expected a tensor or "
            "(output, bias_or_None)"
        )
    output, bias = out
    if bias is None:
        return output
    if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != tuple(output.shape[-1:]):
        shape = list(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__
        raise ValueError(
            f"{type(module).__name__}.forward returned a bias of shape {shape} with an output of shape "
            f"{list(output.shape)}: the caller cannot add it (skip_bias_add with a gathered output returns "
            "this rank's bias shard)"
        )
    _LAST_CALL.returned_bias = True
    if not getattr(_LAST_CALL, "add", True):
        return _AddedAfterTheSum.apply(output, bias)
    return output + bias


def own_module_state(module: str | None) -> tuple[str, ...]:
    """``(module,)`` when ``module``'s globals belong to the checked code (made rank-local on inproc:
    in a real job each rank is a process with its own); ``()`` for tpsim's and torch's own modules."""
    if not module or module.split(".")[0] in _NOT_RANK_LOCAL:
        return ()
    return (module,)


def _rank_local(cls: type) -> tuple[str, ...]:
    return own_module_state(getattr(cls, "__module__", None))


# --- the bias, read from the built module -----------------------------------------------------------


def _inside_rank() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _probe_bias(build: Callable[..., nn.Module]) -> bool | None:
    """Whether the layer ``build`` constructs has a ``bias`` parameter: one probe build on a one-rank
    in-process world (tp size 1, 2 x 2 features). None when the constructor raises there."""
    import torch.distributed as dist

    from tpsim.runner import run

    def probe() -> bool:
        module = build(2, 2, False, group=dist.group.WORLD, rank=0, world_size=1,
                       master_weight=torch.zeros(2, 2), master_bias=None, dtype=torch.float32)
        return isinstance(getattr(module, "bias", None), nn.Parameter)

    try:
        return bool(run(probe, 1, backend="inproc", timeout=30.0)[0])
    except Exception:  # noqa: BLE001 - the real runs report what the constructor does
        return None


def _probe_implicit_group(cls: type, build: Callable[..., nn.Module]) -> None:
    """A layer that reads its tp group itself must be buildable in a one-rank world (tp size 1, where
    every size divides). If it is not, it depends on set-up tpsim cannot see (vLLM's
    ``initialize_model_parallel``): that is a usage error naming the layer's own error, never a
    finding against the layer."""
    import torch.distributed as dist

    from tpsim.runner import run

    def probe() -> None:
        build(2, 2, False, group=dist.group.WORLD, rank=0, world_size=1, master_weight=torch.zeros(2, 2),
              master_bias=None, dtype=torch.float32)

    try:
        run(probe, 1, backend="inproc", timeout=30.0, rank_local=_rank_local(cls))
    except Exception as err:  # noqa: BLE001 - whatever the constructor raised is quoted
        what = str(err).strip().splitlines()[0][:400] if str(err).strip() else type(err).__name__
        raise InvalidArgument(
            f"{cls.__qualname__} takes no tp group (implicit-group convention), so it must find one itself, but it "
            f"cannot be built in a one-rank world (tp size 1, 2 x 2 features): {what}. A layer whose library state "
            "must be initialised first (vLLM's initialize_model_parallel) needs a Variant whose builder initialises "
            f"it, with that library's module rank_local: see {HOW_TO_CHECK}"
        ) from None


def _bias_setup(cls: type, sig: _Signature, build: Callable[..., nn.Module]) -> tuple[bool, bool, tuple[str, ...]]:
    """``(bias, always_bias, notes)`` of a plain class: from the ``bias`` flag, else the built module."""
    if sig.has("bias"):
        return True, False, ()
    if _inside_rank():
        # Re-resolved inside a rank (a gloo/nccl worker): the parent probed and drew the cases;
        # the builder handles either kind of case.
        return True, False, ()
    if _probe_bias(build):
        return True, True, (
            f"{cls.__qualname__} has no bias flag but always builds a bias: biased cases only, with the master "
            "bias loaded into it",
        )
    return False, False, (f"{cls.__qualname__} has no bias parameter: bias-free cases only",)


def _zero_unflagged_bias(module: nn.Module, bias: bool, has_flag: bool) -> None:
    # A layer that always has a bias computes the bias-free layer when that bias is zero: what a
    # bias-free case of it means (the search draws biased cases only where it can tell).
    if not bias and not has_flag:
        param = getattr(module, "bias", None)
        if isinstance(param, torch.Tensor):
            with torch.no_grad():
                param.zero_()


def _placements(kind: str) -> tuple[Shard, Shard | Replicate]:
    return (Shard(0), Shard(0)) if kind == "column" else (Shard(1), Replicate())


def _construct(cls: type, in_features: int, out_features: int, bias: bool, has_flag: bool,
               kwargs: dict[str, Any]) -> nn.Module:
    """``cls(in_features, out_features, **kwargs)``, with ``bias=`` where the constructor has the flag."""
    if has_flag:
        kwargs = {**kwargs, "bias": bias}
    module = cls(in_features, out_features, **kwargs)
    _zero_unflagged_bias(module, bias, has_flag)
    return module


def _convention_variant(
    cls: type,
    sig: _Signature,
    build: Callable[..., nn.Module],
    *,
    kind: str,
    weight: dict[str, Any],
    convention: str,
    extra_notes: tuple[str, ...] = (),
    **fields: Any,
) -> Variant:
    """The variant of a plain class built by ``build``: the weight's :class:`ParamSpec` options
    (``weight``), the bias read from the signature or the built module, ``fields`` as given."""
    has_bias, always, notes = _bias_setup(cls, sig, build)
    weight_placement, bias_placement = _placements(kind)
    params = [ParamSpec("weight", "weight", weight_placement, **weight)]
    if has_bias:
        # A replicated bias may live on tp rank 0 only (nanotron's row layers): read from the built layers.
        held_by = "detect" if isinstance(bias_placement, Replicate) else "all"
        params.append(ParamSpec("bias", "bias", bias_placement, load=True, held_by=held_by))
    return Variant(
        kind=kind,
        build=build,
        params=tuple(params),
        bias=has_bias,
        always_bias=always,
        forward=add_returned_bias,
        description=f"{cls.__module__}.{cls.__qualname__} ({convention})",
        notes=(*notes, *extra_notes),
        rank_local=_rank_local(cls),
        **fields,
    )


# --- the four conventions -----------------------------------------------------------------------


def from_master_weight_class(
    cls: type,
    *,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str = "complete",
    name: str | None = None,
    forced: bool = False,
    ctor_args: CtorArgs = (),
) -> Variant:
    """A variant for a class with constructor ``(in_features, out_features, bias, master_weight)``.

    The builder passes ``in_features``/``out_features`` by position and ``bias``/``master_weight``
    by name; a constructor without a ``bias`` parameter is probed for a built bias (module docstring).
    """
    kind = _resolve_kind(cls, kind)
    sig = _signature(cls)
    has_flag = sig.has("bias")
    if forced:
        _check_fit(cls, "master-weight", sig, ["master_weight", *(["bias"] if has_flag else []),
                                               *(n for n, _ in ctor_args)])
    extra = ctor_settings(cls, sig, ctor_args, {"master_weight": "the master weight"})

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        # The convention reads rank/world size from the default group: nothing else to pass.
        # A clone, so a layer that slices the master without copying cannot alias the harness's tensor.
        return _construct(cls, in_features, out_features, bias, has_flag,
                          {**extra, "master_weight": master_weight.clone()})

    # The weight is sliced by the layer itself (load=False: its shape is checked, its values are
    # what the properties test); the zero-initialised bias gets the master bias by its placement.
    return _convention_variant(
        cls, sig, build, kind=kind, weight={"load": False}, convention="master-weight convention",
        name=name or cls.__qualname__, input=input, output=output or ("sharded" if kind == "column" else "partial"),
        input_grad=input_grad,
        # The convention reads rank and world size from the default group: it cannot shard over a
        # tp group smaller than the world.
        subgroups=False,
    )


def from_tp_rank_class(
    cls: type,
    *,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str = "complete",
    name: str | None = None,
    forced: bool = False,
    ctor_args: CtorArgs = (),
) -> Variant:
    """A variant for a class with constructor ``(in_features, out_features, tp_size, tp_rank[, tp_group])``."""
    kind = _resolve_kind(cls, kind)
    sig = _signature(cls)
    has_group = sig.has("tp_group")
    has_flag = sig.has("bias")
    if forced:
        _check_fit(cls, "tp-rank", sig, ["tp_size", "tp_rank", *(["tp_group"] if has_group else []),
                                         *(["bias"] if has_flag else []), *(n for n, _ in ctor_args)])
    extra = ctor_settings(cls, sig, ctor_args, {"tp_size": "the tp size", "tp_rank": "the tp rank",
                                                "tp_group": "the tp group"})

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        kwargs: dict[str, Any] = {**extra, "tp_size": world_size, "tp_rank": rank}
        if has_group:
            kwargs["tp_group"] = group
        # The convention initialises in the default dtype; the harness loads master values in
        # the case's dtype, so convert first (the values are overwritten anyway).
        return _construct(cls, in_features, out_features, bias, has_flag, kwargs).to(dtype)

    return _convention_variant(
        cls, sig, build, kind=kind, weight={"transposed": True, "load": True}, convention="tp-rank convention",
        name=name or cls.__qualname__, input=input, output=output or ("sharded" if kind == "column" else "reduced"),
        input_grad=input_grad,
    )


def from_group_class(
    cls: type,
    *,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str = "complete",
    name: str | None = None,
    forced: bool = False,
    ctor_args: CtorArgs = (),
) -> Variant:
    """A variant for a Megatron-style class ``(input_size, output_size, *, bias=True,
    gather_output=False, skip_bias_add=False, process_group=None)`` (see the module docstring)."""
    sig = _signature(cls)
    group_kw = _group_keyword(sig)
    if group_kw is None:
        raise InvalidArgument(
            f"--convention group does not fit {cls.__qualname__}({sig.render()}): it has no "
            f"{'/'.join(GROUP_KEYWORDS)} keyword to pass the tp group by; see {HOW_TO_CHECK}"
        )
    return _group_like(cls, sig, group_kw, kind=kind, input=input, output=output, input_grad=input_grad, name=name,
                       forced=forced, ctor_args=ctor_args)


def from_implicit_group_class(
    cls: type,
    *,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str = "complete",
    name: str | None = None,
    forced: bool = False,
    ctor_args: CtorArgs = (),
) -> Variant:
    """A variant for a vLLM-style class ``(input_size, output_size, bias=True, ..., skip_bias_add=False,
    params_dtype=None, reduce_results=True)`` that takes no group: it reads its tp group itself (the
    default group, or its library's state through a ``get_tp_group()``), so its tp group is the world."""
    sig = _signature(cls)
    return _group_like(cls, sig, None, kind=kind, input=input, output=output, input_grad=input_grad, name=name,
                       forced=forced, ctor_args=ctor_args)


def _group_like(cls: type, sig: _Signature, group_kw: str | None, *, kind: str | None, input: str | None,
                output: str | None, input_grad: str, name: str | None, forced: bool, ctor_args: CtorArgs) -> Variant:
    """The ``group`` (``group_kw`` names the keyword) and ``implicit-group`` (None) conventions."""
    kind = _resolve_kind(cls, kind)
    convention = "group" if group_kw is not None else "implicit-group"
    has_flag = sig.has("bias")
    options = [k for k in _GROUP_OPTIONS if sig.has(k)]
    # nanotron's mode (an enum with ALL_REDUCE and REDUCE_SCATTER) follows the placements too.
    mode = _nanotron_mode(cls, sig)
    passed = [*([group_kw] if group_kw else []), *(["bias"] if has_flag else []), *options,
              *(["mode"] if mode is not None else []), *(n for n, _ in ctor_args)]
    if forced:
        _check_fit(cls, convention, sig, passed)
    missing = [n for n in sig.required if n not in set(sig.names[:2]) | set(passed)]
    if missing:
        raise InvalidArgument(
            f"{cls.__qualname__}({sig.render()}) requires {', '.join(missing)}, which the {convention} convention "
            f"does not pass: fix it with --ctor-arg {missing[0]}=VALUE (repeatable; a Python literal, or an enum "
            f"member's name), or describe the layer with a tpsim Variant: see {HOW_TO_CHECK}"
        )
    defaults = sig.defaults
    if kind == "column":
        gathered = "gather_output" in defaults and bool(defaults["gather_output"])
        output = output or ("gathered" if gathered else "sharded")
        input = input or "replicated"
    else:
        parallel = defaults.get("input_is_parallel", True) is not False
        input = input or ("sharded" if parallel else "replicated")
        output = output or ("partial" if defaults.get("reduce_results", True) is False else "reduced")
    sequence = "sequence-sharded" in (input, output)
    if sequence and not sig.has("sequence_parallel") and mode is None:
        raise InvalidArgument(
            f"{cls.__qualname__}({sig.render()}) has no sequence_parallel keyword (nor nanotron's mode), so it "
            "cannot run with a sequence-sharded input/output; drop --input/--output sequence-sharded or describe it "
            "with a Variant"
        )
    settings: dict[str, Any] = {}
    if "gather_output" in options:
        settings["gather_output"] = output == "gathered"
    if "input_is_parallel" in options:
        settings["input_is_parallel"] = input != "replicated"
    if "sequence_parallel" in options:
        settings["sequence_parallel"] = sequence
    if "reduce_results" in options and kind == "row":
        settings["reduce_results"] = output != "partial"
    if "skip_bias_add" in options and "skip_bias_add" not in defaults:
        settings["skip_bias_add"] = False  # required: tpsim adds a returned bias either way
    if mode is not None:
        settings["mode"] = mode["REDUCE_SCATTER" if sequence else "ALL_REDUCE"]
    fixed = {**_fixed_by_placements(settings), **({group_kw: "the tp group"} if group_kw else {})}
    extra = ctor_settings(cls, sig, ctor_args, fixed)
    settings.update(extra)
    takes_dtype = sig.has("params_dtype")

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        kwargs = {group_kw: group} if group_kw is not None else {}
        if takes_dtype and "params_dtype" not in extra:
            kwargs["params_dtype"] = dtype  # vLLM's: its parameters are created in the case's dtype
        # Its own init, in the default dtype: converted, then overwritten with the master shards.
        return _construct(cls, in_features, out_features, bias, has_flag, {**kwargs, **settings}).to(dtype)

    if group_kw is None and not _inside_rank():
        _probe_implicit_group(cls, build)
    how = f"tp group by {group_kw}=" if group_kw is not None else "the layer reads its tp group itself: the world"
    if mode is not None:
        how += f"; mode={settings['mode'].name}"
    if extra:
        how += "; " + ", ".join(f"{k}={v!r}" for k, v in extra.items())
    return _convention_variant(
        cls, sig, build, kind=kind, weight={"load": True}, convention=f"{convention} convention, {how}",
        name=name or cls.__qualname__, input=input, output=output, input_grad=input_grad,
        # Megatron's tensors are sequence-first [s, b, h]: the sequence dim is 0 (--sequence-dim overrides).
        sequence_dim=0 if sequence else -2,
        # Without a group to pass, the layer's tp group is the whole world.
        **({} if group_kw is not None else {"subgroups": False, "extra_notes": (
            f"{cls.__qualname__} takes no tp group (implicit-group convention): it must find it itself, e.g. a "
            "get_tp_group() that defaults to the world; a library whose parallel state must be initialised first "
            f"(vLLM's initialize_model_parallel) needs a Variant whose builder initialises it: see {HOW_TO_CHECK}",)}),
    )


# --- constructor arguments a user fixes (--ctor-arg NAME=VALUE) ----------------------------------

#: ``(name, text)`` pairs, as ``--ctor-arg NAME=VALUE`` gives them.
CtorArgs = tuple[tuple[str, str], ...]
#: What each option keyword the conventions set follows (a --ctor-arg cannot set them).
_PLACEMENT_FLAGS = {
    "gather_output": "--output gathered|sharded",
    "input_is_parallel": "--input sharded|replicated",
    "sequence_parallel": "--input/--output sequence-sharded",
    "reduce_results": "--output reduced|partial",
    "mode": "ALL_REDUCE, or REDUCE_SCATTER with --input/--output sequence-sharded",
}


def _nanotron_mode(cls: type, sig: _Signature) -> type[enum.Enum] | None:
    """nanotron's ``TensorParallelLinearMode`` when the constructor takes it as ``mode`` (an enum, by its
    annotation or its default, with members ``ALL_REDUCE`` and ``REDUCE_SCATTER``), else None."""
    if not sig.has("mode"):
        return None
    kinds = _enum_type(cls, sig, "mode")
    if kinds is None or not {"ALL_REDUCE", "REDUCE_SCATTER"} <= set(kinds.__members__):
        return None
    return kinds


def _fixed_by_placements(settings: dict[str, Any]) -> dict[str, str]:
    return {k: _PLACEMENT_FLAGS[k] for k in settings if k in _PLACEMENT_FLAGS}


def _annotation(cls: type, name: str) -> Any:
    try:
        sig = inspect.signature(cls.__init__, eval_str=True)
    except Exception:  # noqa: BLE001 - an annotation that cannot be evaluated: no enum to read
        sig = inspect.signature(cls.__init__)
    param = sig.parameters.get(name)
    return None if param is None else param.annotation


def _enum_type(cls: type, sig: _Signature, name: str) -> type[enum.Enum] | None:
    """The enum a constructor parameter takes, from its annotation or its default (None: not an enum)."""
    annotation = _annotation(cls, name)
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation
    default = sig.defaults.get(name)
    return type(default) if isinstance(default, enum.Enum) else None


def parse_ctor_arg(cls: type, sig: _Signature, name: str, text: str) -> Any:
    """The value ``--ctor-arg name=text`` passes: a member of the parameter's enum by name (its
    annotation's or its default's: ``mode=ALL_REDUCE``), else a Python literal (``True``, ``8``,
    ``'text'``, ``None``), else the text itself where the parameter takes a string."""
    kinds = _enum_type(cls, sig, name)
    if kinds is not None:
        member = text.rpartition(".")[2]
        if member in kinds.__members__:
            return kinds[member]
        raise InvalidArgument(
            f"--ctor-arg {name}={text}: {cls.__qualname__}'s {name} is a {kinds.__name__}; expected one of "
            f"{', '.join(kinds.__members__)}"
        )
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        pass
    if _annotation(cls, name) in (str, "str") or isinstance(sig.defaults.get(name), str):
        return text
    raise InvalidArgument(
        f"--ctor-arg {name}={text}: expected a Python literal (True, 8, 0.5, 'text', None) or, for an enum "
        "parameter, a member name"
    )


def ctor_settings(cls: type, sig: _Signature, ctor_args: CtorArgs, fixed: dict[str, str]) -> dict[str, Any]:
    """The constructor keywords ``--ctor-arg`` fixes, parsed (see :func:`parse_ctor_arg`). A keyword the
    convention passes itself (the sizes, the bias flag, the group, an option that follows the placements)
    is refused, naming what sets it; so is one the constructor does not take."""
    sizes = _size_names(sig) or ("in_features", "out_features")
    reserved = {sizes[0]: "the case's in_features", sizes[1]: "the case's out_features",
                "bias": "the case's bias setting", **fixed}
    out: dict[str, Any] = {}
    for name, text in ctor_args:
        if name in reserved:
            raise InvalidArgument(
                f"--ctor-arg {name}={text}: tpsim passes {name} itself ({reserved[name]}); drop --ctor-arg {name}"
            )
        if not sig.has(name) and not sig.var_keyword:
            raise InvalidArgument(
                f"--ctor-arg {name}={text}: {cls.__qualname__}({sig.render()}) has no parameter {name!r}"
            )
        out[name] = parse_ctor_arg(cls, sig, name, text)
    return out


_ADAPTERS = {"master-weight": from_master_weight_class, "tp-rank": from_tp_rank_class, "group": from_group_class,
             "implicit-group": from_implicit_group_class}


def variant_from_class(
    cls: type,
    *,
    convention: str | None = None,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str | None = None,
    name: str | None = None,
    ctor_args: CtorArgs = (),
) -> Variant:
    """A variant for a plain ``nn.Module`` class of any convention (detected when not given; a given
    convention must fit the constructor). ``ctor_args`` are ``(name, text)`` pairs of constructor
    keywords the user fixes (``--ctor-arg NAME=VALUE``, see :func:`parse_ctor_arg`)."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgument(f"{cls!r} is not an nn.Module class")
    forced = convention is not None
    if convention is None:
        convention = detect_convention(cls)
    if convention not in CONVENTIONS:
        raise InvalidArgument(f"convention={convention!r}; expected one of {', '.join(CONVENTIONS)}")
    return _ADAPTERS[convention](cls, kind=kind, input=input, output=output, input_grad=input_grad or "complete",
                                 name=name, forced=forced, ctor_args=tuple(tuple(p) for p in ctor_args))
