"""One world run per vocab-parallel case, and its float64 dense reference.

**The data** of a case is drawn from its ``seed`` in the parent (:func:`embedding_data`,
:func:`cross_entropy_data`), float64 normal draws rounded to the case's dtype, so the reference and
the ranks see the very same numbers: the table (embedding) or the classifier (cross-entropy with
hidden states), then per tp group its token ids or targets, its logits or hidden states, and its
upstream grads. Group 0 gets the **shard boundaries first**: the first and last id of every rank's
range (padded as Megatron pads, and as ``torch.tensor_split`` cuts), then 0 and ``V - 1``; a
cross-entropy's last position is ``ignore_index`` when there are two or more. Padding columns of
the logits hold a large value (:data:`PADDING_LOGIT`): an implementation that lets them into the
softmax is far off.

**The ranks** (:func:`embedding_rank`, :func:`cross_entropy_rank`, module-level so gloo workers can
run them) build or call the variant on their tp group and return tensors, as an
:class:`EmbeddingRankResult` or a :class:`CrossEntropyRankResult`; everything is compared in the
parent (:mod:`tpsim.props.vocab.checks`).

**Which rows a rank holds** is read from the shape it stores (:func:`vocab_rows`): ``n`` rows on
every rank of a vocabulary padded to ``tp * n`` (Megatron), or ``torch.tensor_split``'s uneven pieces.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from tpsim.props.observation import RankOutput
from tpsim.props.rank import enter_rank, rank_phase
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.variant import get_param

__all__ = [
    "NO_WEIGHT",
    "PADDING_LOGIT",
    "WEIGHT_SHAPE",
    "CrossEntropyData",
    "CrossEntropyRankResult",
    "EmbeddingData",
    "EmbeddingRankResult",
    "boundary_ids",
    "cross_entropy_data",
    "cross_entropy_rank",
    "embedding_data",
    "embedding_rank",
    "padded_width",
    "vocab_rows",
]

#: The logit every padding column holds (see the module docstring).
PADDING_LOGIT = 30.0


def padded_width(vocab: int, tp: int, multiple: int = 1) -> int:
    """Megatron's padded vocabulary: ``vocab`` rounded up to a multiple of ``multiple * tp``."""
    step = multiple * tp
    return -(-vocab // step) * step


def vocab_rows(stored: int, vocab: int, tp: int, rank: int, stored_by_rank: list[int] | None = None) -> tuple[int, int] | None:
    """``(start, stop)``: the ids rank ``rank`` owns when it stores ``stored`` rows of a vocabulary of
    ``vocab`` ids over ``tp`` ranks (``stored_by_rank``: every rank's size, when known); None when no
    layout explains the sizes.

    Padded (Megatron): every rank stores the same ``n`` with ``tp * n >= vocab``; rows past ``vocab``
    are padding. Uneven (``torch.tensor_split``): rank ``r`` stores ``vocab // tp`` rows, one more on
    the first ``vocab % tp`` ranks. Anything else (e.g. ``vocab // tp`` rows everywhere: a truncated
    vocabulary) explains nothing."""
    sizes = stored_by_rank if stored_by_rank is not None else [stored] * tp
    if len(set(sizes)) == 1:
        return (rank * stored, (rank + 1) * stored) if stored * tp >= vocab else None
    split = [vocab // tp + (1 if r < vocab % tp else 0) for r in range(tp)]
    if list(sizes) == split:
        start = sum(split[:rank])
        return start, start + stored
    return None


def boundary_ids(vocab: int, tp: int, multiple: int = 1) -> list[int]:
    """The first and last real id of every rank's range (padded and uneven splits), then 0 and ``vocab - 1``."""
    ids: list[int] = []
    n = padded_width(vocab, tp, multiple) // tp
    for r in range(tp):
        ids += [r * n, (r + 1) * n - 1]
    sizes = [vocab // tp + (1 if r < vocab % tp else 0) for r in range(tp)]
    start = 0
    for s in sizes:
        ids += [start, start + s - 1]
        start += s
    ids += [0, vocab - 1]
    seen: list[int] = []
    for i in ids:
        if 0 <= i < vocab and i not in seen:
            seen.append(i)
    return seen


def _ids(gen: torch.Generator, shape: tuple[int, ...], vocab: int, first: list[int]) -> torch.Tensor:
    ids = torch.randint(0, vocab, shape, generator=gen, dtype=torch.long)
    flat = ids.view(-1)
    n = min(len(first), flat.numel())
    if n:
        flat[:n] = torch.tensor(first[:n], dtype=torch.long)
    return ids


def _draw(gen: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    # Drawn in float32 for float32 and narrower cases (half the work of a float64 draw at a realistic
    # vocabulary), then rounded to the case's dtype: the ranks and the reference see the same values.
    # Scaled in place, and not at all by 1 (the same values: at a realistic vocabulary each full-size
    # temporary is a pass over the table's memory).
    wide = torch.promote_types(dtype, torch.float32)
    drawn = torch.randn(shape, generator=gen, dtype=wide)
    return (drawn if scale == 1.0 else drawn.mul_(scale)).to(dtype)


def _groups(case: Any) -> int:
    return case.world_size // (case.tp_size or case.world_size)


# --- embeddings ----------------------------------------------------------------------------------


@dataclass
class EmbeddingData:
    """A case's tensors: the ``[V, D]`` table, and per tp group its ids and upstream grads."""

    table: torch.Tensor
    ids: list[torch.Tensor]
    grads: list[torch.Tensor]


def embedding_data(case: EmbeddingCase, padding_multiple: int = 1) -> EmbeddingData:
    """Draw the table, then per group the ids (group 0: the shard boundaries first) and upstream grads."""
    gen = torch.Generator().manual_seed(case.seed)
    dt = case.torch_dtype
    table = _draw(gen, (case.vocab_size, case.embedding_dim), dt)
    first = boundary_ids(case.vocab_size, case.tp_size or case.world_size, padding_multiple)
    ids, grads = [], []
    for group in range(_groups(case)):
        ids.append(_ids(gen, case.batch_shape, case.vocab_size, first if group == 0 else []))
        grads.append(_draw(gen, (*case.batch_shape, case.embedding_dim), dt))
    return EmbeddingData(table, ids, grads)


#: :attr:`EmbeddingRankResult.status` values of an embedding's own (besides :mod:`tpsim.props.observation`').
NO_WEIGHT = "no-weight"  # the module has no parameter of the variant's weight name
WEIGHT_SHAPE = "weight-shape"  # the stored table is no row shard of the table (``shape`` says what it is)


@dataclass
class EmbeddingRankResult(RankOutput):
    """What one rank of an embedding case returns (besides :class:`~tpsim.props.observation.RankOutput`'s
    fields; ``status`` may be :data:`NO_WEIGHT` or :data:`WEIGHT_SHAPE`):

    - ``rows``: how many rows of the table it stores (None without a table);
    - ``shape``: the stored table's shape, for :data:`WEIGHT_SHAPE`;
    - ``weight``: the stored table after loading (padding rows included);
    - ``weight_grad``: its grad after the backward (None when it got none).
    """

    rows: int | None = None
    shape: tuple[int, ...] | None = None
    weight: torch.Tensor | None = None
    weight_grad: torch.Tensor | None = None


def embedding_rank(payload: dict[str, Any]) -> EmbeddingRankResult:
    """What every rank runs for one embedding case: build, load (``load=True``), forward, backward."""
    this_rank = enter_rank(payload)
    case, variant, data, group_index, rank, tp = (this_rank.case, this_rank.variant, this_rank.data, this_rank.group_index,
                                                  this_rank.rank, this_rank.tp)
    with rank_phase("build"):
        module = variant.build(case.vocab_size, case.embedding_dim, group=this_rank.group, dtype=case.torch_dtype,
                               weight=data.table.clone())
    weight = get_param(module, variant.weight)
    result = EmbeddingRankResult(group=group_index, tp_rank=rank)
    if weight is None:
        result.status = NO_WEIGHT
        return result
    rows = result.rows = weight.shape[0]
    if tuple(weight.shape[1:]) != (case.embedding_dim,):
        result.status, result.shape = WEIGHT_SHAPE, tuple(weight.shape)
        return result
    if variant.load:
        # Every rank's stored size decides the layout (uneven or padded): exchange them first.
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(tp)]
        dist.all_gather(sizes, torch.tensor([rows]), group=this_rank.group)
        where = vocab_rows(rows, case.vocab_size, tp, rank, [int(s) for s in sizes])
        if where is None:
            result.status, result.shape = WEIGHT_SHAPE, tuple(weight.shape)
            return result
        start, stop = where
        with torch.no_grad():
            real = data.table[min(start, case.vocab_size):min(stop, case.vocab_size)]
            weight[: real.shape[0]].copy_(real)
            weight[real.shape[0]:].zero_()  # padding rows (zeroing only them: the table is large)
    result.weight = weight.detach()  # the module is dropped after the run: no copy needed
    ids = data.ids[group_index]
    with rank_phase("forward"):
        out = result.read(variant.call(module, ids))
    upstream = data.grads[group_index]
    if result.unusable(out, upstream.shape):
        return result
    result.output = out.detach()
    with rank_phase("backward"):
        out.backward(upstream.to(out.dtype))
    result.weight_grad = None if weight.grad is None else weight.grad.detach()
    return result


# --- cross-entropies -----------------------------------------------------------------------------


@dataclass
class CrossEntropyData:
    """A case's tensors: per tp group the full padded logits ``[..., Vp]`` (or hidden states, with the
    ``[V, H]`` classifier), the targets and the upstream grads (per token, or one for a reduction)."""

    width: int
    targets: list[torch.Tensor]
    grads: list[torch.Tensor]
    logits: list[torch.Tensor] = field(default_factory=list)
    hidden: list[torch.Tensor] = field(default_factory=list)
    weight: torch.Tensor | None = None


def cross_entropy_data(case: CrossEntropyCase, ignores: bool = True) -> CrossEntropyData:
    """Draw the classifier (with hidden states), then per group the targets (group 0: the shard
    boundaries first; the last position ``ignore_index`` when ``ignores``: the variant takes one),
    logits or hidden states, upstream grads."""
    gen = torch.Generator().manual_seed(case.seed)
    dt, vocab, tp = case.torch_dtype, case.vocab_size, case.tp_size or case.world_size
    width = padded_width(vocab, tp)
    data = CrossEntropyData(width=width, targets=[], grads=[])
    if case.hidden:
        data.weight = _draw(gen, (vocab, case.hidden), dt, case.hidden**-0.5)
    for group in range(_groups(case)):
        target = _ids(gen, case.batch_shape, vocab, boundary_ids(vocab, tp) if group == 0 else [])
        if ignores and target.numel() >= 2:
            target.view(-1)[-1] = case.ignore_index
        data.targets.append(target)
        if case.hidden:
            data.hidden.append(_draw(gen, (*case.batch_shape, case.hidden), dt))
        else:
            # scale 3: the ranks' maxima differ, so a missing MAX all-reduce shows
            logits = _draw(gen, (*case.batch_shape, width), dt, 3.0)
            logits[..., vocab:] = PADDING_LOGIT
            data.logits.append(logits)
        shape = case.batch_shape if case.reduction == "none" else ()
        data.grads.append((torch.rand(shape, generator=gen, dtype=torch.float64) + 0.5).to(dt))
    return data


def _rows(full: torch.Tensor, width: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a ``[V, ...]`` tensor padded with zero rows to ``width``."""
    pad = full.new_zeros(width - full.shape[0], *full.shape[1:])
    return torch.cat([full, pad]).chunk(tp, dim=0)[rank]


@dataclass
class CrossEntropyRankResult(RankOutput):
    """What one rank of a cross-entropy case returns (besides :class:`~tpsim.props.observation.RankOutput`'s
    fields; ``output`` is the loss): the grads of its leaves after the backward, None where it got
    none — ``input_grad`` (its logits' shard), or ``hidden_grad`` and ``weight_grad`` (the hidden
    states and its classifier rows)."""

    input_grad: torch.Tensor | None = None
    hidden_grad: torch.Tensor | None = None
    weight_grad: torch.Tensor | None = None


def cross_entropy_rank(payload: dict[str, Any]) -> CrossEntropyRankResult:
    """What every rank runs for one cross-entropy case: call it on its shard, backward."""
    this_rank = enter_rank(payload)
    case, variant, data, group_index, rank, tp = (this_rank.case, this_rank.variant, this_rank.data, this_rank.group_index,
                                                  this_rank.rank, this_rank.tp)
    target = data.targets[group_index]
    if variant.input == "hidden":
        hidden = data.hidden[group_index].clone().requires_grad_()
        weight = _rows(data.weight, data.width, tp, rank).clone().requires_grad_()  # type: ignore[arg-type]
        leaves: tuple[torch.Tensor, ...] = (hidden, weight)
    else:
        logits = data.logits[group_index].chunk(tp, dim=-1)[rank].clone().requires_grad_()
        leaves = (logits,)
    with rank_phase("forward"):
        loss = variant.call(leaves, target, label_smoothing=case.label_smoothing, ignore_index=case.ignore_index,
                            vocab_size=case.vocab_size, reduction=case.reduction, group=this_rank.group)
    upstream = data.grads[group_index]
    result = CrossEntropyRankResult(group=group_index, tp_rank=rank)
    loss = result.read(loss)
    if result.unusable(loss, upstream.shape):
        return result
    result.output = loss.detach().clone()
    with rank_phase("backward"):
        loss.backward(upstream.to(loss.dtype))
    grads = [None if leaf.grad is None else leaf.grad.detach().clone() for leaf in leaves]
    if variant.input == "hidden":
        result.hidden_grad, result.weight_grad = grads
    else:
        (result.input_grad,) = grads
    return result


def dense_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, label_smoothing: float, ignore_index: int,
                        reduction: str) -> torch.Tensor:
    """``F.cross_entropy`` over the last dim of ``logits`` (``[..., V]``), per token shaped like ``target``."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), label_smoothing=label_smoothing,
                           ignore_index=ignore_index, reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss
