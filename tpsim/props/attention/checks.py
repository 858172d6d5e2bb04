"""The attention properties, and the recognisers of the attention diagnoses.

Every rank's tensor is compared with its piece of the float64 reference, tpsim's own dense attention,
within its dense twin's bound (:mod:`tpsim.props.attention.reference`), in every dtype. The
pieces follow the head layout every attention variant promises (written out here, independently
of the layer code): rank ``r`` of ``tp`` holds query heads ``r*h/tp`` to ``(r+1)*h/tp``; key/value
heads ``r*g/tp`` to ``(r+1)*g/tp`` when ``g >= tp``, else the one head ``r // (tp/g)``; the packed
weight's rows are its Q rows, then its K rows, then its V rows; the out-projection's columns are
those of its query heads; its bias is whole.

- ``forward-equivalence``: the output (with sequence parallelism: the rank's slice of the sequence);
- ``input-grad-equivalence``: the input's grad, complete on every rank (its slice with SP);
- ``weight-grad-equivalence`` / ``bias-grad-equivalence``: ``qkv`` and ``proj`` weight and bias grads;
- ``replica-consistency``: the same bits on every rank of a tp group for everything replicated —
  the output and input grad without SP, the out-projection's bias grad, and a replicated key/value
  head's rows and their grads on every rank that holds it;
- ``divisibility``: head counts the tp size cannot split (``h`` not divisible by ``tp``, or ``g``
  and ``tp`` not dividing one another) are refused on every rank with an error naming them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from tpsim.attention_variant import AttentionVariant
from tpsim.diagnosis import (
    ATTENTION_SCALE,
    KV_HEADS_NOT_REPLICATED,
    QKV_HEAD_MISMATCH,
    SHAPE_ERROR,
    Failure,
    close,
    recogniser,
)
from tpsim.props.attention.case import AttentionCase
from tpsim.props.attention.reference import attention_reference, attention_run
from tpsim.props.attention.world import AttentionRankResult
from tpsim.props.judging import Check, GroupContext, Replicated, failure, replica_consistency
from tpsim.props.observation import OK, Observation
from tpsim.props.property_names import BIAS_GRAD, DIVISIBILITY, FORWARD, INPUT_GRAD, REPLICA, WEIGHT_GRAD

__all__ = ["ATTENTION_CHECKS", "ATTENTION_PROPERTIES", "AttentionContext", "divides", "qkv_rows"]

#: The attention family's properties, in report order.
ATTENTION_PROPERTIES = (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BIAS_GRAD, REPLICA, DIVISIBILITY)


def divides(case: AttentionCase) -> bool:
    """Whether the tp size can split the case's heads (see the module docstring)."""
    tp, h, g = case.tp_size or case.world_size, case.num_heads, case.num_kv_heads
    return h % tp == 0 and (g % tp == 0 or tp % g == 0)


def kv_heads_of(case: AttentionCase, tp: int, rank: int) -> list[int]:
    """The key/value heads rank ``rank`` holds."""
    g = case.num_kv_heads
    return list(range(rank * g // tp, (rank + 1) * g // tp)) if g >= tp else [rank // (tp // g)]


def q_heads_of(case: AttentionCase, tp: int, rank: int) -> list[int]:
    """The query heads rank ``rank`` holds."""
    n = case.num_heads // tp
    return list(range(rank * n, (rank + 1) * n))


def qkv_rows(case: AttentionCase, tp: int, rank: int, kv: list[int] | None = None) -> torch.Tensor:
    """Rows of the packed ``[Q; K; V]`` rank ``rank`` holds (``kv``: other key/value heads than its own)."""
    h, g, d = case.num_heads, case.num_kv_heads, case.head_dim
    kv = kv_heads_of(case, tp, rank) if kv is None else kv
    rows = [r for i in q_heads_of(case, tp, rank) for r in range(i * d, (i + 1) * d)]
    for offset in (h * d, (h + g) * d):
        rows += [offset + r for j in kv for r in range(j * d, (j + 1) * d)]
    return torch.tensor(rows, dtype=torch.long)


def _piece(case: AttentionCase, variant: AttentionVariant, name: str, full: torch.Tensor, tp: int,
           rank: int) -> torch.Tensor:
    if name in ("y", "x"):
        if not variant.sequence_parallel:
            return full
        return full.chunk(tp, dim=-2)[rank]
    if name.startswith("qkv."):
        return full.index_select(0, qkv_rows(case, tp, rank))
    if name == "proj.weight":
        return full.chunk(tp, dim=1)[rank]
    return full  # proj.bias: replicated


def _reference(case: AttentionCase, obs: Observation, group_index: int,
               **changes: Any) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The float64 reference of tp group ``group_index`` with its twin's bounds; with ``changes`` (``scale``,
    ``kv_map``: :func:`tpsim.props.attention.reference.attention_run`), the output a buggy block gives,
    with the correct output's bound."""
    data = obs.data
    drawn = (case, data.masters, data.inputs[group_index], data.grads[group_index])
    if not changes:
        return attention_reference(*drawn)
    tol = attention_reference(*drawn)["y"][1]
    return {"y": (attention_run(*drawn, **changes)["y"].to(torch.float64), tol)}


def _outputs_match(variant: AttentionVariant, case: AttentionCase, values: list[AttentionRankResult], group: list[int],
                   ref: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> bool:
    full, tol = ref["y"]
    tp = len(group)
    for i, r in enumerate(group):
        got = values[r].output
        expected = _piece(case, variant, "y", full, tp, i)
        if got is None or got.shape != expected.shape or not close(got, expected, _piece(case, variant, "y", tol, tp, i)):
            return False
    return True


@recogniser(ATTENTION_SCALE)
def _attention_scale(variant: AttentionVariant, case: AttentionCase, obs: Observation, values: list[AttentionRankResult],
                     group: list[int], group_index: int) -> Failure | None:
    tp = len(group)
    if tp < 2:
        return None
    for label, c in ((f"sqrt(tp) = sqrt({tp})", math.sqrt(tp)), (f"1/sqrt(tp) = 1/sqrt({tp})", 1 / math.sqrt(tp)),
                     (f"tp = {tp}", float(tp)), (f"1/tp = 1/{tp}", 1.0 / tp)):
        scaled = _reference(case, obs, group_index, scale=c / math.sqrt(case.head_dim))
        if _outputs_match(variant, case, values, group, scaled):
            return failure(variant, case, FORWARD, ATTENTION_SCALE,
                           f"the output is the attention with its softmax scale multiplied by {label}: the scale "
                           f"{c:.6g}/sqrt(head_dim) was computed from a per-rank size (e.g. the local projection "
                           f"width divided by the global head count); use 1/sqrt(head_dim={case.head_dim})",
                           rank=group[0], details={"factor": c})
    return None


def _held_kv_heads(case: AttentionCase, stored: torch.Tensor, masters: dict[str, torch.Tensor | None], n_q: int,
                   n_kv: int) -> list[int] | None:
    """The master key/value heads whose K and V rows rank's stored ``qkv`` weight holds, in order."""
    h, g, d = case.num_heads, case.num_kv_heads, case.head_dim
    w = masters["qkv.weight"]
    if w is None:
        return None
    k_rows = stored[n_q * d: (n_q + n_kv) * d]
    v_rows = stored[(n_q + n_kv) * d:]
    heads = []
    for j in range(n_kv):
        block_k, block_v = k_rows[j * d:(j + 1) * d], v_rows[j * d:(j + 1) * d]
        match = [m for m in range(g) if torch.equal(block_k, w[(h + m) * d:(h + m + 1) * d])
                 and torch.equal(block_v, w[(h + g + m) * d:(h + g + m + 1) * d])]
        if not match:
            return None
        heads.append(match[0])
    return heads


@recogniser(QKV_HEAD_MISMATCH, KV_HEADS_NOT_REPLICATED)
def _kv_pairing(variant: AttentionVariant, case: AttentionCase, obs: Observation, values: list[AttentionRankResult],
                group: list[int], group_index: int) -> Failure | None:
    """Read which key/value heads every rank holds; if a rank's differ from its query heads' groups,
    recompute the attention with that pairing and name it when the output matches."""
    tp, h, kv = len(group), case.num_heads, case.num_kv_heads
    if tp < 2:
        return None
    d = case.head_dim
    w = obs.data.masters["qkv.weight"]
    if w is None:
        return None
    kv_map: list[int] = [-1] * h
    wrong: list[int] = []
    for i, r in enumerate(group):
        stored = values[r].values.get("qkv.weight")
        q_heads, own = q_heads_of(case, tp, i), kv_heads_of(case, tp, i)
        if stored is None or stored.shape[0] != (len(q_heads) + 2 * len(own)) * d:
            return None
        if not torch.equal(stored[: len(q_heads) * d], w[q_heads[0] * d:(q_heads[-1] + 1) * d]):
            return None  # its query heads are not its own: another mechanism
        held = _held_kv_heads(case, stored, obs.data.masters, len(q_heads), len(own))
        if held is None:
            return None
        if held != own:
            wrong.append(r)
        per_kv = len(q_heads) // len(held)
        for j, head in enumerate(q_heads):
            kv_map[head] = held[j // per_kv]  # the local grouping: local query head j uses local K/V head j // per_kv
    if not wrong or not _outputs_match(variant, case, values, group, _reference(case, obs, group_index, kv_map=kv_map)):
        return None
    name = KV_HEADS_NOT_REPLICATED if kv < tp else QKV_HEAD_MISMATCH
    canonical = [i // (h // kv) for i in range(h)]
    pairs = ", ".join(f"q{i}->kv{kv_map[i]} (not kv{canonical[i]})" for i in range(h) if kv_map[i] != canonical[i])
    why = (f"with {kv} key/value heads on {tp} ranks, each head must be replicated on the {tp // kv} ranks whose "
           f"query heads use it (rank r holds head r // {tp // kv})" if kv < tp else
           "each rank must hold the key/value heads of its own query heads' groups (contiguous blocks of heads in "
           "Q, K and V alike)")
    return failure(variant, case, FORWARD, name,
                   f"ranks {wrong} hold key/value heads their query heads do not use, and the output is the attention "
                   f"with query heads paired {pairs}: {why}", rank=wrong[0], details={"kv_map": kv_map})


_NAMES = {"y": "the output", "x": "the input's grad", "qkv.weight": "the qkv weight's grad",
          "qkv.bias": "the qkv bias's grad", "proj.weight": "the proj weight's grad", "proj.bias": "the proj bias's grad"}
_PROPERTY = {"y": FORWARD, "x": INPUT_GRAD, "qkv.weight": WEIGHT_GRAD, "proj.weight": WEIGHT_GRAD,
             "qkv.bias": BIAS_GRAD, "proj.bias": BIAS_GRAD}


class AttentionContext(GroupContext):
    """One tp group of an attention case: the float64 reference of its data and the bounds."""

    def __init__(self, variant: AttentionVariant, obs: Observation, group_index: int, ranks: Sequence[int],
                 values: list[AttentionRankResult]) -> None:
        super().__init__(variant, obs, group_index, ranks, values)
        self.ref = _reference(self.case, obs, group_index)
        self.group = list(range(self.tp))

    def replicated(self) -> list[Replicated]:
        values = self.values
        items = [Replicated("the proj bias's grad", [v.grads.get("proj.bias") for v in values])]
        if not self.variant.sequence_parallel:
            items = [Replicated("the output", [v.output for v in values]),
                     Replicated("the input's grad", [v.input_grad for v in values]), *items]
        # A replicated key/value head: its K/V rows, and their grads, on every rank that holds it.
        tp, kv = self.tp, self.case.num_kv_heads
        if kv < tp:
            q_rows = self.case.num_heads // tp * self.case.head_dim
            for first in range(0, tp, tp // kv):
                holders = range(first, first + tp // kv)
                for read, what in ((lambda v: v.values, "the K/V rows of a replicated key/value head"),
                                   (lambda v: v.grads, "the grad of a replicated key/value head's K/V rows")):
                    for name in ("qkv.weight", "qkv.bias"):
                        rows = [read(values[r]).get(name) for r in holders]
                        items.append(Replicated(f"{what} ({name}) on ranks {list(holders)}",
                                                [None if t is None else t[q_rows:] for t in rows], name,
                                                ": a replica's grad must be summed over the ranks holding it"))
        return items


def _check(prop: str) -> Check:
    def check(ctx: AttentionContext) -> Failure | None:
        variant, case = ctx.variant, ctx.case
        for i, v in enumerate(ctx.values):
            if v.status != OK:
                out = v.output
                return failure(variant, case, FORWARD, SHAPE_ERROR,
                               f"the output on rank {i} has shape {None if out is None else list(out.shape)} "
                               f"({v.output_type}); expected "
                               f"{list(_piece(case, variant, 'y', ctx.ref['y'][0], ctx.tp, i).shape)}", rank=i)
            got = {"y": v.output, "x": v.input_grad, **v.grads}
            for name, (full, tol) in ctx.ref.items():
                if _PROPERTY[name] != prop:
                    continue
                recognisers = ([partial(_kv_pairing, variant, case, ctx.obs, ctx.values, ctx.group, ctx.group_index),
                                partial(_attention_scale, variant, case, ctx.obs, ctx.values, ctx.group, ctx.group_index)]
                               if name == "y" else [])
                found = ctx.compared(prop, _NAMES[name], i, got.get(name),
                                _piece(case, variant, name, full, ctx.tp, i), _piece(case, variant, name, tol, ctx.tp, i),
                                recognisers)
                if found is not None:
                    return found
        return None

    return check


#: The registry: the attention family's check of each property on one tp group.
ATTENTION_CHECKS: dict[str, Check] = {**{p: _check(p) for p in (FORWARD, INPUT_GRAD, WEIGHT_GRAD, BIAS_GRAD)},
                                      REPLICA: replica_consistency}
