"""Vocabulary parallelism: the embedding table and the softmax over the vocabulary, sharded by rows.

Shapes, with ``ws`` the tensor-parallel world size, ``r`` this rank, ``V`` the vocabulary size and
``Vp`` the padded vocabulary size (below)::

    VocabParallelEmbedding        weight [Vp/ws, D]      ids: [...] (replicated)  -> out: [..., D] (replicated)
    vocab_parallel_cross_entropy  logits [..., Vp/ws]    target: [...] (replicated) -> loss: [...] (replicated)
    vocab_parallel_linear_cross_entropy
                                  hidden [..., D] (replicated), weight [Vp/ws, D], target [...] -> loss [...]

Rank ``r`` owns the ids ``[r * Vp/ws, (r + 1) * Vp/ws)`` of the (padded) vocabulary, in rank order:
rows of the embedding table, columns of the logits.

**Vocabulary sizes that do not divide.** The vocabulary is padded the way Megatron pads it
(``_vocab_size_with_padding``): ``Vp`` is ``V`` rounded up to a multiple of ``padding_multiple * ws``
(Megatron's ``make_vocab_size_divisible_by`` times the tp size; ``padding_multiple=1`` pads the
least, to a multiple of ``ws``). Padding rows sit at the end of the table (on the last ranks), are
zero, are never looked up (ids must be ``< V``) and so always get a zero gradient; ``to_dense()``
drops them. The cross-entropy is told the true ``vocab_size`` and excludes the padding columns
from the softmax, so both are *exactly* their dense counterparts over ``V`` classes. (Megatron
keeps the padding logits in its softmax: a model trained that way pushes them down, but its loss
is not ``F.cross_entropy`` over the real vocabulary; Megatron-LM #1754 is a divergence at
vocabularies that do not divide by tp.)

**Label smoothing** follows ``F.cross_entropy``: the target distribution puts ``1 - eps + eps/V``
on the target and ``eps/V`` on every other id, so the loss is ``(1 - eps) * nll + eps * mean_j
(-log p_j)``, the mean over the *whole* vocabulary (all ranks). Megatron's ``label_smoothing=s``
spreads ``s`` over the ``V - 1`` other ids instead; it equals ``F.cross_entropy`` with
``label_smoothing = s * V / (V - 1)``. Averaging the smoothing term over one rank's shard gives
each rank a different loss (Megatron-LM #737).

Every collective is on ``group`` (explicit; ``None`` is the default group), and every argument
check happens before the first collective, on every rank alike, so bad input raises the same
``ValueError``/``TypeError`` everywhere instead of leaving a peer waiting.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.layers.linear import _SKIP_INIT, check_dtype, check_options, check_positive_int, skip_init
from tpsim.layers.mappings import (
    Group,
    _size_and_rank,
    all_gather,
    copy_to_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    resolve_group,
)

__all__ = [
    "REDUCTIONS",
    "CrossEntropySteps",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "padded_vocab_size",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_linear_cross_entropy",
    "vocab_range",
]

#: The ``reduction`` values the cross-entropy accepts (``F.cross_entropy``'s).
REDUCTIONS = ("none", "mean", "sum")


# ------------------------------------------------------------------------------ the vocab split


def padded_vocab_size(vocab_size: int, world_size: int, padding_multiple: int = 1) -> int:
    """``vocab_size`` rounded up to a multiple of ``padding_multiple * world_size`` (Megatron's padding)."""
    check_positive_int(vocab_size, "vocab_size", "padded_vocab_size")
    check_positive_int(world_size, "world_size", "padded_vocab_size")
    check_positive_int(padding_multiple, "padding_multiple", "padded_vocab_size")
    multiple = padding_multiple * world_size
    return -(-vocab_size // multiple) * multiple


def vocab_range(padded_vocab: int, rank: int, world_size: int) -> tuple[int, int]:
    """``[start, end)``: the ids rank ``rank`` owns of a padded vocabulary of ``padded_vocab`` ids."""
    if padded_vocab % world_size:
        raise ValueError(
            f"vocab_range: padded_vocab={padded_vocab} is not divisible by world_size={world_size}; "
            "pad it first with padded_vocab_size()"
        )
    per_rank = padded_vocab // world_size
    return rank * per_rank, (rank + 1) * per_rank


def _check_ids(ids: Any, vocab_size: int, owner: str, what: str, ignore_index: int | None = None) -> None:
    """Integer ids in ``[0, vocab_size)`` (or ``ignore_index``); checked before any collective.

    The range check reads the ids' min and max (one host sync on a GPU); a silent out-of-range id
    would otherwise read another rank's row or no row at all.
    """
    if not isinstance(ids, torch.Tensor):
        raise TypeError(f"{owner}: {what} must be a torch.Tensor of token ids, got {type(ids).__name__}")
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype == torch.bool:
        raise TypeError(f"{owner}: {what} must hold integer token ids (e.g. torch.long), got dtype {ids.dtype}")
    if ids.numel() == 0:
        return
    live = ids if ignore_index is None else ids[ids != ignore_index]
    if live.numel() == 0:
        return
    low, high = int(live.min()), int(live.max())
    if low < 0 or high >= vocab_size:
        bad = low if low < 0 else high
        ignore = "" if ignore_index is None else f" (or ignore_index={ignore_index})"
        raise ValueError(f"{owner}: {what} holds id {bad}, outside [0, vocab_size={vocab_size}){ignore}")


# ------------------------------------------------------------------------------ the embedding


class VocabParallelEmbedding(nn.Module):
    """``torch.nn.Embedding`` with the table's rows (the vocabulary) sharded over the tp group.

    Rank ``r`` holds ``weight`` ``[Vp/ws, embedding_dim]``: rows ``vocab_start_index`` to
    ``vocab_end_index`` of the table padded to ``Vp = padded_num_embeddings`` rows (see the module
    docstring). Forward: every rank looks up the ids it owns, writes zeros for the others (the
    mask), and one all-reduce (:func:`reduce_from_tensor_parallel_region`) sums the ranks' partial
    lookups, so the output ``[*ids.shape, embedding_dim]`` is replicated. Backward: each rank's
    ``weight.grad`` holds the gradient of its own rows only (padding rows: zero); no collective.

    Initialisation: the full ``[num_embeddings, embedding_dim]`` table is drawn exactly as
    ``nn.Embedding(num_embeddings, embedding_dim)`` draws it (``N(0, 1)``) from torch's default
    generator, zero padding rows appended, and this rank keeps its rows; with the same seed on every
    rank the layer *is* that ``nn.Embedding`` (``to_dense()`` gives it back).

    ``padding_idx``, ``max_norm`` and sparse gradients are not supported (``from_dense`` refuses
    them). Ids outside ``[0, num_embeddings)`` raise ``ValueError`` on every rank.
    """

    #: Dim of the ``[vocab, dim]`` table that is sharded.
    partition_dim = 0
    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("padding_multiple",)

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        padding_multiple: int = 1,
        group: Group = None,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        check_positive_int(num_embeddings, "num_embeddings", owner)
        check_positive_int(embedding_dim, "embedding_dim", owner)
        check_positive_int(padding_multiple, "padding_multiple", owner)
        dtype = check_dtype(dtype, owner)
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.padding_multiple = padding_multiple
        self.padded_num_embeddings = padded_vocab_size(num_embeddings, self.tp_world_size, padding_multiple)
        self.vocab_start_index, self.vocab_end_index = vocab_range(
            self.padded_num_embeddings, self.tp_rank, self.tp_world_size
        )
        local = self.padded_num_embeddings // self.tp_world_size
        self.weight = nn.Parameter(torch.empty(local, embedding_dim, dtype=dtype, device=device))
        if not _SKIP_INIT.get():
            self.reset_parameters()

    # -------------------------------------------------------------- shards <-> dense tensors

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a full ``[num_embeddings, ...]`` table, zero padding rows appended
        where this rank's range passes the end of the vocabulary; no communication."""
        if full.shape[0] != self.num_embeddings:
            raise ValueError(
                f"{type(self).__name__}.shard: expected a full table with num_embeddings={self.num_embeddings} "
                f"rows, got shape {tuple(full.shape)}"
            )
        start, end = self.vocab_start_index, self.vocab_end_index
        real = full[min(start, self.num_embeddings) : min(end, self.num_embeddings)]
        if real.shape[0] == end - start:
            return real
        padding = full.new_zeros(end - start - real.shape[0], *full.shape[1:])
        return torch.cat([real, padding], dim=0)

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Redraw the full table as ``nn.Embedding`` does (``N(0, 1)``) and keep this rank's rows."""
        full = torch.empty(self.num_embeddings, self.embedding_dim, dtype=self.weight.dtype)
        nn.init.normal_(full)
        self.weight.copy_(self.shard(full))

    @classmethod
    def from_dense(cls, embedding: nn.Embedding, *, group: Group = None, **options: Any) -> VocabParallelEmbedding:
        """This rank's rows of a dense ``nn.Embedding`` (same dtype and device; no communication).

        ``options``: ``padding_multiple``. Refuses an embedding with ``padding_idx``,
        ``max_norm``, ``scale_grad_by_freq`` or ``sparse`` (features this layer does not have).
        """
        owner = cls.__name__
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(f"{owner}.from_dense: embedding must be a torch.nn.Embedding, got {type(embedding).__name__}")
        check_options(options, cls.OPTIONS, owner)
        unsupported = {
            "padding_idx": embedding.padding_idx,
            "max_norm": embedding.max_norm,
            "scale_grad_by_freq": embedding.scale_grad_by_freq or None,
            "sparse": embedding.sparse or None,
        }
        for name, value in unsupported.items():
            if value is not None:
                raise ValueError(f"{owner}.from_dense: {name}={value!r} is not supported; use an nn.Embedding without it")
        with skip_init():
            layer = cls(
                embedding.num_embeddings,
                embedding.embedding_dim,
                group=group,
                dtype=embedding.weight.dtype,
                device=embedding.weight.device,
                **options,
            )
        with torch.no_grad():
            layer.weight.copy_(layer.shard(embedding.weight))
        return layer

    @torch.no_grad()
    def to_dense(self) -> nn.Embedding:
        """The full ``nn.Embedding`` (padding dropped), gathered onto every rank (a collective)."""
        ref = self.weight
        dense = nn.Embedding(
            self.num_embeddings, self.embedding_dim, device="meta", dtype=ref.dtype
        ).to_empty(device=ref.device)
        full = all_gather(ref.detach(), 0, self.group)  # [Vp, D]
        dense.weight.copy_(full[: self.num_embeddings])
        return dense

    # ---------------------------------------------------------------------------- forward

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        _check_ids(input_, self.num_embeddings, type(self).__name__, "input")
        if self.tp_world_size == 1:
            return F.embedding(input_, self.weight)
        # Ids another rank owns: look up local row 0 (any valid row) and zero the result, so the
        # all-reduce adds exactly one non-zero row per id, and row 0 gets no gradient from them.
        outside = (input_ < self.vocab_start_index) | (input_ >= self.vocab_end_index)
        local_ids = (input_ - self.vocab_start_index).masked_fill(outside, 0)
        partial = self._mask(F.embedding(local_ids, self.weight), outside)  # [..., D], zeros except this rank's ids
        return reduce_from_tensor_parallel_region(partial, self.group)  # [..., D], replicated

    def _mask(self, rows: torch.Tensor, outside: torch.Tensor) -> torch.Tensor:
        """Zero the rows looked up for the ids another rank owns (a seam: a subclass may change it)."""
        return rows.masked_fill(outside.unsqueeze(-1), 0.0)

    def extra_repr(self) -> str:
        text = (
            f"{self.num_embeddings}, {self.embedding_dim}, tp_world_size={self.tp_world_size}, "
            f"tp_rank={self.tp_rank}, rows=[{self.vocab_start_index}, {self.vocab_end_index})"
        )
        if self.padded_num_embeddings != self.num_embeddings:
            text += f", padded_num_embeddings={self.padded_num_embeddings}"
        return text


# ------------------------------------------------------------------------------ cross-entropy


def _check_loss_args(
    logits: Any,
    target: Any,
    label_smoothing: Any,
    ignore_index: Any,
    vocab_size: Any,
    reduction: Any,
    group: Group,
) -> tuple[Group, int]:
    """Every argument of the cross-entropy, before any collective; returns the resolved group and
    the vocabulary size."""
    owner = "vocab_parallel_cross_entropy"
    group = resolve_group(group)
    world_size, _ = _size_and_rank(group, owner)
    if not isinstance(logits, torch.Tensor) or not logits.dtype.is_floating_point:
        got = type(logits).__name__ if not isinstance(logits, torch.Tensor) else f"a tensor of dtype {logits.dtype}"
        raise TypeError(f"{owner}: logits must be a floating-point torch.Tensor (this rank's vocab shard), got {got}")
    if logits.dim() == 0 or logits.shape[-1] == 0:
        raise ValueError(f"{owner}: logits must be [..., vocab/world_size] with a non-empty last dim, "
                         f"got shape {tuple(logits.shape)}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"{owner}: target must be a torch.Tensor of class ids, got {type(target).__name__}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"{owner}: target shape {tuple(target.shape)} must be the logits' shape without the vocab dim, "
            f"{tuple(logits.shape[:-1])} (logits shape {tuple(logits.shape)})"
        )
    if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not (
        0.0 <= label_smoothing <= 1.0
    ):
        raise ValueError(f"{owner}: label_smoothing={label_smoothing!r} must be a float in [0, 1]")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"{owner}: ignore_index={ignore_index!r} must be an int")
    if reduction not in REDUCTIONS:
        raise ValueError(f"{owner}: reduction={reduction!r} must be one of {', '.join(map(repr, REDUCTIONS))}")
    padded = logits.shape[-1] * world_size
    if vocab_size is None:
        vocab_size = padded
    check_positive_int(vocab_size, "vocab_size", owner)
    if vocab_size > padded:
        raise ValueError(
            f"{owner}: vocab_size={vocab_size} is more than the {padded} ids the logits hold "
            f"({logits.shape[-1]} columns per rank on {world_size} rank(s))"
        )
    _check_ids(target, vocab_size, owner, "target", ignore_index=ignore_index)
    return group, vocab_size


def _all_reduce_max(t: torch.Tensor, group: Group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t


class _Forward(NamedTuple):
    """What :meth:`CrossEntropySteps.forward` computes: the loss and what its closed-form backward needs."""

    loss: torch.Tensor  # [...], per token, zero where ignored; in the compute dtype
    softmax: torch.Tensor  # [..., Vp/ws], this rank's columns of the softmax, zero on padding columns
    local_target: torch.Tensor  # [...], the target's column on this rank (0 where another rank owns it)
    mine: torch.Tensor  # [...], True where this rank owns the (not ignored) target
    ignored: torch.Tensor  # [...], True where the target is ignore_index
    valid: torch.Tensor | None  # [Vp/ws], False on padding columns; None when this rank holds none


class CrossEntropySteps:
    """The forward of :func:`vocab_parallel_cross_entropy`, one method for each step the vocabulary
    split adds: which ids are classes, the global maximum, the label-smoothing mean.

    :meth:`forward` is written in differentiable torch ops whose cross-rank sums leave through
    :func:`reduce_from_tensor_parallel_region` (identity backward, Megatron's structure), so it serves
    twice: :func:`vocab_parallel_cross_entropy` runs it without a graph inside an autograd function
    whose backward is the closed form (saving only the softmax shard), and calling an instance runs
    it under autograd. A subclass that overrides one step, called, is the loss with exactly that step
    changed, its gradient included (tpsim's cross-entropy mutants are such subclasses).
    """

    def classes(self, vocab_size: int, padded: int) -> int:
        """The ids in the softmax: the real vocabulary, so the ``padded - vocab_size`` padding columns are none."""
        return vocab_size

    def global_max(self, local_max: torch.Tensor, group: Group) -> torch.Tensor:
        """The per-token maximum over the whole vocabulary (for a softmax that cannot overflow): an
        all-reduce MAX of every rank's ``local_max`` ``[...]`` (-inf on a rank holding only padding)."""
        return _all_reduce_max(local_max, group)

    def mean_logit(
        self, sum_logits: torch.Tensor, shifted: torch.Tensor, valid: torch.Tensor | None, vocab: int
    ) -> torch.Tensor:
        """The label-smoothing term's mean (shifted) logit over the *whole* vocabulary: the all-reduced
        ``sum_logits`` over ``vocab`` ids (``shifted``, ``valid``: this rank's columns)."""
        return sum_logits / vocab

    def forward(
        self,
        logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        ignore_index: int,
        vocab_size: int,
        group: Group,
    ) -> _Forward:
        """Two all-reduces: MAX of the per-token maximum, then one SUM of three per-token sums.

        Computed in float32 or wider (``promote_types(logits.dtype, float32)``); arguments checked already.
        """
        ws, rank = _size_and_rank(group, "vocab_parallel_cross_entropy")
        local = logits.shape[-1]
        start = rank * local
        vocab = self.classes(vocab_size, ws * local)
        x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # [..., Vp/ws]
        # Padding columns (ids >= vocab, on the last rank or ranks) are not classes: out of the softmax.
        valid = (torch.arange(start, start + local, device=x.device) < vocab) if start + local > vocab else None

        # 1. the global max over the vocabulary
        masked = x if valid is None else x.masked_fill(~valid, float("-inf"))
        logits_max = self.global_max(masked.detach().amax(dim=-1), group)  # [...]
        shifted = x - logits_max.unsqueeze(-1)  # [..., Vp/ws]
        if valid is not None:
            # zeroed before exp too: under a maximum of -inf (a rank holding only padding, when a
            # subclass skips the all-reduce) exp would give inf, and its zero gradient times inf NaN
            shifted = shifted.masked_fill(~valid, 0.0)
        exp = shifted.exp()
        if valid is not None:
            exp = exp.masked_fill(~valid, 0.0)

        # 2. one SUM all-reduce of three per-token sums: sum exp, the target's logit, sum of logits
        ignored = target == ignore_index
        mine = (target >= start) & (target < start + local) & ~ignored
        local_target = (target - start).masked_fill(~mine, 0)
        picked = shifted.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~mine, 0.0)
        sums = torch.stack([exp.sum(dim=-1), picked, shifted.sum(dim=-1)], dim=-1)  # [..., 3]
        sum_exp, target_logit, sum_logits = reduce_from_tensor_parallel_region(sums, group).unbind(-1)

        log_z = sum_exp.log()
        loss = log_z - target_logit  # -log p(target)
        if label_smoothing > 0.0:
            # mean over the vocabulary of -log p_j = log Z - mean_j logit_j
            mean_logit = self.mean_logit(sum_logits, shifted, valid, vocab)
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_z - mean_logit)
        loss = loss.masked_fill(ignored, 0.0)
        softmax = exp / sum_exp.unsqueeze(-1)  # [..., Vp/ws], zero on padding columns
        return _Forward(loss, softmax, local_target, mine, ignored, valid)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0,
                 ignore_index: int = -100, *, vocab_size: int | None = None, reduction: str = "none",
                 group: Group = None) -> torch.Tensor:
        """:func:`vocab_parallel_cross_entropy` (same arguments, checks and loss) through these steps,
        differentiated by autograd: the gradient is that of the steps as written."""
        group, vocab = _check_loss_args(logits, target, label_smoothing, ignore_index, vocab_size, reduction, group)
        out = self.forward(logits, target, float(label_smoothing), ignore_index, vocab, group)
        return _reduce(out.loss.to(logits.dtype), target, ignore_index, reduction)


#: The correct steps, which the loss function runs.
_STEPS = CrossEntropySteps()


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Cross-entropy of vocab-sharded logits: :class:`CrossEntropySteps` forward (two all-reduces),
    none backward (the softmax shard is saved).

    Returned in the logits' dtype, like a fused loss kernel; the gradient comes back in the logits' dtype.
    """

    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        target: torch.Tensor,
        label_smoothing: float,
        ignore_index: int,
        vocab_size: int,
        group: Group,
    ) -> torch.Tensor:
        out = _STEPS.forward(logits, target, label_smoothing, ignore_index, vocab_size, group)
        valid = out.valid if out.valid is not None else out.softmax.new_empty(0)
        ctx.save_for_backward(out.softmax, out.local_target, out.mine, out.ignored, valid)
        ctx.label_smoothing, ctx.vocab_size, ctx.has_padding = label_smoothing, vocab_size, out.valid is not None
        ctx.logits_dtype = logits.dtype
        return out.loss.to(logits.dtype)

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        softmax, local_target, mine, ignored, valid = ctx.saved_tensors
        eps = ctx.label_smoothing
        # d loss / d logit_j = p_j - (1 - eps) [j == target] - eps / V   (zero on padding and ignored)
        grad = softmax.clone()
        if eps > 0.0:
            grad -= eps / ctx.vocab_size
            if ctx.has_padding:
                grad = grad.masked_fill(~valid, 0.0)
        onehot = torch.zeros_like(grad).scatter_(-1, local_target.unsqueeze(-1), 1.0)
        grad -= (1.0 - eps) * onehot * mine.unsqueeze(-1)
        grad = grad.masked_fill(ignored.unsqueeze(-1), 0.0)
        grad *= grad_loss.unsqueeze(-1).to(grad.dtype)
        return grad.to(ctx.logits_dtype), None, None, None, None, None


def _reduce(loss: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str) -> torch.Tensor:
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    # F.cross_entropy's mean: over the targets that are not ignored. When every target is ignored
    # torch returns NaN with a zero gradient; so does this (0 * sum keeps the graph, NaN adds no grad).
    count = int((target != ignore_index).sum())
    if count == 0:
        return loss.sum() * 0.0 + float("nan")
    return loss.sum() / count


def vocab_parallel_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Group = None,
) -> torch.Tensor:
    """``F.cross_entropy`` of logits whose vocabulary (last) dim is sharded over ``group``.

    ``logits``: this rank's ``[..., Vp/ws]`` columns (rank ``r`` holds ids ``[r*Vp/ws, (r+1)*Vp/ws)``,
    e.g. a :class:`~tpsim.layers.ColumnParallelLinear` output without ``gather_output``).
    ``target``: ``[...]`` global class ids, the same on every rank; ``ignore_index`` entries add
    nothing and get a zero gradient. ``vocab_size``: the real vocabulary when the logits are padded
    (default ``ws * logits.shape[-1]``); the padding columns are left out of the softmax.

    Returns ``F.cross_entropy(full_logits.flatten(0, -2), target.flatten(), label_smoothing=...,
    ignore_index=..., reduction=...)`` (per-token ``[...]`` for the default ``reduction="none"``,
    Megatron's), identical on every rank. Forward: an all-reduce MAX of the per-token maximum, then
    one all-reduce SUM. Backward: no collective; the logits' gradient is this rank's shard of the
    dense one. See the module docstring for label smoothing.
    """
    group, vocab = _check_loss_args(logits, target, label_smoothing, ignore_index, vocab_size, reduction, group)
    loss = _VocabParallelCrossEntropy.apply(logits, target, float(label_smoothing), ignore_index, vocab, group)
    return _reduce(loss, target, ignore_index, reduction)


def vocab_parallel_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    *,
    vocab_size: int | None = None,
    reduction: str = "none",
    group: Group = None,
) -> torch.Tensor:
    """The vocab-parallel output layer and its loss: ``cross_entropy(hidden @ Wᵀ, target)``.

    ``hidden``: ``[..., D]``, replicated. ``weight``: this rank's ``[Vp/ws, D]`` rows of the
    classifier, e.g. a tied :class:`VocabParallelEmbedding`'s ``weight`` (then pass
    ``vocab_size=embedding.num_embeddings``). The logits shard is ``hidden @ weightᵀ`` and the
    loss is :func:`vocab_parallel_cross_entropy`'s. ``hidden`` enters through
    :func:`copy_to_tensor_parallel_region`, so its gradient is all-reduced in backward and is the
    complete, identical gradient on every rank (each rank's own product is only its vocabulary's
    summand; apple/ml-cross-entropy #42).
    """
    owner = "vocab_parallel_linear_cross_entropy"
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor):
        raise TypeError(f"{owner}: hidden and weight must be torch.Tensors")
    if weight.dim() != 2 or hidden.dim() == 0 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"{owner}: expected hidden [..., D] and weight [vocab/world_size, D], got hidden shape "
            f"{tuple(hidden.shape)} and weight shape {tuple(weight.shape)}"
        )
    group = resolve_group(group)
    logits = F.linear(copy_to_tensor_parallel_region(hidden, group), weight)  # [..., Vp/ws]
    return vocab_parallel_cross_entropy(
        logits, target, label_smoothing, ignore_index, vocab_size=vocab_size, reduction=reduction, group=group
    )


class VocabParallelCrossEntropy(nn.Module):
    """``torch.nn.CrossEntropyLoss`` over vocab-sharded logits: :func:`vocab_parallel_cross_entropy` as a module.

    ``forward(logits, target)`` with ``logits`` ``[..., Vp/ws]`` (class dim *last*, the layout of
    a column-parallel output; the dense module takes ``logits.flatten(0, -2)``) and ``target``
    ``[...]``. Same ``label_smoothing``, ``ignore_index`` and ``reduction`` (default ``"mean"``,
    as ``nn.CrossEntropyLoss``) plus ``vocab_size`` (the real vocabulary when the logits are
    padded) and ``group``. Class weights are not supported.
    """

    #: A loss has no parameters; nothing is sharded but the logits it is given.
    partition_dim = None
    #: The keyword options ``from_dense`` passes on to the constructor.
    OPTIONS = ("vocab_size",)

    def __init__(
        self,
        label_smoothing: float = 0.0,
        ignore_index: int = -100,
        reduction: str = "mean",
        *,
        vocab_size: int | None = None,
        group: Group = None,
    ) -> None:
        super().__init__()
        owner = type(self).__name__
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)) or not (
            0.0 <= label_smoothing <= 1.0
        ):
            raise ValueError(f"{owner}: label_smoothing={label_smoothing!r} must be a float in [0, 1]")
        if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
            raise TypeError(f"{owner}: ignore_index={ignore_index!r} must be an int")
        if reduction not in REDUCTIONS:
            raise ValueError(f"{owner}: reduction={reduction!r} must be one of {', '.join(map(repr, REDUCTIONS))}")
        if vocab_size is not None:
            check_positive_int(vocab_size, "vocab_size", owner)
        self.label_smoothing = float(label_smoothing)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.vocab_size = vocab_size
        self.group = resolve_group(group)
        self.tp_world_size, self.tp_rank = _size_and_rank(self.group, owner)

    def forward(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return vocab_parallel_cross_entropy(
            logits,
            target,
            self.label_smoothing,
            self.ignore_index,
            vocab_size=self.vocab_size,
            reduction=self.reduction,
            group=self.group,
        )

    @classmethod
    def from_dense(cls, loss: nn.CrossEntropyLoss, *, group: Group = None, **options: Any) -> VocabParallelCrossEntropy:
        """The vocab-parallel twin of a dense ``nn.CrossEntropyLoss`` (``options``: ``vocab_size``)."""
        owner = cls.__name__
        if not isinstance(loss, nn.CrossEntropyLoss):
            raise TypeError(f"{owner}.from_dense: loss must be a torch.nn.CrossEntropyLoss, got {type(loss).__name__}")
        check_options(options, cls.OPTIONS, owner)
        if loss.weight is not None:
            raise ValueError(f"{owner}.from_dense: class weights (weight of shape {tuple(loss.weight.shape)}) "
                             "are not supported")
        return cls(loss.label_smoothing, loss.ignore_index, loss.reduction, group=group, **options)

    def to_dense(self) -> nn.CrossEntropyLoss:
        """The equivalent ``nn.CrossEntropyLoss`` (no communication: a loss has no parameters)."""
        return nn.CrossEntropyLoss(
            ignore_index=self.ignore_index, reduction=self.reduction, label_smoothing=self.label_smoothing
        )

    def extra_repr(self) -> str:
        return (
            f"label_smoothing={self.label_smoothing}, ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
            f"vocab_size={self.vocab_size}, tp_world_size={self.tp_world_size}"
        )
