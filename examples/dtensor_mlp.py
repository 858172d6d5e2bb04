"""PyTorch's own tensor parallelism, checked by tpsim: a two-layer MLP with the colwise -> rowwise plan.

``parallelize_mlp`` is the plan users write (``fc1`` ``ColwiseParallel``, ``fc2`` ``RowwiseParallel``,
one all-reduce forward, one backward); ``tests/test_dtensor.py`` checks it against
``tpsim.layers.ParallelMLP`` on generated cases (equal outputs and grads on every rank).

tpsim's variant description describes *one* linear map with one master weight, so the two
variants below check the whole plan as a linear map by making the other layer an identity
(frozen, no bias: the harness's SGD steps leave it alone):

- ``MLPMasterFc2``: ``fc1 = I`` (colwise), identity activation, ``fc2 = W`` (rowwise):
  a replicated input, an all-reduced output; ``W`` is ``S(1)``, its bias ``R``.
- ``MLPMasterFc1``: ``fc1 = W`` (colwise), ``fc2 = I`` (rowwise): replicated input, full
  output on every rank; ``W`` and its bias are ``S(0)``.

Check them with ``tpsim check examples/dtensor_mlp.py`` (add ``--backend gloo`` for processes).
"""

from __future__ import annotations

import os
import sys
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from tpsim.placement import Replicate as TpReplicate
from tpsim.placement import Shard as TpShard
from tpsim.variant import ParamSpec, Variant

# tpsim imports example files by path (also inside gloo workers): make the shared helper importable.
_HERE = os.path.dirname(os.path.abspath(__file__))
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from dtensor_common import ROWWISE_LIMITS, mesh_of  # noqa: E402

__all__ = ["TPSIM_VARIANTS", "parallelize_mlp", "plan"]


def plan() -> dict[str, Any]:
    """The colwise -> rowwise plan for a module with ``fc1`` and ``fc2`` (fresh style objects)."""
    return {"fc1": ColwiseParallel(), "fc2": RowwiseParallel()}


def parallelize_mlp(mlp: nn.Module, group: Any) -> nn.Module:
    """Parallelise ``mlp`` (any module with ``fc1``/``fc2`` linears, e.g. ``tpsim.layers.DenseMLP``)
    in place over ``group`` with :func:`plan`; returns it."""
    return parallelize_module(mlp, mesh_of(group), plan())


class _TwoLinear(nn.Module):
    """``fc2(fc1(x))`` with an identity activation."""

    def __init__(self, fc1: nn.Linear, fc2: nn.Linear) -> None:
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.fc1(x))


def _identity(n: int, dtype: torch.dtype) -> nn.Linear:
    eye = nn.Linear(n, n, bias=False, dtype=dtype)
    with torch.no_grad():
        eye.weight.copy_(torch.eye(n, dtype=dtype))
    return eye


def _master(in_features: int, out_features: int, bias: bool, weight: torch.Tensor, b: torch.Tensor | None,
            dtype: torch.dtype) -> nn.Linear:
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(weight)
        if bias:
            linear.bias.copy_(b)
    return linear


def _builder(master_at: str) -> Any:
    def build(in_features: int, out_features: int, bias: bool, *, group: Any, master_weight: torch.Tensor,
              master_bias: torch.Tensor | None, dtype: torch.dtype, **_: Any) -> nn.Module:
        layer = _master(in_features, out_features, bias, master_weight, master_bias, dtype)
        if master_at == "fc2":
            mlp = _TwoLinear(_identity(in_features, dtype), layer)
        else:
            mlp = _TwoLinear(layer, _identity(out_features, dtype))
        parallelize_mlp(mlp, group)
        frozen = mlp.fc1 if master_at == "fc2" else mlp.fc2
        frozen.weight.requires_grad_(False)  # the identity stays an identity through the SGD steps
        return mlp

    return build


# torch 2.13.0 limits (dtensor_common.py); both contain a RowwiseParallel layer, so its 1-D-input
# limit applies as well.
MLPMasterFc2 = Variant(
    **ROWWISE_LIMITS,
    name="MLPMasterFc2",
    kind="row",
    build=_builder("fc2"),
    input="replicated",
    output="reduced",
    params=(
        ParamSpec("fc2.weight", "weight", TpShard(1)),
        ParamSpec("fc2.bias", "bias", TpReplicate()),
    ),
    description="fc1=I (ColwiseParallel) -> fc2=W (RowwiseParallel): the colwise->rowwise plan as one linear map",
)
MLPMasterFc1 = Variant(
    **ROWWISE_LIMITS,
    name="MLPMasterFc1",
    kind="column",
    build=_builder("fc1"),
    input="replicated",
    output="gathered",
    params=(
        ParamSpec("fc1.weight", "weight", TpShard(0)),
        ParamSpec("fc1.bias", "bias", TpShard(0)),
    ),
    description="fc1=W (ColwiseParallel) -> fc2=I (RowwiseParallel): the colwise->rowwise plan as one linear map",
)

TPSIM_VARIANTS = [MLPMasterFc2, MLPMasterFc1]
