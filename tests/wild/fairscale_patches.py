"""Patched subclasses of fairscale's tensor-parallel layers (checked with the fairscale preset).

- ``BiasBeforeReduceRowParallelLinear``: adds its full bias before the all-reduce: ``bias-duplication``;
- ``NoCopyColumnParallelLinear``: no copy-to-region, so the input grad is never all-reduced:
  ``grad-not-reduced``;
- ``QuietRowParallelLinear``: a subclass that changes nothing that matters (correct: must pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from fairscale.nn.model_parallel.layers import ColumnParallelLinear, RowParallelLinear
from fairscale.nn.model_parallel.mappings import (
    gather_from_model_parallel_region,
    reduce_from_model_parallel_region,
    scatter_to_model_parallel_region,
)


class BiasBeforeReduceRowParallelLinear(RowParallelLinear):
    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        if not self.input_is_parallel:
            input_ = scatter_to_model_parallel_region(input_)
        return reduce_from_model_parallel_region(F.linear(input_, self.weight, self.bias))  # bias on every rank


class NoCopyColumnParallelLinear(ColumnParallelLinear):
    def forward(self, input_: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        output = F.linear(input_, self.weight, self.bias)  # no copy_to_model_parallel_region
        return gather_from_model_parallel_region(output) if self.gather_output else output


class QuietRowParallelLinear(RowParallelLinear):
    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"
