"""What a config class's plan shards, found by building its tiny model: modules, switches, calls.

:func:`describe` builds the tiny model of one config class (:mod:`tpsim.presets.hf.configs`) and reads:

- **the plan** as the model assembled it (``model.tp_plan`` after ``post_init``: the config's
  ``base_model_tp_plan``, transformers' automatic ``embed_tokens: embedding_rowwise``, the head's
  ``_tp_plan``, the children's plans under their names), the rules the model would apply;
- **the modules it shards**: for a rule under a layer list (``model.layers.*.self_attn.q_proj``), the
  decoder layer (``model.layers.*``) and its child (``model.layers.*.self_attn``), one module per
  class found at that path across the layers (a dense MLP and an MoE block under the same name are
  two), each with the layers it is found in; for any other rule, the module it names (the embedding,
  the head). Each module gets the rules under its path;
- **the switches** that change a module's parameters or paths: boolean config attributes about
  biases, q/k norms, shared experts (``n_shared_experts`` 1 or 0), a q-LoRA rank, and the experts
  implementations (``grouped_mm``, ``batched_mm``) where the experts class lets them be set; a
  switch belongs to the modules whose parameter names it changes;
- **how the model calls each module**: a forward of the model on token ids, with pre-hooks, shows
  which argument holds the hidden states (or that the module takes ids);
- **what each forward decides on its values**: a module whose forward takes a top-k, an argmax or a
  sort (an MoE router) is checked in float64 and float32 only (:data:`DISCRETE_NOTE`).

Each module is then built alone (:class:`tpsim.presets.hf.modules.ModelModule`) and run densely once
at two switch settings (all off, all on), forward and backward; a module that cannot be built or
run so, or that the model never calls on token ids, is not checked, with the reason
(:attr:`Described.not_checked`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from tpsim.presets.hf import configs
from tpsim.presets.hf.modules import Call, ModelModule, first_tensor, stand_in_fill

__all__ = ["DISCRETE_NOTE", "Described", "Root", "Switch", "describe"]

#: Why a module that takes a discrete decision on its activations is checked in float64 and float32 only.
DISCRETE_NOTE = ("its forward takes a discrete decision on its activations (a top-k, an argmax or a sort: an MoE "
                 "router): in bfloat16 and float16 the rounding of a correct tp run flips a near tie as often as "
                 "not, so it is checked in float64 and float32 only")

#: Config attributes that may switch parameters or modules on and off (booleans, by name).
_SWITCH_NAMES = re.compile(r"(bias|qk_norm|qk_layernorm|use_qk|norm_qk|q_norm|k_norm|shared_expert|is_moe|"
                           r"use_moe|gated|use_gate)", re.I)
#: Counts whose 0 switches a module off.
_COUNT_SWITCHES = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
#: Optional sizes whose ``None`` switches a module off (and the value that switches it on).
_OPTIONAL_SIZES = {"q_lora_rank": configs.FIXED_SIZES["q_lora_rank"]}
#: Config settings that add a kind of layer the plan has rules for, tried where rules name nothing.
_COVERAGE: tuple[dict[str, Any], ...] = (
    {"first_k_dense_replace": 1}, {"num_dense_layers": 1}, {"mlp_only_layers": [0]},
    {"mlp_layer_types": ["dense", "sparse"]}, {"first_dense_layers": 1}, {"moe_layer_start_index": 1},
    {"decoder_sparse_step": 2},
)
#: The experts implementations transformers dispatches to besides the eager loop.
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "batched_mm")
#: Functions of a forward that decide on values (ops whose result is an index or an order).
_DISCRETE = {"topk", "sort", "argsort", "argmax", "argmin", "multinomial", "kthvalue", "msort"}

#: Token ids of the probe forward: batch 2, sequence 3 (the largest sequence a case draws).
_PROBE = (2, 3)

#: Model inputs besides ``input_ids`` that a config class's model needs, as functions of
#: ``(ids, dtype)`` (module-level: built alike in every process).


def _embeds(ids: torch.Tensor, dtype: torch.dtype, width: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(4321)
    return torch.randn(*ids.shape, width, generator=gen, dtype=torch.float64).to(dtype)


class _Embeds:
    """``inputs_embeds`` of ``width`` features for a model that takes no token ids."""

    def __init__(self, width: int) -> None:
        self.width = width

    def __call__(self, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return _embeds(ids, dtype, self.width)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Embeds) and other.width == self.width

    def __hash__(self) -> int:
        return hash(self.width)


@dataclass(frozen=True)
class Switch:
    """A config switch: its name in a case (``attention_bias``), the config attribute (or
    ``_grouped_mm``: an experts implementation) and its two values."""

    name: str
    attr: str
    off: Any
    on: Any


@dataclass(frozen=True)
class Root:
    """A module the plan shards (see the module docstring)."""

    name: str
    path: str
    cls: str
    layers: tuple[int, ...]
    plan: tuple[tuple[str, str], ...]
    call: Call
    switches: tuple[str, ...]
    discrete: bool
    params: tuple[str, ...]
    role: str
    train: bool = True
    notes: tuple[str, ...] = ()
    #: Parameters the module keeps in a dtype of its own (an MoE router made in float32): ``(name, dtype)``.
    own_dtypes: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Described:
    """One config class as the preset checks it (plain data)."""

    config: str
    model: str
    base: tuple[tuple[str, Any], ...]
    sizes: tuple[str, ...]
    head_dim: int
    head_dim_explicit: bool
    mha: bool
    shard_heads: bool
    switches: tuple[Switch, ...]
    roots: tuple[Root, ...]
    not_checked: tuple[tuple[str, str], ...]
    attn: str
    empty_buffers: tuple[str, ...]
    inputs: tuple[tuple[str, Any], ...] = ()
    notes: tuple[str, ...] = ()
    unmatched: tuple[str, ...] = ()

    def builder(self, root: Root, replace: type | None = None) -> ModelModule:
        names = self.names_of(root)
        return ModelModule(config=self.config, model=self.model, path=root.path, names=names, base=self.base,
                           switches=tuple((s.name, s.attr, s.off, s.on) for s in self.switches if s.name in names),
                           layers=root.layers, call=root.call, attn=self.attn, empty_buffers=self.empty_buffers,
                           inputs=self.inputs, replace=replace, train=root.train)

    def names_of(self, root: Root) -> tuple[str, ...]:
        """The sizes a case of ``root`` draws: the config's, its switches, and its layer."""
        return (*self.sizes, *root.switches, *(("layer",) if len(root.layers) > 1 else ()))


def _path(obj: Any) -> str:
    return f"{obj.__module__}.{obj.__qualname__}"


def _wild(name: str) -> str:
    from transformers.distributed.parallel_utils import replace_layer_number_by_wildcard

    return replace_layer_number_by_wildcard(name)


def probe_sizes(described_sizes: tuple[str, ...], mha: bool, head_dim: int) -> dict[str, int]:
    """Sizes of a tiny model that any tp size up to 2 divides, for probing."""
    heads = 4
    out = {"hidden": heads * head_dim, "heads": heads, "kv_heads": heads if mha else 2, "ffn": 8, "experts": 4,
           "top_k": 2}
    return {k: v for k, v in out.items() if k in described_sizes}


def _size_axes(config_cls: type, base: Mapping[str, Any]) -> tuple[tuple[str, ...], bool]:
    defaults = config_cls().to_dict()
    has = {size: any(a in defaults for a in attrs) for size, attrs in configs.DRAWN.items()}
    sizes = ["hidden"]
    mha = True
    if has["heads"]:
        sizes.append("heads")
        heads = next(defaults[a] for a in configs.DRAWN["heads"] if a in defaults)
        kv = defaults.get("num_key_value_heads")
        mha = kv is None or kv == heads
        if has["kv_heads"] and not mha:
            sizes.append("kv_heads")
    if has["ffn"]:
        sizes.append("ffn")
    # an expert count that is set, or left None for the model to require (a MoE model whose config
    # does not default it)
    moe = any(a in defaults and (defaults[a] is None or (isinstance(defaults[a], int) and defaults[a] > 0))
              for a in configs.DRAWN["experts"])
    if moe:
        sizes.append("experts")
        if has["top_k"]:
            sizes.append("top_k")
    return tuple(sizes), mha


def _shards_heads(plan: Mapping[str, str]) -> bool:
    """Whether the plan shards attention heads (a q/k/v projection column-parallel): then every
    rank must hold whole heads."""
    heads = re.compile(r"(^|\.)(q_proj|k_proj|v_proj|qkv_proj|query_key_value|c_attn|q_b_proj|kv_b_proj|wq|wk|wv|"
                       r"query|key|value|qkv|in_proj)$")
    return any(heads.search(k) and s in ("colwise", "packed_colwise") for k, s in plan.items())


def _candidate_switches(config_cls: type, base: Mapping[str, Any], model_cls: type) -> list[Switch]:
    defaults = config_cls().to_dict()
    out = []
    for attr, value in defaults.items():
        if isinstance(value, bool) and _SWITCH_NAMES.search(attr):
            out.append(Switch(attr, attr, value, not value))
    for attr in _COUNT_SWITCHES:
        current = base.get(attr, defaults.get(attr))
        if isinstance(current, int) and not isinstance(current, bool) and current > 0:
            out.append(Switch("shared_experts", attr, 0, current))
            break
    for attr, on in _OPTIONAL_SIZES.items():
        if attr in defaults and (defaults[attr] is None or isinstance(defaults[attr], int)):
            out.append(Switch(attr.replace("_rank", ""), attr, None, base.get(attr, on)))
    return out


def _names_under(model: nn.Module, found: _RootFound) -> frozenset[str]:
    """The names of the parameters and module classes under each of ``found``'s layers (or its path)."""
    paths = [found.path.replace("*", str(i), 1) for i in found.layers] if found.layers else [found.path]
    out = set()
    for path in paths:
        prefix = path + "."
        for name, _ in model.named_parameters():
            if name.startswith(prefix) or name == path:
                out.add(name)
        for name, m in model.named_modules():
            if name.startswith(prefix) or name == path:
                out.add(f"{name}:{type(m).__name__}")
    return frozenset(out)


#: The most parameters a tiny model may have: a config whose sub-configs were not all shrunk (a composite
#: default is tens of billions) is refused before anything is allocated, never built for real.
MAX_TINY_PARAMETERS = 5_000_000


def _meta_model(model_cls: type, config: Any) -> nn.Module:
    with torch.device("meta"):
        return model_cls(config)


def check_tiny(model_cls: type, config: Any) -> None:
    """Refuse (LookupError) a tiny config whose model has more than :data:`MAX_TINY_PARAMETERS`."""
    count = sum(p.numel() for p in _meta_model(model_cls, config).parameters())
    if count > MAX_TINY_PARAMETERS:
        raise LookupError(f"its tiny config still has {count:,} parameters (a sub-config tpsim does not shrink): "
                          f"more than {MAX_TINY_PARAMETERS:,}, not built")


@dataclass
class _RootFound:
    path: str
    cls: type
    layers: list[int] = field(default_factory=list)
    role: str = "module"


def _roots(model: nn.Module, plan: Mapping[str, str]) -> tuple[list[_RootFound], list[str]]:
    """The modules the plan's rules shard (see the module docstring), and the rules that name nothing."""
    modules = dict(model.named_modules())
    params = dict(model.named_parameters())
    found: dict[tuple[str, type], _RootFound] = {}
    unmatched = []

    def add(path: str, cls: type, layer: int | None, role: str) -> None:
        key = (path, cls)
        if key not in found:
            found[key] = _RootFound(path, cls, role=role)
        if layer is not None and layer not in found[key].layers:
            found[key].layers.append(layer)

    for rule in plan:
        if "*" in rule:
            head, _, rest = rule.partition(".*")
            layers = modules.get(head)
            if not isinstance(layers, (nn.ModuleList, nn.ModuleDict)):
                unmatched.append(rule)
                continue
            child = rest.lstrip(".").split(".")[0]
            matched = False
            for key, layer in layers.named_children():
                if not key.isdigit():
                    continue
                i = int(key)
                target = f"{head}.{key}.{rest.lstrip('.')}" if rest else f"{head}.{key}"
                if target not in modules and target not in params:
                    continue
                matched = True
                add(f"{head}.*", type(layer), i, "layer")
                if child:
                    sub = modules.get(f"{head}.{key}.{child}")
                    if sub is not None:
                        add(f"{head}.*.{child}", type(sub), i, "child")
            if not matched:
                unmatched.append(rule)
        else:
            if rule in modules:
                add(rule, type(modules[rule]), None, "module")
            elif rule in params:
                owner = rule.rpartition(".")[0]
                add(owner, type(modules[owner]), None, "module")
            else:
                unmatched.append(rule)
    return list(found.values()), unmatched


def _rules_under(plan: Mapping[str, str], path: str) -> dict[str, str]:
    return {k: v for k, v in plan.items() if k == path or k.startswith(path + ".")}


class _Recorder:
    """Pre-hooks on modules (by concrete path): the arguments of each one's first call."""

    def __init__(self, model: nn.Module, paths: list[str]) -> None:
        self.calls: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}
        self.outputs: dict[str, Any] = {}
        self.handles = []
        for path in paths:
            module = model.get_submodule(path)
            self.handles.append(module.register_forward_pre_hook(self._pre(path), with_kwargs=True))
            self.handles.append(module.register_forward_hook(self._post(path)))

    def _pre(self, path: str) -> Any:
        def hook(_m: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            self.calls.setdefault(path, (args, kwargs))
        return hook

    def _post(self, path: str) -> Any:
        def hook(_m: nn.Module, _args: Any, out: Any) -> None:
            self.outputs.setdefault(path, first_tensor(out))
        return hook

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _call_of(module: nn.Module, args: tuple[Any, ...], kwargs: Mapping[str, Any], b: int, s: int,
             hidden: int) -> Call | str:
    """How the model passes the hidden states (or ids) to ``module``; a string says why it cannot be checked."""

    def hidden_like(t: Any) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3 and tuple(t.shape[:2]) == (b, s)

    if isinstance(module, nn.Embedding) or (args and isinstance(args[0], torch.Tensor) and not args[0].is_floating_point()
                                            and tuple(args[0].shape) == (b, s)):
        return Call(kind="ids", index=0)
    given = args[0] if args else kwargs.get("hidden_states")
    if isinstance(given, torch.Tensor) and given.is_floating_point() and not hidden_like(given):
        return (f"the model calls it on hidden states of shape {list(given.shape)}, not [batch, seq, features] "
                f"(here [{b}, {s}, features]): a module of {given.dim()}-D activations (hyper-connection or "
                "alt-up streams, flattened tokens)")
    if args and hidden_like(args[0]):
        choice: Call = Call(index=0)
        width = args[0].shape[-1]
    elif hidden_like(kwargs.get("hidden_states")):
        choice, width = Call(index=None, keyword="hidden_states"), kwargs["hidden_states"].shape[-1]
    else:
        first = next(((i, a) for i, a in enumerate(args) if hidden_like(a)), None)
        if first is not None:
            choice, width = Call(index=first[0]), first[1].shape[-1]
        else:
            named = next(((k, v) for k, v in kwargs.items() if hidden_like(v)), None)
            if named is None:
                shown = ", ".join([*(f"{type(a).__name__}{list(a.shape) if isinstance(a, torch.Tensor) else ''}"
                                     for a in args), *(f"{k}=" for k in kwargs)])
                return f"the model calls it without [batch, seq, features] hidden states ({shown})"
            choice, width = Call(index=None, keyword=named[0]), named[1].shape[-1]
    if width != hidden:
        return f"the model calls it on [batch, seq, {width}] hidden states, not the model's hidden size {hidden}"
    return choice


class _Discrete(torch.overrides.TorchFunctionMode):
    """Records whether a forward takes an index or an order of its values (:data:`_DISCRETE`)."""

    def __init__(self) -> None:
        super().__init__()
        self.found: set[str] = set()

    def __torch_function__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        name = getattr(func, "__name__", "")
        kwargs = kwargs or {}
        if name in _DISCRETE or (name in ("max", "min") and (len(args) > 1 or "dim" in kwargs)):
            self.found.add(name)
        return func(*args, **kwargs)


def _nondeterministic_buffers(model_cls: type, config: Any) -> tuple[str, ...]:
    """Floating buffers that two builds of the model do not make alike (``torch.empty`` ones)."""
    torch.manual_seed(1)
    a = dict(model_cls(config).named_buffers())
    torch.manual_seed(2)
    b = dict(model_cls(config).named_buffers())
    return tuple(sorted(n for n, t in a.items() if n in b and t.shape == b[n].shape
                        and not torch.equal(t.nan_to_num(), b[n].nan_to_num())))


def _dense_runs(config: Any, model: str) -> bool:
    """Whether the dense model of ``config`` (class path ``model``) runs a forward on token ids."""
    from tpsim.presets.hf.modules import _resolve

    try:
        with _quiet(), torch.no_grad():
            config._attn_implementation = "eager"
            if hasattr(config, "_experts_implementation"):
                config._experts_implementation = "eager"
            built = _resolve(model)(config)
            stand_in_fill(built)  # torch.empty experts and routers: values a forward can run on
            ids = torch.randint(0, configs.VOCAB, (1, 2), generator=torch.Generator().manual_seed(3))
            built(input_ids=ids, use_cache=False)
    except TypeError:
        return True  # a model that needs other inputs (a tower): its modules were found runnable alone
    except Exception:  # noqa: BLE001 - the family refuses these sizes in its forward
        return False
    return True


def _smoke(builder: ModelModule, values: tuple[int, ...]) -> tuple[bool, str | None]:
    """Run the module alone, densely, forward and backward, twice: (deterministic, error or None)."""
    try:
        torch.manual_seed(0)
        held = builder(*values, dtype=torch.float64)
        gen = torch.Generator().manual_seed(7)
        hidden = values[builder.names.index("hidden")]
        x = torch.randn(_PROBE[0], _PROBE[1], hidden, generator=gen, dtype=torch.float64, requires_grad=True)
        outs = []
        for _ in range(2):  # forward and backward twice, as the training steps of a case run it
            y = held(x)
            if not isinstance(y, torch.Tensor) or not y.is_floating_point():
                return True, f"its output is {type(y).__name__}, not a floating tensor"
            if y.dtype != torch.float64:
                return True, (f"the model keeps it in {str(y.dtype).replace('torch.', '')} whatever the model's dtype "
                              "(its output in a float64 model is not float64): tpsim judges a module in the case's "
                              "dtype only")
            if y.dim() != 3 or tuple(y.shape[:2]) != _PROBE:
                return True, f"its output has shape {list(y.shape)}, not [batch, seq, features]"
            outs.append(y.detach().clone())
            y.sum().backward()
        return torch.equal(outs[0], outs[1]), None
    except Exception as err:  # noqa: BLE001 - the reason it cannot be checked, reported
        text = str(err).strip().splitlines()
        return True, f"{type(err).__name__}: {text[0][:200] if text else ''}"


def _settings(names: tuple[str, ...], probe: Mapping[str, int], switches: tuple[str, ...],
              layers: int) -> list[tuple[int, ...]]:
    """The drawn values a module is tried at before it is checked: every switch off at each of its
    layers, every switch on, and each switch on alone."""
    def values(on: set[str], layer: int) -> tuple[int, ...]:
        return tuple(probe[n] if n in probe else layer if n == "layer" else int(n in on) for n in names)

    out = [values(set(), layer) for layer in range(max(layers, 1))]
    if switches:
        out.append(values(set(switches), 0))
        out += [values({sw}, 0) for sw in switches if len(switches) > 1]
    return list(dict.fromkeys(out))


def _checked_alone(builder: ModelModule, settings: list[tuple[int, ...]]) -> tuple[bool, tuple[str, ...], bool,
                                                                                 tuple[tuple[str, str], ...]] | str:
    """Run the module alone at each of ``settings`` (:func:`_smoke`): whether it runs in training mode
    (else eval mode: its training forward is not a function of its input), the names of its
    parameters at every setting, whether its forward decides on values, and the parameters it keeps
    in a dtype of its own (not float64 in a float64 build); or why it cannot be checked."""
    train = True
    for values in settings:
        deterministic, error = _smoke(builder, values)
        if error is None and not deterministic and train:
            train = False
            builder = ModelModule(**{**builder.__dict__, "train": False})
            deterministic, error = _smoke(builder, values)
        if error is None and not deterministic:
            error = "its forward gives different outputs on the same input, in training and in eval mode"
        if error is not None:
            return error
    params: set[str] = set()
    own: dict[str, str] = {}
    discrete = False
    b, s = _PROBE
    for values in settings:
        held = builder(*values, dtype=torch.float64)
        params.update(n for n, _ in held.named_parameters())
        own.update((n, str(p.dtype).replace("torch.", "")) for n, p in held.named_parameters()
                   if p.is_floating_point() and p.dtype != torch.float64)
        hidden = values[builder.names.index("hidden")]
        x = torch.randn(b, s, hidden, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
        mode = _Discrete()
        with torch.no_grad(), mode:
            held(x)
        discrete = discrete or bool(mode.found)
    return train, tuple(sorted(params)), discrete, tuple(sorted(own.items()))


def _role_name(found: _RootFound) -> str:
    """A layer's module by its class (``Qwen3MoeSparseMoeBlock``), any other by its path (``embed_tokens``)."""
    return found.cls.__name__ if found.layers else found.path.rpartition(".")[2]


@contextlib.contextmanager
def _quiet() -> Any:
    import logging
    import warnings

    logger = logging.getLogger("transformers")
    level = logger.level
    logger.setLevel(logging.ERROR)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            yield
        finally:
            logger.setLevel(level)


def describe(config_cls: type) -> Described:
    """The modules ``config_cls``'s plan shards, their switches and calls (see the module docstring)."""
    with _quiet():
        return _describe(config_cls)


def _describe(config_cls: type) -> Described:
    from tpsim.presets.hf.configs import config_for, head_dim_of, model_class, tiny_kwargs

    model_cls = model_class(config_cls)
    if model_cls is None:
        raise LookupError(f"no model class of transformers runs {config_cls.__name__}")
    base, notes = tiny_kwargs(config_cls)
    sizes, mha = _size_axes(config_cls, base)
    head_dim, explicit = head_dim_of(config_cls, base)
    probe = probe_sizes(sizes, mha, head_dim)
    config = config_for(config_cls, base, probe, {})
    attn = "sdpa" if getattr(model_cls, "_supports_sdpa", False) else "eager"
    config._attn_implementation = attn
    check_tiny(model_cls, config)
    model = model_cls(config)
    plan = dict(model.tp_plan or {})
    found, unmatched = _roots(model, plan)
    if unmatched:
        # Rules for a kind of layer the tiny model lacks (an all-sparse default has no dense MLP): the
        # config's own ways to have one, kept where they leave fewer rules naming nothing.
        defaults = config_cls().to_dict()
        for tweak in _COVERAGE:
            if not all(k in defaults for k in tweak) or all(base.get(k) == v for k, v in tweak.items()):
                continue
            trial = {**base, **tweak}
            if "mlp_layer_types" in tweak and isinstance(base.get("mlp_layer_types", defaults["mlp_layer_types"]), list):
                current = list(base.get("mlp_layer_types", defaults["mlp_layer_types"]))
                trial["mlp_layer_types"] = ["dense", *current[1:]] if len(current) > 1 else ["dense", "sparse"]
            try:
                other_config = config_for(config_cls, trial, probe, {})
                other_config._attn_implementation = attn
                check_tiny(model_cls, other_config)
                other = model_cls(other_config)
                _, fewer = _roots(other, dict(other.tp_plan or {}))
            except Exception:  # noqa: BLE001 - a tweak the family refuses is no way of its
                continue
            if len(fewer) < len(unmatched):
                base, config, model, unmatched = trial, other_config, other, fewer
                notes.append(f"{', '.join(tweak)} set: a layer kind the plan has rules for")
                found, _ = _roots(model, plan)
                if not unmatched:
                    break
    switches: list[tuple[Switch, tuple[tuple[str, type], ...]]] = []
    baseline = {(f.path, f.cls): _names_under(model, f) for f in found}
    for switch in _candidate_switches(config_cls, base, model_cls):
        try:
            off, on = (_meta_model(model_cls, config_for(config_cls, base, probe, {switch.attr: value}))
                       for value in (switch.off, switch.on))
        except Exception:  # noqa: BLE001 - a value the family's validators refuse is not a switch of it
            continue
        changed = tuple((f.path, f.cls) for f in found if _names_under(off, f) != _names_under(on, f))
        if changed:
            switches.append((switch, changed))
    if getattr(model_cls, "_can_set_experts_implementation", lambda: False)():
        experts = tuple((f.path, f.cls) for f in found
                        if any(re.search(r"(^|\.)experts:", n) for n in baseline[(f.path, f.cls)]))
        if experts:
            for impl in EXPERTS_IMPLEMENTATIONS:
                switches.append((Switch(impl, f"_{impl}", False, True), experts))
    empty = _nondeterministic_buffers(model_cls, config)
    # the model's inputs: token ids, or embeddings for a model that takes none
    inputs: tuple[tuple[str, Any], ...] = ()
    import inspect

    forward_params = inspect.signature(model_cls.forward).parameters
    if "input_ids" not in forward_params and "inputs_embeds" in forward_params:
        inputs = (("inputs_embeds", _Embeds(int(probe["hidden"]))),)
    # how the model calls each module (at the first layer it is found in)
    concrete = {f.path: f.path.replace("*", str(f.layers[0])) if f.layers else f.path for f in found}
    recorder = _Recorder(model, list(concrete.values()))
    b, s = _PROBE
    ids = torch.randint(0, configs.VOCAB, (b, s), generator=torch.Generator().manual_seed(3))
    not_checked: list[tuple[str, str]] = []
    try:
        with torch.no_grad():
            extra = {k: v(ids, torch.float32) for k, v in inputs}
            model(**extra) if "inputs_embeds" in extra else model(input_ids=ids, use_cache=False)
    except Exception as err:  # noqa: BLE001 - every module is then not checked, with the reason
        text = str(err).strip().splitlines()
        reason = f"the dense tiny model's forward on token ids fails: {type(err).__name__}: {text[0][:200] if text else ''}"
        for f in found:
            not_checked.append((f.path, reason))
        found = []
    finally:
        recorder.remove()
    names_taken: set[str] = set()
    roots = []
    shard_heads = _shards_heads(plan)
    for f in found:
        path = concrete[f.path]
        rules = _rules_under(plan, f.path)
        if not rules:
            continue
        if path not in recorder.calls:
            not_checked.append((f.path, "the model's forward on token ids does not call it (a tower or a head that "
                                        "needs other inputs, or a layer the tiny model skips)"))
            continue
        args, kwargs = recorder.calls[path]
        call = _call_of(model.get_submodule(path), args, kwargs, b, s, probe["hidden"])
        if isinstance(call, str):
            not_checked.append((f.path, call))
            continue
        mine = tuple(sw.name for sw, owners in switches if (f.path, f.cls) in owners)
        name = _role_name(f)
        if name in names_taken:
            name = f"{name}[{f.path}]"
        names_taken.add(name)
        root = Root(name=name, path=f.path, cls=_path(f.cls), layers=tuple(sorted(f.layers)), plan=tuple(rules.items()),
                    call=call, switches=mine, discrete=False, params=(), role=f.role)
        draft = Described(config=_path(config_cls), model=_path(model_cls), base=tuple(sorted(base.items())),
                          sizes=sizes, head_dim=head_dim, head_dim_explicit=explicit, mha=mha, shard_heads=shard_heads,
                          switches=tuple(sw for sw, _ in switches), roots=(), not_checked=(), attn=attn,
                          empty_buffers=empty, inputs=inputs)
        builder = draft.builder(root)
        names = builder.names
        settings = _settings(names, probe, mine, len(root.layers))
        found_root = _checked_alone(builder, settings)
        if isinstance(found_root, str):
            not_checked.append((f.path, f"built alone at tiny sizes, its dense forward fails: {found_root}"))
            continue
        train, params, discrete, own_dtypes = found_root
        roots.append(Root(name=name, path=f.path, cls=_path(f.cls), layers=root.layers, plan=root.plan, call=call,
                          switches=mine, discrete=discrete, params=params, role=f.role, train=train,
                          notes=(DISCRETE_NOTE,) if discrete else (), own_dtypes=own_dtypes))
    return Described(config=_path(config_cls), model=_path(model_cls), base=tuple(sorted(base.items())), sizes=sizes,
                     head_dim=head_dim, head_dim_explicit=explicit, mha=mha, shard_heads=shard_heads,
                     switches=tuple(s for s, _ in switches), roots=tuple(roots), not_checked=tuple(not_checked),
                     attn=attn, empty_buffers=empty, inputs=inputs, notes=tuple(notes), unmatched=tuple(unmatched))
