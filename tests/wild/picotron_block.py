"""A Llama decoder layer in picotron's style, declared as a module variant and checked with no adapter code.

picotron's conventions, written fresh: the tp group, size and rank come from the module-global
manager of ``picotron_state`` (``pgm.process_group_manager``, set once per process: the variant's
builder does, as the training script's set-up does); the model is written dense, from a config, and
tensor parallelism replaces its ``nn.Linear`` layers by ``ColumnParallelLinear`` (q, k, v, gate, up:
``gather_output=False``) and ``RowParallelLinear`` (out, down) built from the dense weights' shapes
(``apply_tensor_parallel``); the attention splits its heads with the per-rank counts
(``num_local_heads``, ``num_local_kv_heads``); rotary embeddings by ``apply_rotary_pos_emb(x, cos, sin)``
(``rotate_half``); separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``.

Seeded bugs: ``down_proj_not_reduced`` (``mlp.down_proj: missing-reduction``) and ``kv_repeat_tiled``
(``attention: qkv-head-mismatch``: ``repeat`` instead of ``repeat_interleave`` for the key/value heads).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import ModuleVariant

_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import picotron_state as pgm  # noqa: E402 - beside this file

# --- tp_communications ---------------------------------------------------------------------------------


class Copy(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce over the tp group."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad_output):
        if pgm.process_group_manager.tp_world_size == 1:
            return grad_output
        grad_output = grad_output.contiguous().clone()
        dist.all_reduce(grad_output, op=dist.ReduceOp.SUM, group=pgm.process_group_manager.tp_group)
        return grad_output


class Reduce(torch.autograd.Function):
    """Forward: all-reduce over the tp group. Backward: identity."""

    @staticmethod
    def forward(ctx, x):
        if pgm.process_group_manager.tp_world_size == 1:
            return x
        x = x.contiguous().clone()
        dist.all_reduce(x, op=dist.ReduceOp.SUM, group=pgm.process_group_manager.tp_group)
        return x

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output


# --- tensor_parallel -------------------------------------------------------------------------------


class ColumnParallelLinear(nn.Module):
    """``Y = X Wᵀ``, ``W`` ``[out, in]`` split by output features."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, gather_output: bool = False):
        super().__init__()
        self.tp_world_size = pgm.process_group_manager.tp_world_size
        self.tp_rank = pgm.process_group_manager.tp_rank
        if out_features % self.tp_world_size:
            raise ValueError(f"out_features={out_features} is not divisible by the tp world size {self.tp_world_size}")
        if gather_output:
            raise NotImplementedError("gather_output=True (this example keeps the output sharded)")
        self.output_size_per_partition = out_features // self.tp_world_size
        self.weight = nn.Parameter(torch.empty(self.output_size_per_partition, in_features))
        self.bias = nn.Parameter(torch.zeros(self.output_size_per_partition)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(Copy.apply(x), self.weight, self.bias)  # [batch, seq, out/tp]


class RowParallelLinear(nn.Module):
    """``Y = X Wᵀ + b``, ``W`` ``[out, in]`` split by input features; the input is already split."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.tp_world_size = pgm.process_group_manager.tp_world_size
        if in_features % self.tp_world_size:
            raise ValueError(f"in_features={in_features} is not divisible by the tp world size {self.tp_world_size}")
        self.input_size_per_partition = in_features // self.tp_world_size
        self.weight = nn.Parameter(torch.empty(out_features, self.input_size_per_partition))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.kaiming_uniform_(self.weight, a=5 ** 0.5)

    def reduce(self, output_parallel: torch.Tensor) -> torch.Tensor:
        return Reduce.apply(output_parallel)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.reduce(F.linear(x, self.weight))  # [batch, seq, out]
        return output if self.bias is None else output + self.bias


def apply_tensor_parallel(model: nn.Module, row_linear: type = RowParallelLinear,
                          down_proj: type | None = None) -> nn.Module:
    """Replace the dense linears of every decoder layer by their tensor-parallel counterparts
    (``down_proj``: another row class for the MLP's down projection)."""
    columnwise = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
    rowwise = ("out_proj", "down_proj")
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            bias = child.bias is not None
            if name in columnwise:
                setattr(parent, name, ColumnParallelLinear(child.in_features, child.out_features, bias=bias))
            elif name in rowwise:
                cls = down_proj if name == "down_proj" and down_proj is not None else row_linear
                setattr(parent, name, cls(child.in_features, child.out_features, bias=bias))
    return model


# --- the model ---------------------------------------------------------------------------------------


@dataclass
class LlamaConfig:
    hidden_size: int
    intermediate_size: int
    num_key_value_heads: int
    num_attention_heads: int
    head_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0


def get_cos_sin(seq_length: int, head_dim: int, base: float = 10000.0, dtype: torch.dtype = torch.float32):
    theta = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    position = torch.arange(seq_length, dtype=torch.float64)[:, None]
    angles = (position * theta[None, :]).repeat(1, 2)  # [seq, head_dim]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x``: ``[batch, heads, seq, head_dim]``."""
    return x * cos + rotate_half(x) * sin


class TritonRMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        return self.weight * hidden_states * torch.rsqrt(variance + self.eps)


class Attention(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.num_key_values = config.num_key_value_heads
        self.head_dim = config.head_dim
        tp = pgm.process_group_manager.tp_world_size
        if self.num_key_values % tp:
            raise ValueError(f"num_key_value_heads={self.num_key_values} is not divisible by the tp world size {tp}")
        self.num_local_heads = self.num_heads // tp
        self.num_local_kv_heads = self.num_key_values // tp
        self.q_proj = nn.Linear(self.hidden_size, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(self.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.v_proj = nn.Linear(self.hidden_size, self.num_key_values * self.head_dim, bias=False)
        self.out_proj = nn.Linear(self.num_heads * self.head_dim, self.hidden_size, bias=False)

    def repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat_interleave(self.num_local_heads // self.num_local_kv_heads, dim=1)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch_size, seq_length, _ = x.size()
        q = self.q_proj(x).view(batch_size, seq_length, self.num_local_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(batch_size, seq_length, self.num_local_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, cos, sin), apply_rotary_pos_emb(k, cos, sin)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # [batch, local heads, seq, head_dim]
        out = out.transpose(1, 2).reshape(batch_size, seq_length, self.num_local_heads * self.head_dim)
        return self.out_proj(out)


class MLP(nn.Module):
    def __init__(self, config: LlamaConfig):
        super().__init__()
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, config: LlamaConfig, attention: type = Attention):
        super().__init__()
        self.input_layernorm = TritonRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = TritonRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention = attention(config)
        self.mlp = MLP(config)
        self.head_dim, self.rope_theta = config.head_dim, config.rope_theta

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cos, sin = get_cos_sin(x.shape[1], self.head_dim, self.rope_theta, dtype=x.dtype)
        x = x + self.attention(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


# --- seeded bugs ------------------------------------------------------------------------------------


class _RowNoReduce(RowParallelLinear):
    def reduce(self, output_parallel: torch.Tensor) -> torch.Tensor:
        return output_parallel  # the seeded bug: no all-reduce


class _TiledAttention(Attention):
    def repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        return t.repeat(1, self.num_local_heads // self.num_local_kv_heads, 1, 1)  # the seeded bug: tiles the heads


# --- the variants ----------------------------------------------------------------------------------


def _variant(name: str, attention: type = Attention, down_proj: type | None = None) -> ModuleVariant:
    def build(hidden_size: int, intermediate_size: int, num_key_value_heads: int, *, group, dtype) -> nn.Module:
        pgm.setup(group)  # the training script's set-up, once per process
        config = LlamaConfig(hidden_size, intermediate_size, num_key_value_heads, 2 * num_key_value_heads)
        return apply_tensor_parallel(DecoderLayer(config, attention), down_proj=down_proj).to(dtype)

    return ModuleVariant(name=name, build=build, sizes=("hidden_size", "intermediate_size", "num_key_value_heads"),
                         rank_local=("picotron_state",), min_batch_dims=2, max_batch_dims=2,
                         description=f"picotron-style {name}: DecoderLayer(LlamaConfig(...)) under apply_tensor_parallel")


decoder_layer = _variant("decoder_layer")
down_proj_not_reduced = _variant("down_proj_not_reduced", down_proj=_RowNoReduce)
kv_repeat_tiled = _variant("kv_repeat_tiled", attention=_TiledAttention)

#: What ``tpsim check tests/wild/picotron_block.py --kind module`` checks (``FILE:decoder_layer``: one of them).
TPSIM_MODULES = [decoder_layer, down_proj_not_reduced, kv_repeat_tiled]
