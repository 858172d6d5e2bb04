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
import functools
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
from tpsim.errors import RankError
from tpsim.props.blame import VariantRaised, blame, run_failure
from tpsim.props.judging import Check, GroupContext, Replicated, failure, replica_consistency
from tpsim.props.observation import OK, OUTPUT_SHAPE, Observation
from tpsim.props.property_names import DIVISIBILITY, FORWARD, INPUT_GRAD, REPLICA, WEIGHT_GRAD
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
    "CROSS_ENTROPY_CHECKS",
    "CROSS_ENTROPY_PROPERTIES",
    "EMBEDDING_CHECKS",
    "EMBEDDING_PROPERTIES",
    "CrossEntropyContext",
    "EmbeddingContext",
    "cross_entropy_failed",
]

#: The embedding family's properties, in report order.
EMBEDDING_PROPERTIES = (FORWARD, WEIGHT_GRAD, REPLICA, DIVISIBILITY)
#: The cross-entropy family's properties, in report order (weight grads: hidden-state variants only).
CROSS_ENTROPY_PROPERTIES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, REPLICA)

_F64 = torch.float64


# --- embeddings ----------------------------------------------------------------------------------


def _unmasked_leak(case: EmbeddingCase, values: list[EmbeddingRankResult], ids: torch.Tensor,
                   ref: torch.Tensor) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The outputs an embedding would give whose ranks add a row for ids they do not own (rows read from
    the ranks' stored tables; ``values`` in tp rank order); ``(how, leaky output, its magnitude)`` for
    each way of picking the row."""
    tp = len(values)
    stored = [v.weight for v in values]
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
def _vocab_mask_missing(variant: Any, case: EmbeddingCase, values: list[EmbeddingRankResult],
                        ids: torch.Tensor, ref: torch.Tensor, rank: int) -> Failure | None:
    """Every rank's output is the dense lookup plus one row of each rank not owning the id."""
    tp = len(values)
    if tp < 2:
        return None
    got = values[rank].output
    for how, leaky, mag in _unmasked_leak(case, values, ids, ref):
        tol = tolerance(case.torch_dtype, mag, reduction_length=tp, world_size=tp)
        if close(got, leaky, tol) and not close(got, ref, tol):
            return failure(
                variant, case, FORWARD, VOCAB_MASK_MISSING,
                f"the output on rank {rank} is the dense lookup plus, for every id, the {how} row of each of the "
                f"{tp - 1} other ranks: ranks look up ids they do not own without zeroing those rows "
                "before the all-reduce (mask the rows of ids outside the rank's vocabulary range)",
                rank=rank, details={"row": how})
    return None


class EmbeddingContext(GroupContext):
    """One tp group of an embedding case: its ids and upstream grad, the float64 dense lookup, and
    how many rows of the table each rank stores."""

    def __init__(self, variant: EmbeddingVariant, obs: Observation, group_index: int, ranks: Sequence[int],
                 values: list[EmbeddingRankResult]) -> None:
        super().__init__(variant, obs, group_index, ranks, values)
        self.ids, self.upstream = obs.data.ids[group_index], obs.data.grads[group_index].to(_F64)
        # A lookup copies rows: widening the rows looked up equals looking up in the widened table
        # (which, at a realistic vocabulary, is a [V, D] float64 copy).
        self.ref = F.embedding(self.ids, obs.data.table).to(_F64)
        self.sizes = [v.rows for v in values]
        self.divides = self.case.vocab_size % self.tp == 0

    def replicated(self) -> list[Replicated]:
        return [Replicated("the embedding output", [v.output for v in self.values])]

    def rows(self, i: int) -> tuple[int, int] | None:
        """The rows of the table tp rank ``i`` stores (None: no row shard of the table)."""
        return vocab_rows(self.values[i].rows, self.case.vocab_size, self.tp, i, self.sizes)  # type: ignore[arg-type]


def _embedding_forward(ctx: EmbeddingContext) -> Failure | None:
    variant, case = ctx.variant, ctx.case
    for i, v in enumerate(ctx.values):
        if v.status != OK:
            return _embedding_layout_failure(variant, case, v, i, ctx.divides)
        found = ctx.compared(FORWARD, "the embedding output", i, v.output, ctx.ref,
                        ctx.tol(ctx.ref.abs(), 1),
                        [partial(_vocab_mask_missing, variant, case, ctx.values, ctx.ids, ctx.ref, i)])
        if found is not None:
            return found
        if ctx.rows(i) is None:
            return _embedding_layout_failure(variant, case, dataclasses.replace(
                v, status=WEIGHT_SHAPE, shape=(v.rows, case.embedding_dim)), i, ctx.divides)
    return None


def _embedding_weight_grad(ctx: EmbeddingContext) -> Failure | None:
    case = ctx.case
    dense_grad: tuple[torch.Tensor, torch.Tensor] | None = None  # the [V, D] grad: only for a failure
    for i, v in enumerate(ctx.values):
        where = ctx.rows(i) if v.status == OK else None
        if where is None or _grad_rows_hold(case, ctx.ids, ctx.upstream, where, v.weight_grad, ctx.tp):
            continue  # a rank that stores no row shard is the forward's finding
        if dense_grad is None:
            dense_grad = _table_grad(case, ctx.ids, ctx.upstream)
        expected, mag = _rows_of(case, dense_grad, where)
        found = ctx.compared(WEIGHT_GRAD, "the embedding table's grad", i, v.weight_grad, expected,
                        ctx.tol(mag, case.rows))
        if found is not None:
            return found
    return None


#: The registry: the embedding family's check of each property on one tp group.
EMBEDDING_CHECKS: dict[str, Check] = {FORWARD: _embedding_forward, WEIGHT_GRAD: _embedding_weight_grad,
                                      REPLICA: replica_consistency}


def _table_grad(case: EmbeddingCase, ids: torch.Tensor, upstream: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The dense table grad (the upstream rows summed per id) and its magnitude (their absolute values)."""
    d = case.embedding_dim
    flat_ids, flat_g = ids.reshape(-1), upstream.reshape(-1, d)
    grad = torch.zeros(case.vocab_size, d, dtype=_F64).index_add_(0, flat_ids, flat_g)
    mag = torch.zeros(case.vocab_size, d, dtype=_F64).index_add_(0, flat_ids, flat_g.abs())
    return grad, mag


def _grad_rows_hold(case: EmbeddingCase, ids: torch.Tensor, upstream: torch.Tensor, where: tuple[int, int],
                    got: torch.Tensor | None, tp: int) -> bool:
    """Whether :func:`compare` finds rank's table grad ``got`` (rows ``where`` of the table) equal to its
    rows of the dense grad, decided without the ``[V, D]`` float64 grad and magnitude: the same
    comparison, element by element, with the same tolerance. The rows of the ids in the range get
    the dense grad and magnitude of :func:`_table_grad` (the same sums, in the same order); every
    other row's dense grad and magnitude are zero, so its tolerance is the floor and the comparison
    is ``|got| <= floor``, read from the largest ``|got|`` of each run of such rows (NaN never passes).
    False sends the caller to the full comparison, which names what is wrong."""
    start, stop = where
    d = case.embedding_dim
    if got is None or got.dtype != case.torch_dtype or tuple(got.shape) != (stop - start, d):
        return False
    flat_ids, flat_g = ids.reshape(-1), upstream.reshape(-1, d)
    mine = (flat_ids >= start) & (flat_ids < stop)
    rows, inverse = torch.unique(flat_ids[mine], sorted=True, return_inverse=True)
    local = [int(i) - start for i in rows]
    if local:
        grad = torch.zeros(len(local), d, dtype=_F64).index_add_(0, inverse, flat_g[mine])
        mag = torch.zeros(len(local), d, dtype=_F64).index_add_(0, inverse, flat_g[mine].abs())
        if bool(grad.isnan().any()):
            return False  # the full comparison's NaN rule decides
        tol = tolerance(case.torch_dtype, mag, reduction_length=case.rows, world_size=tp)
        if not close(got[local], grad, tol):
            return False
    atol = float(tolerance(case.torch_dtype, torch.zeros((), dtype=_F64), reduction_length=case.rows, world_size=tp))
    edges = [-1, *local, stop - start]
    for lo, hi in zip(edges[:-1], edges[1:], strict=True):
        if hi - lo > 1 and not float(torch.linalg.vector_norm(got[lo + 1:hi], ord=float("inf"))) <= atol:
            return False
    return True


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

    def __init__(self, variant: CrossEntropyVariant, case: CrossEntropyCase, obs: Observation, group_index: int) -> None:
        data = obs.data
        self.case, self.tp = case, case.tp_size or case.world_size
        self.target = data.targets[group_index]
        self.ignored = self.target == case.ignore_index
        dt, vocab, ls = case.torch_dtype, case.vocab_size, case.label_smoothing
        u = eps(dt)
        if variant.input == "hidden":
            self.hidden = data.hidden[group_index].to(_F64, copy=True).requires_grad_()
            self.weight = data.weight.to(_F64, copy=True).requires_grad_()
            x = F.linear(self.hidden, self.weight)
            x.retain_grad()  # the logits' grad bounds the hidden states' and the classifier's
            # logits as the ranks hold them: the classifier padded with zero rows
            self._padded = partial(F.pad, x.detach(), (0, data.width - vocab))
            mag_x = data.hidden[group_index].to(_F64).abs() @ data.weight.to(_F64).abs().T
            dx = tolerance(dt, mag_x, reduction_length=case.hidden, world_size=self.tp, in_place=True).amax(-1)
        else:
            # copy=True: one float64 copy, whatever the case's dtype (a [tokens, V] copy is not cheap)
            x = data.logits[group_index][..., :vocab].to(_F64, copy=True).requires_grad_()
            self._padded = partial(data.logits[group_index].to, _F64)
            dx = torch.zeros(self.target.shape, dtype=_F64)
        self.x = x
        loss = dense_cross_entropy(x, self.target, label_smoothing=ls, ignore_index=case.ignore_index,
                                   reduction=case.reduction)
        upstream = data.grads[group_index].to(_F64)
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
            summed = per_token.sum() + tolerance(dt, self.token_loss.abs().sum(), reduction_length=case.rows,
                                                 world_size=self.tp)
            self.loss_tol = summed * scale + u * self.loss.abs()
        # the logits' grad, per entry: (p_j - (1-eps)[j=t] - eps/V) g, its magnitude (p_j + (1-eps)[j=t] + eps/V)|g|
        self.upstream = upstream
        g_tok = (upstream if case.reduction == "none" else upstream / (1 if case.reduction == "sum" else count))
        #: each token's factor of its logits' grad (zero for ignored tokens), [..., 1]
        self.token_grad = g_tok.expand(self.target.shape).masked_fill(self.ignored, 0.0).unsqueeze(-1)
        g_abs = self.token_grad.abs()
        p = torch.softmax(xs, -1)
        # Logits in: p and mag are needed only for the logits' bound, which is made in their storage (the
        # same operations; a [tokens, V] float64 temporary fewer each); hidden states in: both are read again.
        hidden_in = variant.input == "hidden"
        mag = (p.add if hidden_in else p.add_)(ls / vocab).mul_(g_abs)
        mag.scatter_add_(-1, safe.unsqueeze(-1), (1 - ls) * g_abs)
        g_tol = tolerance(dt, mag, reduction_length=vocab, world_size=self.tp, in_place=not hidden_in)
        g_tol.add_(torch.abs(x.grad, out=shifted), alpha=2 * u)  # its own roundings to the dtype
        del shifted
        if hidden_in:
            g_tol.add_(p.mul_(g_abs).mul_(2 * dx.unsqueeze(-1)))  # the logits' own error moves p
        del p
        if variant.input == "hidden":
            w_abs = data.weight.to(_F64).abs()
            h_abs = data.hidden[group_index].to(_F64).abs().reshape(-1, case.hidden)
            self.hidden_grad = self.hidden.grad
            # tolerance() is linear in the magnitude: one product of |W| (|h|) per bound, not two
            unit = torch.ones((), dtype=_F64)
            over_vocab = float(tolerance(dt, unit, reduction_length=vocab, world_size=self.tp))
            over_tokens = float(tolerance(dt, unit, reduction_length=case.rows, world_size=self.tp))
            self.hidden_tol = (mag * over_vocab + g_tol) @ w_abs
            wg = self.weight.grad
            w_tol = (mag * over_tokens + g_tol).reshape(-1, vocab).T @ h_abs
            self.weight_grad, self.weight_tol = (self._pad_rows(wg, data.width), self._pad_rows(w_tol, data.width))
        else:
            pad = data.width - vocab  # padding columns: exactly zero
            self.logits_grad = F.pad(x.grad, (0, pad)) if pad else x.grad
            self.logits_tol = F.pad(g_tol, (0, pad)) if pad else g_tol

    @functools.cached_property
    def padded_logits(self) -> torch.Tensor:
        """The logits as the ranks hold them (padding columns included), float64: only the recognisers
        of a failing case read them, so they are made when first asked for."""
        return self._padded()

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


#: A candidate mechanism *explains* a result when the result's distance from the candidate is at most
#: this fraction of its largest distance from the dense result (plus the bound): a library that takes its own
#: path to the same wrong value (Megatron-core's float64 label smoothing lands 1.7e-7 from the closed
#: form, where its deviation from the dense loss is 0.1) still shows that mechanism, while a candidate
#: that explains less than 99.9% of the deviation is no evidence.
EXPLAINED = 1e-3


def _explains(got: torch.Tensor, cand: torch.Tensor, dense: torch.Tensor, tol: torch.Tensor) -> bool:
    """Whether ``cand`` explains ``got`` (see :data:`EXPLAINED`)."""
    # The deviation of the whole tensor: an entry the bug barely moves is no reason for a tighter test.
    away = (got.to(_F64) - dense.to(_F64)).abs().max() if got.shape == dense.shape and got.numel() else 0.0
    return close(got, cand, tol + EXPLAINED * away)


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
        if not _explains(got, cand, ref.loss, tol):
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


#: A candidate loss of a per-shard smoothing bug: ``form(logits, i)`` is tp rank ``i``'s loss (reduced as
#: the case asks) of the float64 logits ``[..., V]`` (a leaf, so that autograd gives its grad), None where
#: the form does not apply.
_ShardForm = Callable[[torch.Tensor, int], "torch.Tensor | None"]


def _per_shard_forms(case: CrossEntropyCase, ref: _CrossEntropyReference, tp: int) -> list[_ShardForm]:
    """The smoothed losses that average the smoothing term over rank ``i``'s shard only: as F.cross_entropy
    smooths, ``(1-eps) nll + eps (log Z - mean_shard x)``; and as Megatron does with the shard's ``n``
    ids as the vocabulary size, ``(1-s) nll - s (mean_shard x - log Z)`` with ``s = given n/(n-1)``,
    given eps itself or the Megatron preset's ``eps (V-1)/V`` (docs/presets.md). Megatron's backward is
    the derivative of that forward (the softmax minus ``(1-s)`` at the target minus ``s/n``), so the
    same forms give the grads it returns."""
    from tpsim.presets.megatron import megatron_label_smoothing

    ls, vocab = case.label_smoothing, case.vocab_size
    width = ref.padded_logits.shape[-1] // tp
    safe = ref.target.masked_fill(ref.ignored, 0)

    def pieces(x: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        lo, hi = min(i * width, vocab), min((i + 1) * width, vocab)
        if hi <= lo:
            return None
        log_z = torch.logsumexp(x, -1)
        nll = log_z - x.gather(-1, safe.unsqueeze(-1)).squeeze(-1)
        return log_z, nll, x[..., lo:hi].mean(-1), hi - lo

    def torch_form(x: torch.Tensor, i: int) -> torch.Tensor | None:
        got = pieces(x, i)
        if got is None:
            return None
        log_z, nll, mean, _ = got
        return ref.reduce((1 - ls) * nll + ls * (log_z - mean))

    def megatron_form(given: float) -> _ShardForm:
        def form(x: torch.Tensor, i: int) -> torch.Tensor | None:
            got = pieces(x, i)
            if got is None or got[3] < 2:  # one id: Megatron divides by n - 1 = 0 (see _smoothing_shard_of_one)
                return None
            log_z, nll, mean, n = got
            s = given * n / (n - 1)
            return ref.reduce((1 - s) * nll - s * (mean - log_z))

        return form

    return [torch_form, megatron_form(ls), megatron_form(megatron_label_smoothing(ls, vocab))]


def _smoothing_message(case: CrossEntropyCase, tp: int) -> str:
    return (f"with label_smoothing={case.label_smoothing:g}, each rank's loss averages the smoothing term -log p_j "
            f"over its own vocabulary shard only (so the {tp} ranks' losses differ, and so do their grads): "
            "all-reduce the sum of the shard's log-probabilities (or logits) and divide by the whole vocabulary "
            "size (Megatron-LM #737)")


@recogniser(LABEL_SMOOTHING_PER_SHARD)
def _smoothing_per_shard(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference, values: list[CrossEntropyRankResult],
                         group: list[int]) -> Failure | None:
    """The loss: every rank's loss is one per-shard form's loss of its rank (:func:`_per_shard_forms`)."""
    tp = len(group)
    if tp < 2 or case.label_smoothing == 0.0:
        return None
    xs = ref.x.detach()
    for form in _per_shard_forms(case, ref, tp):
        found = _loss_candidate(variant, case, ref, values, group, LABEL_SMOOTHING_PER_SHARD,
                                partial(form, xs), _smoothing_message(case, tp))
        if found is not None:
            return found
    return None


@recogniser(LABEL_SMOOTHING_PER_SHARD)
def _smoothing_per_shard_grad(variant: Any, case: CrossEntropyCase, ref: _CrossEntropyReference,
                              values: list[CrossEntropyRankResult], group: list[int]) -> Failure | None:
    """The logits' grad: every rank's grad is the derivative of one per-shard form's loss of its rank with
    respect to its own columns (autograd through the form, the case's upstream grad), within the bound the
    dense grad has (the module docstring) for the candidate's own entries, and some rank's grad is told
    apart from the dense one by it. Its own minimal case may be one where the losses stay within their
    (looser) bound, e.g. in bfloat16."""
    tp = len(group)
    if tp < 2 or case.label_smoothing == 0.0 or variant.input != "logits":
        return None
    dt, vocab = case.torch_dtype, case.vocab_size
    width = ref.logits_grad.shape[-1] // tp
    pad = ref.logits_grad.shape[-1] - vocab
    u = eps(dt)
    softmax_part = torch.softmax(ref.x.detach(), -1) * ref.token_grad  # p_j g: the dense and the candidate's
    for form in _per_shard_forms(case, ref, tp):
        all_dense = True  # evidence needs a rank whose grad the candidate tells apart from the dense one
        for i, r in enumerate(group):
            x = ref.x.detach().clone().requires_grad_()
            loss = form(x, i)
            got = values[r].input_grad
            if loss is None or got is None:
                break
            (grad,) = torch.autograd.grad(loss, x, ref.upstream)
            # entries (p_j - c_j) g: magnitude |p_j g| + |c_j g|, as the dense grad's bound is derived
            mag = softmax_part.abs() + (grad - softmax_part).abs()
            tol = tolerance(dt, mag, reduction_length=vocab, world_size=tp) + 2 * u * grad.abs()
            if pad:
                grad, tol = F.pad(grad, (0, pad)), F.pad(tol, (0, pad))
            cols = slice(i * width, (i + 1) * width)
            cand, tol = grad[..., cols], tol[..., cols]
            if got.shape != cand.shape or not _explains(got, cand, ref.logits_grad[..., cols], tol):
                break
            all_dense = all_dense and close(got, ref.logits_grad[..., cols], ref.logits_tol[..., cols])
        else:
            if not all_dense:
                return failure(variant, case, INPUT_GRAD, LABEL_SMOOTHING_PER_SHARD,
                               _smoothing_message(case, tp) + "; each rank's logits grad is the grad of its own "
                               "rank's per-shard loss", rank=group[0])
    return None


#: tpsim's own packages whose code is the variant's (a layer, a mutant), not the harness around it.
_VARIANT_PACKAGES = ("tpsim.layers", "tpsim.mutants")


def _variants_own(err: BaseException, error_type: str, phase: str) -> bool:
    """Whether ``err`` is a :class:`VariantRaised` of class ``error_type`` raised during ``phase`` by the
    variant's own code (its innermost frame outside the harness), read from its declared fields only."""
    if not isinstance(err, VariantRaised) or err.collective is not None:
        return False
    where = err.raised_in
    harness = where.split(".")[0] == "tpsim" and not where.startswith(_VARIANT_PACKAGES)
    return err.phase == phase and err.error_type == error_type and bool(where) and not harness


@recogniser(LABEL_SMOOTHING_PER_SHARD)
def _smoothing_shard_of_one(variant: Any, case: CrossEntropyCase, obs: Observation) -> Failure | None:
    """The crash of the same bug where each rank owns one id: the smoothing factor ``s n/(n-1)`` with the
    shard's ``n = 1`` as the vocabulary size divides by zero. Evidence: label_smoothing > 0, tp >= 2, a
    shard width of 1, and every rank's own code raised ZeroDivisionError in the forward."""
    tp = case.tp_size or case.world_size
    if tp < 2 or case.label_smoothing == 0.0 or obs.data.width // tp != 1 or not isinstance(obs.error, RankError):
        return None
    b = blame(obs.error)
    if b.death is not None or sorted(b.raised) != list(range(case.world_size)):
        return None
    if not all(_variants_own(e, "ZeroDivisionError", "forward") for e in b.raised.values()):
        return None
    first = b.raised[0]
    return Failure(FORWARD, LABEL_SMOOTHING_PER_SHARD,
                   f"with label_smoothing={case.label_smoothing:g} and vocab_size={case.vocab_size} over tp_size={tp}, "
                   f"every rank owns one id, and every rank raised ZeroDivisionError in the forward "
                   f"({first.raised_in}): the smoothing factor s*n/(n-1) takes the shard's n = 1 ids as the "
                   "vocabulary size; use the whole vocabulary's size and all-reduce the shard's log-probabilities "
                   "(Megatron-LM #737)", case=case, rank=0, variant=variant.name,
                   traceback=first.traceback_text.rstrip() or None, details={"phase": "forward", "shard_width": 1})


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


class CrossEntropyContext(GroupContext):
    """One tp group of a cross-entropy case: ``F.cross_entropy`` in float64, its grads and their bounds
    (:class:`_CrossEntropyReference`)."""

    def __init__(self, variant: CrossEntropyVariant, obs: Observation, group_index: int, ranks: Sequence[int],
                 values: list[CrossEntropyRankResult]) -> None:
        super().__init__(variant, obs, group_index, ranks, values)
        self.ref = _CrossEntropyReference(variant, self.case, obs, group_index)
        self.group = list(range(self.tp))  # the recognisers read every rank of the group, in tp rank order

    def replicated(self) -> list[Replicated]:
        items = [Replicated("the loss", [v.output for v in self.values])]
        if self.variant.input == "hidden":
            items.append(Replicated("the hidden states' grad", [v.hidden_grad for v in self.values]))
        return items


def _loss(ctx: CrossEntropyContext) -> Failure | None:
    variant, case, ref, values = ctx.variant, ctx.case, ctx.ref, ctx.values
    for r, v in enumerate(values):
        if v.status != OK:
            out = v.output
            expected = list(case.batch_shape) if case.reduction == "none" else []
            return failure(variant, case, FORWARD, SHAPE_ERROR,
                           f"the loss on rank {r} has shape {None if out is None else list(out.shape)} "
                           f"({v.output_type}); expected {expected} for reduction={case.reduction!r}", rank=r)
        recognisers = [partial(fn, variant, case, ref, values, ctx.group) for fn in
                       (_loss_off_by_log_tp, _smoothing_per_shard, _max_not_reduced, _padding_in_softmax)]
        found = ctx.compared(FORWARD, "the loss", r, v.output, ref.loss, ref.loss_tol, recognisers)
        if found is not None:
            return found
    return None


def _input_grad(ctx: CrossEntropyContext) -> Failure | None:
    variant, case, ref, values = ctx.variant, ctx.case, ctx.ref, ctx.values
    for r, v in enumerate(values):
        if variant.input == "logits":
            width = ref.logits_grad.shape[-1] // ctx.tp
            cols = slice(r * width, (r + 1) * width)
            found = ctx.compared(INPUT_GRAD, "the logits' grad", r, v.input_grad,
                            ref.logits_grad[..., cols], ref.logits_tol[..., cols],
                            [partial(_smoothing_per_shard_grad, variant, case, ref, values, ctx.group)])
        else:
            found = ctx.compared(INPUT_GRAD, "the hidden states' grad", r, v.hidden_grad,
                            ref.hidden_grad, ref.hidden_tol,
                            [partial(_hidden_grad_not_reduced, variant, case, ref, values, ctx.group, r)])
        if found is not None:
            return found
    return None


def _classifier_grad(ctx: CrossEntropyContext) -> Failure | None:
    ref = ctx.ref
    width = ref.weight_grad.shape[0] // ctx.tp
    for r, v in enumerate(ctx.values):
        rows = slice(r * width, (r + 1) * width)
        found = ctx.compared(WEIGHT_GRAD, "the classifier rows' grad", r, v.weight_grad,
                        ref.weight_grad[rows], ref.weight_tol[rows])
        if found is not None:
            return found
    return None


#: The registry: the cross-entropy family's check of each property on one tp group (weight grads:
#: hidden-state variants only, see the family's ``applicable``).
CROSS_ENTROPY_CHECKS: dict[str, Check] = {FORWARD: _loss, INPUT_GRAD: _input_grad, WEIGHT_GRAD: _classifier_grad,
                                          REPLICA: replica_consistency}


def cross_entropy_failed(variant: CrossEntropyVariant, obs: Observation) -> Failure:
    """A run that failed: the crash of per-shard smoothing with one id per rank, else the run's failure."""
    return _smoothing_shard_of_one(variant, obs.case, obs) or run_failure(variant.name, obs.case, obs.error)  # type: ignore[arg-type]
