"""Trainer-reduced grads: a replicated parameter whose grad the layer leaves as per-rank summands
for the trainer to sum (Megatron's sequence-parallel row bias and LayerNorm grads, summed by
``finalize_model_grads``). Declared ``ParamSpec(grad="partial")`` or marked
``param.sequence_parallel = True`` on the built module, it passes: the rank-order sum of the
summands equals the dense grad, training applies the trainer's sum, and the replicas agree after it.
Without either, the same layer is caught as ``grad-not-reduced`` — one cause, with the replicas'
divergence and the wrong training listed under it."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tpsim.errors import InvalidArgument
from tpsim.placement import Replicate, Shard
from tpsim.props import check_case
from tpsim.props.linear.case import Case
from tpsim.props.search import search
from tpsim.variant import ParamSpec, Variant

_TARGET = __file__


class _ScatterSequence(torch.autograd.Function):
    """Sum the ranks' summands and keep this rank's slice of the sequence dim (a reduce-scatter);
    backward: all-gather the grad along that dim."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
        ctx.group, ctx.dim = group, dim
        total = x.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total.chunk(dist.get_world_size(group), dim=dim)[dist.get_rank(group)].contiguous()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        parts = [torch.empty_like(grad) for _ in range(dist.get_world_size(ctx.group))]
        dist.all_gather(parts, grad.contiguous(), group=ctx.group)
        return torch.cat(parts, dim=ctx.dim), None, None


class SequenceRowPartialBias(nn.Module):
    """A sequence-parallel row layer in Megatron's style: weight ``[out, in/tp]``, the summands
    reduce-scattered along the sequence dim (-2), the replicated bias added to this rank's tokens
    only — so its grad is this rank's summand, which the trainer sums. ``mark`` sets Megatron's
    marker on the bias."""

    def __init__(self, in_features: int, out_features: int, *, group: Any, dtype: torch.dtype, mark: bool):
        super().__init__()
        self.group = group
        tp = dist.get_world_size(group)
        if in_features % tp:
            raise ValueError(f"in_features={in_features} is not divisible by the tp size {tp}")
        self.weight = nn.Parameter(torch.empty(out_features, in_features // tp, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype))
        if mark:
            self.bias.sequence_parallel = True  # type: ignore[attr-defined]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() < 2 or x.shape[-2] % dist.get_world_size(self.group):
            raise ValueError(f"the sequence length (dim -2) of input shape {list(x.shape)} must divide by the tp size")
        return _ScatterSequence.apply(F.linear(x, self.weight), self.group, x.dim() - 2) + self.bias


def _build(mark: bool) -> Any:
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, dtype: torch.dtype, **_: Any) -> nn.Module:
        return SequenceRowPartialBias(in_features, out_features, group=group, dtype=dtype, mark=mark)

    return build


def _variant(name: str, *, mark: bool, bias_grad: str = "complete") -> Variant:
    return Variant(
        name=name, kind="row", build=_build(mark), output="sequence-sharded", min_batch_dims=1,
        params=(ParamSpec("weight", "weight", Shard(1)), ParamSpec("bias", "bias", Replicate(), grad=bias_grad)),
        target=f"{_TARGET}:{name}",
    )


#: Marked like Megatron's (the trainer sums it): partial without a declaration.
marked = _variant("marked", mark=True)
#: Not marked, declared instead (what ``tpsim check --param-grad bias=partial`` does).
declared = _variant("unmarked", mark=False).with_param_grads({"bias": "partial"}).replace(
    name="declared", target=f"{_TARGET}:declared")
#: Neither marked nor declared: the grad is left partial and nothing says so.
unmarked = _variant("unmarked", mark=False)

CASE = Case(world_size=2, in_features=4, out_features=3, batch_shape=(2, 4), bias=True, seed=3)


@pytest.mark.parametrize("variant", [marked, declared], ids=lambda v: v.name)
def test_a_partial_grad_the_trainer_sums_passes(variant: Variant) -> None:
    assert check_case(variant, CASE) == []
    assert check_case(variant, CASE.replace(world_size=4, tp_size=2, dtype="float32")) == []
    report = search(variant, world_sizes=(1, 2, 4), max_examples=40, seed=0)
    assert report.passed, [f.describe() for f in report.failures]


def test_without_the_marker_or_the_declaration_it_is_one_cause() -> None:
    (cause,) = check_case(unmarked, CASE)
    assert (cause.property, cause.diagnosis) == ("bias-grad-equivalence", "grad-not-reduced")
    assert "declare ParamSpec('bias', ..., grad='partial') or mark it bias.sequence_parallel = True" in cause.message
    # Training compares the grads accumulated over the first optimizer step's micro-batches: the same
    # mechanism shows there first (the summands add up to the dense accumulated grad).
    # Listed in the order properties are evaluated.
    assert [(c.property, c.diagnosis) for c in cause.consequences] == [
        ("replica-consistency", "replica-divergence"), ("training-equivalence", "grad-not-reduced")]


def test_a_partial_declaration_on_a_layer_that_reduces_is_caught() -> None:
    # tpsim's own sequence-parallel row layer all-reduces its bias grad: declaring it partial would
    # make the trainer count it tp times.
    from tpsim.builtin_variants import row_sequence_parallel

    wrong = row_sequence_parallel.with_param_grads({"bias": "partial"})
    (cause,) = check_case(wrong, CASE)
    assert (cause.property, cause.diagnosis) == ("bias-grad-equivalence", "grad-scaled")
    assert "every rank already holds the complete gradient" in cause.message


def test_partial_is_for_replicated_parameters_only() -> None:
    with pytest.raises(InvalidArgument, match="only a replicated parameter's grad can be left partial"):
        ParamSpec("weight", "weight", Shard(1), grad="partial")
    with pytest.raises(InvalidArgument, match="grad='sum'.*expected one of complete, partial"):
        ParamSpec("bias", "bias", Replicate(), grad="sum")
    with pytest.raises(InvalidArgument, match="has no parameter 'gamma'"):
        marked.with_param_grads({"gamma": "partial"})


@pytest.mark.gloo
@pytest.mark.parametrize("variant", [marked, declared], ids=lambda v: v.name)
def test_a_partial_grad_passes_on_gloo(variant: Variant) -> None:
    assert check_case(variant, CASE, backend="gloo") == []


@pytest.mark.gloo
def test_without_the_marker_it_is_caught_on_gloo() -> None:
    (cause,) = check_case(unmarked, CASE, backend="gloo")
    assert (cause.property, cause.diagnosis) == ("bias-grad-equivalence", "grad-not-reduced")
