"""Head-sharded self-attention (Megatron's pattern): packed Q/K/V column-parallel, out-projection row-parallel.

Shapes, with ``ws`` the tensor-parallel world size, ``h`` query heads, ``g`` key/value heads
(grouped-query attention: ``g`` divides ``h``; ``g == h`` is multi-head, ``g == 1`` multi-query),
``d`` the head dim and ``H`` the hidden size::

    x [..., S, H] (replicated; [..., S/ws, H] with sequence_parallel=True)
      -> qkv: QKVParallelLinear       weight [(h/ws + 2*g_r) * d, H]       -> q [..., S, h/ws * d]
                                                                            k, v [..., S, g_r * d]
      -> attention per local head     softmax(q kᵀ * scale [+ causal mask]) v   [..., S, h/ws * d]
      -> proj: RowParallelLinear      weight [H, h/ws * d], bias [H]      -> [..., S, H] (one all-reduce;
                                                                             reduce-scatter with SP)

The dense twin, :class:`DenseAttention`, packs ``qkv`` as one ``nn.Linear(H, (h + 2g) * d)`` whose
rows are ``[Q; K; V]``, each part head-major (head ``i`` is rows ``i*d`` to ``(i+1)*d`` of its part),
and query head ``i`` attends with key/value head ``i // (h/g)`` (the grouping of
``F.scaled_dot_product_attention(enable_gqa=True)`` and Hugging Face's ``repeat_kv``).

**Heads across ranks.** Rank ``r`` holds query heads ``r*h/ws`` to ``(r+1)*h/ws`` and exactly the
key/value heads those queries use, so attention needs no communication:

- ``g >= ws`` (``g`` divisible by ``ws``): key/value heads ``r*g/ws`` to ``(r+1)*g/ws`` (each part of
  the packed weight sharded on its own, Megatron's partition stride);
- ``g < ws`` (``ws`` divisible by ``g``): one key/value head, ``r // (ws/g)``, *replicated* on the
  ``ws/g`` ranks whose query heads use it (vLLM's KV-head replication). Each replica's weight
  gradient is only its own queries' part, so in backward the replicas' K/V gradients are summed
  over the tp group (one all-reduce of a ``[g, 2d, H]`` buffer), making them complete and identical.

``ws`` must divide ``h``, and ``g`` and ``ws`` must divide one another (``ValueError`` naming the
sizes, at construction, on every rank, before any collective).

``sequence_parallel=True``: the input and output are sharded along the sequence dim (-2); the
Q/K/V projection all-gathers the sequence (its input gradient is reduce-scattered) and the
out-projection reduce-scatters it. No rotary embedding, dropout or attention mask other than the
optional causal one: this is the part of a transformer block that tensor parallelism changes.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.layers.linear import (
    _SKIP_INIT,
    RowParallelLinear,
    check_dtype,
    check_input,
    check_options,
    check_positive_int,
    draw_master,
    skip_init,
)
from tpsim.layers.mappings import (
    Group,
    _size_and_rank,
    all_gather,
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    resolve_group,
)

__all__ = ["DenseAttention", "ParallelAttention", "QKVParallelLinear", "attend", "head_layout"]


# ------------------------------------------------------------------------------ shared pieces


def _check_heads(hidden: Any, num_heads: Any, num_kv_heads: Any, head_dim: Any, owner: str) -> tuple[int, int, int]:
    """``(num_heads, num_kv_heads, head_dim)`` after validation (``None`` defaults resolved)."""
    check_positive_int(hidden, "hidden", owner)
    check_positive_int(num_heads, "num_heads", owner)
    num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
    check_positive_int(num_kv_heads, "num_kv_heads", owner)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"{owner}: num_heads={num_heads} is not divisible by num_kv_heads={num_kv_heads} (each key/value "
            "head serves an equal group of query heads)"
        )
    if head_dim is None:
        if hidden % num_heads:
            raise ValueError(
                f"{owner}: hidden={hidden} is not divisible by num_heads={num_heads}; pass head_dim explicitly"
            )
        head_dim = hidden // num_heads
    check_positive_int(head_dim, "head_dim", owner)
    return num_heads, num_kv_heads, head_dim


def head_layout(num_heads: int, num_kv_heads: int, world_size: int, rank: int, owner: str = "head_layout") -> dict[str, int]:
    """Which heads rank ``rank`` holds: ``q_start``, ``q_heads``, ``kv_start``, ``kv_heads``, ``kv_replicas``.

    Raises ``ValueError`` when ``world_size`` does not divide ``num_heads``, or when
    ``num_kv_heads`` and ``world_size`` do not divide one another.
    """
    if num_heads % world_size:
        raise ValueError(
            f"{owner}: num_heads={num_heads} is not divisible by the tensor-parallel world size {world_size} "
            "(query heads are sharded over the group)"
        )
    if num_kv_heads % world_size and world_size % num_kv_heads:
        raise ValueError(
            f"{owner}: num_kv_heads={num_kv_heads} and the tensor-parallel world size {world_size} must divide one "
            f"another (key/value heads are sharded when there are at least as many as ranks, else replicated)"
        )
    q_heads = num_heads // world_size
    if num_kv_heads >= world_size:
        kv_heads, replicas = num_kv_heads // world_size, 1
        kv_start = rank * kv_heads
    else:
        kv_heads, replicas = 1, world_size // num_kv_heads
        kv_start = rank // replicas
    return {"q_start": rank * q_heads, "q_heads": q_heads, "kv_start": kv_start, "kv_heads": kv_heads,
            "kv_replicas": replicas}


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dim: int, *, causal: bool, scale: float) -> torch.Tensor:
    """Scaled dot-product attention on head-packed features.

    ``q`` ``[..., S, hq*d]``, ``k``/``v`` ``[..., S, hk*d]`` (``hk`` divides ``hq``; query head ``i``
    uses key/value head ``i // (hq/hk)``) -> ``[..., S, hq*d]``.
    """
    def heads(t: torch.Tensor) -> torch.Tensor:  # [..., S, n*d] -> [..., n, S, d]
        return t.unflatten(-1, (t.shape[-1] // head_dim, head_dim)).transpose(-3, -2)

    qh, kh, vh = heads(q), heads(k), heads(v)
    out = F.scaled_dot_product_attention(
        qh, kh, vh, is_causal=causal, scale=scale, enable_gqa=qh.shape[-3] != kh.shape[-3]
    )  # [..., hq, S, d]
    return out.transpose(-3, -2).flatten(-2)  # [..., S, hq*d]


def _check_attention_input(x: Any, hidden: int, owner: str) -> None:
    check_input(x, hidden, owner, f"hidden={hidden}")
    if x.dim() < 2:
        raise ValueError(f"{owner} expected an input [..., sequence, hidden={hidden}], got shape {tuple(x.shape)}")


# ------------------------------------------------------------------------------ dense twin


class DenseAttention(nn.Module):
    """The single-device attention that :class:`ParallelAttention` shards (see the module docstring).

    ``qkv``: ``nn.Linear(hidden, (num_heads + 2*num_kv_heads) * head_dim)``, rows ``[Q; K; V]``;
    ``proj``: ``nn.Linear(num_heads * head_dim, hidden)``. ``forward(x)``: ``x`` ``[..., S, hidden]``
    -> ``[..., S, hidden]``. ``head_dim`` defaults to ``hidden // num_heads``, ``num_kv_heads`` to
    ``num_heads``, ``softmax_scale`` to ``1/sqrt(head_dim)``. Built like any ``nn.Linear``
    (torch's default init: ``qkv`` drawn first, then ``proj``).
    """

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = True,
        softmax_scale: float | None = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.num_heads, self.num_kv_heads, self.head_dim = _check_heads(hidden, num_heads, num_kv_heads, head_dim, owner)
        self.hidden = hidden
        self.causal = bool(causal)
        self.softmax_scale = _check_scale(softmax_scale, self.head_dim, owner)
        d, h, g = self.head_dim, self.num_heads, self.num_kv_heads
        factory = {"dtype": dtype, "device": device}
        self.qkv = nn.Linear(hidden, (h + 2 * g) * d, bias=bias, **factory)
        self.proj = nn.Linear(h * d, hidden, bias=bias, **factory)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _check_attention_input(x, self.hidden, type(self).__name__)
        d, h, g = self.head_dim, self.num_heads, self.num_kv_heads
        q, k, v = self.qkv(x).split((h * d, g * d, g * d), dim=-1)
        return self.proj(attend(q, k, v, d, causal=self.causal, scale=self.softmax_scale))

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}")


def _check_scale(softmax_scale: Any, head_dim: int, owner: str) -> float:
    if softmax_scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)) or not softmax_scale > 0:
        raise ValueError(f"{owner}: softmax_scale={softmax_scale!r} must be a positive float (default 1/sqrt(head_dim))")
    return float(softmax_scale)


# ------------------------------------------------------------------------------ the Q/K/V projection


class _SumGradOverReplicas(torch.autograd.Function):
    """Identity forward. Backward: rows ``[start:]`` of the gradient (the K/V rows) summed over the
    ranks that hold the same replica, through one all-reduce of a ``[count, ...]`` buffer on ``group``
    in which each rank fills slot ``index`` (its replica) and leaves the others zero."""

    @staticmethod
    def forward(ctx: Any, param: torch.Tensor, start: int, group: Group, index: int, count: int) -> torch.Tensor:
        ctx.start, ctx.group, ctx.index, ctx.count = start, group, index, count
        return param.view_as(param)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        grad = grad.clone(memory_format=torch.contiguous_format)
        tail = grad[ctx.start :]
        buffer = grad.new_zeros(ctx.count, *tail.shape)  # [kv heads, 2*d(, H)]
        buffer[ctx.index] = tail
        dist.all_reduce(buffer, group=ctx.group)
        tail.copy_(buffer[ctx.index])
        return grad, None, None, None, None


class QKVParallelLinear(nn.Module):
    """The packed ``[Q; K; V]`` projection of (grouped-query) attention, sharded by heads.

    Rank ``r`` holds ``weight`` ``[(q_heads + 2*kv_heads) * d, hidden]`` (and ``bias``): its query
    heads' rows of Q, then its key/value heads' rows of K and of V, where the heads are
    :func:`head_layout`'s. Forward returns this rank's ``(q, k, v)``. The input is replicated (its
    gradient all-reduced in backward) or, with ``sequence_parallel=True``, sequence-sharded along
    dim -2 (all-gathered; gradient reduce-scattered). With fewer key/value heads than ranks the
    K/V rows are replicas, whose gradients are summed over the replicas in backward (module
    docstring of :mod:`tpsim.layers.attention`).
    """

    #: Dim of the ``[out, in]`` weight that is sharded (by heads, each part on its own).
    partition_dim = 0

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        bias: bool = True,
        group: Group = None,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.num_heads, self.num_kv_heads, self.head_dim = _check_heads(hidden, num_heads, num_kv_heads, head_dim, owner)
        dtype = check_dtype(dtype, owner)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        layout = self._layout(owner)
        self.q_head_start, self.q_heads = layout["q_start"], layout["q_heads"]
        self.kv_head_start, self.kv_heads, self.kv_replicas = layout["kv_start"], layout["kv_heads"], layout["kv_replicas"]
        self.hidden = hidden
        self.in_features = hidden
        self.out_features = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        self.sequence_parallel = bool(sequence_parallel)
        d = self.head_dim
        #: The full sizes of the packed parts (Q, K, V) along the weight's dim 0, in features (the
        #: sharding description :mod:`tpsim.layers.linear` documents: each part is split on its own).
        self.parts = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        #: This rank's sizes of the packed parts (Q, K, V), in features.
        self.local_parts = (self.q_heads * d, self.kv_heads * d, self.kv_heads * d)
        rows = sum(self.local_parts)
        self.weight = nn.Parameter(torch.empty(rows, hidden, dtype=dtype, device=device))
        if bias:
            self.bias: nn.Parameter | None = nn.Parameter(torch.empty(rows, dtype=dtype, device=device))
        else:
            self.register_parameter("bias", None)
        if not _SKIP_INIT.get():
            self.reset_parameters()

    def _layout(self, owner: str) -> dict[str, int]:
        """Which heads this rank holds: :func:`head_layout`'s (a seam: a subclass may deal them otherwise)."""
        return head_layout(self.num_heads, self.num_kv_heads, self.tp_world_size, self.tp_rank, owner)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full packed ``[(h + 2g) * d, ...]`` tensor (weight or bias); no communication."""
        d, h, g = self.head_dim, self.num_heads, self.num_kv_heads
        if full.shape[0] != (h + 2 * g) * d:
            raise ValueError(
                f"{type(self).__name__}.shard: expected {(h + 2 * g) * d} packed rows ((num_heads={h} + "
                f"2*num_kv_heads={g}) * head_dim={d}), got shape {tuple(full.shape)}"
            )
        q, k, v = full.split((h * d, g * d, g * d), dim=0)
        q_rows = q[self.q_head_start * d : (self.q_head_start + self.q_heads) * d]
        return torch.cat([q_rows, self._kv_rows(k), self._kv_rows(v)], dim=0)

    def _kv_rows(self, part: torch.Tensor) -> torch.Tensor:
        """This rank's rows of the full K (or V) part ``[g * d, ...]``: its key/value heads' (a seam:
        a subclass may pick other heads)."""
        d = self.head_dim
        return part[self.kv_head_start * d : (self.kv_head_start + self.kv_heads) * d]

    def _unshard(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank's rows gathered (collective) and put back in the dense ``[Q; K; V]`` order."""
        stacked = all_gather(local.detach(), 0, self.group).view(self.tp_world_size, *local.shape)
        q, k, v = stacked.split(self.local_parts, dim=1)  # each [ws, rows_r, ...]
        step = self.kv_replicas  # one rank per distinct key/value head block
        return torch.cat([part.reshape(-1, *local.shape[1:]) for part in (q, k[::step], v[::step])], dim=0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Draw the full packed weight and bias as ``nn.Linear(hidden, (h + 2g) * d)`` does; keep this rank's rows."""
        weight, bias = draw_master(self.out_features, self.hidden, self.bias is not None, self.weight.dtype)
        self.weight.copy_(self.shard(weight))
        if self.bias is not None and bias is not None:
            self.bias.copy_(self.shard(bias))

    @torch.no_grad()
    def to_dense(self) -> nn.Linear:
        """The full packed ``nn.Linear``, gathered onto every rank (a collective: call it on every rank)."""
        ref = self.weight
        dense = nn.Linear(self.hidden, self.out_features, bias=self.bias is not None, device="meta",
                          dtype=ref.dtype).to_empty(device=ref.device)
        dense.weight.copy_(self._unshard(self.weight))
        if self.bias is not None:
            dense.bias.copy_(self._unshard(self.bias))
        return dense

    def _param(self, p: torch.Tensor) -> torch.Tensor:
        if self.kv_replicas == 1:
            return p
        return _SumGradOverReplicas.apply(p, self.local_parts[0], self.group, self.kv_head_start, self.num_kv_heads)

    def forward(self, input_: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        owner = type(self).__name__
        _check_attention_input(input_, self.hidden, owner)
        if self.sequence_parallel:
            full = gather_from_sequence_parallel_region(input_, self.group, -2)  # [..., S, H]
        else:
            full = copy_to_tensor_parallel_region(input_, self.group)  # [..., S, H]
        bias = None if self.bias is None else self._param(self.bias)
        out = F.linear(full, self._param(self.weight), bias)  # [..., S, (q_heads + 2*kv_heads) * d]
        q, k, v = out.split(self.local_parts, dim=-1)
        return q, k, v

    def extra_repr(self) -> str:
        return (
            f"hidden={self.hidden}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
            f"tp_world_size={self.tp_world_size}, tp_rank={self.tp_rank}, q_heads=[{self.q_head_start}, "
            f"{self.q_head_start + self.q_heads}), kv_heads=[{self.kv_head_start}, {self.kv_head_start + self.kv_heads})"
            + (f", kv_replicas={self.kv_replicas}" if self.kv_replicas > 1 else "")
        )


# ------------------------------------------------------------------------------ the block


class ParallelAttention(nn.Module):
    """Tensor-parallel self-attention: :class:`QKVParallelLinear` -> attention per local head ->
    :class:`~tpsim.layers.RowParallelLinear` (see the module docstring for shapes and head layout).

    ``forward(x)``: ``x`` ``[..., S, hidden]`` replicated (``[..., S/ws, hidden]`` with
    ``sequence_parallel=True``) -> the same shape, replicated (sequence-sharded). One all-reduce
    forward (the out-projection's) and one backward (the input gradient's), plus, when key/value
    heads are replicated, one all-reduce of their weight (and bias) gradients.

    Initialisation: ``qkv`` is drawn as ``nn.Linear(hidden, (h + 2g) * d)``, then ``proj`` as
    ``nn.Linear(h * d, hidden)``, each as described in :mod:`tpsim.layers.linear`, so a seed
    gives the same attention as :class:`DenseAttention` at every world size.
    """

    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("sequence_parallel",)
    #: The Q/K/V projection's class (a seam: a subclass may build another).
    _qkv_class: type[QKVParallelLinear] = QKVParallelLinear

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int | None = None,
        *,
        head_dim: int | None = None,
        bias: bool = True,
        causal: bool = True,
        softmax_scale: float | None = None,
        group: Group = None,
        sequence_parallel: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        self.num_heads, self.num_kv_heads, self.head_dim = _check_heads(hidden, num_heads, num_kv_heads, head_dim, owner)
        check_dtype(dtype, owner)
        self.softmax_scale = _check_scale(softmax_scale, self.head_dim, owner)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        head_layout(self.num_heads, self.num_kv_heads, self.tp_world_size, self.tp_rank, owner)  # checks first
        self.hidden = hidden
        self.causal = bool(causal)
        self.sequence_parallel = bool(sequence_parallel)
        common: dict[str, Any] = {"group": self.group, "sequence_parallel": self.sequence_parallel,
                                  "dtype": dtype, "device": device}
        self.qkv = self._qkv_class(hidden, self.num_heads, self.num_kv_heads, head_dim=self.head_dim, bias=bias,
                                   **common)
        self.proj = RowParallelLinear(
            self.num_heads * self.head_dim, hidden, bias, input_is_parallel=True, sequence_dim=-2, **common
        )

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        _check_attention_input(input_, self.hidden, type(self).__name__)
        q, k, v = self.qkv(input_)  # [..., S, q_heads*d], [..., S, kv_heads*d] x 2
        context = attend(q, k, v, self.head_dim, causal=self.causal, scale=self.softmax_scale)  # [..., S, q_heads*d]
        return self.proj(context)  # [..., S(/ws), hidden]

    @classmethod
    def from_dense(cls, attention: DenseAttention, *, group: Group = None, **options: Any) -> ParallelAttention:
        """This rank's shard of a :class:`DenseAttention` (no communication; ``options``: ``sequence_parallel``)."""
        if not isinstance(attention, DenseAttention):
            raise TypeError(f"{cls.__name__}.from_dense: attention must be a DenseAttention, got {type(attention).__name__}")
        check_options(options, cls.OPTIONS, cls.__name__)
        ref = attention.qkv.weight
        with skip_init():
            layer = cls(
                attention.hidden,
                attention.num_heads,
                attention.num_kv_heads,
                head_dim=attention.head_dim,
                bias=attention.qkv.bias is not None,
                causal=attention.causal,
                softmax_scale=attention.softmax_scale,
                group=group,
                dtype=ref.dtype,
                device=ref.device,
                **options,
            )
        with torch.no_grad():
            layer.qkv.weight.copy_(layer.qkv.shard(attention.qkv.weight))
            layer.proj.weight.copy_(layer.proj.shard(attention.proj.weight))
            if layer.qkv.bias is not None:
                layer.qkv.bias.copy_(layer.qkv.shard(attention.qkv.bias))
                layer.proj.bias.copy_(attention.proj.bias)
        return layer

    @torch.no_grad()
    def to_dense(self) -> DenseAttention:
        """The full :class:`DenseAttention`, gathered onto every rank (collectives: call it on every rank)."""
        ref = self.qkv.weight
        with torch.device("meta"):
            dense = DenseAttention(
                self.hidden, self.num_heads, self.num_kv_heads, head_dim=self.head_dim,
                bias=self.qkv.bias is not None, causal=self.causal, softmax_scale=self.softmax_scale, dtype=ref.dtype,
            )
        dense = dense.to_empty(device=ref.device)
        dense.qkv = self.qkv.to_dense()
        dense.proj = self.proj.to_dense()
        return dense

    def extra_repr(self) -> str:
        text = (f"hidden={self.hidden}, num_heads={self.num_heads}, num_kv_heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, causal={self.causal}")
        if self.sequence_parallel:
            text += ", sequence_parallel=True"
        return text
