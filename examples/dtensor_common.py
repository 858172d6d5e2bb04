"""What the ``dtensor_*`` examples share: a 1-D mesh over the tp group, a DTensor-parallelised
``nn.Linear`` built from master values, and the restrictions torch 2.13.0's DTensor needs.

tpsim's variant description reads DTensor parameters directly: :func:`tpsim.variant.get_param`
turns a DTensor parameter (global shape) into its local shard, with the local shard of its grad,
so a ``ParamSpec`` names the parameter (``"weight"``, ``"fc2.bias"``) as for any other layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

__all__ = ["DTENSOR_LIMITS", "ROWWISE_LIMITS", "full_output", "local_output", "mesh_of", "parallel_linear"]

#: Case restrictions (``Variant`` fields) every DTensor adapter declares, for limits of torch 2.13.0
#: that are not bugs of the layer under test (see docs/dtensor.md, pinned by
#: tests/test_dtensor.py::test_upstream_failures_reported so that a torch fix is noticed):
#:
#: - ``divisible_only``: DTensor shards a dim that does not divide by the mesh size unevenly
#:   (``torch.chunk`` sizes) by design, instead of refusing it as the Megatron convention tpsim
#:   checks does; the divisibility property does not apply.
#: - ``min_features=2``: on a one-rank mesh a sharded dim of global size 1 is refused by DTensor's
#:   view propagation ("This operation would remove or reshape sharded dimension").
DTENSOR_LIMITS: dict[str, Any] = {"divisible_only": True, "min_features": 2}
#: torch 2.13.0: ``RowwiseParallel`` without bias fails in backward on a 1-D input (no batch dim):
#: adapters containing a rowwise layer also declare ``min_batch_dims=1`` ("dimensionality of sizes (2)
#: must match dimensionality of strides (1)" from ``DTensor.from_local``'s backward).
ROWWISE_LIMITS: dict[str, Any] = {**DTENSOR_LIMITS, "min_batch_dims": 1}


def mesh_of(group: Any) -> DeviceMesh:
    """A 1-D CPU mesh over the tp ``group`` (any process group, on any backend, inproc included)."""
    return DeviceMesh.from_group(group, "cpu")


def parallel_linear(
    in_features: int,
    out_features: int,
    bias: bool,
    *,
    group: Any,
    master_weight: torch.Tensor,
    master_bias: torch.Tensor | None,
    dtype: torch.dtype,
    style: Any,
) -> nn.Module:
    """A dense ``nn.Linear`` holding the master values, parallelised in place with ``style``."""
    linear = nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    with torch.no_grad():
        linear.weight.copy_(master_weight)
        if bias:
            linear.bias.copy_(master_bias)
    return parallelize_module(linear, mesh_of(group), style)


def local_output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Variant.forward`` for ``use_local_output=False``: the DTensor output's local tensor."""
    return module(x).to_local()


def full_output(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Variant.forward`` for ``use_local_output=False``: the DTensor output's ``full_tensor()``."""
    return module(x).full_tensor()
