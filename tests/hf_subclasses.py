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
