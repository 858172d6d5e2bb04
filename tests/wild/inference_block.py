"""An inference block in vLLM's style, checked forward-only with no adapter code.

vLLM's conventions, written fresh: the tp group is a module global set once per process (here by the
block's constructor, as a worker's start-up does) and read by every layer through ``get_tp_group()``;
the weights are ``nn.Parameter(..., requires_grad=False)``; the all-reduce is a plain in-place
``dist.all_reduce`` with no autograd (inference only); the linear layers return ``(output, bias)``;
``MergedColumnParallelLinear`` packs gate and up and records their full sizes in ``output_sizes``;
``SiluAndMul``; ``divide()`` refuses a size that does not divide with a bare ``assert`` (stripped by
``python -O``); the row layer adds its bias on tp rank 0 only, before its all-reduce, so that it is
counted once.

- ``InferenceMLP(hidden, ffn, process_group=None)``: gate/up, SiluAndMul, down;
- ``InferenceBlock(hidden, ffn, process_group=None)``: RMSNorm, the MLP, a residual;
- ``NoGradBlock``: the same, refusing to run with grad mode on (as a model that expects
  ``torch.inference_mode()``): a forward-only check must never run it with grad mode on.

Seeded bugs (each a subclass: same constructor): ``BiasOnEveryRankBlock`` (``mlp.down_proj:
bias-duplication``: the ``tp_rank == 0`` test forgotten) and ``UnreducedBlock`` (``mlp.down_proj:
missing-reduction``: ``reduce_results=False`` on a layer whose caller does not reduce).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

_TP_GROUP = None


def set_tp_group(group) -> None:
    global _TP_GROUP
    _TP_GROUP = group


def get_tp_group():
    return _TP_GROUP


def get_tensor_model_parallel_world_size() -> int:
    return dist.get_world_size(get_tp_group())


def get_tensor_model_parallel_rank() -> int:
    return dist.get_rank(get_tp_group())


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    # Inference only: in place, outside autograd.
    if get_tensor_model_parallel_world_size() > 1:
        dist.all_reduce(x, group=get_tp_group())
    return x


def divide(numerator: int, denominator: int) -> int:
    assert numerator % denominator == 0, f"{numerator} is not divisible by {denominator}"
    return numerator // denominator


class MergedColumnParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.output_sizes = list(output_sizes)
        local = sum(divide(s, tp) for s in output_sizes)
        self.weight = nn.Parameter(torch.empty(local, input_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(local), requires_grad=False) if bias else None
        nn.init.normal_(self.weight, std=input_size ** -0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        return F.linear(x, self.weight, self.bias), None


class RowParallelLinear(nn.Module):
    def __init__(self, input_size: int, output_size: int, bias: bool = True, reduce_results: bool = True) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.tp_rank = get_tensor_model_parallel_rank()
        self.reduce_results = reduce_results
        self.weight = nn.Parameter(torch.empty(output_size, divide(input_size, tp)), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(output_size), requires_grad=False) if bias else None
        nn.init.normal_(self.weight, std=input_size ** -0.5)

    def _bias(self) -> torch.Tensor | None:
        # Added on one rank only: the all-reduce sums it once.
        return self.bias if self.tp_rank == 0 else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        out = F.linear(x, self.weight, self._bias())
        if self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out, None


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class InferenceMLP(nn.Module):
    row_layer = RowParallelLinear
    reduce_results = True

    def __init__(self, hidden: int, ffn: int, process_group=None) -> None:
        super().__init__()
        set_tp_group(process_group)
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [ffn, ffn])
        self.act_fn = SiluAndMul()
        self.down_proj = self.row_layer(ffn, hidden, bias=True, reduce_results=self.reduce_results)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up, _ = self.gate_up_proj(x)
        out, _ = self.down_proj(self.act_fn(gate_up))
        return out


class InferenceBlock(nn.Module):
    mlp_class = InferenceMLP

    def __init__(self, hidden: int, ffn: int, process_group=None) -> None:
        super().__init__()
        set_tp_group(process_group)
        self.norm = RMSNorm(hidden)
        self.mlp = self.mlp_class(hidden, ffn, process_group=process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.norm(x))


class NoGradBlock(InferenceBlock):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled():
            raise RuntimeError("NoGradBlock runs under torch.no_grad() / torch.inference_mode() only")
        return super().forward(x)


# --- seeded bugs -----------------------------------------------------------------------------------


class _RowBiasOnEveryRank(RowParallelLinear):
    def _bias(self) -> torch.Tensor | None:
        return self.bias  # the tp_rank == 0 test forgotten: the all-reduce sums tp copies of it


class _BiasOnEveryRankMLP(InferenceMLP):
    row_layer = _RowBiasOnEveryRank


class BiasOnEveryRankBlock(InferenceBlock):
    mlp_class = _BiasOnEveryRankMLP


class _UnreducedMLP(InferenceMLP):
    reduce_results = False  # and nobody reduces after it


class UnreducedBlock(InferenceBlock):
    mlp_class = _UnreducedMLP
