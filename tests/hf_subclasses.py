"""Subclasses of Hugging Face's Llama MLP, attention and decoder layer, as a patch or a fork writes them: checked with the
transformers preset under Llama's tp plan (``tpsim check tests/hf_subclasses.py:NAME``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP


class PatchedLlamaMLP(LlamaMLP):
    """A correct patch: the down projection gets a bias (rowwise adds it once, after the reduction)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=True)


class WrongPlanLlamaMLP(PatchedLlamaMLP):
    """Bug: the subclass plans its down projection column-parallel."""

    tp_plan = {"down_proj": "colwise"}


class _LocalKernelLinear(nn.Linear):
    """A linear layer with a local kernel (as quantized or fused kernels are written): it runs on the
    local pieces of DTensor inputs and parameters, bias included."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        def local(t):
            return t.to_local() if hasattr(t, "to_local") else t

        return F.linear(local(x), local(self.weight), local(self.bias))


class BiasTwiceLlamaMLP(LlamaMLP):
    """Bug: the down projection's local kernel adds the (replicated) bias on every rank; the rowwise
    style then sums the ranks' outputs, so the bias is added tp times."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.down_proj = _LocalKernelLinear(config.intermediate_size, config.hidden_size, bias=True)


class WrongPlanLlamaAttention(LlamaAttention):
    """Bug: the subclass plans the output projection column-parallel, like q/k/v."""

    tp_plan = {"o_proj": "colwise"}


class BiasTwiceLlamaDecoderLayer(LlamaDecoderLayer):
    """Bug: inside the decoder layer, the MLP's down projection is a local kernel with a bias that every
    rank adds before the rowwise reduction."""

    def __init__(self, config, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        self.mlp.down_proj = _LocalKernelLinear(config.intermediate_size, config.hidden_size, bias=True)


# --- seeded defects in other families: one plan rule changed, as a patch of the family's module would ---

from transformers.models.gemma3.modeling_gemma3 import Gemma3MLP  # noqa: E402
from transformers.models.mistral.modeling_mistral import MistralAttention  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock  # noqa: E402
from transformers.models.qwen2.modeling_qwen2 import Qwen2MLP  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock  # noqa: E402


class WrongPlanQwen2MLP(Qwen2MLP):
    """Bug: the down projection planned column-parallel (rowwise turned colwise)."""

    tp_plan = {"down_proj": "colwise"}


class WrongPlanMistralAttention(MistralAttention):
    """Bug: the output projection planned column-parallel (rowwise turned colwise)."""

    tp_plan = {"o_proj": "colwise"}


class WrongPlanGemma3MLP(Gemma3MLP):
    """Bug: the down projection planned column-parallel (rowwise turned colwise)."""

    tp_plan = {"down_proj": "colwise"}


class LocalExpertsQwen3MoeBlock(Qwen3MoeSparseMoeBlock):
    """Bug: the experts run on their local shards with no reduction (``local_params`` in place of
    ``moe_tp_experts``): each rank's output is its partial sum."""

    tp_plan = {"experts": "local_params"}


class WrongPlanMixtralMoeBlock(MixtralSparseMoeBlock):
    """Bug: the experts' down projection planned column-parallel (rowwise turned colwise)."""

    tp_plan = {"experts.down_proj": "colwise"}


from transformers.models.glm.modeling_glm import GlmMLP  # noqa: E402


class GatherDroppedGlmMLP(GlmMLP):
    """Bug: the packed gate/up projection planned plain column-parallel (its gather dropped: ``colwise`` in place
    of ``colwise_gather_output``), so the ``chunk`` that splits gate from up splits each rank's shard instead."""

    tp_plan = {"gate_up_proj": "colwise"}
