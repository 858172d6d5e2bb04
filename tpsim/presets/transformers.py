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
  module's wrapper (:class:`_WithRotary`), with no mask: the tensor-parallel question is the same
  with or without one;
- the model's own init, overwritten with the master values (every parameter is loaded).
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch
from hypothesis import strategies as st
from torch import nn

from tpsim.errors import InvalidArgument
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
#: The roles the module check can judge today. The attention and the decoder layer need a rounding
#: bound through rotary embeddings, SDPA and RMSNorm that the module oracle cannot derive yet: their
#: variants are built (and their plans exercised by tests/test_presets_transformers.py against the
#: dense module directly), and join this set when the oracle covers them.
ORACLE_ROLES = frozenset({"mlp"})


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


class _WithRotary(nn.Module):
    """The model's attention or decoder layer called as a module of one input ``[batch, seq, hidden]``.
    Its rotary tables come from the model's own rotary embedding for positions ``0..seq-1``, computed
    once at construction (buffers: constants of the module, like the model's own ``inv_freq``), so
    that the check's rounding bound needs no rule for ``cos``/``sin``."""

    def __init__(self, inner: nn.Module, rotary: nn.Module, role: str, positions: int) -> None:
        super().__init__()
        self.inner = inner
        self.role = role
        with torch.no_grad():
            x = torch.zeros(1, positions, 1, dtype=torch.float64)
            cos, sin = rotary(x, torch.arange(positions).unsqueeze(0))
        self.register_buffer("cos", cos[0].clone(), persistent=False)
        self.register_buffer("sin", sin[0].clone(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1]
        tables = (self.cos[:seq].unsqueeze(0), self.sin[:seq].unsqueeze(0))
        if self.role == "attention":
            return self.inner(x, position_embeddings=tables, attention_mask=None)[0]
        return self.inner(x, attention_mask=None, position_embeddings=tables)


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
        return _WithRotary(self.cls(config, layer_idx=0), rotary, self.role, config.max_position_embeddings).to(dtype)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Dense) and (self.cls, self.model, self.role) == (other.cls, other.model, other.role)

    def __hash__(self) -> int:
        return hash((self.cls, self.model, self.role))


def plan_for(model: str, role: str, cls: type) -> dict[str, str]:
    """The model's ``base_model_tp_plan`` rules for ``role``, re-rooted at the checked module (the
    attention and decoder layer sit under ``inner.`` in their wrapper), with a subclass's own
    ``tp_plan`` rules replacing the ones for the paths it names."""
    module = importlib.import_module(f"transformers.models.{model}.configuration_{model}")
    base = dict(getattr(module, _MODELS[model][1]).base_model_tp_plan)
    prefix = _PREFIX[role]
    plan = {k[len(prefix):]: v for k, v in base.items() if k.startswith(prefix)}
    own = getattr(cls, "tp_plan", None)
    if isinstance(own, Mapping):
        plan.update(own)
    root = "" if role == "mlp" else "inner."
    return {root + k: v for k, v in plan.items()}


def _head_sizes(role: str) -> Any:
    def strategy(tp: int, divisible: bool) -> Any:
        @st.composite
        def draw(draw_fn: Any) -> tuple[int, ...]:
            kv = tp * draw_fn(st.integers(1, 2))
            heads = kv * draw_fn(st.integers(1, 2))
            hidden = heads * draw_fn(st.integers(1, 3))  # the config requires a multiple of the heads
            if role == "attention":
                return (hidden, heads, kv)
            return (hidden, tp * draw_fn(st.integers(1, 3)), heads, kv)

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
        # What a module target checks: the roles the module check can bound today (see ORACLE_ROLES).
        found = {}
        for path in self.classes:
            module, _, name = path.rpartition(".")
            model = path.split(".")[2]
            if _role_of(model, name) in ORACLE_ROLES:
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
        if role not in ORACLE_ROLES:
            raise InvalidArgument(
                f"{cls.__qualname__} is a {model} {role} (rotary tables, scaled_dot_product_attention, RMSNorm): the "
                "module check's derived rounding bound does not cover those ops yet (it refuses the decoder layer and "
                "raises false alarms on the attention at world size 1), so it is not checked rather than misjudged; "
                f"check {_MODELS[model][2]} (tpsim check transformers.models.{model}), whose plan rules are the same"
            )
        plan = plan_for(model, role, cls)
        fields: dict[str, Any] = {"plan_name": f"{model} base_model_tp_plan"}
        if role == "mlp" and "attention" not in ORACLE_ROLES:
            names = _MODELS[model]
            fields["notes"] = (f"{names[3]} and {names[4]} are not checked yet: the module check cannot bound rotary "
                               "embeddings, SDPA and RMSNorm (their plans are tested against the dense modules in "
                               "tests/test_presets_transformers.py)",)
        if role != "mlp":
            fields.update(size_strategy=_head_sizes(role), min_batch_dims=2)
        return [plan_variant(_Dense(cls, model, role), plan, sizes=_SIZES[role], name=cls.__qualname__,
                             description=f"{cls.__module__}.{cls.__qualname__} from a tiny {model} config under "
                                         f"its base_model_tp_plan", **fields)]


#: The preset object (listed in :data:`tpsim.presets.PRESETS`).
PRESET = TransformersPreset()
