"""A Llama decoder layer in vLLM's style, declared as a module variant and checked with no adapter code.

vLLM's conventions, written fresh: no layer takes a group — every one reads the module-global tp
coordinator of ``vllm_state`` (``get_tp_group()``, ``get_tensor_model_parallel_world_size()``, set
once per process by ``initialize_model_parallel``: the variant's builder does, as a worker's start-up
does); ``ColumnParallelLinear`` / ``RowParallelLinear`` return ``(output, output_bias)`` (the bias is
returned, not added, under ``skip_bias_add``; the row layer adds it on tp rank 0 only, before its
all-reduce, so that it is counted once); ``QKVParallelLinear`` packs Q, K and V and
``MergedColumnParallelLinear`` packs gate and up, each recording the full sizes of its parts in
``output_sizes``; ``SiluAndMul``; neox-style rotary embeddings (``rotate_half``) applied by a
``get_rope``-like module to ``(positions, query, key)``; tokens flattened to ``[num_tokens, hidden]``;
the layer's forward is ``(positions, hidden_states, residual) -> (hidden_states, residual)`` with
RMSNorm fusing the residual add. vLLM's layers are inference-only; these make the column layer's
input grad complete (an all-reduce in its backward) so that tpsim checks the backward as well.

Seeded bugs: ``row_bias_on_every_rank`` (``self_attn.o_proj: bias-duplication``: the ``tp_rank > 0``
test forgotten) and ``down_proj_not_reduced`` (``mlp.down_proj: missing-reduction``:
``reduce_results=False`` on a layer whose caller does not reduce).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import ModuleVariant

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import vllm_state  # noqa: E402 - beside this file
from vllm_state import (  # noqa: E402
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
    get_tp_group,
    tensor_model_parallel_all_reduce,
)


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return tensor_model_parallel_all_reduce(grad), None


class ColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, gather_output: bool = False,
                 skip_bias_add: bool = False, output_sizes: list[int] | None = None):
        super().__init__()
        if gather_output:
            raise NotImplementedError("gather_output=True (this example shards the output)")
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size, self.output_size = input_size, output_size
        self.output_size_per_partition = divide(output_size, self.tp_size)
        self.output_sizes = output_sizes if output_sizes is not None else [output_size]
        for size in self.output_sizes:
            divide(size, self.tp_size)
        self.skip_bias_add = skip_bias_add
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, input_size))
        nn.init.normal_(self.weight, std=input_size ** -0.5)
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        bias = None if self.skip_bias_add else self.bias
        output = F.linear(_CopyToTP.apply(input_), self.weight, bias)
        return output, (self.bias if self.skip_bias_add else None)


class MergedColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = True):
        super().__init__(input_size, sum(output_sizes), bias=bias, output_sizes=list(output_sizes))


class QKVParallelLinear(ColumnParallelLinear):
    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int,
                 bias: bool = True):
        tp_size = get_tensor_model_parallel_world_size()
        self.head_size = head_size
        self.num_heads = divide(total_num_heads, tp_size)
        self.num_kv_heads = divide(total_num_kv_heads, tp_size)
        output_sizes = [total_num_heads * head_size, total_num_kv_heads * head_size, total_num_kv_heads * head_size]
        super().__init__(hidden_size, sum(output_sizes), bias=bias, output_sizes=output_sizes)


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, input_is_parallel: bool = True,
                 skip_bias_add: bool = False, reduce_results: bool = True):
        super().__init__()
        if not input_is_parallel:
            raise NotImplementedError("input_is_parallel=False (this example takes the parallel input)")
        self.tp_rank = get_tensor_model_parallel_rank()
        self.tp_size = get_tensor_model_parallel_world_size()
        self.input_size_per_partition = divide(input_size, self.tp_size)
        self.skip_bias_add, self.reduce_results = skip_bias_add, reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, self.input_size_per_partition))
        nn.init.normal_(self.weight, std=input_size ** -0.5)
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None

    def forward(self, input_parallel: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        # Only rank 0 adds the bias, so that the all-reduce counts it once.
        bias_ = None if (self.tp_rank > 0 or self.skip_bias_add) else self.bias
        output_parallel = F.linear(input_parallel, self.weight, bias_)
        output = tensor_model_parallel_all_reduce(output_parallel) if self.reduce_results and self.tp_size > 1 \
            else output_parallel
        return output, (self.bias if self.skip_bias_add else None)


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:
            x = x + residual
            residual = x
        out = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * self.weight
        return out if residual is None else (out, residual)


class RotaryEmbedding(nn.Module):
    """Neox style: the first and second halves of each head are the pairs."""

    def __init__(self, head_size: int, base: float = 10000.0):
        super().__init__()
        self.head_size = head_size
        inv_freq = 1.0 / base ** (torch.arange(0, head_size, 2, dtype=torch.float64) / head_size)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor):
        """``query``/``key``: ``[num_tokens, heads * head_size]``."""
        freqs = torch.outer(positions.to(self.inv_freq.dtype), self.inv_freq)
        cos, sin = freqs.cos().to(query.dtype)[:, None, :], freqs.sin().to(query.dtype)[:, None, :]

        def rotate(x: torch.Tensor) -> torch.Tensor:
            x = x.unflatten(-1, (-1, self.head_size))
            x1, x2 = x.chunk(2, dim=-1)
            return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)

        return rotate(query), rotate(key)


def get_rope(head_size: int, base: float = 10000.0) -> RotaryEmbedding:
    return RotaryEmbedding(head_size, base)


class Attention(nn.Module):
    """The attention op: causal, grouped-query; ``q``/``k``/``v`` are ``[num_tokens, heads * head_size]``."""

    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int):
        super().__init__()
        self.num_heads, self.head_size, self.scale, self.num_kv_heads = num_heads, head_size, scale, num_kv_heads

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q = q.unflatten(-1, (self.num_heads, self.head_size)).transpose(0, 1)  # [heads, tokens, d]
        k = k.unflatten(-1, (self.num_kv_heads, self.head_size)).transpose(0, 1)
        v = v.unflatten(-1, (self.num_kv_heads, self.head_size)).transpose(0, 1)
        rep = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(rep, dim=0), v.repeat_interleave(rep, dim=0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale)
        return out.transpose(0, 1).flatten(-2)


class LlamaAttention(nn.Module):
    def __init__(self, hidden_size: int, num_heads: int, num_kv_heads: int, head_dim: int, bias: bool = False):
        super().__init__()
        tp_size = get_tp_group().world_size
        self.num_heads = divide(num_heads, tp_size)
        self.num_kv_heads = divide(num_kv_heads, tp_size)
        self.head_dim = head_dim
        self.q_size, self.kv_size = self.num_heads * head_dim, self.num_kv_heads * head_dim
        self.qkv_proj = QKVParallelLinear(hidden_size, head_dim, num_heads, num_kv_heads, bias=bias)
        self.o_proj = RowParallelLinear(num_heads * head_dim, hidden_size, bias=bias)
        self.rotary_emb = get_rope(head_dim)
        self.attn = Attention(self.num_heads, head_dim, head_dim ** -0.5, num_kv_heads=self.num_kv_heads)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
        qkv, _ = self.qkv_proj(hidden_states)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.rotary_emb(positions, q, k)
        output, _ = self.o_proj(self.attn(q, k, v))
        return output


class LlamaMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=bias)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias=bias, reduce_results=reduce_results)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        x, _ = self.down_proj(self.act_fn(gate_up))
        return x


class LlamaDecoderLayer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_kv_heads: int, *, heads_per_kv: int = 2,
                 head_dim: int = 4, bias: bool = False, reduce_results: bool = True):
        super().__init__()
        divide(intermediate_size, get_tensor_model_parallel_world_size())
        self.self_attn = LlamaAttention(hidden_size, num_kv_heads * heads_per_kv, num_kv_heads, head_dim, bias=bias)
        self.mlp = LlamaMLP(hidden_size, intermediate_size, reduce_results=reduce_results)
        self.input_layernorm = RMSNorm(hidden_size)
        self.post_attention_layernorm = RMSNorm(hidden_size)

    def forward(self, positions: torch.Tensor, hidden_states: torch.Tensor,
                residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        hidden_states = self.self_attn(positions, hidden_states)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


# --- seeded bugs ------------------------------------------------------------------------------------


class _RowBiasOnEveryRank(RowParallelLinear):
    def forward(self, input_parallel):
        bias_ = None if self.skip_bias_add else self.bias  # the seeded bug: the tp_rank > 0 test forgotten
        return tensor_model_parallel_all_reduce(F.linear(input_parallel, self.weight, bias_)), None


class RowBiasOnEveryRank(LlamaDecoderLayer):
    """Attention with biases (as Qwen2's qkv), whose ``o_proj`` adds its bias on every rank before the all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_kv_heads: int):
        super().__init__(hidden_size, intermediate_size, num_kv_heads, bias=True)
        self.self_attn.o_proj.__class__ = _RowBiasOnEveryRank


class DownProjNotReduced(LlamaDecoderLayer):
    """The MLP's ``down_proj`` built with ``reduce_results=False`` (as for a caller that reduces), and no caller does."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_kv_heads: int):
        super().__init__(hidden_size, intermediate_size, num_kv_heads, reduce_results=False)


# --- the variants ----------------------------------------------------------------------------------


def run_layer(layer: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """A one-layer model: positions ``0..num_tokens-1``; the layer's output plus its residual."""
    positions = torch.arange(hidden_states.shape[0], device=hidden_states.device)
    out, residual = layer(positions, hidden_states, None)
    return out + residual


def _variant(cls: type, name: str) -> ModuleVariant:
    def build(hidden_size: int, intermediate_size: int, num_kv_heads: int, *, group, dtype) -> nn.Module:
        vllm_state.initialize_model_parallel(group)  # a worker's start-up, once per process
        return cls(hidden_size, intermediate_size, num_kv_heads).to(dtype)

    return ModuleVariant(name=name, build=build, sizes=("hidden_size", "intermediate_size", "num_kv_heads"),
                         forward=run_layer, rank_local=("vllm_state",), min_batch_dims=1, max_batch_dims=1,
                         description=f"vLLM-style {cls.__name__}(hidden_size, intermediate_size, num_kv_heads)")


decoder_layer = _variant(LlamaDecoderLayer, "decoder_layer")
row_bias_on_every_rank = _variant(RowBiasOnEveryRank, "row_bias_on_every_rank")
down_proj_not_reduced = _variant(DownProjNotReduced, "down_proj_not_reduced")

#: What ``tpsim check tests/wild/vllm_block.py --kind module`` checks (``FILE:decoder_layer``: one of them).
TPSIM_MODULES = [decoder_layer, row_bias_on_every_rank, down_proj_not_reduced]
