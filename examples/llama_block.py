"""A Llama-style decoder block in the "group" convention (Megatron style), written for tpsim to check.

``x -> x + self_attn(input_layernorm(x)) -> h + mlp(post_attention_layernorm(h))``:

- ``RMSNorm``: replicated weight; under sequence parallelism each rank normalises its own slice of
  the sequence, so its weight grad is a per-rank summand: the weight carries Megatron's
  ``sequence_parallel = True`` marker and the trainer sums it over the tp group (tpsim does, as
  Megatron's ``finalize_model_grads``);
- ``Attention``: grouped-query attention (``kv_heads`` key/value heads, ``q_per_kv`` query heads
  each) with rotary position embeddings, in the real form (``rotate_half``) or the complex form
  (``view_as_complex`` times ``exp(i θ)``); Q, K and V packed in one column-parallel ``qkv_proj``
  whose three parts are each sharded by heads; the causal softmax by
  ``scaled_dot_product_attention``; the row-parallel ``o_proj``;
- ``MLP``: SwiGLU with a packed column-parallel ``gate_up_proj`` (gate and up each sharded) and a
  row-parallel ``down_proj``;
- the linear layers return ``(output, bias)`` as Megatron's do (the bias is ``None`` unless
  ``skip_bias_add``); with ``sequence_parallel=True`` the column layers all-gather the sequence
  before their matmul and the row layers reduce-scatter it after.

The constructor is ``LlamaBlock(hidden, ffn, kv_heads, *, q_per_kv=2, head_dim=4, ...,
process_group=None)``: its required ints are the sizes tpsim draws (multiples of the tp size, so
``kv_heads`` is too), the input is ``[..., seq, hidden]`` (``sequence_first=True``:
``[seq, ..., hidden]``, Megatron's layout). A size that the tp size does not divide (``ffn``,
``kv_heads``) is refused on every rank with a ValueError naming it; ``hidden`` is not sharded.

Check it::

    tpsim check examples/llama_block.py:LlamaBlock --kind module
    tpsim check examples/llama_block.py --kind module     # every variant of TPSIM_MODULES below

Seeded bugs for it are in ``examples/llama_block_bugs.py``.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import ModuleVariant, module_from_class

# --- the tp region: autograd-aware collectives over an explicit group --------------------------------


def _partition(size: int, group, name: str) -> int:
    # A ValueError on every rank, before any collective: a size the tp size does not divide.
    tp = dist.get_world_size(group)
    if size % tp:
        raise ValueError(f"{name}={size} is not divisible by the tensor-parallel size {tp}")
    return size // tp


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    tp = dist.get_world_size(group)
    x = x.contiguous()
    dist.all_reduce(x, group=group)
    return x.chunk(tp, dim=dim)[dist.get_rank(group)].contiguous()


class _Copy(torch.autograd.Function):
    """Forward: identity. Backward: all-reduce (every rank's input grad is a summand)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _Reduce(torch.autograd.Function):
    """Forward: all-reduce of the partial outputs. Backward: identity."""

    @staticmethod
    def forward(ctx, x, group):
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherSequence(torch.autograd.Function):
    """Sequence parallelism: forward all-gather along the sequence dim, backward reduce-scatter."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.dim, ctx.group), None, None


class _ScatterSequence(torch.autograd.Function):
    """Sequence parallelism: forward reduce-scatter along the sequence dim, backward all-gather."""

    @staticmethod
    def forward(ctx, x, dim, group):
        ctx.dim, ctx.group = dim, group
        return _reduce_scatter(x, dim, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.dim, ctx.group), None, None


# --- layers ------------------------------------------------------------------------------------------


def _init(weight: torch.Tensor, fan_in: int) -> None:
    bound = 1 / math.sqrt(fan_in)
    nn.init.uniform_(weight, -bound, bound)


class ColumnParallelLinear(nn.Module):
    """``Y = X Aᵀ + b``, ``A`` split by output features (weight ``[out/tp, in]``). ``parts``: the full
    sizes of packed parts (Q/K/V, gate/up), each sharded on its own: the rank's rows are its shard
    of every part, in order (the attribute tells a loader, and tpsim, how to shard it)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, parts: tuple[int, ...] | None = None,
                 sequence_parallel: bool = False, sequence_dim: int = 0, process_group=None):
        super().__init__()
        self.group = dist.group.WORLD if process_group is None else process_group
        if parts is not None:
            for i, p in enumerate(parts):
                _partition(p, self.group, f"packed part {i} of output_size")
            self.parts = tuple(parts)
        per_rank = _partition(output_size, self.group, "output_size")
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = nn.Parameter(torch.empty(per_rank, input_size))
        _init(self.weight, input_size)
        self.bias = nn.Parameter(torch.zeros(per_rank)) if bias else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.sequence_parallel:
            x = _GatherSequence.apply(x, self.sequence_dim, self.group)
        else:
            x = _Copy.apply(x, self.group)
        return F.linear(x, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    """``Y = X Aᵀ + b``, ``A`` split by input features (weight ``[out, in/tp]``); the input is already
    parallel; the bias is added once, after the reduction (or returned under ``skip_bias_add``)."""

    def __init__(self, input_size: int, output_size: int, *, bias: bool = False, skip_bias_add: bool = False,
                 sequence_parallel: bool = False, sequence_dim: int = 0, process_group=None):
        super().__init__()
        self.group = dist.group.WORLD if process_group is None else process_group
        per_rank = _partition(input_size, self.group, "input_size")
        self.skip_bias_add = skip_bias_add
        self.sequence_parallel, self.sequence_dim = sequence_parallel, sequence_dim
        self.weight = nn.Parameter(torch.empty(output_size, per_rank))
        _init(self.weight, input_size)
        self.bias = nn.Parameter(torch.zeros(output_size)) if bias else None
        if self.bias is not None and sequence_parallel:
            self.bias.sequence_parallel = True  # each rank adds it to its own slice of the sequence

    def reduce(self, partial: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            return _ScatterSequence.apply(partial, self.sequence_dim, self.group)
        return _Reduce.apply(partial, self.group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        y = self.reduce(F.linear(x, self.weight))
        if self.bias is None or self.skip_bias_add:
            return y, self.bias
        return y + self.bias, None


class RMSNorm(nn.Module):
    """``x / rms(x) * weight``, written out as Llama's is (computed in float32, cast back)."""

    def __init__(self, hidden: int, *, eps: float = 1e-6, sequence_parallel: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden))
        if sequence_parallel:
            self.weight.sequence_parallel = True  # its grad is a per-rank summand: the trainer sums it

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class Attention(nn.Module):
    """Grouped-query attention with rotary embeddings (see the module docstring)."""

    def __init__(self, hidden: int, kv_heads: int, *, q_per_kv: int = 2, head_dim: int = 4, rope_theta: float = 10000.0,
                 rotary: str = "real", bias: bool = False, sequence_parallel: bool = False, sequence_first: bool = False,
                 process_group=None):
        super().__init__()
        if rotary not in ("real", "complex"):
            raise ValueError(f"rotary={rotary!r}; expected 'real' or 'complex'")
        if head_dim % 2:
            raise ValueError(f"head_dim={head_dim} must be even for rotary embeddings")
        self.group = dist.group.WORLD if process_group is None else process_group
        tp = dist.get_world_size(self.group)
        self.kv_local = _partition(kv_heads, self.group, "kv_heads")
        self.heads_local = self.kv_local * q_per_kv
        self.q_per_kv, self.head_dim, self.rotary = q_per_kv, head_dim, rotary
        self.sequence_first = sequence_first
        seq_dim = 0 if sequence_first else -2
        q, kv = kv_heads * q_per_kv * head_dim, kv_heads * head_dim
        self.qkv_proj = ColumnParallelLinear(hidden, q + 2 * kv, bias=bias, parts=(q, kv, kv),
                                             sequence_parallel=sequence_parallel, sequence_dim=seq_dim,
                                             process_group=self.group)
        self.o_proj = RowParallelLinear(q, hidden, bias=bias, sequence_parallel=sequence_parallel, sequence_dim=seq_dim,
                                        process_group=self.group)
        inv_freq = 1.0 / rope_theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        del tp

    def rope(self, t: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``t``: ``[B, heads, s, head_dim]``."""
        angles = torch.outer(positions.float(), self.inv_freq.float())  # [s, head_dim/2]
        if self.rotary == "complex":
            pairs = t.float().reshape(*t.shape[:-1], -1, 2)
            rotated = torch.view_as_complex(pairs.contiguous()) * torch.polar(torch.ones_like(angles), angles)
            return torch.view_as_real(rotated).flatten(-2).type_as(t)
        emb = torch.cat((angles, angles), dim=-1)
        return (t * emb.cos().to(t.dtype)) + (_rotate_half(t) * emb.sin().to(t.dtype))

    def repeat_kv(self, t: torch.Tensor) -> torch.Tensor:
        """``[B, kv, s, d] -> [B, kv * q_per_kv, s, d]``: each key/value head once for every query head of
        its group (query heads ``j * q_per_kv`` to ``(j + 1) * q_per_kv`` use key/value head ``j``)."""
        return t.repeat_interleave(self.q_per_kv, dim=1)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        qkv, _ = self.qkv_proj(x)
        single = qkv.dim() == 1  # one token, no sequence dim
        if single:
            qkv = qkv.unsqueeze(0)
        elif self.sequence_first:
            qkv = qkv.movedim(0, -2)  # [..., s, features]
        lead, s = qkv.shape[:-2], qkv.shape[-2]
        qkv = qkv.reshape(-1, s, qkv.shape[-1])
        hd = self.head_dim
        q, k, v = qkv.split((self.heads_local * hd, self.kv_local * hd, self.kv_local * hd), dim=-1)
        q = q.unflatten(-1, (self.heads_local, hd)).transpose(1, 2)
        k = k.unflatten(-1, (self.kv_local, hd)).transpose(1, 2)
        v = v.unflatten(-1, (self.kv_local, hd)).transpose(1, 2)
        positions = torch.arange(s, device=x.device)
        q, k = self.rope(q, positions), self.rope(k, positions)
        k, v = self.repeat_kv(k), self.repeat_kv(v)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out = out.transpose(1, 2).flatten(-2).reshape(*lead, s, -1)
        if single:
            out = out.squeeze(0)
        elif self.sequence_first:
            out = out.movedim(-2, 0)
        return self.o_proj(out)


class MLP(nn.Module):
    """SwiGLU: ``down(silu(gate(x)) * up(x))`` with gate and up packed in one column layer."""

    def __init__(self, hidden: int, ffn: int, *, bias: bool = False, sequence_parallel: bool = False,
                 sequence_first: bool = False, process_group=None):
        super().__init__()
        group = dist.group.WORLD if process_group is None else process_group
        seq_dim = 0 if sequence_first else -2
        self.gate_up_proj = ColumnParallelLinear(hidden, 2 * ffn, bias=bias, parts=(ffn, ffn),
                                                 sequence_parallel=sequence_parallel, sequence_dim=seq_dim,
                                                 process_group=group)
        self.down_proj = RowParallelLinear(ffn, hidden, bias=bias, sequence_parallel=sequence_parallel,
                                           sequence_dim=seq_dim, process_group=group)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        gate_up, _ = self.gate_up_proj(x)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaBlock(nn.Module):
    """One decoder layer: pre-norm attention and SwiGLU MLP, each with its residual add."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, q_per_kv: int = 2, head_dim: int = 4,
                 rotary: str = "real", bias: bool = False, sequence_parallel: bool = False,
                 sequence_first: bool = False, process_group=None):
        super().__init__()
        group = dist.group.WORLD if process_group is None else process_group
        _partition(ffn, group, "ffn")
        common = dict(bias=bias, sequence_parallel=sequence_parallel, sequence_first=sequence_first,
                      process_group=group)
        self.input_layernorm = RMSNorm(hidden, sequence_parallel=sequence_parallel)
        self.self_attn = Attention(hidden, kv_heads, q_per_kv=q_per_kv, head_dim=head_dim, rotary=rotary, **common)
        self.post_attention_layernorm = RMSNorm(hidden, sequence_parallel=sequence_parallel)
        self.mlp = MLP(hidden, ffn, **common)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attn, bias = self.self_attn(self.input_layernorm(x))
        h = x + (attn if bias is None else attn + bias)
        mlp, bias = self.mlp(self.post_attention_layernorm(h))
        return h + (mlp if bias is None else mlp + bias)


class LlamaBlockComplexRope(LlamaBlock):
    """The block with the complex form of the rotary embedding."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None, **kwargs):
        super().__init__(hidden, ffn, kv_heads, rotary="complex", process_group=process_group, **kwargs)


class LlamaBlockSP(LlamaBlock):
    """The block under sequence parallelism, Megatron's layout: input and output ``[seq/tp, ..., hidden]``."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None, **kwargs):
        kwargs.setdefault("sequence_first", True)
        super().__init__(hidden, ffn, kv_heads, sequence_parallel=True, process_group=process_group, **kwargs)


class LlamaBlock8B(LlamaBlock):
    """The block with Llama-3-8B's heads: 4 query heads per key/value head, head_dim 128 (with
    ``kv_heads=8`` and ``hidden=4096``: 32 query heads; the size tpsim's timing in docs/design.md uses)."""

    def __init__(self, hidden: int, ffn: int, kv_heads: int, *, process_group=None, **kwargs):
        kwargs.setdefault("q_per_kv", 4)
        kwargs.setdefault("head_dim", 128)
        super().__init__(hidden, ffn, kv_heads, process_group=process_group, **kwargs)


def sequence_parallel(cls: type, name: str | None = None) -> ModuleVariant:
    """The module variant of a sequence-parallel block class: input and output sharded along dim 0."""
    return module_from_class(cls, input="sequence-sharded", output="sequence-sharded", sequence_dim=0, name=name)


#: What ``tpsim check examples/llama_block.py --kind module`` checks.
TPSIM_MODULES = [
    module_from_class(LlamaBlock),
    module_from_class(LlamaBlockComplexRope),
    sequence_parallel(LlamaBlockSP),
]
