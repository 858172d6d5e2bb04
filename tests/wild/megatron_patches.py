"""Patched subclasses of Megatron-core's tensor-parallel layers, as teams that fork or patch them write.

``tpsim check tests/wild/megatron_patches.py:NAME`` checks each with the Megatron-core preset (the
class derives from ``ColumnParallelLinear`` / ``RowParallelLinear``), every option combination.
Three carry a realistic bug; one is correct.

- ``BiasBeforeReduceRowParallelLinear``: adds its full bias to its partial product before the
  all-reduce (a "fused bias" patch): ``bias-duplication``;
- ``NoCopyColumnParallelLinear``: computes ``x Wᵀ`` straight from the input, without the
  copy-to-region whose backward all-reduces the input grad: ``grad-not-reduced``;
- ``UnmarkedSequenceRowParallelLinear``: under sequence parallelism drops Megatron's
  ``bias.sequence_parallel`` marker, so no trainer sums the bias grad: ``grad-not-reduced``;
- ``CountingColumnParallelLinear``: counts its calls (correct: must pass).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)


class BiasBeforeReduceRowParallelLinear(RowParallelLinear):
    def forward(self, input_: torch.Tensor):
        if not self.input_is_parallel:
            input_ = scatter_to_tensor_model_parallel_region(input_, group=self.tp_group)
        fused_bias = None if self.skip_bias_add else self.bias
        partial = F.linear(input_, self.weight, fused_bias)  # the bug: every rank adds the full bias
        if self.sequence_parallel:
            output = reduce_scatter_to_sequence_parallel_region(partial, group=self.tp_group)
        else:
            output = reduce_from_tensor_model_parallel_region(partial, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class NoCopyColumnParallelLinear(ColumnParallelLinear):
    def forward(self, input_: torch.Tensor, weight=None, runtime_gather_output=None):
        if self.sequence_parallel:
            return super().forward(input_, weight, runtime_gather_output)
        bias = None if self.skip_bias_add else self.bias
        output = F.linear(input_, self.weight, bias)  # the bug: no copy-to-region, no input-grad all-reduce
        if self.gather_output:
            output = gather_from_tensor_model_parallel_region(output, group=self.tp_group)
        return output, (self.bias if self.skip_bias_add else None)


class UnmarkedSequenceRowParallelLinear(RowParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.bias is not None:
            # The bug: "we do not use finalize_model_grads", so nothing sums the bias grad.
            self.bias.sequence_parallel = False


class CountingColumnParallelLinear(ColumnParallelLinear):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.calls = 0

    def forward(self, *args, **kwargs):
        self.calls += 1
        return super().forward(*args, **kwargs)
