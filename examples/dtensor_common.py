"""What the ``dtensor_*`` examples share: a 1-D mesh over the tp group, a DTensor-parallelised
``nn.Linear`` built from master values, and :class:`LocalShards`, which lets tpsim's variant
description address the local shard of each DTensor parameter.

Why the wrapper: a DTensor parameter reports its *global* shape (``[out, in]`` for a colwise
weight), while a variant's :class:`~tpsim.variant.ParamSpec` describes what one rank stores (the
shard, ``[out/ws, in]``) and the harness reads ``.grad`` from that tensor. ``local.<path>`` returns
the DTensor's local tensor (it shares storage, so the harness's loader writes through to the
parameter) with the DTensor grad's local tensor attached as its ``.grad``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import parallelize_module

__all__ = ["LocalShards", "mesh_of", "parallel_linear"]


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


class _LocalPath:
    """``local.fc1.weight``: walks submodules, then returns the parameter's local shard."""

    def __init__(self, module: nn.Module) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        child = getattr(self._module, name)
        if child is None or isinstance(child, nn.Module):
            return child if child is None else _LocalPath(child)
        if not hasattr(child, "to_local"):
            return child  # a plain tensor parameter
        local = child._local_tensor  # shares storage with the DTensor parameter
        grad = child.grad
        local.grad = None if grad is None else grad._local_tensor
        return local


class LocalShards(nn.Module):
    """Wraps a module parallelised with DTensor. ``forward`` runs the inner module (turning a DTensor
    output into a plain tensor: its local shard, or with ``output="full"`` its ``full_tensor()``);
    ``local.<path>`` is the local shard of the DTensor parameter at ``<path>``, with its grad.

    ``parameters()`` are the real DTensor parameters, so the harness's SGD steps update them.
    """

    def __init__(self, inner: nn.Module, output: str = "local") -> None:
        super().__init__()
        if output not in ("local", "full"):
            raise ValueError(f"LocalShards(output={output!r}): expected 'local' or 'full'")
        self.inner = inner
        self._output = output

    @property
    def local(self) -> Any:
        return _LocalPath(self.inner)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(x)
        if hasattr(out, "to_local"):  # a DTensor output (use_local_output=False)
            return out.full_tensor() if self._output == "full" else out.to_local()
        return out
