"""A packed QKV projection written fresh in vLLM's style, with fewer key/value heads than ranks.

vLLM's ``QKVParallelLinear(hidden_size, head_size, total_num_heads, total_num_kv_heads, bias, ...)``
is a column-parallel layer whose weight packs ``[Q; K; V]``. Query heads are sharded:
``total_num_heads / tp`` per rank. Key/value heads are sharded the same way while there are at
least as many as ranks; with fewer, each rank holds *one* key/value head, shared by
``num_kv_head_replicas = tp // total_num_kv_heads`` ranks: rank ``r`` holds head
``r // num_kv_head_replicas``. The layer reads its tp group from the parallel state (a module
global that defaults to the world, :func:`init_tp_group` sets it) unless one is passed; its
weights are loaded through ``weight_loader(param, loaded_weight, loaded_shard_id)`` per shard id
``"q"``, ``"k"``, ``"v"``, which slices the full projection by ``shard_id = tp_rank`` for Q and
``tp_rank // num_kv_head_replicas`` for K and V. ``forward`` returns ``(output, output_bias)``:
rank ``r``'s ``[q heads; its K head(s); its V head(s)]`` (not gathered) and None.

Unlike vLLM's (inference only), these weights take grads, and the input passes a
copy-to-region (identity forward, all-reduce of the input grad over the group).

- ``QKVParallelLinear``: correct;
- ``RoundRobinKVQKVLinear``: rank ``r`` takes key/value head ``r % total_num_kv_heads`` (round
  robin) instead of ``r // num_kv_head_replicas``: same shapes, query heads paired with the wrong
  key/value head;
- ``AlwaysReplicatedKVQKVLinear``: holds one replicated key/value head even when there are more
  key/value heads than ranks.

The module-level variants (``correct``, ``round_robin``, ``always_replicated``) declare them with
``packed=(q_per_kv, 1, 1)`` and ``head_size``: ``tpsim check tests/wild/vllm_qkv.py:correct``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.placement import Shard
from tpsim.variant import ParamSpec, Variant

#: The tp group of this process (vLLM's ``_TP``), set by ``init_tp_group``; the world when unset.
_TP_GROUP = None

#: Rows per head of the declared variants, and query heads per key/value head.
HEAD_SIZE = 2
Q_PER_KV = 2


def init_tp_group(group) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group():
    return _TP_GROUP if _TP_GROUP is not None else dist.group.WORLD


def divide(numerator: int, denominator: int) -> int:
    if numerator % denominator:
        raise ValueError(f"{numerator} is not divisible by {denominator}")
    return numerator // denominator


class _CopyToRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class QKVParallelLinear(nn.Module):
    def __init__(self, hidden_size: int, head_size: int, total_num_heads: int, total_num_kv_heads: int | None = None,
                 bias: bool = True, params_dtype: torch.dtype | None = None, tp_group=None):
        super().__init__()
        self.group = tp_group if tp_group is not None else get_tp_group()
        self.tp_size = dist.get_world_size(self.group)
        self.tp_rank = dist.get_rank(self.group)
        self.hidden_size, self.head_size = hidden_size, head_size
        self.total_num_heads = total_num_heads
        self.total_num_kv_heads = total_num_kv_heads or total_num_heads
        self.num_heads = divide(total_num_heads, self.tp_size)
        self._kv_layout()
        rows = (self.num_heads + 2 * self.num_kv_heads) * head_size
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(rows, hidden_size, dtype=dtype))
        self.weight.weight_loader = self.weight_loader
        self.bias = nn.Parameter(torch.zeros(rows, dtype=dtype)) if bias else None
        if self.bias is not None:
            self.bias.weight_loader = self.weight_loader

    def _kv_layout(self) -> None:
        if self.tp_size >= self.total_num_kv_heads:
            self.num_kv_heads = 1
            self.num_kv_head_replicas = divide(self.tp_size, self.total_num_kv_heads)
        else:
            self.num_kv_heads = divide(self.total_num_kv_heads, self.tp_size)
            self.num_kv_head_replicas = 1

    def _kv_shard_id(self) -> int:
        return self.tp_rank // self.num_kv_head_replicas

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, loaded_shard_id: str) -> None:
        """Copy this rank's rows of one full projection (``"q"``, ``"k"`` or ``"v"``) into ``param``."""
        d = self.head_size
        if loaded_shard_id == "q":
            offset, size, shard_id = 0, self.num_heads * d, self.tp_rank
        elif loaded_shard_id == "k":
            offset, size, shard_id = self.num_heads * d, self.num_kv_heads * d, self._kv_shard_id()
        elif loaded_shard_id == "v":
            offset, size, shard_id = (self.num_heads + self.num_kv_heads) * d, self.num_kv_heads * d, self._kv_shard_id()
        else:
            raise ValueError(f"loaded_shard_id={loaded_shard_id!r}; expected 'q', 'k' or 'v'")
        with torch.no_grad():
            param.narrow(0, offset, size).copy_(loaded_weight.narrow(0, shard_id * size, size))

    def forward(self, x: torch.Tensor):
        return F.linear(_CopyToRegion.apply(x, self.group), self.weight, self.bias), None


class RoundRobinKVQKVLinear(QKVParallelLinear):
    def _kv_shard_id(self) -> int:
        return self.tp_rank % self.total_num_kv_heads  # BUG: round robin, not r // replicas


class AlwaysReplicatedKVQKVLinear(QKVParallelLinear):
    def _kv_layout(self) -> None:
        # BUG: one key/value head per rank whatever their number (replicas only when fewer than ranks)
        self.num_kv_heads = 1
        self.num_kv_head_replicas = max(1, self.tp_size // self.total_num_kv_heads)


def _builder(cls):
    def build(in_features, out_features, bias, *, group, master_weight, master_bias, dtype, parts, head_size,
              **_):
        q, k, _v = parts
        layer = cls(in_features, head_size, q // head_size, k // head_size, bias=bias, params_dtype=dtype,
                    tp_group=group)
        for param, master in ((layer.weight, master_weight), (layer.bias, master_bias)):
            if param is not None:  # the checkpoint's separate q/k/v projections, each through the loader
                for shard_id, piece in zip("qkv", master.split(parts, dim=0), strict=True):
                    param.weight_loader(param, piece.to(dtype), shard_id)
        return layer

    return build


def _output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    output, output_bias = module(x)
    if output_bias is not None:
        raise ValueError("these layers add their bias: output_bias must be None")
    return output


#: How the variants below declare their weight and bias: Q/K/V in proportions Q_PER_KV:1:1, by heads.
QKV_PLACEMENT = Shard(0, parts=(Q_PER_KV, 1, 1), head_size=HEAD_SIZE)


def _variant(cls, name: str, placement: Shard = QKV_PLACEMENT, grad: str = "partial") -> Variant:
    # grad="partial": a replicated key/value head's grad is each replica's own share (the trainer sums them).
    return Variant(name=name, kind="column", input="replicated", output="sharded",
                   params=(ParamSpec("weight", "weight", placement, load=False, grad=grad),
                           ParamSpec("bias", "bias", placement, load=False, grad=grad)),
                   build=_builder(cls), forward=_output)


correct = _variant(QKVParallelLinear, "vllm_qkv")
round_robin = _variant(RoundRobinKVQKVLinear, "vllm_qkv_round_robin")
#: The same layer declared as a plain column (``tpsim check ... --packed 2,1,1 --head-size 2`` declares the rest).
round_robin_undeclared = _variant(RoundRobinKVQKVLinear, "vllm_qkv_round_robin", Shard(0), "complete")
#: The correct layer declared with complete key/value grads (it leaves them partial: must fail).
correct_declared_complete = _variant(QKVParallelLinear, "vllm_qkv_declared_complete", grad="complete")
always_replicated = _variant(AlwaysReplicatedKVQKVLinear, "vllm_qkv_always_replicated")


class SummedReplicaGradQKVLinear(QKVParallelLinear):
    """Sums a replicated key/value head's weight and bias grads over the ranks that hold it, so every
    replica holds the head's whole grad (tpsim.layers.attention.QKVParallelLinear's rule): wrong where the
    grads are declared partial (vLLM's rule, the trainer sums them), right where declared complete."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.num_kv_head_replicas > 1:
            for param in (self.weight, self.bias):
                if param is not None:
                    param.register_hook(self._sum_replicas)

    def _sum_replicas(self, grad: torch.Tensor) -> torch.Tensor:
        q_rows, d = self.num_heads * self.head_size, self.head_size
        buf = grad.new_zeros(self.total_num_kv_heads, 2 * d, *grad.shape[1:])
        buf[self._kv_shard_id()] = grad[q_rows:]
        dist.all_reduce(buf, group=self.group)
        return torch.cat([grad[:q_rows], buf[self._kv_shard_id()]])


summed_replica_grad = _variant(SummedReplicaGradQKVLinear, "vllm_qkv_summed_replica_grad")
#: The same layer declared as completing the grads itself (tpsim.layers.attention.QKVParallelLinear's rule): correct.
summed_replica_grad_complete = _variant(SummedReplicaGradQKVLinear, "vllm_qkv_summed_complete", grad="complete")
