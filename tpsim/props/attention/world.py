"""One world run per attention case: its data, and the rank side.

**The data** of a case is drawn from its ``seed`` in the parent (:func:`attention_data`), float64
normal draws rounded to the case's dtype: the packed ``[Q; K; V]`` weight (scaled ``1/sqrt(hidden)``
as ``nn.Linear`` draws), its bias, the out-projection (scaled ``1/sqrt(num_heads * head_dim)``) and
its bias, then per tp group the input ``[*batch, seq, hidden]`` and the upstream grad of the output.

**The ranks** (:func:`attention_rank`, module-level so gloo workers can run it) build the block from
the master parameters on their tp group (the variant's builder slices them: its split of the heads
is under test), run forward and backward on their input (their slice of the sequence with
sequence parallelism), and return the output, the input grad, every parameter's grad and value, as
an :class:`AttentionRankResult`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from tpsim.attention_variant import ATTENTION_PARAMS
from tpsim.props.attention.case import AttentionCase
from tpsim.props.observation import RankOutput
from tpsim.props.rank import enter_rank, rank_phase
from tpsim.variant import get_param

__all__ = ["AttentionData", "AttentionRankResult", "attention_data", "attention_rank"]


@dataclass
class AttentionData:
    """A case's tensors: the master parameters by name, and per tp group the input and upstream grad."""

    masters: dict[str, torch.Tensor | None]
    inputs: list[torch.Tensor]
    grads: list[torch.Tensor]


def attention_data(case: AttentionCase) -> AttentionData:
    """Draw the parameters, then per group the input and the upstream grad (see the module docstring)."""
    gen = torch.Generator().manual_seed(case.seed)
    dt = case.torch_dtype
    h, kv, d, hid = case.num_heads, case.num_kv_heads, case.head_dim, case.hidden

    def draw(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(shape, generator=gen, dtype=torch.float64) * scale).to(dt)

    rows = (h + 2 * kv) * d
    masters: dict[str, torch.Tensor | None] = {
        "qkv.weight": draw(rows, hid, scale=hid**-0.5),
        "qkv.bias": draw(rows, scale=0.5) if case.bias else None,
        "proj.weight": draw(hid, h * d, scale=(h * d) ** -0.5),
        "proj.bias": draw(hid, scale=0.5) if case.bias else None,
    }
    inputs, grads = [], []
    for _ in range(case.world_size // (case.tp_size or case.world_size)):
        inputs.append(draw(*case.batch_shape, case.seq, hid))
        grads.append(draw(*case.batch_shape, case.seq, hid))
    return AttentionData(masters, inputs, grads)


@dataclass
class AttentionRankResult(RankOutput):
    """What one rank of an attention case returns (besides :class:`~tpsim.props.observation.RankOutput`'s
    fields), by the names of :data:`~tpsim.attention_variant.ATTENTION_PARAMS` (None: the block has
    no such parameter, or it got no grad):

    - ``values``: its parameters as built from the masters (before any step);
    - ``input_grad``: the grad of its input (its slice of the sequence with sequence parallelism);
    - ``grads``: its parameters' grads after the backward.
    """

    values: dict[str, torch.Tensor | None] = field(default_factory=dict)
    input_grad: torch.Tensor | None = None
    grads: dict[str, torch.Tensor | None] = field(default_factory=dict)


def _sequence_slice(t: torch.Tensor, tp: int, rank: int) -> torch.Tensor:
    return t.chunk(tp, dim=-2)[rank] if t.shape[-2] % tp == 0 else torch.tensor_split(t, tp, dim=-2)[rank]


def attention_rank(payload: dict[str, Any]) -> AttentionRankResult:
    """What every rank runs for one attention case: build from the masters, forward, backward."""
    this_rank = enter_rank(payload)
    case, variant, data, group_index, rank, tp = (this_rank.case, this_rank.variant, this_rank.data, this_rank.group_index,
                                                  this_rank.rank, this_rank.tp)
    with rank_phase("build"):
        module = variant.build(case.hidden, case.num_heads, case.num_kv_heads, case.head_dim, bias=case.bias,
                               causal=case.causal, sequence_parallel=variant.sequence_parallel, group=this_rank.group,
                               dtype=case.torch_dtype,
                               masters={k: None if v is None else v.clone() for k, v in data.masters.items()})
    params = {ours: get_param(module, theirs) for ours, theirs in zip(ATTENTION_PARAMS, variant.params, strict=True)}
    result = AttentionRankResult(group=group_index, tp_rank=rank,
                                 values={k: None if p is None else p.detach().clone() for k, p in params.items()})
    x, upstream = data.inputs[group_index], data.grads[group_index]
    if variant.sequence_parallel:
        x, upstream = _sequence_slice(x, tp, rank), _sequence_slice(upstream, tp, rank)
    x = x.clone().requires_grad_()
    with rank_phase("forward"):
        out = result.read(variant.call(module, x))
    if result.unusable(out, upstream.shape):
        return result
    result.output = out.detach().clone()
    with rank_phase("backward"):
        out.backward(upstream.to(out.dtype))
    result.input_grad = None if x.grad is None else x.grad.detach().clone()
    result.grads = {k: None if p is None or p.grad is None else p.grad.detach().clone() for k, p in params.items()}
    return result
