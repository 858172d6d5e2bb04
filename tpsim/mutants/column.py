"""Column-parallel mutants: a correct master-weight column layer and one bug per subclass.

Each class docstring says the mechanism and the diagnosis tpsim is expected to give.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.mutants._ops import copy_to_region, gather_from_region

__all__ = [
    "ColumnBackwardAverage",
    "ColumnBiasDefaultDtype",
    "ColumnFloorDivision",
    "ColumnGatherDim1",
    "ColumnGatherNoAutograd",
    "ColumnGatherWrongDim",
    "ColumnIgnoresBias",
    "ColumnNoBackwardReduce",
    "ColumnNodeLocalRank",
    "ColumnReversedShards",
    "ColumnWrongSplitDim",
    "CorrectColumn",
]


class CorrectColumn(nn.Module):
    """The correct base: ``(in_features, out_features, bias, master_weight, *, group)``; weight
    ``[out/ws, in]`` sliced from the master, zero bias ``[out/ws]``, replicated input whose grad is
    all-reduced in backward, output sharded (or gathered when ``gather`` is True)."""

    gather = False

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *, group: Any = None):
        super().__init__()
        self.group = group
        ws, rank = dist.get_world_size(group), dist.get_rank(group)
        self.world_size, self.rank = ws, rank
        self.check_sizes(in_features, out_features, ws)
        weight = self.slice_weight(master_weight, rank, ws)
        self.weight = nn.Parameter(weight.clone())
        self.bias = nn.Parameter(torch.zeros(weight.shape[0], dtype=master_weight.dtype)) if bias else None

    def check_sizes(self, in_features: int, out_features: int, ws: int) -> None:
        if out_features % ws:
            raise ValueError(f"out_features={out_features} is not divisible by world_size={ws}")

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        return master.chunk(ws, dim=0)[rank]

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_region(x, self.group)

    def gather_output(self, y: torch.Tensor) -> torch.Tensor:
        return gather_from_region(y, self.group, -1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(self.enter(x), self.weight, self.bias)
        return self.gather_output(y) if self.gather else y


class ColumnWrongSplitDim(CorrectColumn):
    """Splits the master weight along dim 1 (input features) instead of dim 0 — the skill's
    "memory aid" mixed up. The shard has shape ``[out, in/ws]``. Diagnosis: ``wrong-shard-dim``."""

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        return master.chunk(ws, dim=1)[rank]


class ColumnReversedShards(CorrectColumn):
    """Takes chunk ``ws-1-rank`` (a reversed rank order, e.g. from a descending device list).
    Output blocks come out reversed. Diagnosis: ``wrong-shard-order``."""

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        return master.chunk(ws, dim=0)[ws - 1 - rank]


class ColumnNoBackwardReduce(CorrectColumn):
    """Uses the replicated input directly, without the copy-to-region whose backward all-reduces
    the input grad (the skill's and the tutorial's column layer; bigcode-project/Megatron-LM #35,
    torchtitan #1805): each rank's input grad is only its summand. Diagnosis: ``grad-not-reduced``."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return x


class ColumnBackwardAverage(CorrectColumn):
    """All-reduces the input grad with a mean instead of a sum (``ReduceOp.AVG`` habits from data
    parallelism): the input grad is 1/ws of the dense one (torchtitan #2106 is the opposite: reduced
    twice). Diagnosis: ``grad-scaled``."""

    def enter(self, x: torch.Tensor) -> torch.Tensor:
        return copy_to_region(x, self.group, average=True)


class ColumnFloorDivision(CorrectColumn):
    """No divisibility check; the shard size is ``out_features // ws`` (floor division), so a
    non-divisible ``out_features`` silently drops the last ``out % ws`` output features.
    Diagnosis: ``divisibility-unchecked``."""

    def check_sizes(self, in_features: int, out_features: int, ws: int) -> None:
        pass

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        local = master.shape[0] // ws
        return master[rank * local : (rank + 1) * local]


class ColumnGatherWrongDim(CorrectColumn):
    """Gathers the output shards along dim 0 instead of the feature dim (vllm #30610's pattern: its
    test used 1-D tensors only, where dim 0 *is* the feature dim). Correct for 1-D input, wrong for
    any batched input. Diagnosis: ``wrong-shard-dim``."""

    gather = True

    def gather_output(self, y: torch.Tensor) -> torch.Tensor:
        return gather_from_region(y, self.group, 0)


class ColumnGatherDim1(CorrectColumn):
    """Written for ``[tokens, hidden]`` inputs: vectors are unsqueezed and the gather concatenates
    along dim 1, which is the feature dim only for 1-D and 2-D inputs. A ``[batch, seq, hidden]``
    input gets its shards stacked along the sequence. Visible only with 3-D (or deeper) input.
    Diagnosis: ``wrong-shard-dim``."""

    gather = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        vector = x.dim() == 1
        if vector:
            x = x.unsqueeze(0)
        y = F.linear(self.enter(x), self.weight, self.bias)
        y = gather_from_region(y, self.group, 1)
        return y.squeeze(0) if vector else y


class ColumnNodeLocalRank(CorrectColumn):
    """Picks its shard by the node-local rank (``rank % 4``, as ``LOCAL_RANK`` on 4-GPU nodes) instead
    of the tp rank. Identical for world sizes up to 4; from 5 ranks on, rank 4 holds shard 0 again.
    Visible only at world size > 4. Diagnosis: ``wrong-shard-order``."""

    def slice_weight(self, master: torch.Tensor, rank: int, ws: int) -> torch.Tensor:
        return master.chunk(ws, dim=0)[rank % 4]


class ColumnIgnoresBias(CorrectColumn):
    """Registers a bias but never adds it (a refactor dropped ``self.bias`` from the ``F.linear``
    call). Diagnosis: ``bias-missing``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self.enter(x), self.weight)


class ColumnBiasDefaultDtype(CorrectColumn):
    """Creates its bias with ``torch.zeros(local_out)``, in the *default* dtype (float32), instead of
    the master weight's dtype. Any float64, bfloat16 or float16 layer with a bias then fails in its
    forward (``F.linear`` refuses mixed dtypes) on every rank. Diagnosis: ``exception`` (the report
    names the rank and carries its traceback)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, master_weight: torch.Tensor, *, group: Any = None):
        super().__init__(in_features, out_features, bias, master_weight, group=group)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.weight.shape[0]))


class ColumnGatherNoAutograd(CorrectColumn):
    """Gathers the output shards with a bare ``dist.all_gather`` into fresh buffers (the tutorial's
    habit of calling ``dist.*`` directly) instead of an autograd-aware gather: the forward values are
    right, but the output has no ``grad_fn``, so nothing flows back to the weight or the input.
    Diagnosis: ``output-detached``."""

    gather = True

    def gather_output(self, y: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(y) for _ in range(self.world_size)]
        dist.all_gather(parts, y.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)
