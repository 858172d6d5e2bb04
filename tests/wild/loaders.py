"""Fresh modules whose own loaders put the dense weights into each rank's pieces (checked with no adapter code).

Two loader conventions people bring:

- **vLLM's ``weight_loader``** (an inference engine): every parameter carries
  ``param.weight_loader(param, full)``, which cuts this rank's piece of the checkpoint tensor. The row
  layer here holds its bias as this rank's ``1/tp`` term and adds it before the all-reduce, so the
  loader must scale it: ``InferenceMLP`` does, ``UnscaledBiasMLP``'s loader forgets (the sum then
  holds the bias ``tp`` times: ``bias-duplication``). Both are inference modules (``--forward-only``).
- **a loader method** ``load_weights(state_dict)`` (a training library): ``FusedQKVMix`` packs its
  Q/K/V projection into one column weight whose forward splits the local rows into this rank's q, k
  and v; its loader must cut each part on its own. ``WrongOrderQKVMix``'s loader cuts ranks first,
  parts second (a contiguous chunk of the packed rows): ``packed-shard-layout``, named as the
  loader's — declaring the packed layout does not hide it (``DECLARED_WRONG_ORDER``).

``RankZeroBiasMLP`` keeps its row bias on tp rank 0 with zeros elsewhere (its loader writes them):
the forward is right, but every rank's optimizer moves its zero copy (``zero-copies-drift``); its
forward-only twin ``RANK_ZERO_BIAS_INFERENCE`` passes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim import ModuleVariant, ParamSpec, Shard


def _tp(group) -> tuple[int, int]:
    return dist.get_rank(group), dist.get_world_size(group)


def _divide(n: int, tp: int) -> int:
    if n % tp:
        raise ValueError(f"{n} is not divisible by the tp size {tp}")
    return n // tp


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        x = x.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


# --- vLLM-style weight_loader (inference) -------------------------------------------------------


class _InferenceMLP(nn.Module):
    """``x -> relu(x W1_r^T + b1_r) W2_r^T + b2/tp`` summed over ranks, weights without grads."""

    scale_row_bias = True

    def __init__(self, hidden: int, ffn: int, *, group=None, dtype=torch.float32):
        super().__init__()
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.tp = _tp(self.group)
        local = _divide(ffn, self.tp)
        self.fc1 = nn.Linear(hidden, local, dtype=dtype).requires_grad_(False)
        self.fc2 = nn.Linear(local, hidden, dtype=dtype).requires_grad_(False)
        self.fc1.weight.weight_loader = self._rows
        self.fc1.bias.weight_loader = self._rows
        self.fc2.weight.weight_loader = self._columns
        self.fc2.bias.weight_loader = self._row_bias

    def _rows(self, param, full):
        param.data.copy_(full.chunk(self.tp, dim=0)[self.rank])

    def _columns(self, param, full):
        param.data.copy_(full.chunk(self.tp, dim=1)[self.rank])

    def _row_bias(self, param, full):
        # Added on every rank before the all-reduce: each rank holds its 1/tp term of the bias.
        param.data.copy_(full / self.tp if self.scale_row_bias else full)

    def forward(self, x):
        out = self.fc2(F.relu(self.fc1(x)))
        dist.all_reduce(out, group=self.group)
        return out


class InferenceMLP(_InferenceMLP):
    """Correct: the loader scales the row bias by 1/tp."""


class UnscaledBiasMLP(_InferenceMLP):
    """The loader forgets to scale the row bias: every rank adds all of it."""

    scale_row_bias = False


# --- a loader method (training) -----------------------------------------------------------------


class _QKVMix(nn.Module):
    """``y = (q * sigmoid(k) + v) Wo^T``: one packed ``qkv`` column weight ``[q; k; v]`` (each part
    ``inner`` rows) and a row projection ``o``, both sharded over the tp group."""

    def __init__(self, hidden: int, inner: int, *, group=None, dtype=torch.float32):
        super().__init__()
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.tp = _tp(self.group)
        self.local = _divide(inner, self.tp)
        self.qkv = nn.Linear(hidden, 3 * self.local, bias=False, dtype=dtype)
        self.o = nn.Linear(self.local, hidden, bias=False, dtype=dtype)

    def _cut_qkv(self, full: torch.Tensor) -> torch.Tensor:
        parts = full.chunk(3, dim=0)  # q, k, v
        return torch.cat([p.chunk(self.tp, dim=0)[self.rank] for p in parts], dim=0)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.qkv.weight.copy_(self._cut_qkv(state_dict["qkv.weight"]))
            self.o.weight.copy_(state_dict["o.weight"].chunk(self.tp, dim=1)[self.rank])

    def forward(self, x):
        q, k, v = self.qkv(_Copy.apply(x, self.group)).chunk(3, dim=-1)
        return _AllReduce.apply(self.o(q * torch.sigmoid(k) + v), self.group)


class FusedQKVMix(_QKVMix):
    """Correct: each rank's rows are its shard of q, of k and of v."""


class WrongOrderQKVMix(_QKVMix):
    """The loader splits in the wrong order: ranks first, then parts (a contiguous chunk of ``[q; k; v]``)."""

    def _cut_qkv(self, full: torch.Tensor) -> torch.Tensor:
        return full.chunk(self.tp, dim=0)[self.rank]


def _builder(cls):
    def build(hidden, inner, *, group, dtype):
        return cls(hidden, inner, group=group, dtype=dtype)

    return build


FUSED_QKV = ModuleVariant(name="FusedQKVMix", build=_builder(FusedQKVMix), sizes=("hidden", "inner"),
                          load="load_weights")
WRONG_ORDER_QKV = ModuleVariant(name="WrongOrderQKVMix", build=_builder(WrongOrderQKVMix), sizes=("hidden", "inner"),
                                load="load_weights")
#: The wrong-order loader with the packed layout declared, as a hint might have suggested: the values
#: are still the loader's, so the declaration cannot hide the mis-slice.
DECLARED_WRONG_ORDER = WRONG_ORDER_QKV.replace(
    name="WrongOrderQKVMix-declared", params=(ParamSpec("qkv.weight", "weight", Shard(0, parts=(1, 1, 1))),))


# --- a bias held by rank 0 with zeros elsewhere -------------------------------------------------


class RankZeroBiasMLP(nn.Module):
    """A column then a row linear; the row bias is added before the all-reduce, held by tp rank 0 with
    zeros on the other ranks (its loader writes them): the sum holds it once."""

    def __init__(self, hidden: int, ffn: int, *, group=None, dtype=torch.float32):
        super().__init__()
        self.group = dist.group.WORLD if group is None else group
        self.rank, self.tp = _tp(self.group)
        local = _divide(ffn, self.tp)
        self.fc1 = nn.Linear(hidden, local, dtype=dtype)
        self.fc2 = nn.Linear(local, hidden, dtype=dtype)

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.fc1.weight.copy_(state_dict["fc1.weight"].chunk(self.tp, dim=0)[self.rank])
            self.fc1.bias.copy_(state_dict["fc1.bias"].chunk(self.tp, dim=0)[self.rank])
            self.fc2.weight.copy_(state_dict["fc2.weight"].chunk(self.tp, dim=1)[self.rank])
            self.fc2.bias.copy_(state_dict["fc2.bias"] if self.rank == 0 else torch.zeros_like(self.fc2.bias))

    def forward(self, x):
        h = F.gelu(self.fc1(_Copy.apply(x, self.group)))
        return _AllReduce.apply(self.fc2(h), self.group)


RANK_ZERO_BIAS = ModuleVariant(name="RankZeroBiasMLP", build=_builder(RankZeroBiasMLP), sizes=("hidden", "ffn"),
                               load="load_weights")
RANK_ZERO_BIAS_INFERENCE = RANK_ZERO_BIAS.replace(name="RankZeroBiasMLP-inference", forward_only=True)
