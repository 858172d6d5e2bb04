"""The Hugging Face transformers preset: ``tpsim check transformers.models.<family>``, any family with a tp plan.

Tested with ``transformers==5.24.0``. For every config class of the family that defines a
``base_model_tp_plan`` (a multimodal family's text config included), the preset builds the family's
tiny model and finds, with nothing written per family (:mod:`tpsim.presets.hf`):

- the modules the plan shards: each decoder layer class, each child of a layer a rule names (the
  attention, the MLP, the MoE block with its router, experts and shared experts, a linear attention),
  the embedding (transformers' automatic ``embed_tokens: embedding_rowwise`` included) and the head
  (``lm_head: colwise_gather_output``); each is a variant named after its class (a layer's module) or
  its path (``embed_tokens``, ``lm_head``);
- the sizes a case draws (hidden, heads, key/value heads, intermediate size, experts, top-k) and the
  config switches that change the module's parameters or paths (bias switches, q/k norms, a q-LoRA
  rank, the experts implementations, which layer: sliding or full, dense or MoE), drawn by
  Hypothesis; the family's config validators and transformers' head rule decide which are valid
  (:mod:`tpsim.presets.hf.sizes`);
- how the model calls each module (its rotary tables per layer type, masks, positions: recorded from
  the model's own forward, :mod:`tpsim.presets.hf.modules`), and eager attention where the model does
  not support SDPA.

Each module is checked as a plan target (:mod:`tpsim.props.module.plans`): the dense module against
itself under the plan's rules for its path, applied by transformers' own ``apply_tensor_parallelism``
after its own wildcard expansion, each DTensor parameter loaded as ``from_pretrained`` loads it; a
rule that names nothing in a case's module (a rule for another kind of layer) is skipped, as
transformers skips it. A module whose forward decides on its values (an MoE router) is checked in
float64 and float32 only. A module that cannot be built alone or that the model never calls on token
ids is not checked: the first variant's notes list it with the reason.

A subclass of one of these modules (a patch, a fork) is checked in its place under the same plan:
``tpsim check mypatch.py:MyLlamaMLP``; a class attribute ``tp_plan`` (paths relative to the module,
e.g. ``{"down_proj": "colwise"}``) replaces the model's rules for the paths it names.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Mapping
from typing import Any

from tpsim.errors import InvalidArgument
from tpsim.presets._base import quiet_import

__all__ = ["PRESET", "TransformersPreset", "described", "family_inventory", "family_of", "family_variants"]

_PREFIX = "transformers.models."


class _FamilyTargets(tuple):
    """The preset's module targets: ``transformers.models.<family>``, any family (``in``); iterates
    over the package they live in."""

    def __new__(cls) -> _FamilyTargets:
        return super().__new__(cls, ("transformers.models",))

    def __contains__(self, item: object) -> bool:
        return isinstance(item, str) and item.startswith(_PREFIX) and item.count(".") == 2 and bool(item.split(".")[2])


def family_of(module: str) -> str | None:
    """The family a module path belongs to (``transformers.models.llama.modeling_llama`` -> ``llama``)."""
    if not module.startswith(_PREFIX):
        return None
    parts = module.split(".")
    return parts[2] if len(parts) > 2 and parts[2] else None


@functools.cache
def described(config_path: str) -> Any:
    """The discovery of one config class (:func:`tpsim.presets.hf.discovery.describe`), once per process
    and kept on disk (:func:`tpsim.presets.hf.cache.cached`): every worker of a check resolves the same
    variants without building and running the tiny model again."""
    from tpsim.presets.hf.cache import cached
    from tpsim.presets.hf.discovery import describe
    from tpsim.presets.hf.modules import _resolve

    config_cls = _resolve(config_path)
    return cached(config_cls, describe)


@functools.cache
def _plan_configs(family: str) -> tuple[str, ...]:
    from tpsim.presets.hf.configs import plan_configs

    return tuple(f"{c.__module__}.{c.__qualname__}" for c in plan_configs(family))


def _not_checked_note(found: list[tuple[str, str, str]]) -> str:
    return "not checked: " + "; ".join(f"{path} of {config} ({why})" for config, path, why in found)


def family_variants(family: str, *, replace: Mapping[str, type] | None = None) -> tuple[list[Any], list[tuple[str, str, str]]]:
    """The variants of ``family`` (one per module its plans shard) and the modules not checked,
    ``(config, path, reason)``. ``replace``: a module class path -> the class checked in its place."""
    variants, skipped = [], []
    configs = _plan_configs(family)
    if not configs:
        raise InvalidArgument(f"transformers.models.{family} defines no base_model_tp_plan in its config classes: "
                              "there is no plan to check")
    names: set[str] = set()
    for config_path in configs:
        short = config_path.rpartition(".")[2]
        try:
            d = described(config_path)
        except Exception as err:  # noqa: BLE001 - the config class is not checked, with the reason
            skipped.append((short, "(all)", f"{type(err).__name__}: {err}"))
            continue
        skipped.extend((short, path, why) for path, why in d.not_checked)
        for root in d.roots:
            chosen = (replace or {}).get(root.cls)
            if replace is not None and chosen is None:
                continue
            name = root.name if root.name not in names else f"{short}.{root.name}"
            names.add(name)
            variants.append(_variant(d, root, name, chosen))
    return variants, skipped


def family_inventory(family: str) -> dict[str, Any]:
    """The modules of ``family`` as plain data (the zoo's table): each checked one (its variant's name,
    path, class, config class, layers, switches and rules) and each one not checked, with the reason."""
    variants, skipped = family_variants(family)
    modules, configs = [], []
    by_name = {v.name: v for v in variants}
    for config_path in _plan_configs(family):
        short = config_path.rpartition(".")[2]
        configs.append(short)
        try:
            d = described(config_path)
        except Exception:  # noqa: BLE001 - listed among the skipped ones already
            continue
        for root in d.roots:
            name = next((n for n, v in by_name.items() if v.dense.path == root.path and v.dense.config == d.config
                         and n.endswith(root.name)), root.name)
            modules.append({"name": name, "path": root.path, "cls": root.cls.rpartition(".")[2], "config": short,
                            "layers": list(root.layers), "switches": list(root.switches),
                            "rules": len(root.plan), "discrete": root.discrete})
    not_checked = [{"name": path.rpartition(".")[2] or path, "path": path, "config": config, "reason": why}
                   for config, path, why in skipped]
    return {"configs": configs, "modules": modules, "not_checked": not_checked, "notes": _family_notes(family)}


def _family_notes(family: str) -> list[str]:
    """What the tiny configs of ``family`` change besides sizes that leaves something unchecked."""
    out = []
    for config_path in _plan_configs(family):
        try:
            d = described(config_path)
        except Exception:  # noqa: BLE001 - listed among the skipped ones already
            continue
        out += [f"{config_path.rpartition('.')[2]}: {n}" for n in d.notes if n.startswith("not checked")]
    return out


def _variant(d: Any, root: Any, name: str, replace: type | None) -> Any:
    from tpsim.presets.hf.sizes import SizeRule
    from tpsim.props.module.plans import plan_variant

    plan = dict(root.plan)
    notes = list(root.notes)
    own = getattr(replace, "tp_plan", None) if replace is not None else None
    if isinstance(own, Mapping):
        plan.update({f"{root.path}.{k}": v for k, v in own.items()})
    builder = d.builder(root, replace)
    config = d.config.rpartition(".")[2]
    layers = f", layers {list(root.layers)} of its tiny model" if len(root.layers) > 1 else ""
    return plan_variant(
        builder, plan, sizes=builder.names, name=name, plan_name=f"{config} tp plan",
        size_strategy=SizeRule(d, root), min_batch_dims=2, max_batch_dims=2, skip_unmatched=True,
        unsharded=tuple(n for n in builder.names if n not in ("hidden", "heads", "kv_heads", "ffn")),
        dtypes=("float64", "float32") if root.discrete else None, notes=tuple(notes), own_dtypes=root.own_dtypes,
        # a patch's parameters are its own (read by building it); the model's module's were found already
        parameters=None if replace is not None else root.params,
        description=f"{(replace.__module__ + '.' + replace.__qualname__) if replace else root.cls} at {root.path} of "
                    f"{d.model.rpartition('.')[2]} (a tiny {config}{layers}), {d.attn} attention, under the plan's "
                    "rules for its path")


def _origin(cls: type) -> tuple[str, type]:
    """The family and the transformers module class ``cls`` is, or derives from."""
    for base in cls.__mro__:
        family = family_of(getattr(base, "__module__", ""))
        if family is not None and ".modeling_" in base.__module__:
            return family, base
    raise InvalidArgument(f"{cls!r} derives from no module class of transformers.models")


class TransformersPreset:
    """Every transformers family with a tp plan, module by module (see the module docstring)."""

    name = "transformers"
    requirement = "transformers==5.24.0"
    targets = _FamilyTargets()
    #: No fixed list: any module class of ``transformers.models.<family>.modeling_*`` (:meth:`kind_of`).
    classes: Mapping[str, str] = {}
    rank_local: tuple[str, ...] = ()

    def kind_of(self, cls: Any) -> str | None:
        """``"module"`` for an ``nn.Module`` class of a transformers modeling module (not a whole
        pretrained model), else None."""
        module = getattr(cls, "__module__", "") or ""
        if family_of(module) is None or ".modeling_" not in module or not isinstance(cls, type):
            return None
        from torch import nn

        if not issubclass(cls, nn.Module):
            return None
        try:
            from transformers import PreTrainedModel
        except ImportError:
            return "module"
        return None if issubclass(cls, PreTrainedModel) else "module"

    def load(self) -> dict[str, Any]:
        quiet_import(self, "transformers")
        return {}

    def target_variants(self, module: str, kinds: Any = None) -> list[Any]:
        """The variants of the module target ``transformers.models.<family>`` (of the ``module`` kind)."""
        if kinds is not None and "module" not in kinds:
            return []
        self.load()
        family = family_of(module)
        if family is None:
            raise InvalidArgument(f"{module!r} is not a transformers model family; expected transformers.models.<family>")
        try:
            importlib.import_module(module)
        except ImportError as err:
            raise InvalidArgument(f"cannot import {module}: {err}") from None
        variants, skipped = family_variants(family)
        if not variants:
            why = "; ".join(f"{c} {p}: {w}" for c, p, w in skipped) or "no module of its tiny model is named by a rule"
            raise InvalidArgument(f"{module}: no module of its plans can be checked ({why})")
        extra = ([_not_checked_note(skipped)] if skipped else []) + _family_notes(family)
        if extra:
            first = variants[0]
            variants[0] = first.replace(notes=(*first.notes, *extra))
        return variants

    def variants(self, cls: Any, kind: str) -> list[Any]:
        family, base = _origin(cls)
        path = f"{base.__module__}.{base.__qualname__}"
        found, _ = family_variants(family, replace={path: cls})
        if not found:
            raise InvalidArgument(f"{cls.__qualname__} derives from {base.__qualname__}, which no rule of the "
                                  f"{family} plans shards (or which the preset cannot build alone); see tpsim check "
                                  f"transformers.models.{family}")
        return [v.replace(name=cls.__qualname__ if len(found) == 1 else f"{cls.__qualname__}[{v.name}]")
                for v in found]


#: The preset object (listed in :data:`tpsim.presets.PRESETS`).
PRESET = TransformersPreset()
