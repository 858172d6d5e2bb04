"""Adapters that turn a plain ``nn.Module`` class into a :class:`~tpsim.variant.Variant`.

Two constructor conventions are common in the wild and are recognised from the signature:

``master-weight``: ``cls(in_features, out_features, bias, master_weight)``
    The layer reads its rank and world size from the default process group and slices the
    ``[out, in]`` master weight itself (so the harness does *not* overwrite the weight: the
    slicing is part of what is checked); the bias is zero-initialised and the harness loads the
    master bias into it by its placement (column: this rank's shard, row: the whole bias).
    Weight stored ``[out/ws, in]`` (column) / ``[out, in/ws]`` (row). Defaults: column output
    ``sharded``, row output ``partial`` (the caller all-reduces). A constructor without ``bias``
    runs bias-free cases only.

``tp-rank``: ``cls(in_features, out_features, tp_size, tp_rank[, tp_group][, bias])``
    The layer initialises its own weights randomly; the harness overwrites them with the master
    shards. Weight stored transposed: ``[in, out/ws]`` (column) / ``[in/ws, out]`` (row).
    A class without a ``bias`` parameter runs bias-free cases only. Defaults: column output
    ``sharded``, row output ``reduced`` (its forward all-reduces).

The kind (column/row) is read from the class name when it contains exactly one of "column" or
"row"; otherwise pass ``kind=``.
"""

from __future__ import annotations

import inspect
from typing import Any

from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.placement import Replicate, Shard
from tpsim.variant import KINDS, ParamSpec, Variant

__all__ = ["CONVENTIONS", "detect_convention", "detect_kind", "from_master_weight_class", "from_tp_rank_class", "variant_from_class"]

CONVENTIONS = ("master-weight", "tp-rank")


def _signature_names(cls: type) -> list[str]:
    try:
        sig = inspect.signature(cls.__init__)
    except (TypeError, ValueError) as err:
        raise InvalidArgument(f"cannot read the constructor signature of {cls.__qualname__}: {err}") from err
    return [n for n in sig.parameters if n != "self"]


def detect_convention(cls: type) -> str:
    """``"master-weight"`` or ``"tp-rank"`` from the constructor's parameter names.

    Raises :class:`tpsim.InvalidArgument` when the signature fits neither or both.
    """
    names = _signature_names(cls)
    found = []
    if "master_weight" in names:
        found.append("master-weight")
    if "tp_size" in names and "tp_rank" in names:
        found.append("tp-rank")
    if len(found) != 1:
        what = "both conventions" if found else "neither convention"
        raise InvalidArgument(
            f"cannot tell the convention of {cls.__qualname__}({', '.join(names)}): it fits {what}; "
            "pass --convention master-weight|tp-rank, or describe it with a tpsim Variant"
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


def from_master_weight_class(
    cls: type,
    *,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str = "complete",
    name: str | None = None,
) -> Variant:
    """A variant for a class with constructor ``(in_features, out_features, bias, master_weight)``.

    The builder passes ``in_features``/``out_features`` by position and ``bias``/``master_weight``
    by name; a constructor without a ``bias`` parameter gives a bias-free variant.
    """
    kind = _resolve_kind(cls, kind)
    has_bias = "bias" in _signature_names(cls)

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        # The convention reads rank/world size from the default group: nothing else to pass.
        # A clone, so a layer that slices the master without copying cannot alias the harness's tensor.
        kwargs: dict[str, Any] = {"master_weight": master_weight.clone()}
        if has_bias:
            kwargs["bias"] = bias
        return cls(in_features, out_features, **kwargs)

    weight = Shard(0) if kind == "column" else Shard(1)
    bias_placement = Shard(0) if kind == "column" else Replicate()
    # The weight is sliced by the layer itself (load=False: its shape is checked, its values are
    # what the properties test); the zero-initialised bias gets the master bias by its placement.
    params = [ParamSpec("weight", "weight", weight, load=False)]
    if has_bias:
        params.append(ParamSpec("bias", "bias", bias_placement, load=True))
    notes = () if has_bias else (f"{cls.__qualname__} has no bias parameter: bias-free cases only",)
    return Variant(
        name=name or cls.__qualname__,
        kind=kind,
        build=build,
        input=input,
        output=output or ("sharded" if kind == "column" else "partial"),
        input_grad=input_grad,
        params=tuple(params),
        bias=has_bias,
        description=f"{cls.__module__}.{cls.__qualname__} (master-weight convention)",
        notes=notes,
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
) -> Variant:
    """A variant for a class with constructor ``(in_features, out_features, tp_size, tp_rank[, tp_group])``."""
    kind = _resolve_kind(cls, kind)
    names = _signature_names(cls)
    has_group = "tp_group" in names
    has_bias = "bias" in names

    def build(in_features, out_features, bias, *, group, rank, world_size, master_weight, master_bias, dtype):
        kwargs: dict[str, Any] = {"tp_size": world_size, "tp_rank": rank}
        if has_group:
            kwargs["tp_group"] = group
        if has_bias:
            kwargs["bias"] = bias
        module = cls(in_features, out_features, **kwargs)
        # The convention initialises in the default dtype; the harness loads master values in
        # the case's dtype, so convert first (the values are overwritten anyway).
        return module.to(dtype)

    weight = Shard(0) if kind == "column" else Shard(1)
    bias_placement = Shard(0) if kind == "column" else Replicate()
    params = [ParamSpec("weight", "weight", weight, transposed=True, load=True)]
    if has_bias:
        params.append(ParamSpec("bias", "bias", bias_placement, load=True))
    notes = () if has_bias else (f"{cls.__qualname__} has no bias parameter: bias-free cases only",)
    return Variant(
        name=name or cls.__qualname__,
        kind=kind,
        build=build,
        input=input,
        output=output or ("sharded" if kind == "column" else "reduced"),
        input_grad=input_grad,
        params=tuple(params),
        bias=has_bias,
        description=f"{cls.__module__}.{cls.__qualname__} (tp-rank convention)",
        notes=notes,
    )


def variant_from_class(
    cls: type,
    *,
    convention: str | None = None,
    kind: str | None = None,
    input: str | None = None,
    output: str | None = None,
    input_grad: str | None = None,
    name: str | None = None,
) -> Variant:
    """A variant for a plain ``nn.Module`` class of either convention (detected when not given)."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        raise InvalidArgument(f"{cls!r} is not an nn.Module class")
    if convention is None:
        convention = detect_convention(cls)
    if convention not in CONVENTIONS:
        raise InvalidArgument(f"convention={convention!r}; expected one of {', '.join(CONVENTIONS)}")
    adapter = from_master_weight_class if convention == "master-weight" else from_tp_rank_class
    return adapter(cls, kind=kind, input=input, output=output, input_grad=input_grad or "complete", name=name)
