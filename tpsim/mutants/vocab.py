"""Vocab-parallel mutants: embeddings and cross-entropies that get one thing wrong, as published code did.

Each mutant has the signature of the correct form it changes, so the same check runs on both:

- embeddings: subclasses of :class:`tpsim.layers.VocabParallelEmbedding` (``from_dense`` builds them);
- cross-entropies: functions ``(logits, target, label_smoothing=0.0, ignore_index=-100, *,
  vocab_size=None, reduction="none", group=None)`` like :func:`tpsim.layers.vocab_parallel_cross_entropy`;
- linear cross-entropies: ``(hidden, weight, target, ...)`` like
  :func:`tpsim.layers.vocab_parallel_linear_cross_entropy`.

The cross-entropy mutants are written the plain way (differentiable torch ops, the sums leaving
through an all-reduce whose backward is the identity, Megatron's structure) with the one mistake
in place; everything else (padding columns, ignore_index, reductions) is handled correctly so that
each mutant shows exactly its own bug. Each docstring cites the report and names the diagnosis tpsim
must give.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.diagnosis import (
    GRAD_NOT_REDUCED,
    LABEL_SMOOTHING_PER_SHARD,
    LOSS_OFF_BY_LOG_TP,
    MAX_NOT_REDUCED,
    VOCAB_MASK_MISSING,
    VOCAB_PADDING_IN_SOFTMAX,
)
from tpsim.layers import VocabParallelEmbedding, vocab_parallel_cross_entropy
from tpsim.mutants._ops import gather_from_region, reduce_from_region
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__all__ = [
    "VOCAB_MUTANTS",
    "EmbeddingUnmaskedIds",
    "cross_entropy_gathered_logits",
    "cross_entropy_local_max",
    "cross_entropy_padding_in_softmax",
    "cross_entropy_smoothing_per_shard",
    "linear_cross_entropy_hidden_grad_not_reduced",
]


class EmbeddingUnmaskedIds(VocabParallelEmbedding):
    """Shifts the ids into its shard and clamps the ones it does not own to local row 0, but never
    zeroes their rows before the all-reduce (the mask half of Megatron's VocabParallelEmbedding
    forgotten; PaddleFleet #104 fixed bugs in VocabParallelEmbedding). Every id then also gets row
    0 of each other rank's shard added: ``out[t] = E[t] + sum_{r != owner(t)} E[r * Vp/ws]``.
    Diagnosis: ``vocab-mask-missing``."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        if self.tp_world_size == 1:
            return super().forward(input_)
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        return reduce_from_region(F.embedding(local_ids, self.weight), self.group)  # no masked_fill


# ------------------------------------------------------------------------------ cross-entropies


def _group_size_rank(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _plain_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float,
    ignore_index: int,
    vocab_size: int | None,
    reduction: str,
    group: Any,
    *,
    reduce_max: bool = True,
    global_smoothing: bool = True,
    mask_padding: bool = True,
) -> torch.Tensor:
    """The plain vocab-parallel cross-entropy, with the switches the mutants flip."""
    ws, rank = _group_size_rank(group)
    local = logits.shape[-1]
    start = rank * local
    vocab = ws * local if vocab_size is None or not mask_padding else vocab_size
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    valid = torch.arange(start, start + local, device=x.device) < vocab
    x = x.masked_fill(~valid, float("-inf"))
    logits_max = x.detach().amax(dim=-1, keepdim=True)
    if reduce_max and ws > 1:
        dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=group)
    shifted = (x - logits_max).masked_fill(~valid, 0.0)
    exp = shifted.exp().masked_fill(~valid, 0.0)
    sum_exp = reduce_from_region(exp.sum(dim=-1), group) if ws > 1 else exp.sum(dim=-1)
    ignored = target == ignore_index
    mine = (target >= start) & (target < start + local) & ~ignored
    local_target = (target - start).masked_fill(~mine, 0)
    picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1) * mine
    picked = reduce_from_region(picked, group) if ws > 1 else picked
    log_z = sum_exp.log()
    loss = log_z - picked
    if label_smoothing > 0.0:
        if global_smoothing:
            total = shifted.sum(dim=-1)
            mean_logit = (reduce_from_region(total, group) if ws > 1 else total) / vocab
        else:
            mean_logit = shifted.sum(dim=-1) / valid.sum().clamp_min(1)  # this rank's shard only
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - mean_logit)
    loss = loss.masked_fill(ignored, 0.0).to(logits.dtype)
    if reduction == "sum":
        return loss.sum()
    if reduction == "mean":
        return loss.sum() / (~ignored).sum().to(loss.dtype)
    return loss


def cross_entropy_smoothing_per_shard(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Any = None,
) -> torch.Tensor:
    """Averages the label-smoothing term ``mean_j(-log p_j)`` over this rank's vocabulary shard
    instead of the whole vocabulary (Megatron-LM #737, finding 1 of Megatron-LM #7452:
    ``log_probs.mean(dim=-1)`` on the local logits), so with ``label_smoothing > 0`` at tp > 1 every
    rank returns a different loss, and its gradient is wrong. Diagnosis: ``label-smoothing-per-shard``."""
    return _plain_cross_entropy(logits, target, label_smoothing, ignore_index, vocab_size, reduction, group,
                                global_smoothing=False)


def cross_entropy_local_max(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Any = None,
) -> torch.Tensor:
    """Subtracts each rank's *local* maximum logit before the exponentials and skips the all-reduce
    MAX (Megatron's ``vocab_parallel_cross_entropy`` reduces it over the tp group; PaddleFleet #104
    fixed bugs in vocab_parallel_cross_entropy): the shards' sums of ``exp(x - m_r)`` are then
    added with different shifts, so the normaliser and the loss are wrong whenever the ranks' maxima
    differ. Diagnosis: ``max-not-reduced``."""
    return _plain_cross_entropy(logits, target, label_smoothing, ignore_index, vocab_size, reduction, group,
                                reduce_max=False)


def cross_entropy_padding_in_softmax(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Any = None,
) -> torch.Tensor:
    """Ignores ``vocab_size`` and keeps the padding columns of a vocabulary padded to a multiple of
    the tp size in the softmax, as Megatron does (Megatron-LM #1754: the loss at tp=2 diverges from
    tp=1 when the vocabulary does not divide by the tp size). Only vocabularies that do not divide
    show it. Diagnosis: ``vocab-padding-in-softmax``."""
    return _plain_cross_entropy(logits, target, label_smoothing, ignore_index, vocab_size, reduction, group,
                                mask_padding=False)


def cross_entropy_gathered_logits(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Any = None,
) -> torch.Tensor:
    """Gathers the vocab-sharded logits first (an output layer with ``gather_output=True``) and then
    calls the vocab-parallel cross-entropy on the full logits as if they were this rank's shard
    (finding 2 of Megatron-LM #7452: ``GPTModel`` with ``parallel_output=False``). The
    cross-entropy then sees a vocabulary ``ws`` times too large in which every logit appears ``ws``
    times, so the loss is the correct one plus exactly ``log(ws)``. Diagnosis: ``loss-off-by-log-tp``."""
    ws, _ = _group_size_rank(group)
    full = gather_from_region(logits, group, -1) if ws > 1 else logits  # [..., Vp]
    if vocab_size is not None:
        full = full[..., :vocab_size]
    return vocab_parallel_cross_entropy(full, target, label_smoothing, ignore_index, reduction=reduction, group=group)


def linear_cross_entropy_hidden_grad_not_reduced(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Any = None,
) -> torch.Tensor:
    """A vocab-parallel linear cross-entropy (output layer fused with its loss) that projects the
    replicated hidden states without entering the tensor-parallel region, so the gradient of the
    hidden states (the "embedding" gradient) is each rank's own vocabulary's summand, different on
    every rank, instead of their all-reduced sum (apple/ml-cross-entropy #42: the embedding gradient
    must be the same on every tp rank). Diagnosis: ``grad-not-reduced``."""
    logits = F.linear(hidden, weight)  # missing copy_to_tensor_parallel_region
    return vocab_parallel_cross_entropy(
        logits, target, label_smoothing, ignore_index, vocab_size=vocab_size, reduction=reduction, group=group
    )


# ------------------------------------------------------------------------------ their variants


def _first_paragraph(text: str | None) -> str:
    return " ".join((text or "").strip().split("\n\n")[0].split())


def _embedding_build(cls: type[VocabParallelEmbedding]) -> Any:
    def build(num_embeddings: int, embedding_dim: int, *, group: Any, dtype: Any, weight: torch.Tensor) -> Any:
        dense = nn.Embedding(num_embeddings, embedding_dim, dtype=dtype, device="meta").to_empty(device=weight.device)
        with torch.no_grad():
            dense.weight.copy_(weight)
        return cls.from_dense(dense, group=group)

    return build


def _target(name: str) -> str:
    return f"tpsim.mutants:{name}"


#: ``(mutant name, variant, intended diagnosis, what a case needs)`` of every vocab-parallel mutant
#: (registered in :data:`tpsim.mutants.CATALOG`).
VOCAB_MUTANTS: list[tuple[str, Any, str, str]] = [
    ("embedding-unmasked-ids",
     EmbeddingVariant(name="embedding_unmasked_ids", build=_embedding_build(EmbeddingUnmaskedIds),
                      target=_target("embedding_unmasked_ids"), description=_first_paragraph(EmbeddingUnmaskedIds.__doc__)),
     VOCAB_MASK_MISSING, "tp size >= 2"),
    ("cross-entropy-smoothing-per-shard",
     CrossEntropyVariant(name="cross_entropy_smoothing_per_shard", fn=cross_entropy_smoothing_per_shard,
                         target=_target("cross_entropy_smoothing_per_shard"),
                         description=_first_paragraph(cross_entropy_smoothing_per_shard.__doc__)),
     LABEL_SMOOTHING_PER_SHARD, "label_smoothing > 0, tp size >= 2"),
    ("cross-entropy-local-max",
     CrossEntropyVariant(name="cross_entropy_local_max", fn=cross_entropy_local_max,
                         target=_target("cross_entropy_local_max"),
                         description=_first_paragraph(cross_entropy_local_max.__doc__)),
     MAX_NOT_REDUCED, "tp size >= 2, ranks whose maximum logits differ"),
    ("cross-entropy-gathered-logits",
     CrossEntropyVariant(name="cross_entropy_gathered_logits", fn=cross_entropy_gathered_logits,
                         target=_target("cross_entropy_gathered_logits"),
                         description=_first_paragraph(cross_entropy_gathered_logits.__doc__)),
     LOSS_OFF_BY_LOG_TP, "tp size >= 2"),
    ("cross-entropy-padding-in-softmax",
     CrossEntropyVariant(name="cross_entropy_padding_in_softmax", fn=cross_entropy_padding_in_softmax,
                         target=_target("cross_entropy_padding_in_softmax"),
                         description=_first_paragraph(cross_entropy_padding_in_softmax.__doc__)),
     VOCAB_PADDING_IN_SOFTMAX, "a vocabulary not divisible by the tp size"),
    ("linear-cross-entropy-hidden-grad-not-reduced",
     CrossEntropyVariant(name="linear_cross_entropy_hidden_grad_not_reduced",
                         fn=linear_cross_entropy_hidden_grad_not_reduced, input="hidden",
                         target=_target("linear_cross_entropy_hidden_grad_not_reduced"),
                         description=_first_paragraph(linear_cross_entropy_hidden_grad_not_reduced.__doc__)),
     GRAD_NOT_REDUCED, "tp size >= 2"),
]
