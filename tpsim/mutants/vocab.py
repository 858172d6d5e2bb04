"""Vocab-parallel mutants: embeddings and cross-entropies that get one thing wrong, as published code did.

Each mutant has the signature of the correct form it changes, so the same check runs on both:

- embeddings: subclasses of :class:`tpsim.layers.VocabParallelEmbedding` (``from_dense`` builds them);
- cross-entropies: callables ``(logits, target, label_smoothing=0.0, ignore_index=-100, *,
  vocab_size=None, reduction="none", group=None)`` like :func:`tpsim.layers.vocab_parallel_cross_entropy`;
- linear cross-entropies: ``(hidden, weight, target, ...)`` like
  :func:`tpsim.layers.vocab_parallel_linear_cross_entropy`.

Most cross-entropy mutants are instances of a subclass of
:class:`tpsim.layers.vocab.CrossEntropySteps`, the correct loss's forward run under autograd, that
overrides the one step it gets wrong; everything else (padding columns, ignore_index, reductions) is
the correct code, so each mutant shows exactly its own bug. Each docstring cites the report and
names the diagnosis tpsim must give.
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
from tpsim.layers.vocab import CrossEntropySteps
from tpsim.mutants._ops import gather_from_region
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__all__ = [
    "VOCAB_MUTANTS",
    "CrossEntropyLocalMax",
    "CrossEntropyPaddingInSoftmax",
    "CrossEntropySmoothingPerShard",
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

    def _mask(self, rows: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        return rows  # no masked_fill: the rows looked up for other ranks' ids reach the all-reduce


# ------------------------------------------------------------------------------ cross-entropies


def _group_size_rank(group: Any) -> tuple[int, int]:
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


class CrossEntropySmoothingPerShard(CrossEntropySteps):
    """Averages the label-smoothing term ``mean_j(-log p_j)`` over this rank's vocabulary shard
    instead of the whole vocabulary (Megatron-LM #737, finding 1 of Megatron-LM #7452:
    ``log_probs.mean(dim=-1)`` on the local logits), so with ``label_smoothing > 0`` at tp > 1 every
    rank returns a different loss, and its gradient is wrong. Diagnosis: ``label-smoothing-per-shard``."""

    def mean_logit(
        self, sum_logits: torch.Tensor, shifted: torch.Tensor, valid: torch.Tensor | None, vocab: int
    ) -> torch.Tensor:
        columns = shifted.shape[-1] if valid is None else valid.sum().clamp_min(1)
        return shifted.sum(dim=-1) / columns  # this rank's shard only, not the all-reduced sum


class CrossEntropyLocalMax(CrossEntropySteps):
    """Subtracts each rank's *local* maximum logit before the exponentials and skips the all-reduce
    MAX (Megatron's ``vocab_parallel_cross_entropy`` reduces it over the tp group; PaddleFleet #104
    fixed bugs in vocab_parallel_cross_entropy): the shards' sums of ``exp(x - m_r)`` are then
    added with different shifts, so the normaliser and the loss are wrong whenever the ranks' maxima
    differ. Diagnosis: ``max-not-reduced``."""

    def global_max(self, local_max: torch.Tensor, group: Any) -> torch.Tensor:
        return local_max  # no all-reduce MAX


class CrossEntropyPaddingInSoftmax(CrossEntropySteps):
    """Ignores ``vocab_size`` and keeps the padding columns of a vocabulary padded to a multiple of
    the tp size in the softmax, as Megatron does (Megatron-LM #1754: the loss at tp=2 diverges from
    tp=1 when the vocabulary does not divide by the tp size). Only vocabularies that do not divide
    show it. Diagnosis: ``vocab-padding-in-softmax``."""

    def classes(self, vocab_size: int, padded: int) -> int:
        return padded  # the padding columns are classes too


cross_entropy_smoothing_per_shard = CrossEntropySmoothingPerShard()
cross_entropy_local_max = CrossEntropyLocalMax()
cross_entropy_padding_in_softmax = CrossEntropyPaddingInSoftmax()


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


def _cross_entropy(name: str, fn: Any, **options: Any) -> CrossEntropyVariant:
    """The variant of the cross-entropy mutant ``fn`` (an instance's ``__doc__`` is its class's), target
    ``tpsim.mutants:<name>``."""
    return CrossEntropyVariant(name=name, fn=fn, target=f"tpsim.mutants:{name}",
                               description=_first_paragraph(fn.__doc__), **options)


#: ``(mutant name, variant, intended diagnosis, what a case needs)`` of every vocab-parallel mutant
#: (registered in :data:`tpsim.mutants.CATALOG`).
VOCAB_MUTANTS: list[tuple[str, Any, str, str]] = [
    ("embedding-unmasked-ids",
     EmbeddingVariant(name="embedding_unmasked_ids", build=_embedding_build(EmbeddingUnmaskedIds),
                      target="tpsim.mutants:embedding_unmasked_ids",
                      description=_first_paragraph(EmbeddingUnmaskedIds.__doc__)),
     VOCAB_MASK_MISSING, "tp size >= 2"),
    ("cross-entropy-smoothing-per-shard",
     _cross_entropy("cross_entropy_smoothing_per_shard", cross_entropy_smoothing_per_shard),
     LABEL_SMOOTHING_PER_SHARD, "label_smoothing > 0, tp size >= 2"),
    ("cross-entropy-local-max", _cross_entropy("cross_entropy_local_max", cross_entropy_local_max),
     MAX_NOT_REDUCED, "tp size >= 2, ranks whose maximum logits differ"),
    ("cross-entropy-gathered-logits", _cross_entropy("cross_entropy_gathered_logits", cross_entropy_gathered_logits),
     LOSS_OFF_BY_LOG_TP, "tp size >= 2"),
    ("cross-entropy-padding-in-softmax",
     _cross_entropy("cross_entropy_padding_in_softmax", cross_entropy_padding_in_softmax),
     VOCAB_PADDING_IN_SOFTMAX, "a vocabulary not divisible by the tp size"),
    ("linear-cross-entropy-hidden-grad-not-reduced",
     _cross_entropy("linear_cross_entropy_hidden_grad_not_reduced", linear_cross_entropy_hidden_grad_not_reduced,
                    input="hidden"),
     GRAD_NOT_REDUCED, "tp size >= 2"),
]
