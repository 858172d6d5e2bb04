"""A Llama decoder layer in nanotron's style, checked with ``--kind module`` and no adapter code.

nanotron's conventions, written fresh: the tp group is passed as ``pg`` (``pg.size()``, ``pg.rank()``);
``TensorParallelColumnLinear`` / ``TensorParallelRowLinear`` take a ``mode``
(``TensorParallelLinearMode.ALL_REDUCE``: the column layer's input is an identity whose grad is
all-reduced, the row layer all-reduces its output) and a column layer packing several outputs says
so with ``contiguous_chunks`` (the full sizes of its chunks, each sharded on its own); the fused
``qkv_proj`` and ``gate_up_proj``; rotary embeddings on interleaved pairs; hidden states
``[seq, batch, hidden]``; attributes ``input_layernorm``, ``attn``, ``post_attention_layernorm``,
``mlp``.

``NanotronLlamaLayer(hidden_size, intermediate_size, num_key_value_heads, *, pg, ...)``: the sizes are
what tpsim draws; ``llama_layer`` declares its 3-D input. Seeded bug: ``o_proj_bias_before_all_reduce``
(``attn.o_proj: bias-duplication``).
"""

from __future__ import annotations

import enum
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import module_from_class


class TensorParallelLinearMode(enum.Enum):
    ALL_REDUCE = enum.auto()
    REDUCE_SCATTER = enum.auto()


class DifferentiableIdentity(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce over ``pg``."""

    @staticmethod
    def forward(ctx, tensor, pg):
        ctx.pg = pg
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        grad_output = grad_output.contiguous().clone()
        dist.all_reduce(grad_output, op=dist.ReduceOp.SUM, group=ctx.pg)
        return grad_output, None


class DifferentiableAllReduceSum(torch.autograd.Function):
    """Forward: all-reduce over ``pg``. Backward: identity."""

    @staticmethod
    def forward(ctx, tensor, pg):
        tensor = tensor.contiguous().clone()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=pg)
        return tensor

    @staticmethod
    def backward(ctx, grad_output):
        return grad_output, None


def differentiable_identity(tensor, pg):
    return DifferentiableIdentity.apply(tensor, pg)


def differentiable_all_reduce_sum(tensor, pg):
    return DifferentiableAllReduceSum.apply(tensor, pg)


def _split(size: int, pg, what: str) -> int:
    if size % pg.size():
        raise ValueError(f"{what}={size} must be divisible by the tp size {pg.size()}")
    return size // pg.size()


class TensorParallelColumnLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, pg, mode: TensorParallelLinearMode, bias: bool = True,
                 async_communication: bool = False, contiguous_chunks: tuple[int, ...] | None = None):
        super().__init__()
        if mode is not TensorParallelLinearMode.ALL_REDUCE:
            raise NotImplementedError(f"mode={mode} (this example implements ALL_REDUCE)")
        self.pg, self.mode, self.async_communication = pg, mode, async_communication
        if contiguous_chunks is not None:
            if sum(contiguous_chunks) != out_features:
                raise ValueError(f"contiguous_chunks={contiguous_chunks} must add up to out_features={out_features}")
            for chunk in contiguous_chunks:
                _split(chunk, pg, "a contiguous chunk of out_features")
        self.contiguous_chunks = contiguous_chunks
        local = _split(out_features, pg, "out_features")
        self.weight = nn.Parameter(torch.empty(local, in_features))
        self.bias = nn.Parameter(torch.zeros(local)) if bias else None
        nn.init.uniform_(self.weight, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(differentiable_identity(x, self.pg), self.weight, self.bias)


class TensorParallelRowLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, pg, mode: TensorParallelLinearMode, bias: bool = True,
                 async_communication: bool = False):
        super().__init__()
        if mode is not TensorParallelLinearMode.ALL_REDUCE:
            raise NotImplementedError(f"mode={mode} (this example implements ALL_REDUCE)")
        self.pg, self.mode = pg, mode
        self.weight = nn.Parameter(torch.empty(out_features, _split(in_features, pg, "in_features")))
        self.bias = nn.Parameter(torch.zeros(out_features)) if bias else None
        nn.init.uniform_(self.weight, -1 / math.sqrt(in_features), 1 / math.sqrt(in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = differentiable_all_reduce_sum(F.linear(x, self.weight), self.pg)
        return out if self.bias is None else out + self.bias


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        variance = x.pow(2).mean(-1, keepdim=True)
        return self.weight * (x * torch.rsqrt(variance + self.eps))


class RotaryEmbedding(nn.Module):
    """Rotates interleaved pairs ``(x[2i], x[2i+1])`` by ``position * theta**(-2i/d)``."""

    def __init__(self, dim: int, base: float = 10000.0):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim),
                             persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """``x``: ``[batch, seq, heads, d]``; ``position_ids``: ``[seq]``."""
        freqs = torch.outer(position_ids.to(self.inv_freq.dtype), self.inv_freq).to(x.dtype)  # [seq, d/2]
        cos, sin = freqs.cos()[:, None, :], freqs.sin()[:, None, :]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class CausalSelfAttention(nn.Module):
    def __init__(self, hidden_size: int, num_key_value_heads: int, *, pg, mode: TensorParallelLinearMode,
                 n_q_per_kv: int = 2, d_qk: int = 4, bias: bool = False, row_linear=TensorParallelRowLinear):
        super().__init__()
        self.n_local_kv_heads = _split(num_key_value_heads, pg, "num_key_value_heads")
        self.n_local_q_heads = self.n_local_kv_heads * n_q_per_kv
        self.n_repeats, self.d_qk = n_q_per_kv, d_qk
        q_size, kv_size = num_key_value_heads * n_q_per_kv * d_qk, num_key_value_heads * d_qk
        self.qkv_proj = TensorParallelColumnLinear(hidden_size, q_size + 2 * kv_size, pg=pg, mode=mode, bias=bias,
                                                   contiguous_chunks=(q_size, kv_size, kv_size))
        self.rotary_embedding = RotaryEmbedding(d_qk)
        self.o_proj = row_linear(q_size, hidden_size, pg=pg, mode=mode, bias=bias)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        seq, batch = hidden_states.shape[:2]
        qkv = self.qkv_proj(hidden_states).transpose(0, 1)  # [batch, seq, local q + 2 local kv]
        d = self.d_qk
        q, k, v = torch.split(qkv, (self.n_local_q_heads * d, self.n_local_kv_heads * d, self.n_local_kv_heads * d),
                              dim=-1)
        q = q.reshape(batch, seq, self.n_local_q_heads, d)
        k = k.reshape(batch, seq, self.n_local_kv_heads, d)
        v = v.reshape(batch, seq, self.n_local_kv_heads, d)
        position_ids = torch.arange(seq, device=hidden_states.device)
        q, k = self.rotary_embedding(q, position_ids), self.rotary_embedding(k, position_ids)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [batch, heads, seq, d]
        k = k.repeat_interleave(self.n_repeats, dim=1)
        v = v.repeat_interleave(self.n_repeats, dim=1)
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        attn = attn.transpose(1, 2).reshape(batch, seq, -1).transpose(0, 1)  # [seq, batch, local q]
        return self.o_proj(attn)


class GLUActivation(nn.Module):
    def forward(self, merged_states: torch.Tensor) -> torch.Tensor:
        gate_states, up_states = torch.split(merged_states, merged_states.shape[-1] // 2, dim=-1)
        return F.silu(gate_states) * up_states


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, *, pg, mode: TensorParallelLinearMode):
        super().__init__()
        self.gate_up_proj = TensorParallelColumnLinear(hidden_size, 2 * intermediate_size, pg=pg, mode=mode, bias=False,
                                                       contiguous_chunks=(intermediate_size, intermediate_size))
        self.down_proj = TensorParallelRowLinear(intermediate_size, hidden_size, pg=pg, mode=mode, bias=False)
        self.split_silu_mul = GLUActivation()

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.split_silu_mul(self.gate_up_proj(hidden_states)))


class NanotronLlamaLayer(nn.Module):
    """One decoder layer; hidden states ``[seq, batch, hidden]``."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_key_value_heads: int, *, pg,
                 mode: TensorParallelLinearMode = TensorParallelLinearMode.ALL_REDUCE, attention_bias: bool = False,
                 row_linear=TensorParallelRowLinear):
        super().__init__()
        _split(intermediate_size, pg, "intermediate_size")
        self.input_layernorm = RMSNorm(hidden_size)
        self.attn = CausalSelfAttention(hidden_size, num_key_value_heads, pg=pg, mode=mode, bias=attention_bias,
                                        row_linear=row_linear)
        self.post_attention_layernorm = RMSNorm(hidden_size)
        self.mlp = MLP(hidden_size, intermediate_size, pg=pg, mode=mode)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.attn(self.input_layernorm(hidden_states)) + residual
        residual = hidden_states
        return self.mlp(self.post_attention_layernorm(hidden_states)) + residual


# --- a seeded bug ----------------------------------------------------------------------------------


class _RowBiasBeforeAllReduce(TensorParallelRowLinear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return differentiable_all_reduce_sum(F.linear(x, self.weight, self.bias), self.pg)  # the bias on every rank


class OProjBiasBeforeAllReduce(NanotronLlamaLayer):
    """Attention with biases whose ``o_proj`` adds its full bias on every rank before the all-reduce."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_key_value_heads: int, *, pg):
        super().__init__(hidden_size, intermediate_size, num_key_value_heads, pg=pg, attention_bias=True,
                         row_linear=_RowBiasBeforeAllReduce)


def _layer(cls: type, name: str):
    # nanotron's hidden states are [seq, batch, hidden]: exactly two leading dims.
    return module_from_class(cls, name=name).replace(min_batch_dims=2, max_batch_dims=2)


llama_layer = _layer(NanotronLlamaLayer, "llama_layer")
o_proj_bias_before_all_reduce = _layer(OProjBiasBeforeAllReduce, "o_proj_bias_before_all_reduce")

#: What ``tpsim check tests/wild/nanotron_block.py --kind module`` checks (``FILE:llama_layer``: one of them).
TPSIM_MODULES = [llama_layer, o_proj_bias_before_all_reduce]
