"""User-style tensor-parallel modules for the module-target tests: a correct MLP and one bug each,
built from the mutant layers of :mod:`tpsim.mutants` (a group keyword, Megatron's pattern).

Each class docstring names the sublayer and the diagnosis tpsim must report. A file target
(``tests/module_targets.py:Name``), so gloo workers and ``tpsim replay`` import it by path.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.module_variant import ModuleVariant
from tpsim.mutants._ops import copy_to_region, reduce_from_region
from tpsim.mutants.column import ColumnBackwardAverage, ColumnNoBackwardReduce, CorrectColumn
from tpsim.mutants.row import CorrectRow, RowBiasDivided, RowBiasRank0Only, RowNoReduceWithoutBias
from tpsim.placement import Replicate, Shard
from tpsim.variant import ParamSpec


class RowBiasInsideReduce(CorrectRow):
    """Adds its full bias on every rank, then all-reduces: the output holds ``tp * bias``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return reduce_from_region(F.linear(x, self.weight, self.bias), self.group)


def _mlp(name: str, column: type, row: type, *, bias: bool = True, doc: str = "") -> type:
    class MLP(nn.Module):
        def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
            super().__init__()
            # The mutant layers slice a master weight; the harness loads its own values anyway.
            self.fc1 = column(hidden, ffn, bias, torch.zeros(ffn, hidden), group=process_group)
            self.fc2 = row(ffn, hidden, bias, torch.zeros(hidden, ffn), group=process_group)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc2(F.gelu(self.fc1(x)))

    MLP.__doc__ = doc
    MLP.__name__ = MLP.__qualname__ = name
    return MLP


GoodMLP = _mlp("GoodMLP", CorrectColumn, CorrectRow, doc="Correct: passes every property.")
BiasDuplicatedMLP = _mlp("BiasDuplicatedMLP", CorrectColumn, RowBiasInsideReduce, doc="fc2: bias-duplication (forward).")
InputGradNotReducedMLP = _mlp("InputGradNotReducedMLP", ColumnNoBackwardReduce, CorrectRow, doc="fc1: grad-not-reduced (input grad).")
InputGradAveragedMLP = _mlp("InputGradAveragedMLP", ColumnBackwardAverage, CorrectRow, doc="fc1: grad-scaled (input grad).")
UnreducedMLP = _mlp("UnreducedMLP", CorrectColumn, RowNoReduceWithoutBias, bias=False, doc="fc2: missing-reduction (forward).")
BiasOnRank0MLP = _mlp("BiasOnRank0MLP", CorrectColumn, RowBiasRank0Only, doc="fc2: bias-grad-rank0-only (bias grad).")
BiasDividedMLP = _mlp("BiasDividedMLP", CorrectColumn, RowBiasDivided, doc="fc2: grad-scaled (bias grad).")


class ActivationOnWrongHalfMLP(nn.Module):
    """The sublayers are right, the code between them is not: a rank-dependent activation.
    The divergence first shows at the input of fc2 (``before fc2``)."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.rank = dist.get_rank(process_group)
        self.fc1 = CorrectColumn(hidden, ffn, True, torch.zeros(ffn, hidden), group=process_group)
        self.fc2 = CorrectRow(ffn, hidden, True, torch.zeros(hidden, ffn), group=process_group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(F.gelu(h) if self.rank == 0 else F.silu(h))


class FloorShardedMLP(nn.Module):
    """Shards ffn with a floor division and never checks it: a non-divisible ffn is silently
    truncated. Diagnosis: ``divisibility-unchecked`` naming the parameter."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        local = ffn // dist.get_world_size(process_group)
        self.fc1 = nn.Linear(hidden, local)
        self.fc2 = nn.Linear(local, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(copy_to_region(x, self.group)))
        return reduce_from_region(self.fc2(h), self.group)


class UnevenShardedMLP(nn.Module):
    """Shards ffn unevenly the way ``torch.tensor_split`` does (ceil sizes on the first ranks) and
    computes the dense result correctly: accepted non-divisible sizes are fine."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        tp, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        local = ffn // tp + (1 if rank < ffn % tp else 0)
        self.fc1 = nn.Linear(hidden, local)
        self.fc2 = nn.Linear(local, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(copy_to_region(x, self.group)))
        return reduce_from_region(self.fc2(h), self.group)


class PackedGateUpMLP(nn.Module):
    """A gated MLP whose fc1 packs [gate; up] with each part sharded on its own (rank r holds
    [gate_r; up_r]) and says nothing about it: from shapes alone the harness reads one contiguous
    shard, so the packed layout must be declared (:data:`packed_declared`)."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.group = process_group
        local = ffn // dist.get_world_size(process_group)
        self.fc1 = nn.Linear(hidden, 2 * local)
        self.fc2 = nn.Linear(local, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.fc1(copy_to_region(x, self.group)).chunk(2, dim=-1)
        return reduce_from_region(F.linear(F.silu(gate) * up, self.fc2.weight), self.group) + self.fc2.bias


def _packed_build(hidden: int, ffn: int, *, group: Any, dtype: torch.dtype) -> nn.Module:
    return PackedGateUpMLP(hidden, ffn, process_group=group).to(dtype)


#: :class:`PackedGateUpMLP` with its packed fc1 declared.
packed_declared = ModuleVariant(
    name="PackedGateUpMLP(declared)", build=_packed_build, sizes=("hidden", "ffn"),
    params=(ParamSpec("fc1.weight", "weight", Shard(0, parts=(1, 1))), ParamSpec("fc1.bias", "bias", Shard(0, parts=(1, 1)))),
)


class ExpMLP(nn.Module):
    """Uses ``torch.exp``, which the magnitude run has no rounding bound for."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.exp(self.fc(x))


def _sp_bias_left_partial(hidden: int, ffn: int, *, group: Any, dtype: torch.dtype) -> nn.Module:
    """tpsim's sequence-parallel SwiGLU MLP whose fc2 adds its replicated bias to its own slice of
    the sequence and leaves the bias grad a per-rank summand (Megatron leaves it to the trainer)."""
    from tpsim.layers import ParallelMLP

    mlp = ParallelMLP(hidden, ffn, activation="swiglu", group=group, dtype=dtype, sequence_parallel=True)
    fc2, original = mlp.fc2, mlp.fc2.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        saved, fc2.bias = fc2.bias, None
        try:
            out = original(x)
        finally:
            fc2.bias = saved
        return out + saved

    fc2.forward = forward
    return mlp


#: Nobody sums fc2.bias's grad: ``fc2: grad-not-reduced`` naming it.
sp_bias_not_reduced = ModuleVariant(name="SPMLP(bias grad left partial)", build=_sp_bias_left_partial,
                                    sizes=("hidden", "ffn"), input="sequence-sharded", output="sequence-sharded")
#: The same module with the trainer's sum declared: it holds.
sp_bias_trainer_reduced = sp_bias_not_reduced.replace(
    name="SPMLP(bias grad summed by the trainer)", params=(ParamSpec("fc2.bias", "bias", Replicate(), grad="partial"),))


class SignedMLP(nn.Module):
    """A correct MLP with a constant of mixed signs (a registered buffer, built per rank as its
    slice of the dense one) multiplied into the activations: constants enter the magnitude run
    as magnitudes."""

    def __init__(self, hidden: int, ffn: int, *, process_group: Any = None) -> None:
        super().__init__()
        tp, rank = dist.get_world_size(process_group), dist.get_rank(process_group)
        self.fc1 = CorrectColumn(hidden, ffn, True, torch.zeros(ffn, hidden), group=process_group)
        self.fc2 = CorrectRow(ffn, hidden, True, torch.zeros(hidden, ffn), group=process_group)
        local = ffn // tp
        index = torch.arange(rank * local, (rank + 1) * local)
        self.register_buffer("sign", (index % 2).to(torch.get_default_dtype()) * 2 - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.silu(self.fc1(x)) * self.sign)
