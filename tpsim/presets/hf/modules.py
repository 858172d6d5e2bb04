"""One module of a transformers model, built alone and called as the model calls it.

The module family checks a module of one input ``[batch, seq, hidden]`` against itself parallelised
by a plan (:mod:`tpsim.props.module.plans`). A decoder layer, an attention or an MoE block of a
transformers model takes more than that: rotary tables (per layer type), masks, position ids, a
cache position, per-layer inputs, a key/value state shared by an earlier layer. Rather than knowing
each family's signature, :class:`ModelModule` builds the family's whole tiny model and takes what it
needs from it:

- **the module at its own path.** The model's module at ``path`` (``model.layers.1.mlp``) is held by
  :class:`Held`, a module whose only parameters are that module's, under the same dotted path: the
  plan's rules (``model.layers.*.mlp.experts.gate_up_proj``) name them exactly as they name them in
  the model, and transformers' own wildcard expansion applies them; a finding names the model's path.
- **the call the model makes.** The first time it runs on a ``[b, s, hidden]`` input, :class:`Held`
  runs the model's own forward on token ids ``[b, s]`` up to the module (a forward pre-hook records
  the module's arguments and stops the forward there) and keeps every tensor argument but the hidden
  states as a buffer of its own (a constant of the module, like a rotary table: the magnitude run
  takes its magnitude, a cast takes it to the module's dtype). Every call passes the input in place
  of the hidden states with those arguments. The rest of the model is a dense stand-in, never
  parallelised and never trained (no grads), whose weights are drawn from their names: every rank
  computes the same arguments.
- **an embedding** takes token ids: they are read from the input, ``argmax |x| * vocab // hidden``
  per position (spread over the whole vocabulary, the same under a cast or an ``abs``), so each case
  looks up other rows.

Parameters the model leaves ``torch.empty`` (experts, routers) are drawn by the check like every
parameter; buffers that a build does not make alike (``torch.empty`` ones, found by
:mod:`tpsim.presets.hf.discovery`) are filled from their names.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["Call", "Held", "ModelModule", "first_tensor", "name_seed", "stand_in_fill"]

#: Token ids of the model's forward that prepares a module's arguments (any ids: only the arguments
#: other than the hidden states are kept).
_IDS_SEED = 20240917


def name_seed(name: str) -> int:
    """A seed that depends on ``name`` only."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")


def stand_in_fill(model: nn.Module, buffers: tuple[str, ...] = ()) -> None:
    """Draw every parameter of ``model`` from its name (matrices ``N(0, 1/fan_in)``, norm weights
    ``1 + 0.1 N``, other vectors ``0.1 N``) and the floating ``buffers`` named (``0.1 N``): the same
    values in every process, whatever the model's own init draws."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            gen = torch.Generator().manual_seed(name_seed(name))
            values = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            if p.dim() >= 2:
                values /= max(p.shape[-1], 1) ** 0.5
            elif "norm" in name.lower() and not name.endswith("bias"):
                values = 1.0 + 0.1 * values
            else:
                values *= 0.1
            p.copy_(values.to(p.dtype))
        named = dict(model.named_buffers())
        for name in buffers:
            b = named.get(name)
            if b is None:
                continue
            gen = torch.Generator().manual_seed(name_seed(name))
            if b.is_floating_point():
                b.copy_((0.1 * torch.randn(b.shape, generator=gen, dtype=torch.float64)).to(b.dtype))
            else:
                b.zero_()


def first_tensor(out: Any) -> Any:
    """The first tensor of a module's output (a tensor, a tuple, a ``ModelOutput``); ``out`` itself
    when there is none."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, Mapping):
        values = list(out.values())
    elif isinstance(out, (tuple, list)):
        values = list(out)
    else:
        return out
    for value in values:
        found = first_tensor(value)
        if isinstance(found, torch.Tensor):
            return found
    return out


@dataclass(frozen=True)
class Call:
    """How the model calls a module: ``kind`` ``"hidden"`` (its hidden-states argument is positional
    ``index`` or the keyword ``keyword``) or ``"ids"`` (an embedding: it takes token ids)."""

    kind: str = "hidden"
    index: int | None = 0
    keyword: str | None = None


class _Stop(Exception):
    """Raised by the pre-hook that recorded a module's arguments: the model's forward ends there."""


class Held(nn.Module):
    """The model's module at ``path``, alone under the same dotted path (see the module docstring)."""

    def __init__(self, path: str, module: nn.Module, model: nn.Module, config: Any, call: Call,
                 inputs: Mapping[str, Any]) -> None:
        super().__init__()
        parent: nn.Module = self
        parts = path.split(".")
        for part in parts[:-1]:
            child = nn.Module()
            parent.add_module(part, child)
            parent = child
        parent.add_module(parts[-1], module)
        #: What transformers' apply_tensor_parallelism reads from the model it parallelises (MLA styles).
        self.config = config
        # Not submodules: the model is a stand-in that prepares arguments, neither loaded nor sharded.
        self.__dict__["_model"] = model
        self.__dict__["_held"] = module
        self.__dict__["_call"] = call
        self.__dict__["_inputs"] = dict(inputs)
        self.__dict__["_context"] = {}
        self.__dict__["_vocab"] = int(config.vocab_size) if hasattr(config, "vocab_size") else None

    # -- the arguments the model passes ---------------------------------------------------------
    def _record(self, b: int, s: int, dtype: torch.dtype) -> tuple[Any, Any]:
        module, model = self._held, self._model
        gen = torch.Generator().manual_seed(_IDS_SEED)
        ids = torch.randint(0, self._vocab or 2, (b, s), generator=gen)
        seen: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            seen.append((args, kwargs))
            raise _Stop

        handle = module.register_forward_pre_hook(hook, with_kwargs=True)
        extra = {k: (v(ids, dtype) if callable(v) else v) for k, v in self._inputs.items()}
        try:
            # Outside any torch-function mode of the checker (the magnitude run, the value tape): these
            # arguments are constants of the module, not part of what it computes.
            with torch.no_grad(), torch._C.DisableTorchFunction():
                if "inputs_embeds" in extra:
                    model(use_cache=False, **extra)
                else:
                    model(input_ids=ids, use_cache=False, **extra)
        except _Stop:
            pass
        finally:
            handle.remove()
        if not seen:
            raise RuntimeError(f"the model's forward on token ids never called {type(module).__name__}")
        return seen[0]

    def _arguments(self, x: torch.Tensor) -> tuple[tuple[Any, ...], dict[str, Any]]:
        b, s = int(x.shape[0]), int(x.shape[1])
        key = (b, s)
        found = self._context.get(key)
        if found is None:
            args, kwargs = self._record(b, s, x.dtype)
            call = self._call
            if call.keyword is not None:
                kwargs = {k: v for k, v in kwargs.items() if k != call.keyword}
            else:
                args = args[:call.index] + (None,) + args[call.index + 1:]
            # A key/value cache holds state across calls: each call of the module gets none.
            kwargs = {k: (None if _is_cache(v) else v) for k, v in kwargs.items()}
            args = tuple(None if _is_cache(a) else a for a in args)
            leaves, spec = pytree.tree_flatten((args, kwargs))
            names = []
            for i, leaf in enumerate(leaves):
                if isinstance(leaf, torch.Tensor):
                    name = f"_call_{b}x{s}_{i}"
                    self.register_buffer(name, leaf.detach().clone(), persistent=False)
                    names.append(name)
                else:
                    names.append(None)
            found = (spec, leaves, names)
            self._context[key] = found
        spec, leaves, names = found
        values = [getattr(self, n) if n is not None else leaf for n, leaf in zip(names, leaves, strict=True)]
        args, kwargs = pytree.tree_unflatten(values, spec)
        call = self._call
        if call.keyword is not None:
            kwargs = {**kwargs, call.keyword: x}
        else:
            args = args[:call.index] + (x,) + args[call.index + 1:]
        return args, kwargs

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self._call.kind == "ids":
            with torch._C.DisableTorchFunction():
                # argmax |x| is the same for x and its magnitude, in any dtype (ties aside)
                width = int(x.shape[-1])
                ids = torch.argmax(x.detach().abs(), dim=-1) * (self._vocab or 1) // width
            return first_tensor(self._held(ids))
        # The model passes its hidden states to the module batch-first and contiguous (the output of
        # its own norm or layer): a module checked as its model calls it gets them so.
        args, kwargs = self._arguments(x.contiguous())
        y = first_tensor(self._held(*args, **kwargs))
        if isinstance(y, torch.Tensor) and y.dim() == 2 and y.shape[0] == x.shape[0] * x.shape[1]:
            # an MoE block that returns its tokens flattened ([batch * seq, hidden]); the model reshapes them
            y = y.view(x.shape[0], x.shape[1], y.shape[-1])
        return y


def _is_cache(value: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return False
    return isinstance(value, Cache)


def _resolve(path: str) -> Any:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class ModelModule:
    """The dense builder of one module of a transformers model (data; picklable by reference):
    ``builder(*sizes, dtype) -> Held``. ``sizes`` are the drawn values in the order of ``names``
    (:mod:`tpsim.presets.hf.sizes` says how each maps onto the config); ``path`` is the module's
    generic path (``model.layers.*.mlp``), its ``*`` the layer drawn as ``layer`` among ``layers``;
    ``replace``: a class (a subclass of the module's, a patch) built in its place with the
    arguments the model built it with."""

    config: str
    model: str
    path: str
    names: tuple[str, ...]
    base: tuple[tuple[str, Any], ...]
    switches: tuple[tuple[str, str, Any, Any], ...] = ()
    layers: tuple[int, ...] = ()
    call: Call = field(default_factory=Call)
    attn: str = "sdpa"
    empty_buffers: tuple[str, ...] = ()
    inputs: tuple[tuple[str, Any], ...] = ()
    replace: type | None = None
    train: bool = True

    def sizes_of(self, values: tuple[int, ...]) -> dict[str, int]:
        return dict(zip(self.names, values, strict=True))

    def config_of(self, values: tuple[int, ...]) -> Any:
        """The tiny config of the drawn ``values``."""
        from tpsim.presets.hf.configs import config_for

        drawn = self.sizes_of(values)
        on = {attr: (on_value if drawn.get(name) else off_value) for name, attr, off_value, on_value in self.switches
              if attr and not attr.startswith("_")}
        config = config_for(_resolve(self.config), dict(self.base), drawn, on)
        config._attn_implementation = self.attn
        impl = next((attr[1:] for name, attr, _, _ in self.switches if attr.startswith("_") and drawn.get(name)), None)
        # Always said: left unset, a model picks grouped_mm, whose CPU kernel has no float64 (set per dtype below).
        config._experts_implementation = impl or "eager"
        return config

    def concrete_path(self, values: tuple[int, ...]) -> str:
        """The module's path in the model for the drawn ``values`` (its layer number filled in)."""
        if "*" not in self.path:
            return self.path
        index = self.sizes_of(values).get("layer", 0)
        return self.path.replace("*", str(self.layers[index] if self.layers else 0), 1)

    def model_of(self, values: tuple[int, ...], dtype: torch.dtype) -> tuple[nn.Module, Any]:
        config = self.config_of(values)
        if dtype == torch.float64 and config._experts_implementation == "grouped_mm":
            # torch's grouped_mm has no float64 kernel on CPU (transformers does not fall back): in
            # float64 (the reference, a float64 case) the experts compute the same function with the
            # eager loop; cases in the other dtypes run grouped_mm on every rank and in the dense twin.
            config._experts_implementation = "eager"
        # Built under the dtype as default, as from_pretrained(dtype=...) builds it: tensors a module makes
        # in its constructor (not buffers: .to() would miss them) are in the model's dtype too.
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            model = _resolve(self.model)(config)
        finally:
            torch.set_default_dtype(previous)
        stand_in_fill(model, self.empty_buffers)
        # No .to(dtype) after: a tensor the modeling code makes in a dtype of its own (a router kept in
        # float32) stays in it, as from_pretrained leaves it.
        return model, config

    def __call__(self, *values: int, dtype: torch.dtype) -> nn.Module:
        model, config = self.model_of(tuple(values), dtype)
        path = self.concrete_path(tuple(values))
        module = model.get_submodule(path)
        if self.replace is not None:
            module = _replaced(model, path, module, self.replace, config, dtype)
        own = {id(p) for p in module.parameters()}
        for p in model.parameters():
            if id(p) not in own:
                p.requires_grad_(False)
        model.train(self.train)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return Held(path, module, model, text, self.call, dict(self.inputs))

    def __hash__(self) -> int:
        return hash((self.config, self.path, self.names, self.replace))


def _replaced(model: nn.Module, path: str, module: nn.Module, cls: type, config: Any, dtype: torch.dtype) -> nn.Module:
    """``cls`` built where ``module`` is in ``model``, with the arguments its class takes of the
    model's (the config; a layer index where it takes one), drawn like the rest of the model."""
    import inspect

    params = list(inspect.signature(cls.__init__).parameters)[1:]
    args: list[Any] = [config.get_text_config() if hasattr(config, "get_text_config") else config]
    if len(params) > 1 and params[1] in ("layer_idx", "layer_id", "layer_number"):
        index = next((int(part) for part in path.split(".") if part.isdigit()), 0)  # model.layers.<i>[.mlp]
        args.append(getattr(module, "layer_idx", index))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        new = cls(*args)
    finally:
        torch.set_default_dtype(previous)
    stand_in_fill(new)
    parent_path, _, name = path.rpartition(".")
    parent = model.get_submodule(parent_path) if parent_path else model
    setattr(parent, name, new)
    return new
