"""The vocab-parallel properties, their tolerances, and the recognisers of the vocab-parallel diagnoses.

**Embeddings** (float64 reference: ``F.embedding`` of the same table):

- ``forward-equivalence``: every rank's output equals the dense lookup. A lookup copies a row and
  the all-reduce adds exact zeros to it, so the bound is that of one rounding:
  ``tolerance(dtype, |E[id]|, reduction_length=1, world_size=tp)``;
- ``weight-grad-equivalence``: each rank's table grad equals its rows of the dense grad (padding
  rows: exactly zero), bound ``tolerance(dtype, sum |upstream rows of the id|, tokens, tp)``;
- ``replica-consistency``: the output is the same bits on every rank of the tp group;
- ``divisibility``: a vocabulary that does not divide by the tp size is either handled (padded or
  split unevenly: the properties above hold) or refused on every rank with an error naming the sizes.

**Cross-entropies** (float64 reference: ``F.cross_entropy`` with the same ``label_smoothing``,
``ignore_index`` and ``reduction`` over the real columns). With ``u = eps(dtype)``, ``V`` ids,
``m`` the row maximum, ``Z = sum_j exp(x_j - m)`` and ``t`` the target:

- ``forward-equivalence``: the loss of each token (the normaliser is a sum of ``V`` positive
  terms, the picked and mean logits are shifted values) is within
  ``tolerance(dtype, 1 + log Z + |x_t - m| + eps * mean_j |x_j - m|, V, tp) + u |loss|``; a reduced
  loss sums those bounds and the rounding of the sum (``tolerance(dtype, sum |loss|, tokens, tp)``);
- ``input-grad-equivalence``: each rank's logits grad is its columns of the dense grad (padding
  columns: exactly zero), entry ``(p_j - (1-eps)[j=t] - eps/V) g`` within
  ``tolerance(dtype, (p_j + (1-eps)[j=t] + eps/V)|g|, V, tp) + 2u|grad|``; with hidden states, their
  grad must be complete and identical on every rank: ``tolerance(dtype, |G| |W|, V, tp)`` plus the
  logits' bound through ``|W|``;
- ``weight-grad-equivalence`` (hidden states only): each rank's classifier rows' grad;
- ``replica-consistency``: the loss (and the hidden states' grad) is the same bits on every rank.

With hidden states the logits are themselves a product of length ``H`` in the dtype: their bound
``dx`` adds ``2 max dx`` to the loss (``log Z`` and the picked logit move by at most that) and
``2 max dx p_j |g|`` to each logits grad entry (the softmax's relative sensitivity).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F

from tpsim.diagnosis import (
    DIVISIBILITY_UNCHECKED,
    GRAD_NOT_REDUCED,
    LABEL_SMOOTHING_PER_SHARD,
    LOSS_OFF_BY_LOG_TP,
    MAX_NOT_REDUCED,
    SHAPE_ERROR,
    VOCAB_MASK_MISSING,
    VOCAB_PADDING_IN_SOFTMAX,
    Failure,
    close,
    rank_summands,
    recogniser,
)
from tpsim.props.comparing import compare, failure, groups_of, replica
from tpsim.props.names import DIVISIBILITY, FORWARD, INPUT_GRAD, REPLICA, WEIGHT_GRAD
from tpsim.props.raised import refusal_failure, run_failure
from tpsim.props.results import OK, OUTPUT_SHAPE, Observation
from tpsim.props.tolerance import eps, tolerance
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.props.vocab.world import (
    NO_WEIGHT,
    WEIGHT_SHAPE,
    CrossEntropyRankResult,
    EmbeddingRankResult,
    dense_cross_entropy,
    vocab_rows,
)
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__all__ = [
    "CROSS_ENTROPY_PROPERTIES",
    "EMBEDDING_PROPERTIES",
    "evaluate_cross_entropy",
    "evaluate_embedding",
]

#: The embedding family's properties, in report order.
EMBEDDING_PROPERTIES = (FORWARD, WEIGHT_GRAD, REPLICA, DIVISIBILITY)
#: The cross-entropy family's properties, in report order (weight grads: hidden-state variants only).
CROSS_ENTROPY_PROPERTIES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, REPLICA)

_F64 = torch.float64


# --- embeddings ----------------------------------------------------------------------------------


def _unmasked_leak(case: EmbeddingCase, values: list[EmbeddingRankResult], group: list[int], ids: torch.Tensor,
                   ref: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The outputs an embedding would give whose ranks add a row for ids they do not own (rows read from
    the ranks' stored tables); ``(how, leaky output, its magnitude)`` for each way of picking the row."""
    tp = len(group)
    stored = [values[r].weight for r in group]
    if any(w is None for w in stored):
        return
    sizes = [w.shape[0] for w in stored]
    ranges = [vocab_rows(sizes[i], case.vocab_size, tp, i, sizes) for i in range(tp)]
    if any(rg is None for rg in ranges):
        return
    for how in ("row 0", "clamped"):
        leak = torch.zeros_like(ref)
        mag = ref.abs().clone()
        for i, (start, stop) in enumerate(ranges):  # type: ignore[misc]
            outside = (ids < start) | (ids >= stop)
            local = torch.zeros_like(ids) if how == "row 0" else (ids - start).clamp(0, stop - start - 1)
            rows = stored[i].to(_F64)[local] * outside.unsqueeze(-1)
            leak = leak + rows
            mag = mag + rows.abs()
        yield how, ref + leak, mag


@recogniser(VOCAB_MASK_MISSING)
def _vocab_mask_missing(variant: Any, case: EmbeddingCase, values: list[EmbeddingRankResult], group: list[int],
                        ids: torch.Tensor, ref: torch.Tensor, rank: int) -> Failure | None:
    """Every rank's output is the dense lookup plus one row of each rank not owning the id."""
    if len(group) < 2:
        return None
    got = values[rank].output
    for how, leaky, mag in _unmasked_leak(case, values, group, ids, ref):
        tol = tolerance(case.torch_dtype, mag, reduction_length=len(group), world_size=len(group))
        if close(got, leaky, tol) and not close(got, ref, tol):
            return failure(
                variant, case, FORWARD, VOCAB_MASK_MISSING,
                f"the output on rank {rank} is the dense lookup plus, for every id, the {how} row of each of the "
                f"{len(group) - 1} other ranks: ranks look up ids they do not own without zeroing those rows "
                "before the all-reduce (mask the rows of ids outside the rank's vocabulary range)",
                rank=rank, details={"row": how})
    return None


def evaluate_embedding(variant: EmbeddingVariant, obs: Observation, properties: Sequence[str] | None = None) -> list[Failure]:
    """Evaluate ``properties`` (default: all) of an embedding case; return the failures, in order."""
    case: EmbeddingCase = obs.case
    wanted = tuple(properties or EMBEDDING_PROPERTIES)
    tp = case.tp_size or case.world_size
    divides = case.vocab_size % tp == 0
    if obs.error is not None:
        if not divides:
            found = refusal_failure(variant.name, case, obs.error, f"vocab_size={case.vocab_size} is not divisible by "
                                    f"tp_size={tp}", [case.vocab_size, tp])
            return [found] if found is not None and DIVISIBILITY in wanted else []
        return [run_failure(variant.name, case, obs.error, backward=WEIGHT_GRAD)]
    values = obs.values or []
    failures: list[Failure] = []
    table = obs.data.table.to(_F64)
    for g, group in enumerate(groups_of(case)):
        ids, upstream = obs.data.ids[g], obs.data.grads[g].to(_F64)
        ref = F.embedding(ids, table)
        sizes = [values[r].rows for r in group]
        dense_grad = _table_grad(case, ids, upstream) if WEIGHT_GRAD in wanted else None
        for i, r in enumerate(group):
            v = values[r]
            if v.status != OK:
                failures.append(_embedding_layout_failure(variant, case, v, r, divides))
                break
            found = compare(variant, case, FORWARD, "the embedding output", r, v.output, ref,
                             tolerance(case.torch_dtype, ref.abs(), reduction_length=1, world_size=tp),
                             [partial(_vocab_mask_missing, variant, case, values, group, ids, ref, r)])
            if found is not None and FORWARD in wanted:
                failures.append(found)
                break
            where = vocab_rows(v.rows, case.vocab_size, tp, i, sizes)  # type: ignore[arg-type]
            if where is None:
                failures.append(_embedding_layout_failure(variant, case, dataclasses.replace(
                    v, status=WEIGHT_SHAPE, shape=(v.rows, case.embedding_dim)), r, divides))
                break
            if WEIGHT_GRAD in wanted:
                expected, mag = _rows_of(case, dense_grad, where)  # type: ignore[arg-type]
                tol = tolerance(case.torch_dtype, mag, reduction_length=case.tokens, world_size=tp)
                found = compare(variant, case, WEIGHT_GRAD, "the embedding table's grad", r, v.weight_grad,
                                 expected, tol)
                if found is not None:
                    failures.append(found)
                    break
    if REPLICA in wanted and not failures:
        found = replica(variant, case, values, [("the embedding output", lambda v: v.output)])
        if found is not None:
            failures.append(found)
    return [f for f in failures if f.property in wanted]


def _table_grad(case: EmbeddingCase, ids: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense table grad (the upstream rows summed per id) and its magnitude (their absolute values)."""
    d = case.embedding_dim
    flat_ids, flat_g = ids.reshape(-1), upstream.reshape(-1, d)
    grad = torch.zeros(case.vocab_size, d, dtype=_F64).index_add_(0, flat_ids, flat_g)
    mag = torch.zeros(case.vocab_size, d, dtype=_F64).index_add_(0, flat_ids, flat_g.abs())
    return grad, mag


def _rows_of(case: EmbeddingCase, dense: tuple[torch.Tensor, torch.Tensor],
             where: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows ``[start, stop)`` of the dense grad and of its magnitude (zero rows past the vocabulary)."""
    grad, mag = dense
    start, stop = where
    lo, hi = min(start, case.vocab_size), min(stop, case.vocab_size)
    pad = (stop - start) - (hi - lo)  # padding rows past the vocabulary: zero
    if not pad:
        return grad[lo:hi], mag[lo:hi]
    zeros = torch.zeros(pad, case.embedding_dim, dtype=_F64)
    return torch.cat([grad[lo:hi], zeros]), torch.cat([mag[lo:hi], zeros])


def _embedding_layout_failure(variant: Any, case: EmbeddingCase, v: EmbeddingRankResult, rank: int,
                              divides: bool) -> Failure:
    if v.status == NO_WEIGHT:
        return failure(variant, case, FORWARD, SHAPE_ERROR, f"rank {rank}'s module has no parameter "
                        f"{variant.weight!r} (the variant's weight); name the table parameter with weight=", rank=rank)
    if v.status == OUTPUT_SHAPE:
        shape = None if v.output is None else list(v.output.shape)
        return failure(variant, case, FORWARD, SHAPE_ERROR, f"the embedding output on rank {rank} has shape {shape} "
                        f"({v.output_type}); expected {[*case.batch_shape, case.embedding_dim]}", rank=rank)
    shape = list(v.shape or ())
    tp = case.tp_size or case.world_size
    if not divides and shape and shape[0] * tp < case.vocab_size:
        return failure(variant, case, DIVISIBILITY, DIVISIBILITY_UNCHECKED,
                        f"vocab_size={case.vocab_size} is not divisible by tp_size={tp}, and rank {rank} stores "
                        f"{shape[0]} rows of the table: {shape[0] * tp} rows in all, fewer than the vocabulary (it "
                        "was silently truncated); pad the vocabulary or raise a ValueError naming the sizes", rank=rank)
    return failure(variant, case, FORWARD, SHAPE_ERROR,
                    f"rank {rank} stores its table as shape {shape}: not a row shard of the [{case.vocab_size}, "
                    f"{case.embedding_dim}] table (the same rows on every rank, padded, or torch.tensor_split's "
                    "pieces)", rank=rank, details={"shape": shape})


# --- cross-entropies -----------------------------------------------------------------------------


class _CrossEntropyReference:
    """F.cross_entropy in float64 for one tp group, its grads and the bounds of the module docstring."""

    def __init__(self, variant: CrossEntropyVariant, case: CrossEntropyCase, obs: Observation, g: int) -> None:
        data = obs.data
        self.case, self.tp = case, case.tp_size or case.world_size
        self.target = data.targets[g]
        self.ignored = self.target == case.ignore_index
        dt, vocab, ls = case.torch_dtype, case.vocab_size, case.label_smoothing
        u = eps(dt)
        if variant.input == "hidden":
            self.hidden = data.hidden[g].to(_F64).clone().requires_grad_()
            self.weight = data.weight.to(_F64).clone().requires_grad_()
            x = F.linear(self.hidden, self.weight)
            x.retain_grad()  # the logits' grad bounds the hidden states' and the classifier's
            # logits as the ranks hold them: the classifier padded with zero rows
            self.padded_logits = F.pad(x.detach(), (0, data.width - vocab))
            mag_x = data.hidden[g].to(_F64).abs() @ data.weight.to(_F64).abs().T
            dx = tolerance(dt, mag_x, reduction_length=case.hidden, world_size=self.tp).amax(-1)
        else:
            x = data.logits[g][..., :vocab].to(_F64).clone().requires_grad_()
            self.padded_logits = data.logits[g].to(_F64)
            dx = torch.zeros(self.target.shape, dtype=_F64)
        self.x = x
        loss = dense_cross_entropy(x, self.target, label_smoothing=ls, ignore_index=case.ignore_index,
                                   reduction=case.reduction)
        upstream = data.grads[g].to(_F64)
        loss.backward(upstream)
        self.loss = loss.detach()
        xs = x.detach()
        # Full-size [tokens, V] float64 temporaries dominate at a realistic vocabulary: in place where possible.
        m = xs.amax(-1, keepdim=True)
        shifted = xs - m
        log_z = torch.logsumexp(shifted, -1)
        safe = self.target.masked_fill(self.ignored, 0)
        picked = shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1).abs()
        magnitude = 1 + log_z + picked
        if ls > 0.0:
            magnitude = magnitude + ls * shifted.abs().mean(-1)
        del shifted
        per_token = tolerance(dt, magnitude, reduction_length=vocab, world_size=self.tp) + 2 * dx
        per_token = per_token.masked_fill(self.ignored, 0.0)
        count = max(int((~self.ignored).sum()), 1)
        if case.reduction == "none":
            self.token_loss = self.loss
            self.loss_tol = per_token + u * self.loss.abs()
        else:
            self.token_loss = dense_cross_entropy(xs, self.target, label_smoothing=ls, ignore_index=case.ignore_index,
                                                  reduction="none")
            scale = 1.0 if case.reduction == "sum" else 1.0 / count
            summed = per_token.sum() + tolerance(dt, self.token_loss.abs().sum(), reduction_length=case.tokens,
                                                 world_size=self.tp)
            self.loss_tol = summed * scale + u * self.loss.abs()
        # the logits' grad, per entry: (p_j - (1-eps)[j=t] - eps/V) g, its magnitude (p_j + (1-eps)[j=t] + eps/V)|g|
        g_tok = (upstream if case.reduction == "none" else upstream / (1 if case.reduction == "sum" else count))
        g_abs = g_tok.expand(self.target.shape).abs().masked_fill(self.ignored, 0.0).unsqueeze(-1)
        p = torch.softmax(xs, -1)
        mag = p.add(ls / vocab).mul_(g_abs)
        mag.scatter_add_(-1, safe.unsqueeze(-1), (1 - ls) * g_abs)
        g_tol = tolerance(dt, mag, reduction_length=vocab, world_size=self.tp)
        g_tol.add_(x.grad.abs(), alpha=2 * u)  # its own roundings to the dtype
        if variant.input == "hidden":
            g_tol.add_(p.mul_(g_abs).mul_(2 * dx.unsqueeze(-1)))  # the logits' own error moves p
        del p
        if variant.input == "hidden":
            w_abs = data.weight.to(_F64).abs()
            h_abs = data.hidden[g].to(_F64).abs().reshape(-1, case.hidden)
            self.hidden_grad = self.hidden.grad
            # tolerance() is linear in the magnitude: one product of |W| (|h|) per bound, not two
            unit = torch.ones((), dtype=_F64)
            over_vocab = float(tolerance(dt, unit, reduction_length=vocab, world_size=self.tp))
            over_tokens = float(tolerance(dt, unit, reduction_length=case.tokens, world_size=self.tp))
            self.hidden_tol = (mag * over_vocab + g_tol) @ w_abs
            wg = self.weight.grad
            w_tol = (mag * over_tokens + g_tol).reshape(-1, vocab).T @ h_abs
            self.weight_grad, self.weight_tol = (self._pad_rows(wg, data.width), self._pad_rows(w_tol, data.width))
        else:
            pad = data.width - vocab  # padding columns: exactly zero
            self.logits_grad = F.pad(x.grad, (0, pad)) if pad else x.grad
            self.logits_tol = F.pad(g_tol, (0, pad)) if pad else g_tol

    @staticmethod
    def _pad_rows(t: torch.Tensor, width: int) -> torch.Tensor:
        return torch.cat([t, t.new_zeros(width - t.shape[0], *t.shape[1:])])

    def reduce(self, per_token: torch.Tensor) -> torch.Tensor:
        """A per-token candidate loss reduced as the case asks (ignored tokens contribute zero)."""
        per_token = per_token.masked_fill(self.ignored, 0.0)
        if self.case.reduction == "sum":
            return per_token.sum()
        if self.case.reduction == "mean":
            return per_token.sum() / max(int((~self.ignored).sum()), 1)
        return per_token

    def smoothed(self, shifted: torch.Tensor, valid: torch.Tensor | None = None, count: Any = None) -> torch.Tensor:
        """``(1-eps)(log Z - s_t) + eps (log Z - mean_j s_j)`` of shifted logits ``s`` (padding: ``valid``)."""
        ls = self.case.label_smoothing
        z_terms = shifted.exp() if valid is None else shifted.exp() * valid
        log_z = z_terms.sum(-1).log()
        safe = self.target.masked_fill(self.ignored, 0)
        nll = log_z - shifted.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        if ls == 0.0:
            return nll
        total = shifted.sum(-1) if valid is None else (shifted * valid).sum(-1)
        return (1 - ls) * nll + ls * (log_z - total / (shifted.shape[-1] if count is None else count))


def _loss_candidate(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference, values: list[CrossEntropyRankResult],
                    group: list[int], name: str, candidate: Callable[[int], torch.Tensor | None], message: str) -> Failure | None:
    """A failure named ``name`` when every rank's loss equals ``candidate(rank index)`` within the bound,
    and that bound tells it apart from the dense loss on some rank (else it is no evidence)."""
    hits, told_apart = 0, False
    for i, r in enumerate(group):
        cand = candidate(i)
        got = values[r].output
        if cand is None or got is None or got.shape != cand.shape:
            return None
        # The buggy computation's own reductions may be up to tp times longer (a gathered vocabulary).
        tol = ref.loss_tol * (1 + len(group)) + tolerance(case.torch_dtype, cand.abs(), reduction_length=1,
                                                           world_size=len(group))
        if not close(got, cand, tol):
            return None
        told_apart = told_apart or not close(got, ref.loss, tol)
        hits += 1
    if not hits or not told_apart:
        return None
    return failure(variant, case, FORWARD, name, message, rank=group[0])


@recogniser(LOSS_OFF_BY_LOG_TP)
def _loss_off_by_log_tp(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference, values: list[CrossEntropyRankResult],
                        group: list[int]) -> Failure | None:
    tp = len(group)
    if tp < 2:
        return None
    cand = ref.reduce(ref.token_loss + math.log(tp))
    return _loss_candidate(variant, case, ref, values, group, LOSS_OFF_BY_LOG_TP, lambda i: cand,
                           f"the loss is the dense loss plus exactly log(tp) = log({tp}) = {math.log(tp):.6g} on "
                           "every token: the cross-entropy saw each logit tp times, i.e. it was given the gathered "
                           "logits as if they were this rank's vocabulary shard; pass the shard (a column-parallel "
                           "output without gather_output), or use a dense cross-entropy on gathered logits")


@recogniser(LABEL_SMOOTHING_PER_SHARD)
def _smoothing_per_shard(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference, values: list[CrossEntropyRankResult],
                         group: list[int]) -> Failure | None:
    tp, ls, vocab = len(group), case.label_smoothing, case.vocab_size
    if tp < 2 or ls == 0.0:
        return None
    xs = ref.x.detach()
    width = ref.padded_logits.shape[-1] // tp
    log_z = torch.logsumexp(xs, -1)
    safe = ref.target.masked_fill(ref.ignored, 0)
    nll = log_z - xs.gather(-1, safe.unsqueeze(-1)).squeeze(-1)

    def shard_mean(i: int) -> torch.Tensor | None:
        lo, hi = min(i * width, vocab), min((i + 1) * width, vocab)
        return None if hi <= lo else xs[..., lo:hi].mean(-1)

    def torch_form(i: int) -> torch.Tensor | None:
        mean = shard_mean(i)
        return None if mean is None else ref.reduce((1 - ls) * nll + ls * (log_z - mean))

    def megatron_form(given: float) -> Callable[[int], torch.Tensor | None]:
        def form(i: int) -> torch.Tensor | None:  # Megatron's smoothing with the shard's size as V
            mean, n = shard_mean(i), min((i + 1) * width, vocab) - min(i * width, vocab)
            if mean is None or n < 2:
                return None
            s = given * n / (n - 1)
            return ref.reduce((1 - s) * nll - s * (mean - log_z))

        return form

    from tpsim.presets.megatron import megatron_label_smoothing

    message = (f"with label_smoothing={ls:g}, each rank's loss averages the smoothing term -log p_j over its own "
               f"vocabulary shard only (so the {tp} ranks' losses differ): all-reduce the sum of the shard's "
               "log-probabilities (or logits) and divide by the whole vocabulary size (Megatron-LM #737)")
    # Megatron's code given eps itself, or given its own label_smoothing for the same targets (the
    # Megatron preset passes eps (V-1)/V: docs/presets.md).
    for form in (torch_form, megatron_form(ls), megatron_form(megatron_label_smoothing(ls, vocab))):
        found = _loss_candidate(variant, case, ref, values, group, LABEL_SMOOTHING_PER_SHARD, form, message)
        if found is not None:
            return found
    return None


@recogniser(MAX_NOT_REDUCED)
def _max_not_reduced(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference, values: list[CrossEntropyRankResult],
                     group: list[int]) -> Failure | None:
    tp, vocab = len(group), case.vocab_size
    if tp < 2:
        return None
    full = ref.padded_logits
    width = full.shape[-1] // tp
    valid = (torch.arange(full.shape[-1]) < vocab).to(_F64)
    shards = []
    for i in range(tp):
        block = full[..., i * width:(i + 1) * width]
        v = valid[i * width:(i + 1) * width]
        m = block.masked_fill(v == 0, float("-inf")).amax(-1, keepdim=True)
        shards.append((block - m).masked_fill(v == 0, 0.0) if bool(v.any()) else torch.zeros_like(block))
    shifted = torch.cat(shards, -1)
    cand = ref.reduce(ref.smoothed(shifted, valid, vocab))
    return _loss_candidate(variant, case, ref, values, group, MAX_NOT_REDUCED, lambda i: cand,
                           "the loss equals the cross-entropy in which every rank shifted its logits by its own "
                           "maximum: the all-reduce MAX of the logits' maximum over the tp group is missing, so the "
                           "shards' exponentials are added with different shifts")


@recogniser(VOCAB_PADDING_IN_SOFTMAX)
def _padding_in_softmax(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference, values: list[CrossEntropyRankResult],
                        group: list[int]) -> Failure | None:
    full = ref.padded_logits
    if full.shape[-1] == case.vocab_size:
        return None
    m = full.amax(-1, keepdim=True)
    cand = ref.reduce(ref.smoothed(full - m))
    return _loss_candidate(variant, case, ref, values, group, VOCAB_PADDING_IN_SOFTMAX, lambda i: cand,
                           f"vocab_size={case.vocab_size} was padded to {full.shape[-1]} ids for tp_size={len(group)}, "
                           "and the loss is the cross-entropy over the padded vocabulary: the padding columns took "
                           "part in the softmax; leave the ids >= vocab_size out (Megatron-LM #1754)")


@recogniser(GRAD_NOT_REDUCED)
def _hidden_grad_not_reduced(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference,
                             values: list[CrossEntropyRankResult], group: list[int], rank: int) -> Failure | None:
    grads = [values[r].hidden_grad for r in group]
    if len(group) < 2 or any(g is None for g in grads):
        return None
    if not rank_summands([g.to(_F64) for g in grads], ref.hidden_grad, ref.hidden_tol):
        return None
    return failure(variant, case, INPUT_GRAD, GRAD_NOT_REDUCED,
                    f"the hidden states' grad differs across the ranks of tp group {group} and their sum is the dense "
                    "grad: each rank holds only its vocabulary's summand; enter the hidden states through "
                    "copy_to_tensor_parallel_region so the backward all-reduces it (apple/ml-cross-entropy #42)",
                    rank=rank)


def evaluate_cross_entropy(variant: CrossEntropyVariant, obs: Observation,
                           properties: Sequence[str] | None = None) -> list[Failure]:
    """Evaluate ``properties`` (default: all that apply) of a cross-entropy case; return the failures."""
    case: CrossEntropyCase = obs.case
    wanted = tuple(properties or CROSS_ENTROPY_PROPERTIES)
    if obs.error is not None:
        return [run_failure(variant.name, case, obs.error)]
    values = obs.values or []
    tp = case.tp_size or case.world_size
    failures: list[Failure] = []
    for g, group in enumerate(groups_of(case)):
        ref = _CrossEntropyReference(variant, case, obs, g)
        for r in group:
            v = values[r]
            if v.status != OK:
                out = v.output
                expected = list(case.batch_shape) if case.reduction == "none" else []
                failures.append(failure(variant, case, FORWARD, SHAPE_ERROR,
                                         f"the loss on rank {r} has shape {None if out is None else list(out.shape)} "
                                         f"({v.output_type}); expected {expected} for reduction="
                                         f"{case.reduction!r}", rank=r))
                return [f for f in failures if f.property in wanted]
            loss_recognisers = [partial(fn, variant, case, ref, values, group) for fn in
                                (_loss_off_by_log_tp, _smoothing_per_shard, _max_not_reduced, _padding_in_softmax)]
            found = compare(variant, case, FORWARD, "the loss", r, v.output, ref.loss, ref.loss_tol,
                             loss_recognisers)
            if found is not None:
                failures.append(found)
                break
        for i, r in enumerate(group):
            v = values[r]
            if variant.input == "logits":
                width = ref.logits_grad.shape[-1] // tp
                cols = slice(i * width, (i + 1) * width)
                found = compare(variant, case, INPUT_GRAD, "the logits' grad", r, v.input_grad,
                                 ref.logits_grad[..., cols], ref.logits_tol[..., cols])
            else:
                found = compare(variant, case, INPUT_GRAD, "the hidden states' grad", r, v.hidden_grad,
                                 ref.hidden_grad, ref.hidden_tol,
                                 [partial(_hidden_grad_not_reduced, variant, case, ref, values, group, r)])
            if found is not None:
                failures.append(found)
                break
        if variant.input == "hidden":
            width = ref.weight_grad.shape[0] // tp
            for i, r in enumerate(group):
                rows = slice(i * width, (i + 1) * width)
                found = compare(variant, case, WEIGHT_GRAD, "the classifier rows' grad", r, values[r].weight_grad,
                                 ref.weight_grad[rows], ref.weight_tol[rows])
                if found is not None:
                    failures.append(found)
                    break
    if REPLICA in wanted:
        items = [("the loss", lambda v: v.output)] + ([("the hidden states' grad", lambda v: v.hidden_grad)]
                                                      if variant.input == "hidden" else [])
        found = replica(variant, case, values, items)
        if found is not None:
            failures.append(found)
    seen: set[str] = set()
    result = []
    for f in failures:  # one failure per property: the first group's
        if f.property in wanted and f.property not in seen:
            seen.add(f.property)
            result.append(f)
    return result
