"""Patched subclasses of DeepSpeed AutoTP's layers (checked with the DeepSpeed preset).

- ``BiasBeforeReduceLinearAllreduce``: adds its whole bias before the all-reduce: ``bias-duplication``;
- ``NoCopyLinearLayer``: no ``ColumnParallel`` in its forward, so the input grad is never
  all-reduced: ``grad-not-reduced``;
- ``ReversedSlicesLinearLayer``: slices the dense layer's rows in reversed rank order (its own
  slicing bug: tpsim checks the slices the layer keeps, it does not overwrite them);
- ``FloorLinearAllreduce``: gives every rank ``in // tp`` columns, truncating sizes that do not
  divide: ``divisibility-unchecked``;
- ``ContiguousGradLinearLayer``: DeepSpeed's LinearLayer with its backward all-reduce fixed (the grad
  made contiguous *before* it is reduced and returned): must pass everything.
"""

from __future__ import annotations

import torch
from deepspeed import comm as dist
from deepspeed.comm import pg_utils
from deepspeed.module_inject.layers import ColumnParallel, LinearAllreduce, LinearLayer, RowParallel, add_bias


class BiasBeforeReduceLinearAllreduce(LinearAllreduce):
    def forward(self, input):  # noqa: A002 - DeepSpeed's signature
        output = torch.matmul(input, self.weight.transpose(-1, -2))
        output = add_bias(output, self.bias)  # the whole bias on every rank, then summed
        return RowParallel.apply(self.mp_group, output, not self.is_training_mode())


class NoCopyLinearLayer(LinearLayer):
    def forward(self, input):  # noqa: A002
        output = torch.matmul(input, self.weight.transpose(-1, -2))  # no ColumnParallel: no grad all-reduce
        return add_bias(output, self.bias)


class ReversedSlicesLinearLayer(LinearLayer):
    def uneven_partition(self, params_list):
        for param in params_list:
            if param is None:
                return
            rank = self.tp_world_size - 1 - self.tp_index  # the other end of the dense rows
            param.data = self.move(param.split(self._partition_sizes, dim=0)[rank]).detach()


class FloorLinearAllreduce(LinearAllreduce):
    def uneven_partition(self, params_list):
        weight = params_list[0]
        width = weight.shape[1] // self.tp_world_size  # the remainder is dropped
        weight.data = self.move(weight.narrow(1, self.tp_index * width, width)).detach()

    def forward(self, input):  # noqa: A002
        return super().forward(input.narrow(-1, 0, self.weight.shape[1]))


class _ReduceContiguous(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, input):  # noqa: A002
        ctx.group = group
        return input

    @staticmethod
    def backward(ctx, grad_output):
        grad = grad_output.contiguous()  # the tensor that is reduced is the one returned
        if pg_utils.is_parallel(ctx.group):
            dist.all_reduce(grad, group=ctx.group)
        return None, grad


class ContiguousGradLinearLayer(LinearLayer):
    def forward(self, input):  # noqa: A002
        output = torch.matmul(_ReduceContiguous.apply(self.mp_group, input), self.weight.transpose(-1, -2))
        if self.bias is not None:
            output = add_bias(output, self.bias)
        if self.gather_output:
            from deepspeed.module_inject.layers import GatherFromTensorParallelRegion

            output = GatherFromTensorParallelRegion.apply(self.mp_group, output, self._partition_sizes)
        return output


__all__ = ["BiasBeforeReduceLinearAllreduce", "ColumnParallel", "ContiguousGradLinearLayer", "FloorLinearAllreduce",
           "NoCopyLinearLayer", "ReversedSlicesLinearLayer"]
