"""The Hugging Face transformers preset: ``tpsim check transformers.models.llama`` (and ``.qwen2``, ``.mistral``).

Tested with ``transformers==5.24.0``. For each model the preset builds its MLP, attention and decoder
layer from a tiny config of the case's sizes (no download, no weights file) and checks each as a
plan target (:mod:`tpsim.props.module.plans`): the dense module against itself parallelised by the
model's own ``base_model_tp_plan`` (its ``layers.*.`` rules, re-rooted at the checked module), applied
with transformers' own ``apply_tensor_parallelism`` over a 1-D mesh of the tp group. A subclass of
one of these classes (a patch, a fork) is checked the same way under the same plan:
``tpsim check mypatch.py:MyLlamaMLP``; a subclass may declare its own plan rules in a class attribute
``tp_plan`` (paths relative to the module, e.g. ``{"down_proj": "rowwise"}``), which replace the
model's rules for the paths it names.

What each rank gets:

- the config: ``hidden_size``, ``intermediate_size``, ``num_attention_heads``, ``num_key_value_heads``
  from the case, ``head_dim`` 4, ``attn_implementation="sdpa"``, no dropout; the MLP takes
  ``(hidden, ffn)``, the attention ``(hidden, heads, kv_heads)`` and the decoder layer
  ``(hidden, ffn, heads, kv_heads)``, heads and key/value heads multiples of the tp size (the plan
  shards whole heads);
- the attention and the decoder layer take ``[batch, seq, hidden]`` (two batch dims) and get their
  rotary tables from the model's own rotary embedding for positions ``0..seq-1``, computed in the
  module's forward (:func:`_with_rotary`), with no mask: the tensor-parallel question is the same
  with or without one;
- the dense module built holding the case's weights, sharded by the plan's own code and each piece
  loaded as ``from_pretrained`` loads it (:mod:`tpsim.props.module.plans`): tpsim writes none.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from tpsim.presets._base import quiet_import

__all__ = ["PRESET", "TransformersPreset"]

#: model -> (modeling module, config class, MLP, attention, decoder layer).
_MODELS = {
    "llama": ("modeling_llama", "LlamaConfig", "LlamaMLP", "LlamaAttention", "LlamaDecoderLayer"),
    "qwen2": ("modeling_qwen2", "Qwen2Config", "Qwen2MLP", "Qwen2Attention", "Qwen2DecoderLayer"),
    "mistral": ("modeling_mistral", "MistralConfig", "MistralMLP", "MistralAttention", "MistralDecoderLayer"),
}
_ROLES = ("mlp", "attention", "layer")
#: The ``base_model_tp_plan`` prefix of each role's rules (the decoder layer's rules are all under it).
_PREFIX = {"mlp": "layers.*.mlp.", "attention": "layers.*.self_attn.", "layer": "layers.*."}
_SIZES = {"mlp": ("hidden", "ffn"), "attention": ("hidden", "heads", "kv_heads"),
          "layer": ("hidden", "ffn", "heads", "kv_heads")}
_HEAD_DIM = 4


def _path(model: str, cls_name: str) -> str:
    return f"transformers.models.{model}.{_MODELS[model][0]}.{cls_name}"


def _classes() -> dict[str, str]:
    return {_path(m, names[i]): "module" for m, names in _MODELS.items() for i in (2, 3, 4)}


def _role_of(model: str, cls_name: str) -> str:
    return _ROLES[_MODELS[model].index(cls_name) - 2]


def _config(model: str, sizes: Mapping[str, int]) -> Any:
    module = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    config_cls = getattr(module, _MODELS[model][1])
    heads = sizes.get("heads", 1)  # an MLP: one head divides any hidden size
    config = config_cls(
        hidden_size=sizes["hidden"], intermediate_size=sizes.get("ffn", 2), num_attention_heads=heads,
        num_key_value_heads=sizes.get("kv_heads", heads), head_dim=_HEAD_DIM, num_hidden_layers=1, vocab_size=8,
        attention_dropout=0.0, max_position_embeddings=64,
    )
    config._attn_implementation = "sdpa"
    return config


def _with_rotary(module: nn.Module, rotary: nn.Module, role: str, positions: int) -> nn.Module:
    """The model's attention or decoder layer ``module``, made a module of one input ``[batch, seq,
    hidden]`` in place (its own parameters and sublayer paths unchanged, so a finding names
    ``o_proj``, not a wrapper's path). Its rotary tables come from the model's own rotary embedding
    for positions ``0..seq-1``, computed once here (buffers: constants of the module, like the
    model's own ``inv_freq``)."""
    with torch.no_grad():
        x = torch.zeros(1, positions, 1, dtype=torch.float64)
        cos, sin = rotary(x, torch.arange(positions).unsqueeze(0))
    module.register_buffer("rotary_cos", cos[0].clone(), persistent=False)
    module.register_buffer("rotary_sin", sin[0].clone(), persistent=False)
    own = module.forward  # the class's forward, bound

    def forward(x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        tables = (module.rotary_cos[:seq].unsqueeze(0), module.rotary_sin[:seq].unsqueeze(0))
        if role == "attention":
            return own(x, position_embeddings=tables, attention_mask=None)[0]
        return own(x, attention_mask=None, position_embeddings=tables)

    module.forward = forward  # an instance attribute: nn.Module.__call__ calls it
    return module


class _Dense:
    """The dense builder of one class: ``dense(*sizes, dtype)`` (picklable: it is data)."""

    def __init__(self, cls: type, model: str, role: str) -> None:
        self.cls, self.model, self.role = cls, model, role

    def __call__(self, *values: int, dtype: torch.dtype) -> nn.Module:
        config = _config(self.model, dict(zip(_SIZES[self.role], values, strict=True)))
        if self.role == "mlp":
            return self.cls(config).to(dtype)
        modeling = importlib.import_module(f"transformers.models.{self.model}.{_MODELS[self.model][0]}")
        rotary = getattr(modeling, f"{_MODELS[self.model][2][:-3]}RotaryEmbedding")(config)
        return _with_rotary(self.cls(config, layer_idx=0), rotary, self.role,
                            config.max_position_embeddings).to(dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Dense) and (self.cls, self.model, self.role) == (other.cls, other.model, other.role)

    def __hash__(self) -> int:
        return hash((self.cls, self.model, self.role))


def plan_for(model: str, role: str, cls: type) -> dict[str, str]:
    """The model's ``base_model_tp_plan`` rules for ``role``, re-rooted at the checked module, with a
    subclass's own ``tp_plan`` rules replacing the ones for the paths it names."""
    module = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    base = dict(getattr(module, _MODELS[model][1]).base_model_tp_plan)
    prefix = _PREFIX[role]
    plan = {k[len(prefix):]: v for k, v in base.items() if k.startswith(prefix)}
    own = getattr(cls, "tp_plan", None)
    if isinstance(own, Mapping):
        plan.update(own)
    return plan


def _head_sizes(role: str) -> Any:
    def strategy(tp: int, divisible: bool) -> Any:
        @st.composite
        def draw(draw_fn: Any) -> tuple[int, ...]:
            kv = tp * draw_fn(st.integers(1, 2))
            heads = kv * draw_fn(st.integers(1, 2))
            hidden = heads * draw_fn(st.integers(1, 3))  # the config requires a multiple of the heads
            if role == "attention":
                return (hidden, heads, kv)
            # An intermediate size of 1 on one rank is a torch limitation, not a tp question: DTensor's
            # view rule refuses to flatten [b, 1, 1] sharded on its last dim (torch 2.13: "would remove or
            # reshape sharded dimension 2"), which F.linear does in down_proj at ffn=1, seq=1, tp=1.
            return (hidden, tp * draw_fn(st.integers(2 if tp == 1 else 1, 3)), heads, kv)

        return draw()

    return strategy


class TransformersPreset:
    """Llama, Qwen2 and Mistral MLPs, attentions and decoder layers under their own tp plans (see the
    module docstring)."""

    name = "transformers"
    requirement = "transformers==5.24.0"
    targets = tuple(f"transformers.models.{m}" for m in _MODELS)
    classes = _classes()
    rank_local: tuple[str, ...] = ()

    def load(self) -> dict[str, Any]:
        found = {}
        for path in self.classes:
            module, _, name = path.rpartition(".")
            found[path] = getattr(quiet_import(self, module), name)
        return found

    def _origin(self, cls: type) -> tuple[str, str]:
        for base in cls.__mro__:
            path = f"{base.__module__}.{base.__qualname__}"
            if path in self.classes:
                model = path.split(".")[2]
                return model, _role_of(model, base.__qualname__)
        raise ValueError(f"{cls!r} derives from no class of the transformers preset")

    def variants(self, cls: Any, kind: str) -> list[Any]:
        from tpsim.props.module.plans import plan_variant

        model, role = self._origin(cls)
        plan = plan_for(model, role, cls)
        fields: dict[str, Any] = {"plan_name": f"{model} base_model_tp_plan"}
        if role != "mlp":
            fields.update(size_strategy=_head_sizes(role), min_batch_dims=2)
        return [plan_variant(_Dense(cls, model, role), plan, sizes=_SIZES[role], name=cls.__qualname__,
                             description=f"{cls.__module__}.{cls.__qualname__} from a tiny {model} config under "
                                         f"its base_model_tp_plan", **fields)]


#: The preset object (listed in :data:`tpsim.presets.PRESETS`).
PRESET = TransformersPreset()
