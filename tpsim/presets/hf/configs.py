"""Which config classes of a transformers family define a tp plan, which model runs each, and tiny configs.

A family is a folder ``transformers.models.<family>``; it may hold several config classes with a plan
of their own (a multimodal family's text config, a talker and a code predictor, a vision tower).
:func:`plan_configs` lists them, :func:`model_class` finds the model class that runs each (a
``*ForCausalLM`` first, then the base model; a config-only folder through transformers' auto
mapping, as ``from_pretrained`` finds it), and :func:`tiny_kwargs` shrinks the family's default
config to a tiny one:

- every size attribute the config has (:data:`FIXED_SIZES`) gets a small value, kept only where the
  default is an int (0 stays 0: it switches a feature off) or ``None`` where ``None`` means "derive
  it" (:data:`NONE_OK`); the sizes the search draws (:data:`DRAWN`) are set per case
  (:func:`config_for`);
- the layers: every per-layer list of the default config (``layer_types``, ``mlp_layer_types``, ...)
  and every layer-index list (``mlp_only_layers``, ``moe_layers``, ...) are read together and the
  first layer of each distinct combination is kept (at most :data:`MAX_LAYERS`), so that each kind
  of layer the model has exists in the tiny one; where every layer is sparse, a dense first layer
  is added the way the config says it (``first_k_dense_replace``, ``mlp_only_layers``, ...);
- rotary: M-RoPE sections are scaled to the tiny head size; token ids are remapped into the tiny
  vocabulary; dropouts and router noise are 0 (a forward must be a function of its input);
- sub-configs of a composite config are shrunk alike.

Config attributes that constrain each other in ways only the family's validators or modeling code
know are in :data:`CONFIG_FIXES`, each with its reason: they fix a validator's coupling (a size the
validator derives), never what is checked.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import pkgutil
import re
from collections.abc import Mapping
from typing import Any

__all__ = ["CONFIG_FIXES", "DRAWN", "FIXED_SIZES", "MAX_LAYERS", "NONE_OK", "VOCAB", "config_for",
           "families_with_plans", "model_class", "plan_configs", "tiny_kwargs"]

#: The most layers a tiny config keeps (one per distinct kind of layer of the default config).
MAX_LAYERS = 4
#: The tiny vocabulary: divides every tp size up to 8 and 3, so the vocabulary styles shard it evenly.
VOCAB = 96
#: The head size of a tiny config, and of one with multimodal rotary sections (whose sections must
#: add up to half the rotary dims, each at least 1).
HEAD_DIM = 8
MROPE_HEAD_DIM = 16

#: The sizes the search draws, and the config attributes each sets (every one the config has).
DRAWN: dict[str, tuple[str, ...]] = {
    "hidden": ("hidden_size", "n_embd", "d_model"),
    "heads": ("num_attention_heads", "n_head", "num_heads"),
    "kv_heads": ("num_key_value_heads",),
    "ffn": ("intermediate_size", "n_inner", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size",
            "prefix_dense_intermediate_size", "moe_intermediate_size", "expert_ffn_hidden_size", "moe_hidden_size",
            "shared_expert_intermediate_size", "shared_intermediate_size", "shared_experts_intermediate_size",
            "moe_shared_expert_intermediate_size"),
    "experts": ("num_experts", "n_routed_experts", "num_local_experts", "moe_num_experts"),
    "top_k": ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", "top_k_experts"),
}

#: Fixed small sizes of everything else a config may have (MLA ranks, linear attention, mamba, towers).
FIXED_SIZES: dict[str, int] = {
    "head_dim": HEAD_DIM,
    "vocab_size": VOCAB,
    "max_position_embeddings": 64, "n_positions": 64, "n_ctx": 64,
    # group-limited routing: one group, every expert in it (any expert count is then valid)
    "n_group": 1, "num_expert_group": 1, "topk_group": 1,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "first_k_dense_replace": 1, "num_dense_layers": 1, "decoder_sparse_step": 1, "interleave_moe_layer_step": 1,
    "zero_expert_num": 2,
    # multi-head latent attention
    "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
    "o_lora_rank": 16, "index_head_dim": 16, "index_n_heads": 4, "index_topk": 2, "indexer_n_heads": 4,
    "indexer_head_dim": 16,
    # linear attention, gated delta nets
    "linear_num_key_heads": 4, "linear_num_value_heads": 8, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4, "linear_num_heads": 8, "linear_head_dim": 8,
    # mamba
    "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16, "mamba_n_groups": 2,
    "n_groups": 2, "mamba_d_state": 8, "ssm_state_size": 8, "mamba_d_conv": 4, "mamba_chunk_size": 8,
    "chunk_size": 8, "mamba_dt_rank": 8,
    # windows: the drawn sequences are 1 to 3 tokens, so a window of 2 bites
    "sliding_window": 2, "sliding_window_size": 2, "attention_chunk_size": 2,
    "swa_num_attention_heads": 8, "swa_num_key_value_heads": 4, "swa_head_dim": 8,
    "rotary_dim": 4,
    # towers and projectors of composite models
    "vision_output_dim": 64, "out_hidden_size": 64, "projector_hidden_size": 64, "projector_input_dim": 64,
    "projector_output_dim": 64,
    "num_mtp_layers": 0, "num_nextn_predict_layers": 0,
}

#: Size attributes a family may leave ``None`` by default (derived from others, or required).
NONE_OK = frozenset({"head_dim", "num_key_value_heads", "moe_intermediate_size", "intermediate_size",
                     "num_experts_per_tok", "n_routed_experts", "n_shared_experts", "num_experts", "top_k_experts"})

#: Attributes set to 0 wherever a config has them: a forward must be a function of its input.
_ZEROED = re.compile(r"(^|_)(dropout|drop_rate|dropout_rate|jitter|jitter_noise|router_jitter_noise|attn_pdrop|"
                     r"resid_pdrop|embd_pdrop|hidden_dropout_prob|attention_probs_dropout_prob)$")

#: Per config class: attributes whose valid values the family's validators derive from others, or that
#: the default leaves as something the modeling code cannot run with. Each fixes validity, never what
#: is checked.
CONFIG_FIXES: dict[str, dict[str, Any]] = {
    # the default layer types are None: the modeling code needs them listed
    "CohereCompassTextConfig": {"layer_types": ["sliding_attention", "full_attention"],
                                "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                    "full_attention": {"rope_type": "default", "rope_theta": 1e4}}},
    "DeepseekOcr2TextConfig": {"mlp_layer_types": ["dense", "sparse"]},
    "Lfm2MoeConfig": {"layer_types": ["conv", "full_attention", "conv", "full_attention"], "num_dense_layers": 1,
                      "num_hidden_layers": 4},
    # the layer count is the sum of three groups the validator checks
    "DoryConfig": {"num_hidden_layers": 3, "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
                   "n_input_layers": 1, "n_recurrent_layers": 1, "n_output_layers": 1},
    # validator couplings: a head size the validator ties to another
    "Dots3NoteTextConfig": {"head_dim": 20, "swa_head_dim": 20},
    "Glm5NextTextConfig": {"index_kpool": 2},
    "FalconH1Config": {"mamba_d_ssm": 128},
    "NeoMMEConfig": {"head_dim": 16, "embedding_rank": 16},
    # per-layer inputs and KV sharing need their own sizes; the first layer is the sparse one
    "Gemma3nTextConfig": {"layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
                          "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0], "num_kv_shared_layers": 0,
                          "vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16, "laurel_rank": 8,
                          "num_hidden_layers": 4},
    "Gemma4TextConfig": {"vocab_size_per_layer_input": VOCAB, "hidden_size_per_layer_input": 16,
                         "enable_moe_block": True},
    "Inkling2TextConfig": {"unpadded_vocab_size": VOCAB - 8},
    "Inkling2LoopTextConfig": {"unpadded_vocab_size": VOCAB - 8},
    # the talker reads an attribute its config does not declare
    "Qwen3OmniMoeTalkerTextConfig": {"shared_expert_intermediate_size": 48},
    "Step3p7TextConfig": {"sliding_window": 2},
    "Qwen4ExpTextConfig": {"indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 32, "indexer_budget": 8,
                           "indexer_compress_ratio": 2, "hc_lowrank": 8, "ple_embed_dim": 16,
                           "ngram_vocab_size_base": VOCAB, "split_ngram_parts": 4},
    # multimodal rotary sections that the modeling code derives from a partial rotary factor
    "Glm4vTextConfig": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                            "mrope_section": [1, 1, 2]}},
    "GlmImageTextConfig": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                               "mrope_section": [1, 1, 2]}},
    "Glm4vMoeTextConfig": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5,
                                               "mrope_section": [1, 1, 2]}},
    "HunYuanVLTextConfig": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}},
    "HYV4VLTextConfig": {"qk_rope_head_dim": 8, "head_dim": 8, "qk_head_dim": 16,
                         "rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]}},
    "Ernie4_5_VLMoeTextConfig": {"moe_intermediate_size": [32, 16],
                                 "rope_parameters": {"rope_type": "default", "rope_theta": 5e5,
                                                     "mrope_section": [3, 3, 2]}},
    # encoder-decoder sub-models: the parent config injects the dropout
    "T5GemmaModuleConfig": {"dropout_rate": 0.0},
    "T5Gemma2TextConfig": {"dropout_rate": 0.0},
    "T5Gemma2DecoderConfig": {"dropout_rate": 0.0},
}

#: Model classes a config class is run with where none names it as its ``config_class``.
MODEL_CLASS_FIXES = {
    "T5GemmaModuleConfig": "transformers.models.t5gemma.modeling_t5gemma.T5GemmaEncoder",
}


# --- which config classes have a plan ---------------------------------------------------------------


def _family_package(family: str) -> Any:
    return importlib.import_module(f"transformers.models.{family}")


def _config_modules(family: str) -> list[Any]:
    package = _family_package(family)
    out = []
    for sub in pkgutil.iter_modules(package.__path__):
        if sub.name.startswith("configuration_"):
            out.append(importlib.import_module(f"{package.__name__}.{sub.name}"))
    return out


def plan_configs(family: str) -> list[type]:
    """The config classes defined in ``transformers.models.<family>`` that define a non-empty
    ``base_model_tp_plan`` in their own class body, in source order."""
    from transformers import PretrainedConfig

    found = []
    for module in _config_modules(family):
        for value in vars(module).values():
            if (inspect.isclass(value) and issubclass(value, PretrainedConfig) and value.__module__ == module.__name__
                    and value.__dict__.get("base_model_tp_plan")):
                found.append(value)
    return found


def families_with_plans() -> list[str]:
    """Every ``transformers.models`` family folder with at least one config class that defines a plan
    (imports every configuration module: seconds)."""
    import transformers.models as models

    out = []
    for info in pkgutil.iter_modules(models.__path__):
        if not info.ispkg:
            continue
        try:
            if plan_configs(info.name):
                out.append(info.name)
        except Exception:  # noqa: BLE001 - a folder whose configs cannot be imported has no plan to check
            continue
    return sorted(out)


def _modeling_modules(family: str) -> list[Any]:
    package = _family_package(family)
    out = []
    for sub in pkgutil.iter_modules(package.__path__):
        if sub.name.startswith("modeling_") and not sub.name.startswith(("modeling_flax", "modeling_tf")):
            try:
                out.append(importlib.import_module(f"{package.__name__}.{sub.name}"))
            except Exception:  # noqa: BLE001 - a modeling module needing an absent extra has no class for us
                continue
    return out


def model_class(config_cls: type) -> type | None:
    """The model class that runs ``config_cls``: among the family's classes whose ``config_class`` it
    is, a ``*ForCausalLM``, then a ``*TextModel`` or ``*Model``; for a config-only folder, the class
    transformers' auto mapping names for its ``model_type`` (what ``from_pretrained`` builds)."""
    from transformers import PreTrainedModel

    fixed = MODEL_CLASS_FIXES.get(config_cls.__name__)
    if fixed:
        module, _, name = fixed.rpartition(".")
        return getattr(importlib.import_module(module), name)
    family = config_cls.__module__.split(".")[2]
    candidates = []
    for module in _modeling_modules(family):
        for name, value in vars(module).items():
            if (inspect.isclass(value) and issubclass(value, PreTrainedModel) and value.__module__ == module.__name__
                    and getattr(value, "config_class", None) is config_cls and not name.endswith("PreTrainedModel")):
                candidates.append(value)

    def rank(cls: type) -> tuple[int, int, str]:
        name = cls.__name__
        order = (0 if name.endswith("ForCausalLM") else 1 if name.endswith("TextModel") or (
            name.endswith("Model") and "For" not in name) else 2 if name.endswith("ForMaskedLM") else 3)
        return order, len(name), name

    if candidates:
        return sorted(candidates, key=rank)[0]
    import transformers
    from transformers.models.auto import modeling_auto

    for mapping in (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES):
        name = mapping.get(getattr(config_cls, "model_type", ""))
        if name and hasattr(transformers, name):
            return getattr(transformers, name)
    return None


# --- tiny configs ---------------------------------------------------------------------------------


def _defaults(config_cls: type) -> dict[str, Any]:
    return config_cls().to_dict()


def _per_layer(key: str, value: Any, layers: int) -> bool:
    return isinstance(value, list) and len(value) == layers and layers > 1


def _layer_choice(defaults: Mapping[str, Any]) -> tuple[list[int] | None, dict[str, Any], dict[str, Any]]:
    """The layers of the default config to keep (the first of each distinct combination of its
    per-layer settings), its per-layer lists and its layer-index lists."""
    layers = defaults.get("num_hidden_layers")
    if not isinstance(layers, int) or layers < 2:
        return None, {}, {}
    per_layer, index_lists = {}, {}
    for key, value in defaults.items():
        if key == "rope_parameters":
            continue
        if _per_layer(key, value, layers) and not (key.endswith("_layers") and all(isinstance(x, int) for x in value)
                                                  and sorted(value) == list(range(layers))):
            per_layer[key] = value
        elif (isinstance(value, list) and value and all(isinstance(x, int) and not isinstance(x, bool) for x in value)
              and key.endswith(("layers", "idxs", "indices", "layer_ids")) and max(value) < layers):
            index_lists[key] = value
    sparse = defaults.get("per_layer_config")
    if not (per_layer or index_lists or (isinstance(sparse, dict) and sparse)):
        return None, per_layer, index_lists
    combos: dict[tuple[Any, ...], int] = {}
    for i in range(layers):
        key = tuple(str(per_layer[k][i]) for k in per_layer) + tuple(i in index_lists[k] for k in index_lists)
        key += (str((sparse or {}).get(f"{i:02d}", (sparse or {}).get(str(i)))),)
        combos.setdefault(key, i)
    chosen = sorted(combos.values())[:MAX_LAYERS]
    return (chosen if len(chosen) >= 2 else [0, 1]), per_layer, index_lists


def _mrope_default(config_cls: type) -> list[int] | None:
    """The M-RoPE sections the modeling code falls back to when the config has none."""
    family = config_cls.__module__.split(".")[2]
    for module in _modeling_modules(family):
        try:
            source = inspect.getsource(module)
        except OSError:
            continue
        m = re.search(r'get\("mrope_section", \[([0-9, ]+)\]\)', source)
        if m:
            return [int(x) for x in m.group(1).split(",")]
    return None


def _has_mrope(rope: Mapping[str, Any]) -> bool:
    return "mrope_section" in rope or any(isinstance(v, dict) and "mrope_section" in v for v in rope.values())


def _scaled_mrope(rope: Mapping[str, Any], factor: float) -> dict[str, Any]:
    out = copy.deepcopy(dict(rope))

    def fix(d: dict[str, Any]) -> None:
        if "mrope_section" in d:
            sections = d["mrope_section"]
            target = max(len(sections), round(sum(sections) * factor))
            new = [max(1, round(s * factor)) for s in sections]
            i = 0
            while sum(new) != target:  # keep every section at least 1, the sum exact
                step = 1 if sum(new) < target else -1
                if new[i % len(new)] + step >= 1:
                    new[i % len(new)] += step
                i += 1
            d["mrope_section"] = new

    fix(out)
    for value in out.values():
        if isinstance(value, dict):
            fix(value)
    return out


def tiny_kwargs(config_cls: type) -> tuple[dict[str, Any], list[str]]:
    """Keyword arguments of a tiny config of ``config_cls`` without the drawn sizes (see the module
    docstring), and notes on what was chosen."""
    defaults = _defaults(config_cls)
    keys = set(defaults) | set(getattr(config_cls, "__dataclass_fields__", {}) or {})
    notes: list[str] = []
    kw: dict[str, Any] = {}
    declared = getattr(config_cls, "__dataclass_fields__", {}) or {}
    for key, value in FIXED_SIZES.items():
        if key not in defaults:
            continue
        if key in declared and getattr(declared[key], "default", None) == "auto":
            continue  # the config derives it from the sizes: set, it would contradict them
        current = defaults[key]
        if isinstance(current, int) and not isinstance(current, bool) and current == 0:
            continue  # 0 switches a feature off (NoPE, no dense layers): keep it off
        if (isinstance(current, int) and not isinstance(current, bool)) or (current is None and key in NONE_OK):
            kw[key] = value
    for key, value in defaults.items():
        if _ZEROED.search(key) and isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            kw[key] = 0.0 if isinstance(value, float) else 0
    # MLA: keep head_dim's relation to the nope and rope parts
    if "head_dim" in kw and isinstance(defaults.get("qk_rope_head_dim"), int) and isinstance(defaults.get("head_dim"), int):
        nope0, rope0 = defaults.get("qk_nope_head_dim") or 0, defaults["qk_rope_head_dim"]
        nope, rope = kw.get("qk_nope_head_dim", nope0), kw.get("qk_rope_head_dim", rope0)
        if defaults["head_dim"] == nope0 + rope0:
            kw["head_dim"] = nope + rope
        elif defaults["head_dim"] == rope0:
            kw["head_dim"] = rope
    if "qk_head_dim" in defaults and "qk_nope_head_dim" in kw:
        kw["qk_head_dim"] = kw["qk_nope_head_dim"] + kw.get("qk_rope_head_dim", defaults.get("qk_rope_head_dim") or 0)
    if isinstance(defaults.get("mlp_only_layers"), list):
        kw["mlp_only_layers"] = [0]
    chosen, per_layer, index_lists = _layer_choice(defaults)
    layers = len(chosen) if chosen else 2
    for key in ("num_hidden_layers", "n_layer"):
        if key in keys:
            kw[key] = layers
    if chosen:
        notes.append(f"layers {chosen} of the default config")
        for key, value in per_layer.items():
            kw[key] = [value[i] for i in chosen]
        for key, value in index_lists.items():
            kw[key] = [chosen.index(i) for i in value if i in chosen]
        sparse = defaults.get("per_layer_config")
        if isinstance(sparse, dict) and sparse:
            remapped = {}
            for new, old in enumerate(chosen):
                for key in (f"{old:02d}", str(old)):
                    if key in sparse:
                        remapped[f"{new:02d}"] = {a: _scaled_like(a, v, defaults, kw) for a, v in sparse[key].items()}
                        break
            kw["per_layer_config"] = remapped
    types = kw.get("layer_types") or defaults.get("layer_types") or []
    if any("sliding" in str(t) for t in types) and "sliding_window" in keys and defaults.get("sliding_window") is None:
        kw["sliding_window"] = FIXED_SIZES["sliding_window"]
    rope = defaults.get("rope_parameters")
    if isinstance(rope, dict) and not _has_mrope(rope) and "layer_types" not in str(list(rope)):
        fallback = _mrope_default(config_cls)
        if fallback:
            rope = dict(rope, mrope_section=fallback)
    if isinstance(rope, dict) and _has_mrope(rope):
        if defaults.get("qk_rope_head_dim"):
            old = defaults["qk_rope_head_dim"]
            kw["qk_rope_head_dim"] = MROPE_HEAD_DIM
            if "qk_head_dim" in kw:
                kw["qk_head_dim"] = kw.get("qk_nope_head_dim", 0) + MROPE_HEAD_DIM
        else:
            old = defaults.get("head_dim") or (defaults.get("hidden_size", 0) // max(defaults.get("num_attention_heads", 1), 1))
            kw["head_dim"] = MROPE_HEAD_DIM
        kw["rope_parameters"] = _scaled_mrope(rope, MROPE_HEAD_DIM / old)
    rope = kw.get("rope_parameters", defaults.get("rope_parameters"))
    if isinstance(rope, dict) and "original_max_position_embeddings" in str(rope):
        # yarn / longrope scale from an original context the validator wants below the (tiny) maximum
        limit = FIXED_SIZES["max_position_embeddings"] // 2
        fixed = copy.deepcopy(dict(rope))
        for d in (fixed, *(v for v in fixed.values() if isinstance(v, dict))):
            if isinstance(d.get("original_max_position_embeddings"), int):
                d["original_max_position_embeddings"] = min(d["original_max_position_embeddings"], limit)
        kw["rope_parameters"] = fixed
    small = iter(range(1, VOCAB))
    for key, value in defaults.items():
        if key.endswith(("token_id", "token_index")) or (key.endswith("_id") and "token" in key):
            if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
                kw[key] = next(small)
            elif isinstance(value, list) and value and all(isinstance(x, int) for x in value) and max(value) >= VOCAB:
                kw[key] = [next(small) for _ in value]
    for key, sub in (getattr(config_cls, "sub_configs", None) or {}).items():
        if isinstance(sub, type) and key not in kw:
            try:
                kw[key], _ = tiny_kwargs(sub)
            except Exception as err:  # noqa: BLE001 - the sub-config keeps its defaults, said in the notes
                notes.append(f"{key}: not shrunk ({type(err).__name__}: {err})")
    for key, value in CONFIG_FIXES.get(config_cls.__name__, {}).items():
        kw[key] = copy.deepcopy(value)
    if config_cls.__name__ in FIX_NOTES:
        notes.append(FIX_NOTES[config_cls.__name__])
    return kw, notes


#: What a config fix leaves unchecked, said in the family's notes.
FIX_NOTES: dict[str, str] = {
    "Gemma3nTextConfig": "not checked: key/value states shared across layers (num_kv_shared_layers set to 0): a "
                         "module checked alone would get the shared states recorded from the dense model, with every "
                         "head, where the tp model shares its own sharded ones",
}


def _scaled_like(attr: str, value: Any, defaults: Mapping[str, Any], kw: Mapping[str, Any]) -> Any:
    if isinstance(value, int) and not isinstance(value, bool) and attr in kw and isinstance(defaults.get(attr), int) \
            and defaults[attr]:
        return max(1, round(kw[attr] * value / defaults[attr]))
    return value


def head_dim_of(config_cls: type, base: Mapping[str, Any]) -> tuple[int, bool]:
    """The head size of the tiny config, and whether the config sets it on its own (``head_dim``)
    rather than deriving it as ``hidden_size // num_attention_heads``."""
    if "head_dim" in base and isinstance(base["head_dim"], int):
        return base["head_dim"], True
    defaults = _defaults(config_cls)
    explicit = isinstance(defaults.get("head_dim"), int)
    return (base.get("head_dim") or HEAD_DIM), explicit


def config_for(config_cls: type, base: Mapping[str, Any], drawn: Mapping[str, int],
               switches: Mapping[str, Any]) -> Any:
    """The tiny config of ``config_cls``: ``base`` (:func:`tiny_kwargs`) with the ``drawn`` sizes set on
    every attribute the config has (:data:`DRAWN`; a per-layer list gets the value in every entry) and
    the ``switches`` (attribute -> value); validated by the family's own config class."""
    kw = copy.deepcopy(dict(base))
    defaults = _defaults(config_cls)
    if "heads" in drawn and "kv_heads" not in drawn:  # a multi-head (or latent) config: as many as heads
        drawn = {**drawn, "kv_heads": drawn["heads"]}
    for size, value in drawn.items():
        for attr in DRAWN.get(size, ()):
            if attr not in defaults:
                continue
            current = kw.get(attr, defaults[attr])
            if isinstance(current, list):
                kw[attr] = [value] * len(current)
            elif current is None and attr not in NONE_OK:
                continue
            else:
                kw[attr] = value
    kw.update(switches)
    return config_cls(**kw)
