"""How a case's weights get into each rank's module: the library loads them; tpsim writes only what no
loader takes.

The library does the sharding and tpsim observes: a loader the library has is what loads the case's
dense weights (``masters``, every dense parameter's full value by dotted name), and tpsim never
writes over what it loaded. Which loader, in the order :func:`load_weights` looks (the variant's
``load`` field, :class:`~tpsim.module_variant.ModuleVariant`):

- the builder (``load="build"``): it took ``masters`` and returned the module holding its pieces
  (a builder slicing them, a dense module parallelised by a plan);
- a loader function or method (``load=callable`` or ``load="method_name"``);
- a parameter's own ``weight_loader`` (vLLM's convention: ``param.weight_loader(param, full)``);
- none: tpsim writes the piece the parameter's layout gives it (declared, or read from the shapes) —
  the module has no loader of its own, so there is nothing else to test.

What the library loaded is read back (:func:`read_back`) and judged in the parent against the dense
weights right after construction (:mod:`tpsim.props.module.construction`).

:func:`load_like_from_pretrained` is Hugging Face's ``from_pretrained`` path for a module whose
parameters a style-string plan made DTensors: transformers' own ``DtensorShardOperation`` cuts each
full tensor to this rank's piece and its ``set_param_for_module`` installs it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.module_variant import LOAD_IN_BUILD, ModuleVariant
from tpsim.placement import piece
from tpsim.props.module.dtensors import is_dtensor, load_piece, local_value
from tpsim.props.module.sharding import ParamLayout

__all__ = ["load_like_from_pretrained", "load_weights", "read_back"]


def _loader(variant: ModuleVariant, module: nn.Module) -> Any:
    load = variant.load
    if callable(load):
        return lambda masters: load(module, masters)
    method = getattr(module, str(load), None)
    if not callable(method):
        raise InvalidArgument(f"ModuleVariant {variant.name!r}: load={load!r}, but the built "
                              f"{type(module).__name__} has no method {load!r}; expected a method taking the dense "
                              "weights by dotted name")
    return method


def load_weights(variant: ModuleVariant, module: nn.Module, masters: Mapping[str, torch.Tensor],
                 layouts: Mapping[str, ParamLayout], rank: int, tp: int) -> tuple[str, ...]:
    """Load ``masters`` into this rank's ``module`` (see the module docstring); returns the names of
    the parameters the library loaded (every parameter when the variant has a loader). ``layouts``:
    the parameters tpsim writes when no loader takes them."""
    params = dict(module.named_parameters())
    if variant.load == LOAD_IN_BUILD:
        return tuple(params)
    if variant.load is not None:
        with torch.no_grad():
            _loader(variant, module)(dict(masters))
        return tuple(n for n, _ in module.named_parameters())  # a loader may replace parameter objects
    loaded = []
    with torch.no_grad():
        for name, p in params.items():
            weight_loader = getattr(p, "weight_loader", None)
            if callable(weight_loader) and name in masters:
                weight_loader(p, masters[name].clone())  # its own copy: a loader may keep a view of it
                loaded.append(name)
            elif name in layouts and name in masters:
                layout = layouts[name]
                if is_dtensor(p):
                    load_piece(p, masters[name])
                else:
                    p.copy_(piece(masters[name], layout.placement, rank, tp, layout.uneven))
    return tuple(loaded)


def read_back(module: nn.Module, names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """Each parameter of ``names`` as this rank holds it right after loading (its local piece)."""
    params = dict(module.named_parameters())
    return {n: local_value(params[n]).clone() for n in names if n in params}


def load_like_from_pretrained(module: nn.Module, masters: Mapping[str, torch.Tensor]) -> None:
    """Load ``masters`` as ``from_pretrained`` loads a checkpoint into a module a style-string plan
    parallelised: each DTensor parameter's piece cut by transformers' ``DtensorShardOperation``,
    installed by its ``set_param_for_module``; a piece of another shape than the parameter's local
    one is refused as ``from_pretrained`` refuses it (a mismatched key), naming the parameter."""
    from transformers.core_model_loading import set_param_for_module
    from transformers.distributed.sharding_utils import DtensorShardOperation
    from transformers.utils.loading_report import LoadStateDictInfo

    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(), error_msgs=[],
                             conversion_errors={}, skipped_pp_keys=set())
    for name, p in list(module.named_parameters()):
        if name not in masters or not is_dtensor(p):
            continue
        local = DtensorShardOperation(p).shard_tensor(masters[name], device=p.device, dtype=p.dtype)
        set_param_for_module(module, name, local, info, None)
    if info.mismatched_keys:
        name, got, want = sorted(info.mismatched_keys, key=str)[0]
        raise RuntimeError(f"transformers' loader cut {name} to shape {list(got)} on this rank, but the parameter's "
                           f"local piece has shape {list(want)} (from_pretrained reports it as a mismatched key)")
