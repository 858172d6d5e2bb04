"""Patched versions of Megatron-core's vocab-parallel embedding and cross-entropy, as teams that fork them write.

``tpsim check tests/wild/megatron_vocab_patches.py:NAME`` checks each with the Megatron-core preset:
the embedding derives from ``VocabParallelEmbedding``, the cross-entropies from the autograd
function ``_VocabParallelCrossEntropy`` that ``vocab_parallel_cross_entropy`` applies.

- ``UnmaskedVocabParallelEmbedding``: shifts the ids into its shard (those it does not own become
  row 0) but drops the zeroing of their rows before the all-reduce: ``vocab-mask-missing`` (the rest
  of Megatron's forward, deterministic_mode and reduce_scatter_embeddings included, is kept);
- ``LocalMaxVocabParallelCrossEntropy``: drops the all-reduce MAX of the logits' maximum ("the
  exponentials are summed over the ranks anyway"): ``max-not-reduced``;
- ``GlobalFactorVocabParallelCrossEntropy``: a half fix of Megatron's label smoothing: the smoothing
  factor from the whole vocabulary, the mean log-probability still over the rank's own shard:
  ``label-smoothing-per-shard``;
- ``FixedSmoothingVocabParallelCrossEntropy``: the fix (the shards' log-probabilities summed over
  the tp group, the whole vocabulary's size): correct, must pass at every tp size.

The cross-entropies share :func:`_forward`, Megatron 0.16.1's forward written out once with the
switches they flip (with none flipped it is Megatron's own: the tests check that).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.parallel_state import (
    get_tensor_model_parallel_group,
    get_tensor_model_parallel_rank,
    get_tensor_model_parallel_world_size,
)
from megatron.core.tensor_parallel import VocabParallelEmbedding
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy, _VocabParallelCrossEntropy
from megatron.core.tensor_parallel.mappings import (
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron.core.tensor_parallel.utils import VocabUtility


class UnmaskedVocabParallelEmbedding(VocabParallelEmbedding):
    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_group.size() == 1:
            return super().forward(input_)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        masked_input = input_.clone() - self.vocab_start_index
        masked_input[outside] = 0
        if self.deterministic_mode:
            output_parallel = self.weight[masked_input]
        else:
            output_parallel = torch.nn.functional.embedding(masked_input, self.weight)
        # the bug: output_parallel[outside, :] = 0.0 is gone, so every rank adds its row 0 for ids it does not own
        if self.reduce_scatter_embeddings:  # as Megatron's: [b, s, h] -> [s, b, h], the sequence scattered
            output_parallel = output_parallel.transpose(0, 1).contiguous()
            return reduce_scatter_to_sequence_parallel_region(output_parallel, group=self.tp_group)
        return reduce_from_tensor_model_parallel_region(output_parallel, group=self.tp_group)


def _forward(ctx, vocab_parallel_logits, target, label_smoothing, *, reduce_max=True, whole_vocab_factor=False,
             whole_vocab_mean=False):
    """Megatron-core 0.16.1's ``_VocabParallelCrossEntropy.forward``, with switches: ``reduce_max``
    (the all-reduce MAX), ``whole_vocab_factor`` (the smoothing factor from the whole vocabulary's size
    instead of the shard's), ``whole_vocab_mean`` (the mean log-probability over the whole vocabulary)."""
    group = get_tensor_model_parallel_group()
    logits, logits_max = VocabParallelCrossEntropy.calculate_logits_max(vocab_parallel_logits)
    if reduce_max:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    partition = logits.size()[-1]
    world_size = get_tensor_model_parallel_world_size()
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(partition, get_tensor_model_parallel_rank(),
                                                                        world_size)
    target_mask, masked_target_1d, predicted_logits, sum_exp_logits, exp_logits = (
        VocabParallelCrossEntropy.calculate_predicted_logits(logits, target, logits_max, start, end))
    dist.all_reduce(predicted_logits, op=dist.ReduceOp.SUM, group=group)
    dist.all_reduce(sum_exp_logits, op=dist.ReduceOp.SUM, group=group)
    exp_logits, loss = VocabParallelCrossEntropy.calculate_cross_entropy_loss(exp_logits, predicted_logits,
                                                                              sum_exp_logits)
    vocab_size = partition * world_size if whole_vocab_factor else exp_logits.size(-1)
    if label_smoothing > 0:
        smoothing = label_smoothing * vocab_size / (vocab_size - 1)
        log_probs = torch.log(exp_logits)
        if whole_vocab_mean:
            total = log_probs.sum(dim=-1)
            dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
            mean_log_probs = total / vocab_size
        else:
            mean_log_probs = log_probs.mean(dim=-1)
        loss = (1.0 - smoothing) * loss - smoothing * mean_log_probs
    # The backward (Megatron's, inherited) takes the smoothing factor and its 1/V from these.
    ctx.label_smoothing, ctx.vocab_size = label_smoothing, vocab_size
    ctx.save_for_backward(exp_logits, target_mask, masked_target_1d)
    return loss


class LocalMaxVocabParallelCrossEntropy(_VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        return _forward(ctx, vocab_parallel_logits, target, label_smoothing, reduce_max=False)


class GlobalFactorVocabParallelCrossEntropy(_VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        return _forward(ctx, vocab_parallel_logits, target, label_smoothing, whole_vocab_factor=True)


class FixedSmoothingVocabParallelCrossEntropy(_VocabParallelCrossEntropy):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        return _forward(ctx, vocab_parallel_logits, target, label_smoothing, whole_vocab_factor=True,
                        whole_vocab_mean=True)


class ReleasedVocabParallelCrossEntropy(_VocabParallelCrossEntropy):
    """:func:`_forward` with no switch flipped: must compute exactly what Megatron's own does."""

    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, label_smoothing=0.0):
        return _forward(ctx, vocab_parallel_logits, target, label_smoothing)
