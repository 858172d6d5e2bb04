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
run them) build or call the variant on their tp group and return tensors; everything is compared in
the parent (:mod:`tpsim.props.vocab.checks`).

**Which rows a rank holds** is read from the shape it stores (:func:`vocab_rows`): ``n`` rows on
every rank of a vocabulary padded to ``tp * n`` (Megatron), or ``torch.tensor_split``'s uneven pieces.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import tpsim
from tpsim.comm.board import mark_phase
from tpsim.errors import RankError
from tpsim.props.vocab.case import CrossEntropyCase, EmbeddingCase
from tpsim.props.world import VariantRaised, _tp_group
from tpsim.variant import get_param
from tpsim.vocab_variant import CrossEntropyVariant, EmbeddingVariant

__all__ = [
    "PADDING_LOGIT",
    "CrossEntropyData",
    "EmbeddingData",
    "Observation",
    "boundary_ids",
    "cross_entropy_data",
    "cross_entropy_rank",
    "embedding_data",
    "embedding_rank",
    "observe",
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


def _ids(g: torch.Generator, shape: tuple[int, ...], vocab: int, first: list[int]) -> torch.Tensor:
    ids = torch.randint(0, vocab, shape, generator=g, dtype=torch.long)
    flat = ids.view(-1)
    n = min(len(first), flat.numel())
    if n:
        flat[:n] = torch.tensor(first[:n], dtype=torch.long)
    return ids


def _draw(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    # Drawn in float32 for float32 and narrower cases (half the work of a float64 draw at a realistic
    # vocabulary), then rounded to the case's dtype: the ranks and the reference see the same values.
    wide = torch.promote_types(dtype, torch.float32)
    return (torch.randn(shape, generator=g, dtype=wide) * scale).to(dtype)


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
    g = torch.Generator().manual_seed(case.seed)
    dt = case.torch_dtype
    table = _draw(g, (case.vocab_size, case.embedding_dim), dt)
    first = boundary_ids(case.vocab_size, case.tp_size or case.world_size, padding_multiple)
    ids, grads = [], []
    for group in range(_groups(case)):
        ids.append(_ids(g, case.batch_shape, case.vocab_size, first if group == 0 else []))
        grads.append(_draw(g, (*case.batch_shape, case.embedding_dim), dt))
    return EmbeddingData(table, ids, grads)


def _raised(phase: str, err: BaseException) -> VariantRaised:
    summary = f"{type(err).__name__}: {err}".splitlines()[0][:500]
    return VariantRaised(phase, 0, summary, traceback.format_exc())


def _variant(payload: dict[str, Any]) -> Any:
    variant = payload.get("variant")
    if variant is None:
        from tpsim.props.family import resolve_variant

        variant = resolve_variant(*payload["ref"])
    return variant


def embedding_rank(payload: dict[str, Any]) -> dict[str, Any]:
    """What every rank runs for one embedding case: build, load (``load=True``), forward, backward."""
    case: EmbeddingCase = payload["case"]
    variant: EmbeddingVariant = _variant(payload)
    data: EmbeddingData = payload["data"]
    group, g, rank, tp = _tp_group(case, dist.get_rank())
    torch.manual_seed(case.seed)  # every rank seeded alike before the build, as training scripts do
    mark_phase("build")
    try:
        module = variant.build(case.vocab_size, case.embedding_dim, group=group, dtype=case.torch_dtype,
                               weight=data.table.clone())
    except Exception as err:
        raise _raised("build", err) from err
    weight = get_param(module, variant.weight)
    result: dict[str, Any] = {"status": "ok", "group": g, "tp_rank": rank}
    if weight is None:
        result.update(status="no-weight")
        return result
    rows = weight.shape[0]
    result["rows"] = rows
    if tuple(weight.shape[1:]) != (case.embedding_dim,):
        result.update(status="weight-shape", shape=tuple(weight.shape))
        return result
    if variant.load:
        # Every rank's stored size decides the layout (uneven or padded): exchange them first.
        sizes = [torch.zeros(1, dtype=torch.long) for _ in range(tp)]
        dist.all_gather(sizes, torch.tensor([rows]), group=group)
        where = vocab_rows(rows, case.vocab_size, tp, rank, [int(s) for s in sizes])
        if where is None:
            result.update(status="weight-shape", shape=tuple(weight.shape))
            return result
        start, stop = where
        with torch.no_grad():
            weight.zero_()
            real = data.table[min(start, case.vocab_size):min(stop, case.vocab_size)]
            weight[: real.shape[0]].copy_(real)
    result["weight"] = weight.detach()  # the module is dropped after the run: no copy needed
    ids = data.ids[g]
    mark_phase("forward", 0)
    try:
        out = variant.call(module, ids)
    except Exception as err:
        raise _raised("forward", err) from err
    upstream = data.grads[g]
    if not isinstance(out, torch.Tensor) or out.shape != upstream.shape:
        result.update(status="output-shape", output=out.detach().clone() if isinstance(out, torch.Tensor) else None,
                      output_type=type(out).__name__)
        return result
    result["output"] = out.detach()
    mark_phase("backward", 0)
    try:
        out.backward(upstream.to(out.dtype))
    except Exception as err:
        raise _raised("backward", err) from err
    result["weight_grad"] = None if weight.grad is None else weight.grad.detach()
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
    g = torch.Generator().manual_seed(case.seed)
    dt, vocab, tp = case.torch_dtype, case.vocab_size, case.tp_size or case.world_size
    width = padded_width(vocab, tp)
    data = CrossEntropyData(width=width, targets=[], grads=[])
    if case.hidden:
        data.weight = _draw(g, (vocab, case.hidden), dt, case.hidden**-0.5)
    for group in range(_groups(case)):
        target = _ids(g, case.batch_shape, vocab, boundary_ids(vocab, tp) if group == 0 else [])
        if ignores and target.numel() >= 2:
            target.view(-1)[-1] = case.ignore_index
        data.targets.append(target)
        if case.hidden:
            data.hidden.append(_draw(g, (*case.batch_shape, case.hidden), dt))
        else:
            # scale 3: the ranks' maxima differ, so a missing MAX all-reduce shows
            logits = _draw(g, (*case.batch_shape, width), dt, 3.0)
            logits[..., vocab:] = PADDING_LOGIT
            data.logits.append(logits)
        shape = case.batch_shape if case.reduction == "none" else ()
        data.grads.append((torch.rand(shape, generator=g, dtype=torch.float64) + 0.5).to(dt))
    return data


def _rows(full: torch.Tensor, width: int, tp: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of a ``[V, ...]`` tensor padded with zero rows to ``width``."""
    pad = full.new_zeros(width - full.shape[0], *full.shape[1:])
    return torch.cat([full, pad]).chunk(tp, dim=0)[rank]


def cross_entropy_rank(payload: dict[str, Any]) -> dict[str, Any]:
    """What every rank runs for one cross-entropy case: call it on its shard, backward."""
    case: CrossEntropyCase = payload["case"]
    variant: CrossEntropyVariant = _variant(payload)
    data: CrossEntropyData = payload["data"]
    group, g, rank, tp = _tp_group(case, dist.get_rank())
    target = data.targets[g]
    if variant.input == "hidden":
        hidden = data.hidden[g].clone().requires_grad_()
        weight = _rows(data.weight, data.width, tp, rank).clone().requires_grad_()  # type: ignore[arg-type]
        leaves: tuple[torch.Tensor, ...] = (hidden, weight)
    else:
        logits = data.logits[g].chunk(tp, dim=-1)[rank].clone().requires_grad_()
        leaves = (logits,)
    mark_phase("forward", 0)
    try:
        loss = variant.call(leaves, target, label_smoothing=case.label_smoothing, ignore_index=case.ignore_index,
                            vocab_size=case.vocab_size, reduction=case.reduction, group=group)
    except Exception as err:
        raise _raised("forward", err) from err
    upstream = data.grads[g]
    result: dict[str, Any] = {"status": "ok", "group": g, "tp_rank": rank}
    if not isinstance(loss, torch.Tensor) or loss.shape != upstream.shape:
        result.update(status="output-shape", output=loss.detach().clone() if isinstance(loss, torch.Tensor) else None,
                      output_type=type(loss).__name__)
        return result
    result["output"] = loss.detach().clone()
    mark_phase("backward", 0)
    try:
        loss.backward(upstream.to(loss.dtype))
    except Exception as err:
        raise _raised("backward", err) from err
    names = ("hidden_grad", "weight_grad") if variant.input == "hidden" else ("input_grad",)
    for name, leaf in zip(names, leaves, strict=True):
        result[name] = None if leaf.grad is None else leaf.grad.detach().clone()
    return result


# --- the parent side -----------------------------------------------------------------------------


@dataclass
class Observation:
    """What one world run produced: per-rank result dicts, or the runner's error."""

    case: Any
    data: Any
    values: list[dict[str, Any]] | None = None
    error: RankError | None = None

    def rank_errors(self) -> dict[int, BaseException]:
        """Every failed rank's exception (the runner's ``errors``, or the single failing rank)."""
        if self.error is None:
            return {}
        errors = dict(getattr(self.error, "errors", {}) or {})
        return errors or {self.error.rank: self.error}


def observe(variant: Any, case: Any, *, backend: str = "inproc", timeout: float = tpsim.DEFAULT_TIMEOUT,
            isolate: bool = False) -> Observation:
    """Run ``case`` once on ``case.world_size`` ranks of ``backend`` (see the module docstring);
    ``isolate=True`` runs an inproc world in a supervised worker process (see :func:`tpsim.run`)."""
    from tpsim.errors import InvalidArgument

    if isinstance(variant, EmbeddingVariant):
        data: Any = embedding_data(case, variant.padding_multiple)
        fn = embedding_rank
    else:
        data = cross_entropy_data(case, "ignore_index" in variant.accepts)
        fn = cross_entropy_rank
    payload: dict[str, Any] = {"case": case, "data": data}
    if backend == "inproc" and not isolate:
        payload["variant"] = variant
    else:
        if variant.target is None:
            raise InvalidArgument(
                f"variant {variant.name!r} has no target string, so {backend} worker processes cannot import it; "
                "declare it at module level and check it by target (e.g. tpsim check mymodule:Name)"
            )
        payload["ref"] = (variant.target, variant.name, variant.options)
    try:
        values = tpsim.run(fn, case.world_size, backend=backend, args=(payload,), timeout=timeout,
                           isolate=isolate, rank_local=variant.rank_local)
    except RankError as err:
        return Observation(case, data, error=err)
    return Observation(case, data, values=values)


def tokens_of(shape: tuple[int, ...]) -> int:
    """The number of positions of a batch shape."""
    return math.prod(shape)


def dense_cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, label_smoothing: float, ignore_index: int,
                        reduction: str) -> torch.Tensor:
    """``F.cross_entropy`` over the last dim of ``logits`` (``[..., V]``), per token shaped like ``target``."""
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), label_smoothing=label_smoothing,
                           ignore_index=ignore_index, reduction=reduction)
    return loss.reshape(target.shape) if reduction == "none" else loss
